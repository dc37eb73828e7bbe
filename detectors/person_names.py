"""Persons found by a gazetteer, beside the model's (`pii_ner`): a capitalised first name of the
1990 US Census lists (public-domain data, shipped on PyPI in `names==0.3.0`, MIT), alone or
with the surname after it (`Emily is very reliable`, `said Leal to Logan`, `Hugo: What a
wife.`, `Lara Simonds`, `Ana P Perić`). spaCy's small model misses a fifth of the bench's
persons, most of them a first name alone in a dialogue line, a list or a greeting.

What is no person: a first name that is also an ordinary word (`May`, `Will`, `Grant`, `Page`,
`Rose`, `Bill`, `Mark`, `Drew`, `Summer`: a word that punkt's English news text, already
shipped for the sentence chunker, shows lower-cased inside a sentence; and common nouns that
are names, `Ginger`, `Pearl`, `Holly`), a month or weekday and
their abbreviations (`June`, `Jan`), rare census names (below FIRST_MIN_PERCENT of the people:
`Princess`, `Royal`), a name after a determiner or possessive (`the Joy of`, `her first
Oscar`), a name glued to code (`Ann1`, `@emily`, `emily.py`, `Emily(`), a word in capitals. A
find that overlaps any of the model's or the patterns' finds is dropped (`pii_ner`: the model's
span wins), so a gazetteer person never splits one.

Linear time: one scan of word tokens (an unambiguous `re` with no nested quantifier) and set
look-ups. Each piece between natural cuts is scanned alone, as the model reads it."""

from __future__ import annotations

import functools
import importlib.resources
import re

Span = tuple[int, int, str]

# A first name counts when at least this share (percent) of the census's people bear it, chosen
# on the bench's dev split (README): 0.01 keeps 1,555 first names (Emily, Logan, Todd, Willie),
# 1,481 less the words below; 0.005 and below added 3 false persons there (`Princess Royal`) for
# at most one more found, 0.02 found 6 fewer.
FIRST_MIN_PERCENT = 0.01
# A surname that is an ordinary word too counts when this share of the people bear it (`Key`,
# `West`: 810 of the census's 18,839 commonest surnames); any other capitalised word after a
# first name is its surname (`Simonds`)
LAST_MIN_PERCENT = 0.001
# months, weekdays and their abbreviations: capitalised words that are no name (`June`, `Jan`)
_CALENDAR = frozenset(
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec "
    "monday tuesday wednesday thursday friday saturday sunday mon tue tues wed thu thur thurs "
    "fri sat sun".split()
)
# first names that are common nouns, rarely lower-cased where they begin a sentence or a title
# and so not among punkt's ordinary words: flowers, gems, materials, virtues (`Ginger flower`,
# `a Pearl Earring`, `Holly and Ivy`, `T. Rex`)
_NOUN_NAMES = frozenset(
    "amber angel charity christian clay cliff daisy ebony ginger hazel heather holly iris ivy "
    "jasmine joy laurel lily melody misty olive pearl penny reed rex ruby rusty sandy violet".split()
)
# the word before a name that makes it a thing's name (`the Joy of Snowflakes`, `a Pearl
# Earring`, `her first Oscar`)
_DETERMINERS = frozenset(
    "a an the this that these those my your his her its our their first every each".split()
)
# a token: letters and digits, with inner apostrophes or hyphens (`O'Brien`, `Mary-Jane`); a
# literal `\n` (text escaped as in JSON or a log) is a token of its own, so the word after it
# starts a line. Each repetition starts with its separator: no backtracking.
_TOKEN = re.compile(r"\\[nrt]|[^\W_]+(?:['\u2019\-][^\W_]+)*")
# what glues a name to code or an address around it (`@emily`, `/Emily`, `emily.py`, `Ann_1`)
_GLUED_BEFORE = frozenset("@/\\#$&+=<>~^|%_.")
_GLUED_AFTER = frozenset("@/\\#$&+=<>~^|%_(")
# punkt's flag for a word seen lower-cased inside a sentence (punkt.rules.orthography.MID_LC)
_MID_LC = 1 << 5


