"""`pii_ner` in German, French, Italian, Spanish, Dutch and Portuguese sentences: the English
model's names cut to their name-like words (detectors/foreign_words.py), exact spans; English
text judged as before."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors import pii_ner
from detectors.foreign_words import name_part, piece_language
from detectors.person_names import first_names
from tests.test_detectors_pii_ner import at, found


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # no name: what the English model called one (`Können Sie`, `das Konto`, `Le contrat`,
        # `Tu peux m'envoyer ton adresse`, `Il mio nuovo`, `Mijn`) is gone
        ("Können Sie mir das Konto nennen?", []),
        ("Le contrat a été signé hier soir.", []),
        ("Tu peux m'envoyer ton adresse ?", []),
        ("Il mio nuovo lavoro inizia lunedì.", []),
        ("Mijn adres is veranderd.", []),
        # a name: kept, without the words around it the model took in (`Sie`, `morgen
        # zurück`, `Können Sie`, `la tarde`)
        ("Bitte rufen Sie Katy Gertz morgen zurück.", [("person", "Katy Gertz")]),
        ("Können Sie Herrn Jonas Keller anrufen?", [("person", "Jonas Keller")]),
        ("La señora Ortega llamó ayer por la tarde.", [("person", "Ortega")]),
        (
            "Chi era il presidente degli Stati Uniti nel 1990?",
            [("location", "Stati Uniti"), ("date", "1990")],
        ),
    ],
)
def test_names_in_other_languages_sentences_with_exact_spans(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert found(text) == [(kind, *at(text, part), part) for kind, part in expected]


@pytest.mark.parametrize(
    ("lang", "text", "find", "kept"),
    [
        ("de", "Der Vertrag wurde gestern unterschrieben.", "Der Vertrag", None),
        ("de", "Bitte rufen Sie Juri Kade zurück.", "Sie Juri Kade", "Juri Kade"),
        ("de", "Was ist das Gegenteil von Einstein", "das Gegenteil von Einstein", "Einstein"),
        # a census first name after an article is a name (`der Peter`, said in the south)
        ("de", "Der Peter hat angerufen.", "Der Peter", "Peter"),
        ("fr", "Salut Anna, tu peux m'envoyer ton numéro ?", "tu peux m'envoyer ton numéro", None),
        # an article inside a find is a name's particle
        ("fr", "Signé par Olivie de la Marques.", "Olivie de la Marques", "Olivie de la Marques"),
        ("nl", "Meneer de Haas belde gisteren.", "Meneer de Haas", "Meneer de Haas"),
        ("it", "Il signor Mazzocchi ha chiamato", "Il signor Mazzocchi ha chiamato", "Mazzocchi"),
        ("it", "Il contratto è stato firmato.", "Il contratto è", None),
        # the find's end past its last word stays; a capitalised stop word inside a sentence is
        # a name's word (`Stati`)
        ("it", "Chi ha ucciso John F. Kennedy?", "John F.", "John F."),
        ("it", "Il presidente degli Stati Uniti", "Stati Uniti", "Stati Uniti"),
        # an initial is a name's word (`A`: a stop word); particles between the kept words and
        # the find's edge, or alone, stay: the model cut the name there
        ("de", "Die Rechnung geht an Elif Rust B.A. heute", "Elif Rust B.A.", "Elif Rust B.A."),
        ("nl", "De factuur gaat naar Sara van der Heiden.", "Sara van der", "Sara van der"),
        ("nl", "De factuur gaat naar van den Eijssel.", "van den", "van den"),
        ("pt", "Vai para da Costa de Novaes amanhã.", "da Costa de Novaes", "da Costa de Novaes"),
        # the normalised view, without accents: its stop words are the lists' views too
        ("fr", "Tu peux m'envoyer ton numero ?", "Tu peux m'envoyer ton numero", None),
    ],
)
def test_a_find_is_cut_to_its_name_like_words(
    lang: str, text: str, find: str, kept: str | None
) -> None:
    expected = None if kept is None else at(text, kept)
    assert name_part(text, *at(text, find), lang) == expected


@pytest.mark.parametrize(
    ("text", "lang"),
    [
        ("Der Vertrag wurde gestern von Frau Schneider unterschrieben.", "de"),
        ("Le contrat a été signé par Odette Delaunay.", "fr"),
        ("La factura debe ir a nombre de Lorenza Iborra.", "es"),
        ("The contract was signed by Odette Delaunay.", None),
        ("Please call Jürgen Weber back on Monday.", None),
    ],
)
def test_the_language_of_a_piece(text: str, lang: str | None) -> None:
    assert piece_language(text) == lang


NLP = None
_NAMES = sorted(first_names())
_ENGLISH = (
    "Please call {a} {b} back on Monday.",
    "The invoice goes to {a} {b} at the London office.",
    "{a} said the meeting with {b} was moved to Friday.",
    "Hi {a}, could you send me the report before the deadline?",
    "I talked to {a} {b} yesterday about the new contract.",
    "The contract was signed by {a} {b}.",
)


@settings(max_examples=25, deadline=None)
@given(
    template=st.sampled_from(_ENGLISH),
    a=st.sampled_from(_NAMES),
    b=st.sampled_from(_NAMES),
)
def test_english_sentences_are_judged_as_without_the_filter(template: str, a: str, b: str) -> None:
    global NLP
    if NLP is None:
        NLP = pii_ner._load()
    text = template.format(a=a.title(), b=b.title())
    with mock.patch.object(pii_ner, "piece_language", return_value=None):  # no filter
        unfiltered = pii_ner.ner_spans(NLP, [text])
    assert pii_ner.ner_spans(NLP, [text]) == unfiltered
