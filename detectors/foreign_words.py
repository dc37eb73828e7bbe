"""The English model's names in other languages' sentences (`pii_ner`): spaCy's small English
model reads capitalised words of German, French, Italian, Spanish, Dutch and Portuguese
sentences, and runs of their function words, as persons and organisations (`Der Vertrag`,
`Le contrat`, `Sie`, `tu peux m'envoyer`): a non-English user's text was garbled by wrong
redactions (bench/quality.py `--only pii-intl`, README). What this module does with such a
find, where the piece it lies in is in one of those languages (`piece_language`, by
py3langid's shipped model, BSD-3-Clause): it keeps the part of the find from its first to its
last *name-like* run of words, or drops it when it has none (`name_part`).

A run is the words between the language's stop words (spaCy's own lists, `spacy.lang.XX`,
shipped with spaCy: no new data; a capitalised stop word inside a sentence counts as a word,
`Stati Uniti`, but for German, which capitalises nouns and its polite `Sie`). A run is
name-like when it has a capitalised word, and it is kept from its first capitalised word to
its last. When the find starts with an article or possessive (`Der Vertrag`, `El contrato`,
`Il signor Mazzocchi`), the run after it loses its first word, the noun the article
determines, unless the run holds a 1990 US Census first name (detectors/person_names.py:
`Der Peter`); an article inside a find is a name's particle as often (`Meneer de Haas`, `de
la Marques`). So `Sie Juri Kade` becomes `Juri Kade`, `das Gegenteil von Einstein`
`Einstein`, `Il signor Mazzocchi` `Mazzocchi`, and `Der Vertrag` and `mi mandi il tuo numero`
go. A find's characters past its first or last word stay (`John F.`). English pieces and pieces
whose language is unsure are left as they are.

What is left on the pii-intl dev split (README): single capitalised words of the frames
(`Überweisen`, `Handynummer`, `Abito`), which no closed word list tells from a surname.
A lower-case name in such a sentence (`chiama mario`) is dropped too: the names the model
finds there are capitalised."""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Iterable
from typing import Any

from .normalise import normalise
from .person_names import first_names

# the languages whose sentences the English model misreads, by ISO 639-1 code as py3langid and
# spacy.lang name them
LANGUAGES = ("de", "fr", "it", "es", "nl", "pt")
# the piece's language must be at least this likely (py3langid's normalised probability): a
# short or mixed piece is left as the English model read it. Chosen on the pii-intl dev split:
# false finds 76 at 0.5, 87 at 0.7, 107 at 0.8, 119 at 0.9, 130 at 0.95 (167 without), person
# recall the same at each; no English text of the US bench or the everyday requests changed.
MIN_CONFIDENCE = 0.5
# Articles and possessive determiners: a closed class of each language, written here (spaCy's
# stop lists hold them but do not mark them), a few dozen words. A capitalised noun after one is
# a common noun (German capitalises every noun): `Der Vertrag`, `das Konto`, `Il mio nuovo`.
_ARTICLES = {
    "de": "der die das den dem des ein eine einen einem einer eines mein meine meinen meinem "
    "meiner meines dein deine deinen deinem deiner sein seine seinen seinem seiner ihr ihre "
    "ihren ihrem ihrer unser unsere unseren unserem euer eure",
    "fr": "le la les l un une des du au aux mon ma mes ton ta tes son sa ses notre votre leur "
    "nos vos leurs ce cet cette ces",
    "it": "il lo la i gli le l un uno una mio mia miei mie tuo tua tuoi tue suo sua suoi sue "
    "nostro nostra vostro vostra questo questa quel quella",
    "es": "el la los las un una unos unas mi mis tu tus su sus nuestro nuestra nuestros "
    "nuestras vuestro vuestra este esta ese esa",
    "nl": "de het een mijn jouw je uw zijn haar ons onze hun deze dit die dat",
    "pt": "o a os as um uma uns umas meu minha meus minhas teu tua teus tuas seu sua seus "
    "suas nosso nossa este esta esse essa",
}
# lower-case particles of surnames in these languages (`van der Heiden`, `da Costa`, `de la
# Marques`, `von Weizsäcker`, `dos Santos`, `ter Horst`)
_PARTICLES = frozenset(
    "van von der den de da di del della dei degli do dos das du des la le lo ten ter zu y e".split()
)
# a word: letters, with inner apostrophes or hyphens (`m'envoyer`, `Mude-Bolander`)
_WORD = re.compile(r"[^\W\d_]+(?:['\u2019\-][^\W\d_]+)*")


