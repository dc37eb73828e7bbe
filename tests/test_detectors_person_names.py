"""Persons by the census gazetteer (detectors/person_names.py) beside `pii_ner`'s model: a known
first name (with its surname) is a person with its exact span, a first name that is also an
ordinary word, a month or a thing's name is none, the model's finds win where they overlap
(none is split), and scanning hostile input costs linear time."""

from __future__ import annotations

import asyncio
import functools
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import detectors
from detectors import pii_ner
from detectors.person_names import first_names, person_spans, word_surnames
from tests.wait_support import within

NER = detectors.build("pii_ner")
# the model as `pii_ner` loads it, once for this module
nlp = functools.cache(pii_ner._load)


def persons(text: str) -> list[str]:
    return [text[s:e] for s, e, _ in person_spans(text)]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Emily is very reliable.", ["Emily"]),
        ("I'm so jealous! said Leal to Logan", ["Logan"]),
        ('Kyra shouted at Willie: "What are you doing here?"', ["Willie"]),
        ("They had 3: Joseph, Mikayla and Todd.", ["Joseph", "Todd"]),  # Mikayla: no 1990 name
        ("Lara Simonds", ["Lara Simonds"]),
        ("Name: Brad Key", ["Brad Key"]),  # `Key`: a word, and a common surname after a name
        ("as regular commenter Ana P Perić points out", ["Ana P Perić"]),
        ("Mary J. Lee called.", ["Mary J. Lee"]),
        ("Name:    Liliana Červenková", ["Liliana Červenková"]),
        ("Ask Kate O'Brien.", ["Kate O'Brien"]),
        # an escaped line break (JSON, logs): the name after it starts a line
        ("What a wife.\\nKimberly: Remember me, Ryan?", ["Kimberly", "Ryan"]),
        ("Emily says hi", ["Emily"]),
        ("Ask Mary Green or Emily Street.", ["Mary Green", "Emily Street"]),  # common surnames
        ("Emily and Todd", ["Emily", "Todd"]),
    ],
)
def test_a_known_first_name_is_a_person_with_its_exact_span(text: str, want: list[str]) -> None:
    assert persons(text) == want
    for s, e, kind in person_spans(text):
        assert kind == "person" and text[s:e] in want


@pytest.mark.parametrize(
    "text",
    [
        "May I help you?",
        "Will you grant access to the page?",
        "Grant access to the Page, then Mark it done.",
        "Rose and Bill went home.",  # first names that are ordinary words are none
        "Summer is here; Drew a line under it.",
        "See you in June, or on Jan 5.",
        "The Joy of Snowflakes",
        "Ginger flower: Holly and Ivy, Ruby or Amber",  # common nouns that are names
        "Which Dutch artist painted a Pearl Earring?",
        "What actress won her first Oscar?",
        "assert Annotated[T, Ann1, Ann2]",
        "mail @emily or open emily.py or /home/Emily/x",
        "call Emily(x) and Emily_2",
        "EMILY SMITH",
        "emily smith",
        "The Princess Royal arrived this morning.",  # `Princess`: a rare census name
    ],
)
def test_ordinary_words_months_and_things_are_no_persons(text: str) -> None:
    assert person_spans(text) == []


def test_the_sets_are_the_census_names_above_the_cutoffs_less_ordinary_words() -> None:
    """The chosen cut-offs: first names borne by at least 0.01% of the people (the dev split's
    choice), less the ordinary words; surnames that are words, only the common ones."""
    firsts = first_names()
    assert {"emily", "logan", "todd", "willie", "kimberly", "hugo"} <= firsts
    assert not {"may", "will", "grant", "page", "rose", "bill", "mark", "june", "jan"} & firsts
    assert not {"ginger", "pearl", "holly", "joy"} & firsts
    assert "princess" not in firsts and "mikayla" not in firsts
    assert len(firsts) == 1_481
    assert {"key", "west", "young", "king", "green", "street"} <= word_surnames()
    assert not {"says", "simonds"} & word_surnames()  # a word no surname; no word