@functools.cache
def ordinary_words() -> frozenset[str]:
    """Lower-cased words seen lower-cased inside a sentence in punkt's English training text
    (news): words that are words, whatever else they name."""
    from punkt.data import english

    return frozenset(w for w, flags in english.ORTHO_CONTEXT.items() if flags & _MID_LC)


def _census(filename: str, min_percent: float) -> set[str]:
    """Lower-cased names of one of the census lists (`NAME percent cumulative rank` per line)
    that at least `min_percent` of the people bear."""
    text = (importlib.resources.files("names") / filename).read_text(encoding="ascii")
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and float(parts[1]) >= min_percent:
            out.add(parts[0].lower())
    return out


@functools.cache
def first_names() -> frozenset[str]:
    """The census's first names (both lists) at FIRST_MIN_PERCENT or more, less the ordinary
    words and the calendar's: loaded once (pii_ner's `_load`, in the model's worker thread)."""
    names = _census("dist.male.first", FIRST_MIN_PERCENT)
    names |= _census("dist.female.first", FIRST_MIN_PERCENT)
    return frozenset(names - ordinary_words() - _CALENDAR - _NOUN_NAMES)


@functools.cache
def word_surnames() -> frozenset[str]:
    """The census's surnames at LAST_MIN_PERCENT or more that are ordinary words too (`Key`,
    `West`, `Young`, `Green`, `King`): a surname after a known first name although a word
    (`Brad Key`); any other capitalised word that is no ordinary word is one anyway (`Simonds`).
    A street word too (`Emily Street`): a street named so is masked as a person then, where a
    surname left out would be released."""
    return frozenset(_census("dist.all.last", LAST_MIN_PERCENT) & ordinary_words())


def _capitalised(word: str) -> bool:
    """`Emily`, `O'Brien`, `McDonald`, `Červenková`: a capital, then not all capitals."""
    return len(word) > 1 and word[0].isupper() and not word.isupper()


def _letters(word: str) -> bool:
    return word.replace("'", "").replace("\u2019", "").replace("-", "").isalpha()


def person_spans(text: str) -> list[Span]:
    """Persons in `text` (one piece between natural cuts, normalised) as (start, end, "person"),
    sorted, none overlapping: a known first name, with the capitalised word after it (a
    surname: `Lara Simonds`, `Liliana Červenková`) and a middle initial between them (`Ana P
    Perić`) where the piece holds them."""
    firsts = first_names()
    tokens = [(m.start(), m.end(), m.group()) for m in _TOKEN.finditer(text)]
    found: list[Span] = []
    i = 0
    while i < len(tokens):
        start, end, word = tokens[i]
        i += 1
        if (
            word.lower() not in firsts
            or not _capitalised(word)
            or not _letters(word)
            or (start and text[start - 1] in _GLUED_BEFORE)
            or (end < len(text) and text[end] in _GLUED_AFTER)
            or (i >= 2 and tokens[i - 2][2].lower() in _DETERMINERS)
        ):
            continue
        # a surname: the next capitalised word (after a middle initial), one space apart
        j = i
        if j + 1 < len(tokens) and _initial(text, tokens, j, end):
            j += 1
        if j < len(tokens) and _surname(text, tokens, j, tokens[j - 1][1]):
            end = tokens[j][1]
            i = j + 1
        found.append((start, end, "person"))
    return found


def _initial(text: str, tokens: list[tuple[int, int, str]], j: int, prev_end: int) -> bool:
    """tokens[j] is a middle initial after the first name (`Ana P Perić`, `Mary J. Lee`)."""
    s, e, w = tokens[j]
    return text[prev_end:s] == " " and len(w) == 1 and w.isupper() and text[e : e + 1] in (" ", ".")


def _surname(text: str, tokens: list[tuple[int, int, str]], j: int, prev_end: int) -> bool:
    """tokens[j] is the surname of the first name before it: one space (or an initial's `. `)
    apart, capitalised, letters, no ordinary word unless a common surname (`Brad Key`, not
    `Emily Says`), not glued to code."""
    ordinary, surnames = ordinary_words(), word_surnames()
    s, e, w = tokens[j]
    return (
        text[prev_end:s] in (" ", ". ")
        and _capitalised(w)
        and _letters(w)
        and (w.lower() not in ordinary or w.lower() in surnames)
        and (e == len(text) or text[e] not in _GLUED_AFTER)
    )