@functools.cache
def _identifier() -> Any:
    """py3langid's model (0.7 s to load: done in the model's loader, off the event loop)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def _with_views(words: Iterable[str]) -> frozenset[str]:
    """The words and their normalised views (`été` and `ete`): the model, and so this module,
    reads a piece's normalised view (DESIGN 4.6b), which drops accents."""
    return frozenset(form for w in words for form in (w, normalise(w).text))


@functools.cache
def _stop_words(lang: str) -> frozenset[str]:
    return _with_views(importlib.import_module(f"spacy.lang.{lang}.stop_words").STOP_WORDS)


@functools.cache
def _articles(lang: str) -> frozenset[str]:
    return _with_views(_ARTICLES[lang].split())


def load() -> None:
    """Everything this module reads, loaded now (from the model's loader, off the loop)."""
    _identifier()
    for lang in LANGUAGES:
        _stop_words(lang), _articles(lang)


def piece_language(piece: str) -> str | None:
    """One of LANGUAGES when the piece is likely in it (MIN_CONFIDENCE), else None (English,
    another language, or unsure). About 0.03 ms for a sentence. Read it from the piece itself,
    not its normalised view: without its accents `Le contrat a été signé` is French at 0.44."""
    lang, p = _identifier().classify(piece)
    return lang if lang in LANGUAGES and p >= MIN_CONFIDENCE else None


def name_part(text: str, start: int, end: int, lang: str) -> tuple[int, int] | None:
    """The part of the find `text[start:end]` (of a piece or its normalised view) in a `lang`
    sentence from its first to its last name-like run of words (see the module's docstring),
    or None when it has none."""
    words = [m for m in _WORD.finditer(text, start, end) if m.end() <= end]
    if not words:
        return start, end  # no letters (a number the model read as a name): not ours to judge
    stop, articles, names = _stop_words(lang), _articles(lang), first_names()
    first = _WORD.search(text)
    lower = [
        # a capitalised stop word inside a sentence is a name's word (`Stati Uniti`, `Via
        # Lattea`, `São Jorge`), but in German, which capitalises nouns and its polite `Sie`;
        # so is a capital alone, an initial (`B.A.`, `A. Weber`)
        ""
        if (lang != "de" and _inner_capital(w, first))
        or (len(w.group()) == 1 and w.group().isupper())
        else w.group().lower()
        for w in words
    ]
    kept: list[tuple[int, int]] = []  # runs kept, as indices of their first and last words
    i = 0
    while i < len(words):
        if lower[i] in stop:
            i += 1
            continue
        j = i
        while j < len(words) and lower[j] not in stop:
            j += 1
        # the find starts with an article and this run follows it (`Der Vertrag`); an article
        # inside a find is a name's particle as often (`Meneer de Haas`, `de la Marques`)
        after_article = i == 1 and lower[0] in articles
        named = any(
            _capitalised(words[k]) and words[k].group().lower() in names for k in range(i, j)
        )
        # after an article, the run's first word is the noun it determines; a name may follow
        # (`Il signor Mazzocchi`, `la señora Polo`)
        capitals = [
            k for k in range(i + (after_article and not named), j) if _capitalised(words[k])
        ]
        if capitals:  # from its first capitalised word to its last: a name's words are
            # capitalised, its lower-case particles (`van`, `de`) are stop words, between runs
            kept.append((capitals[0], capitals[-1]))
        i = j
    if not kept:
        # particles alone: the model cut a name after them (`van den` + `Eijssel`)
        return (start, end) if all(w.group() in _PARTICLES for w in words) else None
    first_kept, last_kept = kept[0][0], kept[-1][1]
    # lower-case particles between the kept words and the find's edge stay: the model cut the
    # name there (`Sara van der` + `Heiden`, `da Costa de Novaes`)
    if all(words[k].group() in _PARTICLES for k in range(first_kept)):
        first_kept = 0
    if all(words[k].group() in _PARTICLES for k in range(last_kept + 1, len(words))):
        last_kept = len(words) - 1
    # what the model's find holds past its first or last word stays (`John F.`, `Dr.`)
    return (
        start if first_kept == 0 else words[first_kept].start(),
        end if last_kept == len(words) - 1 else words[last_kept].end(),
    )


def _capitalised(word: re.Match[str]) -> bool:
    return word.group()[0].isupper()


def _inner_capital(word: re.Match[str], first: re.Match[str] | None) -> bool:
    """Whether a word is capitalised and not its sentence's first word."""
    return _capitalised(word) and (first is None or word.start() != first.start())