def test_the_model_misses_these_persons_and_pii_ner_reports_them() -> None:
    """The model alone finds no person in these; `pii_ner` reports the gazetteer's, exact."""
    texts = ["Emily is very reliable.", "Todd was here, ask Logan.", "Lara Simonds"]
    assert all(
        k != "person" for spans in pii_ner.ner_spans(nlp(), texts, gazetteer=False)
        for *_, k in spans
    )  # fmt: skip
    got = asyncio.run(NER.detect(texts, {}))
    assert [[(d.start, d.end, d.detection, d.text) for d in ds] for ds in got] == [
        [(0, 5, "person", "Emily")],
        [(0, 4, "person", "Todd"), (19, 24, "person", "Logan")],
        [(0, 12, "person", "Lara Simonds")],
    ]
    # `kinds` without person: none of them
    assert asyncio.run(NER.detect(texts, {"kinds": ["location"]})) == [[], [], []]


def test_the_models_find_wins_where_a_gazetteer_person_overlaps_it() -> None:
    """A gazetteer person that overlaps any find of the model (or of a pattern) is dropped,
    or cut to its first name where only its surname overlaps: the model's span is what the
    text holds there, never split or widened."""
    text = "Emily Okafor at Acme Ltd. wrote to Todd about Kate Avenue 5 in Paris."
    found = [(16, 24, "organization"), (51, 59, "address"), (63, 68, "location")]
    gazetteer = [(0, 12, "person"), (16, 20, "person"), (35, 39, "person"), (46, 57, "person")]
    assert pii_ner._with_gazetteer(found, gazetteer, text) == [
        *found,
        (0, 12, "person"),
        (35, 39, "person"),
        (46, 50, "person"),  # `Kate` of `Kate Avenue`: its surname runs into the address
    ]
    # through the model: `Ava` is its organisation here, and stays one
    text = "Ava has the keys."
    [spans] = pii_ner.ner_spans(nlp(), [text])
    assert spans == pii_ner.ner_spans(nlp(), [text], gazetteer=False)[0]


WORDS = [
    "Emily", "Logan", "Todd", "Lara", "Simonds", "Key", "May", "Will", "Grant", "Rose", "Page",
    "Bill", "Mark", "June", "Angela", "Merkel", "Berlin", "Paris", "Smith", "the", "her", "and",
    "is", "called", "P", "J.", "Mr.", "Dr", "Ann1", "@emily", "Červenková", "Street", "Apple",
]  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
    seps=st.lists(st.sampled_from([" ", " ", " ", ", ", ": ", "\\n", "-", "  "]), min_size=12),
)
def test_finds_lie_within_the_text_and_never_split_a_models_span(
    words: list[str], seps: list[str]
) -> None:
    text = "".join(w + s for w, s in zip(words, seps, strict=False)).rstrip()
    alone = person_spans(text)
    assert all(0 <= s < e <= len(text) and k == "person" for s, e, k in alone)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(alone))  # sorted, apart
    [model] = pii_ner.ner_spans(nlp(), [text], gazetteer=False)
    [both] = pii_ner.ner_spans(nlp(), [text])
    assert set(model) <= set(both)  # every model find kept as it was
    for s, e, k in set(both) - set(model):
        assert k == "person"
        # a gazetteer person, or its first name where its surname runs into a model's find
        assert any(s == a and (e == b or text[e] == " ") and e <= b for a, b, _ in alone)
        assert not any(ms < e and s < me for ms, me, _ in model)


@pytest.mark.parametrize(
    "text",
    [
        "Emily " * 20_000,
        "Emily-" * 20_000,
        "Emily'" * 20_000,
        "a" * 100_000,
        "Mary P " * 15_000,
    ],
)
async def test_hostile_input_is_scanned_in_linear_time(text: str) -> None:
    """100,000 characters of names, hyphens, apostrophes and initials without an end: one pass
    of an unambiguous token pattern and set look-ups. A generous deadline only."""
    async with within(30, "a gazetteer scan of 100,000 hostile characters"):
        await asyncio.to_thread(person_spans, text)
