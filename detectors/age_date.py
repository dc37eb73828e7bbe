"""Ages and numeric dates found by pattern, beside the model's (`pii_ner`): the general English
forms of an age (`35 years old`, `a 35-year-old`, `35 years of age`, `43 y/o`, `aged 35`,
`age: 35`, `at the age of 48`, `at age 48`, `just turned 73`) and the numeric forms of a date
(`2/4/1958`, `04.02.1958`, `1958-02-04`), which spaCy's small model misses often (on the
bench's dev split a third of its ages: `I just turned 73`, `43 y/o`, and `2/2/1972` in
`She was born on 2/2/1972.`).

An age's span is the phrase that makes the number an age, as the model's `age` finds are
(`the age of 35`, `63 years old`): the number alone is no age, and the phrase lets a stream's
window that starts at the number judge it as the whole text does. What is no age: a duration
(`35 years of experience`), a term (`the 35-year lease`), a number after a word that is no
age (`version 35`, `page 35`), an age without a number (`the age of empires`), and `age 35`
without `at`/`by`/... before it or `:` / `is` between (`Ice Age 3`). `turned 73` is an age only
where the sentence or clause ends after it or a time follows (`turned 40 last week`), not
`turned 90 degrees`. A date is one whose parts are one (a year 1900-2099, a month 1-12, a day
1-31; day and month in either order), with a four-digit year, and not inside a longer run of
numbers (`1.2.3.2024`, `10/12/14` sizes).

RE2 patterns (linear time on hostile input), in the style of detectors/address.py; each match
is self-sufficient (nothing before its first character decides it but the character before
it) and holds no natural cut."""

from __future__ import annotations

import re

from .re2_scan import WORD_CHARS, Utf8Text, body_spans, bounded_pattern

Span = tuple[int, int, str]

_N = r"[0-9]{1,3}"
# an age's number is not part of a longer number (`1.35 years old`, `2-35 years old`)
_NUMBER_BEFORE = rf"(?:^[.,\-/]?|[^{WORD_CHARS}.,\-/]|[^\p{{N}}][.,\-/])"
_WORD_BEFORE = rf"(?:^|[^{WORD_CHARS}])"
# nor continued: `aged 35.5`, `age: 35/40` are a measure or a ratio, not an age
_NUMBER_AFTER = rf"(?:$|[^{WORD_CHARS}.,/%\-]|[.,\-](?:$|[^\p{{N}}]))"
_AGE_NUMBER_FIRST = bounded_pattern(
    _NUMBER_BEFORE,
    rf"{_N}(?i:(?:-| |)(?:years?|yrs?)(?:-| )old|(?: |-)years? of age| ?y/o| ?y\.o\.)",
    rf"(?:$|[^{WORD_CHARS}])",
)
_AGE_WORD_FIRST = bounded_pattern(
    _WORD_BEFORE,
    r"(?i:aged|age ?[:=]|(?:the )?age (?:is|was|of)|(?:at|by|from|until|till|before|after|since|over"
    rf"|under) age) ?{_N}",
    _NUMBER_AFTER,
)
# `turned 73.`, `turns 40 next week`: reaching an age; `turned 90 degrees` is none
_TURNED = bounded_pattern(
    _WORD_BEFORE,
    rf"(?i:turn(?:ed|s|ing)) {_N}",
    r"(?:$|[.,;:!?)\x{2019}'\"]|(?i: (?:this|last|next|today|tomorrow|yesterday|on|in)\b))",
)
_DATE = bounded_pattern(
    _NUMBER_BEFORE,
    r"[0-9]{1,2}/[0-9]{1,2}/[0-9]{4}|[0-9]{1,2}-[0-9]{1,2}-[0-9]{4}|[0-9]{1,2}\.[0-9]{1,2}\."
    r"[0-9]{4}|[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}|[0-9]{4}/[0-9]{1,2}/[0-9]{1,2}",
    rf"(?:$|[^{WORD_CHARS}.,/\-]|[.,\-](?:$|[^\p{{N}}]))",
)
_DIGITS = re.compile(rb"[0-9]+")


def _age_length(body: bytes) -> int:
    """An age is 1 to 125 years."""
    n = int(_DIGITS.search(body).group())  # the one number in the phrase
    return len(body) if 1 <= n <= 125 else 0


def _date_length(body: bytes) -> int:
    """A year 1900-2099 and a month and day that are one (`2/4/1958` either way round)."""
    parts = [int(p) for p in _DIGITS.findall(body)]
    if body[:4].isdigit():  # year first (ISO)
        year, month, day = parts
        ok = 1 <= month <= 12 and 1 <= day <= 31
    else:
        a, b, year = parts
        ok = 1 <= a <= 31 and 1 <= b <= 31 and (a <= 12 or b <= 12)
    return len(body) if ok and 1900 <= year <= 2099 else 0


def age_date_spans(text: str) -> list[Span]:
    """Ages and numeric dates in `text` (one piece between natural cuts, normalised), as
    (start, end, kind), sorted, none overlapping another."""
    t = Utf8Text(text)
    if len(t.data.translate(None, b"0123456789")) == len(t.data):
        return []  # every match holds a digit
    found: list[Span] = []
    for rx in (_AGE_NUMBER_FIRST, _AGE_WORD_FIRST, _TURNED):
        found.extend((s, e, "age") for s, e in t.spans(body_spans(rx, t.data, _age_length)))
    found.extend((s, e, "date") for s, e in t.spans(body_spans(_DATE, t.data, _date_length)))
    found.sort(key=lambda f: (f[0], -f[1]))
    kept: list[Span] = []
    for span in found:
        if not kept or span[0] >= kept[-1][1]:
            kept.append(span)
    return kept
