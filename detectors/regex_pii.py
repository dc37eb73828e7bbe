"""`regex`: PII found by pattern, with exact spans and score 1.0 (a match is a decision).

Kinds: `email` (also spelt out for a reader with a marker in brackets: `jo [at] example [dot]
com`, `jo(at)example.com`, `jo@example(dot)com`; in words, `jo at example dot com`, unless a
domain label is a word of prose; spaced out, `jo . smith @ example . com`; written backwards,
`moc.elpmaxe@oj`; at most 255 characters after its `@`, RFC 5321's domain bound, padded past
it or not: `DOMAIN_MOST`), `phone` (international `+CC ...` with 8-15 digits, or `00` and a number
libphonenumber calls possible; North American forms: `123-456-7890`, `(555) 123-4567`,
`555.123.4567`, `+1 555 123 4567`, `2125550100`, `555-1234`; national forms of other countries,
8-12 digits in groups: `020 7946 0958`, `(02) 4075 2559`, `01.33.43.04.02`, `030/12345678`,
`0421 96 07 27`, with an extension `x123`; local numbers of 6-8 digits: `795 2525`, `9357 8533`,
`89 97 11`), `ssn` (US, `123-45-6789` or with spaces, excluding numbers the SSA never issues),
`credit_card` (13-19 digits, contiguous or in groups of 3+ digits separated by spaces, dashes or
dots, or 12 contiguous under a Maestro IIN; Luhn-checked), `ipv4` and `ipv6` (checked with
`ipaddress`). `kinds` selects which run (default all); `patterns` adds custom `{name: regex}`.
Phone, SSN and card numbers are also found spelt as words (`five five five, one two three,
...`), a digit per space or line, with look-alike letters among their digits (`555-l23-4S67`)
or over a table row's cells: number_spellings.py's view, judged by the same patterns.

A built-in match inside another built-in match (an IPv4 inside an IPv4-mapped IPv6 address, a US
number inside an international one) is reported once, as the longer. Custom patterns are always
reported.

Hostile input is expected (DESIGN 4, 6). Every regular expression here runs in RE2, whose
matching time is linear in the text: the built-in kinds are written without lookarounds or
backreferences (a match's neighbours are checked by consuming one or two characters on each
side, and the scan resumes where the match itself ended, so this finds exactly what the
lookaround forms found), and custom patterns must be RE2 syntax (no lookarounds or
backreferences; `\\d`, `\\w`, `\\s`, `\\b` are ASCII, `\\pL`/`\\pN` are Unicode). Custom
patterns come from the config; a request may send them only to a detector whose config says
`allow_request_patterns: true`, and then fewer and with a smaller RE2 memory budget (so
compiling one stays cheap). Digits in the built-in kinds are ASCII `0-9`. Punctuation is a
boundary (DESIGN 4.6b): only Unicode letters and numbers next to a value make it part of a
longer token (`id4111111111111111`), but not the letters of scripts written without spaces
between words (Chinese, Japanese, Thai, ...) nor Korean syllables: `电话555-123-4567` holds a
phone number (`_UNSPACED`), and for the numeric kinds the separator that continues a
run of numbers (an SSN's `-`, an address's `.`, with a digit beyond it: 1.2.3.4.5 is no IPv4
address, 0.4111111111111111 no card); so `jo@example.com--he`, `(555-123-4567)`,
`SSN 123-45-6789-` and `_4111111111111111_` hold their values, which a guardrail must find.
Scans of long texts run in worker threads, never on the event loop.

Every kind and pattern runs on the normalised view of the content (normalise.py, DESIGN 4.6b):
`jo\\u200b@example.com`, full-width digits, Cyrillic look-alikes and U+2011 hyphens match like
their plain forms, and so do letters and digits under combining marks (`4111\\u0301 1111 ...`)
and dots of other scripts (`jo@example\\u3002com`); each span is mapped back to the characters
the client sent (the invisible ones inside a match and the marks on its last character
included), so block and redact cover them. Text under a right-to-left override is scanned in the
order a reader sees too (`\\u202emoc.elpmaxe@oj`). Custom patterns also run on the script view
(normalise.script_view: no confusables folded, accents kept), so `(?i)бомба` or `café` find
their phrase, which the view spells `бoмбa` and `cafe`; internationalized e-mail addresses
(`иван@пример.рф`, `山田@例え.jp`) are found there too. Pure ASCII skips the views.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import os
import re
import string
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

import re2
from pydantic import Field, field_validator

from .api import Detection
from .base import Detector, DetectorError, DetectorParams, InvalidParams, parse_params
from .normalise import (
    display_order,
    is_plain,
    normalise,
    script_view,
    unfinished_markup,
    unmarked_view,
)
from .number_spellings import (
    CUT_DIGITS,
    cjk_tail_as_digits,
    may_hold_a_run,
    number_view,
    open_run,
    run_across,
)
from .re2_scan import (
    CONFIG_MAX_MEM,
    WORD_CHARS,
    Span,
    Utf8Text,
    body_spans,
    bounded_pattern,
    re2_options,
)

Kind = Literal["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]
KINDS: tuple[str, ...] = ("email", "phone", "ssn", "credit_card", "ipv4", "ipv6")
MAX_PATTERNS = 32  # custom patterns in a config
MAX_REQUEST_PATTERNS = 8  # custom patterns in one request (when the config allows them)
MAX_PATTERN_CHARS = 512
REQUEST_MAX_MEM = 1 << 20  # a pattern too big for this fails to compile in ~7 ms at worst
# A content up to this many characters is scanned on the event loop, which yields to other tasks
# after every this many characters; a longer one, and every content of a request that brings its
# own patterns, in a worker thread. Measured on 2 cores: the six kinds take 0.06-0.07 us a
# character of prose and 0.4 us of text dense with PII; a hand-off to the thread costs about
# 60 us. So a sentence is far cheaper inline, and the loop never stands still for more than
# ~0.4 ms (prose: ~70 us). Sending a whole call to the thread once its contents passed 256
# characters in total (a burst's sentences come in one call) cost 8% of the orchestrator's CPU
# per answer (bench/openai_overhead.py, ITL 0, c8).
INLINE_CHARS = 1024
# A call whose contents total more than this (a whole document chunked into thousands of
# sentences) goes to the thread in one hand-off, short contents included: scanning 1 MB of
# PII-dense text takes seconds of CPU, and even sliced into INLINE_CHARS turns it took the loop
# from every other request (issue 20). A burst of a stream's sentences stays far below it.
BULK_CHARS = 16 * 1024
MAX_IPV6_CHARS = 45  # ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


# No neighbour checks: the local part starts at its first letter or digit (a leading `.`, `_`,
# `+`, `-` is no part of what the pattern can match, so the search starts after it), and the
# domain ends with the last letter of its top-level label, whatever follows (`--he`, `_`, a
# digit): a guardrail finds the address in `xx.jo@example.com_1` rather than nothing.
_EMAIL = bounded_pattern(
    "",
    r"[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}",
    "",
)
# RFC 5321's bound on a domain: an address's match ends at most this many characters after its
# `@`, so a stream's window, which carries a bounded run (orchestrator/streaming/
# detector_queue.py, SEAM_RUN_CHARS), holds all of any match before any of it leaves. Without it
# a match had no end (`jo@` and 10,000 characters of labels before `.com`): the whole text found
# it and the stream, which cannot hold what has no end, released it raw.
DOMAIN_MOST = 255
# An `@` after a local part whose domain's characters run on past DOMAIN_MOST (`jo@` + `1.` x 200
# + `example.com`): no domain, but padding is no way to get an address's local part out raw. Its
# first DOMAIN_MOST characters are found (whether a top-level label ends the run somewhere past
# them or never does), and a reader gets only the labels after them: a domain, no address. The
# body is its local part, `@` and DOMAIN_MOST domain characters; one more must follow.
_EMAIL_PADDED = bounded_pattern(
    "",
    rf"[A-Za-z0-9][A-Za-z0-9._%+-]{{0,63}}@[A-Za-z0-9.-]{{{DOMAIN_MOST}}}",
    "([A-Za-z0-9.-])",
)
# what a domain starts with: a label and its dot
_DOMAIN_HEAD = re.compile(rb"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.")


def _within_domain_most(candidate: bytes) -> int:
    """An `_EMAIL` body up to DOMAIN_MOST characters after its `@`."""
    return min(len(candidate), candidate.index(b"@") + 1 + DOMAIN_MOST)


def _padded(data: bytes) -> Iterator[tuple[int, int]]:
    """Byte spans of the `_EMAIL_PADDED` bodies whose domain starts as a domain does (a label
    and its dot). A rejected one's `@` rejects every start before it (they share its domain):
    the scan goes on after it, not one character on (64 tries of 320 characters each made
    `a` x 64 + `@` + `-` x 256 cost 60 times a plain scan)."""
    pos = 0
    while (m := _EMAIL_PADDED.search(data, pos)) is not None:
        start, end = m.span(1)
        at = data.index(b"@", start)
        if _DOMAIN_HEAD.match(data, at + 1):
            yield start, end
            pos = end
        else:
            pos = at + 1


def _addresses(data: bytes) -> Iterator[tuple[int, int]]:
    """Byte spans of the addresses as written in `data`, none past DOMAIN_MOST after its `@`
    (an address its own way and padded may overlap: the two are one redaction)."""
    yield from body_spans(_EMAIL, data, _within_domain_most)
    if len(data) > DOMAIN_MOST:
        yield from _padded(data)


# An e-mail address spelt out for a human reader, a marker in brackets for its `@` or a dot:
# `jo [at] example [dot] com`, `jo(at)example.com`, `jo{AT}example dot com`,
# `jo.smith@example(dot)com`, `jo dot smith [at] example.com`. Such a spelling is only ever an
# address (what it is written for is that a person reads one), so it is found whenever its
# `@` is bracketed or written `@`; a bare ` at ` with bare ` dot `s (`user at example dot com`)
# is not: prose says "looked at this dot com bubble". A dot may be a bracketed `dot` or ` dot `
# once the `@` is there. Spaces and tabs only (a natural cut, `. ` or a line break, is crossed
# by no built-in match), at most two at each side of a marker, at most 4 spelt dots in the
# local part and 8 labels in the domain: a match stays shorter than a seam window's reach.
_SPACING = r"[ \t]{0,2}"
_SPELT_AT = rf"{_SPACING}[\[({{<]{_SPACING}(?i:at){_SPACING}[\])}}>]{_SPACING}"
# `@` with spaces around it (`jo @ example.com`), and a dot with spaces on both sides
# (`jo . smith @ example . com`): a sentence never ends with a dot after a space, so such a
# dot is no natural cut (chunkers.natural_cut)
_SPACED_AT = r"[ \t]{0,2}@[ \t]{0,2}"
_SPACED_DOT = r"[ \t]{1,2}\.[ \t]{1,2}"
_SPELT_DOT = (
    rf"(?:{_SPACING}[\[({{<]{_SPACING}(?i:dot){_SPACING}[\])}}>]{_SPACING}|[ \t](?i:dot)[ \t]"
    rf"|{_SPACED_DOT})"
)
# the local part's pieces end in no `.` (a spaced dot after one would cross a sentence end:
# `jo@example.com. . x`)
_LOCAL_SPELT = (
    rf"[A-Za-z0-9](?:[A-Za-z0-9._%+-]{{0,62}}[A-Za-z0-9_%+-])?"
    rf"(?:{_SPELT_DOT}[A-Za-z0-9_%+-](?:[A-Za-z0-9._%+-]{{0,62}}[A-Za-z0-9_%+-])?){{0,4}}"
)
_EMAIL_SPELT = bounded_pattern(
    "",
    _LOCAL_SPELT
    + rf"(?:{_SPELT_AT}|{_SPACED_AT})(?:[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?(?:{_SPELT_DOT}|\.)){{1,8}}"
    r"[A-Za-z]{2,63}",
    "",
)
# An address in words alone, `jo at example dot com`, `jo dot smith at mail dot example dot
# org`: a bare ` at ` only with a bare ` dot ` before a common top-level domain ending the
# domain (`available at docs.python.org` is prose; `at example dot com` is written for a reader
# to turn into an address). Prose with ` at `, ` dot ` and `com` in that order is rare, and a
# domain label that is a word of prose (`looked at this dot com bubble`) makes none.
EMAIL_WORD_TLDS = (
    "com|org|net|edu|gov|mil|int|io|ai|co|me|us|uk|de|fr|es|it|nl|be|ch|at|se|no|dk|fi|pl|pt|ie"
    "|ca|au|nz|in|jp|cn|br|mx|ru|info|biz|dev|app"
)
_EMAIL_WORDS = bounded_pattern(
    "",
    _LOCAL_SPELT
    + rf"[ \t]{{1,2}}(?i:at)[ \t]{{1,2}}(?:[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?(?:{_SPELT_DOT}|\.)){{0,7}}"
    rf"[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?[ \t](?i:dot)[ \t](?i:{EMAIL_WORD_TLDS})",
    r"\p{L}\p{N}",
)
# Words of prose that stand where a domain's label would (`looked at this dot com bubble`,
# `matrix at home dot org`): a label in words is none of them
_PROSE_LABELS = frozenset(
    "this that these those the a an my your our his her their its home work school least last"
    " first once all any some no one each every".split()
)
_WORDS_AT = re.compile(r"[ \t]+(?i:at)[ \t]+")
_WORDS_LABEL = re.compile(r"[A-Za-z0-9-]+")


def _words_length(candidate: bytes) -> int:
    """All of an `_EMAIL_WORDS` candidate, unless a label of its domain is a word of prose
    (`_PROSE_LABELS`): 0."""
    text = candidate.decode("ascii")
    domain = _WORDS_AT.split(text)[-1]
    labels = {m.group().lower() for m in _WORDS_LABEL.finditer(domain)}
    return 0 if labels & _PROSE_LABELS else len(candidate)


# what a spelt address needs: a bracketed `at` or `dot`, ` dot `, ` . `, or an `@` with a
# space beside it (any other text has no spelt address: one C search, before the scan)
_SPELT_MARK = re2.compile(
    rf"[\[({{<]{_SPACING}(?i:at|dot){_SPACING}[\])}}>]|[ \t](?i:dot)[ \t]|[ \t]\.[ \t]|[ \t]@|@[ \t]".encode(),
    re2_options(CONFIG_MAX_MEM),
)
_SPELT_FIRST = (
    b"[",
    b"(",
    b"{",
    b"<",
    b"dot",
    b"DOT",
    b"Dot",
    b" .",
    b"\t.",
    b" @",
    b"\t@",
    b"@ ",
    b"@\t",
)
_WORDS_FIRST = (b"dot", b"DOT", b"Dot")


def _emails(t: Utf8Text) -> Iterator[Span]:
    """E-mail addresses as written, then as spelt out (`_EMAIL_SPELT`) where the text holds a
    marker of one (an address found both ways is reported once: `_outermost`)."""
    yield from t.spans(_addresses(t.data))
    data = t.data
    if b"@" in data:
        # written backwards (`moc.elpmaxe@oj`, no override to show it the right way round): a
        # reader, or a model asked to, reverses it
        size = len(t.text)
        backwards = Utf8Text(t.text[::-1])
        for start, end in backwards.spans(_addresses(backwards.data)):
            yield size - end, size - start
    if any(first in data for first in _SPELT_FIRST) and _SPELT_MARK.search(data):
        yield from t.spans(body_spans(_EMAIL_SPELT, data))
    if any(first in data for first in _WORDS_FIRST):
        yield from t.spans(body_spans(_EMAIL_WORDS, data, _words_length))


# A phone number's left neighbour, the same for the three phone patterns: no letter or digit, as
# for every kind, nor a `-`, `.` or `/` after a digit (which continues a run of numbers, as for
# an SSN: `1-12-2023`, `192.168.1.1`); but a letter of a backslash escape is none (`\n`, `\r`,
# `\t` written out, as in JSON or a log line: `Phone:\n212 555 0100` holds a number, which the
# escape's `n` would otherwise glue to a longer token). It only looks inside the number's own
# whitespace-free run, which a stream's window holds whole (a window starts at whitespace or at
# a detection: DESIGN 4.6a). One rule for all three, since a window that starts at a detection
# of one pattern sees no neighbour at all there: had another pattern's rule rejected that start
# in the whole text (`0/(260)154-4554 ext. 667`: the US form found, the national form with its
# extension not), the window would have found the longer number and the whole text not.
_PHONE_BEFORE = rf"(?:^[.\-/]?|[^{WORD_CHARS}.\-/]|[^\p{{N}}][.\-/]|\\[nrt])"
_PHONE_INTL = bounded_pattern(
    _PHONE_BEFORE, r"\+[0-9]{1,3}(?:[ .-]?\([0-9]{1,4}\))?(?:[ .-]?[0-9]){6,14}", WORD_CHARS
)
# North American numbers: 3-3-4 digits with one kind of separator (any area code: a model
# writes `123-456-7890`, and a guardrail is permissive), or 10 contiguous digits with a real
# area code (`2125550100`; 1xx/0xx contiguous runs are mostly other numbers), an optional
# `+1`/`1` before either. Context-free, like every pattern here: a window of a stream finds
# what the whole text finds (libphonenumber's matcher looks past its match, and streamed
# windows and whole texts disagreed: the seam properties caught it).
_PHONE_US = bounded_pattern(
    _PHONE_BEFORE,
    r"(?:\+?1[ .-]?)?(?:\([0-9]{3}\)[ .-]?[0-9]{3}[ .-][0-9]{4}"
    r"|[0-9]{3}-[0-9]{3}-[0-9]{4}|[0-9]{3}\.[0-9]{3}\.[0-9]{4}|[0-9]{3} [0-9]{3} [0-9]{4}"
    r"|[2-9][0-9]{9})",
    WORD_CHARS,
)
# National numbers of other countries, without `+CC` (`(85) 9334-4656`, `0421 96 07 27`,
# `01.33.43.04.02`, `030/12345678`, `07700 900123`, `(07700)034176`, `555-123-4567x890`): a
# group of 2-8 digits or an area code in brackets, then up to four more groups of 2-8 digits,
# each after one space, dash or dot (a `/` only after a first group that starts with the trunk
# `0`), an optional extension (`x123`, `ext 123`, `ext.123`); or a contiguous trunk number (`0` and 8-10
# digits, the first not `0`: `07299949525`, `018310480`). Which shapes are phones is `_national_shape`'s
# question (this only finds the candidates). The neighbours are checked as for an SSN: a `-`,
# `.` or `/` beside a digit continues the run (`1-12-2023`, `192.168.1.1`).
#
# Why hand-written rather than libphonenumber's PhoneNumberMatcher: a stream's detector judges
# windows that may start at any whitespace of the text or at a detection (DESIGN 4.6a), and the
# seams are only safe when a verdict on a window that holds a whole number is the verdict on the
# whole text. The matcher's is not: it judges a candidate by the text around it (the characters
# before and after, the leniency's checks of the whole candidate run, which a window cuts at a
# space), national formats only for one default region, and `VALID` leniency rejects most
# numbers a model makes up (`123-456-7890`), which a guardrail must catch. Here a verdict is a
# function of the candidate alone, with its neighbours only checked inside its own
# whitespace-free run (which every window holds whole).
# no space after `ext.`: `. ` is a natural cut (chunkers.natural_cut), which no built-in match
# may cross (a chunk may end at `ext.`); `ext. 123` is the number without its extension
_EXT = r"(?: ?(?:x ?|ext ?|ext\.)[0-9]{1,5})?"
_PHONE_NATIONAL = bounded_pattern(
    _PHONE_BEFORE,
    r"(?:0[1-9][0-9]{7,9}|00[1-9][0-9]{6,12}"
    r"|(?:\([0-9]{1,5}\)[ -]?[0-9]{2,8}|0[0-9]{1,4}/[0-9]{2,8})(?:[ .-][0-9]{2,8}){0,4}"
    rf"|[0-9]{{2,8}}(?:[ .-][0-9]{{2,8}}){{1,4}}){_EXT}",
    rf"(?:$|[^{WORD_CHARS}.\-/]|[.\-/](?:$|[^\p{{N}}]))",
)
# area: not 000, 666 or 9xx; group: not 00; serial: not 0000; both separators the same.
# A `-` next to it continues it only with a digit on its other side (`1-123-45-6789`).
_SSN = bounded_pattern(
    rf"(?:^-?|[^{WORD_CHARS}-]|[^\p{{N}}]-)",
    r"(?:00[1-9]|0[1-9][0-9]|[1-578][0-9]{2}|6[0-57-9][0-9]|66[0-57-9])"
    r"(?:-(?:0[1-9]|[1-9][0-9])-| (?:0[1-9]|[1-9][0-9]) )"
    r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})",
    rf"(?:$|[^{WORD_CHARS}-]|-(?:$|[^\p{{N}}]))",
)
# Runs of digit groups joined by single spaces, dashes or dots ([0-9]+(?:[ .-][0-9]+)*); only
# runs of 12 digits or more can hold a card number (13-19; Maestro's 12), so shorter ones are
# not even reported as candidates (a sub-run of a run has fewer digits, so this finds the same
# runs). A `.` before the run after a digit makes it a decimal fraction (`_cards` checks dots
# inside the run).
_DIGIT_RUN = bounded_pattern(
    rf"(?:^\.?|[^{WORD_CHARS}.]|[^\p{{N}}]\.)", r"(?:[0-9][ .-]?){11,}[0-9]", WORD_CHARS
)
# Maestro's numbers are 12-19 digits under the IINs 50 and 56-69 (ISO/IEC 7812); a 12-digit
# number is a card only as one contiguous group under them (and with its Luhn digit): other
# 12-digit runs are references and phone numbers
_MAESTRO_12 = re.compile(r"5[06-9][0-9]{10}|6[0-9]{11}")
# not inside a longer dotted run of numbers on either side (1.2.3.4.5 is no address)
_IPV4 = bounded_pattern(
    rf"(?:^\.?|[^{WORD_CHARS}.]|[^\p{{N}}]\.)",
    r"(?:[0-9]{1,3}\.){3}[0-9]{1,3}",
    rf"(?:$|[^{WORD_CHARS}.]|\.(?:$|[^\p{{N}}]))",
)
# A run of [0-9A-Fa-f:.] (not starting with a dot) with at least two colons: runs with fewer
# are no address, and not reporting them as candidates keeps a text of bare numbers cheap.
_IPV6 = bounded_pattern(
    WORD_CHARS + ":.", r"(?:[0-9A-Fa-f][0-9A-Fa-f.]*)?:[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*", WORD_CHARS
)


def _pattern_spans(rx: Any, data: bytes) -> Iterator[Span]:
    """Byte spans of the non-empty matches of a custom pattern, left to right (finditer's)."""
    pos, size = 0, len(data)
    while pos <= size:
        m = rx.search(data, pos)
        if m is None:
            return
        start, end = m.span()
        if end > start:
            yield start, end
            pos = end
        else:  # an empty match: step over one whole character
            pos = end + (_utf8_len(data[end]) if end < size else 1)


def _utf8_len(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum every payment card number satisfies."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _simple(rx: Any) -> Callable[[Utf8Text], Iterator[Span]]:
    def find(t: Utf8Text) -> Iterator[Span]:
        return t.spans(body_spans(rx, t.data))

    return find


def _phones(t: Utf8Text) -> Iterator[Span]:
    """Phone numbers found by the three patterns (international `+CC ...` with 8-15 digits;
    North American forms; national forms of other countries, see `_national_length`),
    overlapping finds merged into one span and an unmatched bracket left out."""
    found: list[Span] = []
    for start, end in t.spans(body_spans(_PHONE_INTL, t.data)):
        if 8 <= sum(ch.isdigit() for ch in t.text[start:end]) <= 15:
            found.append((start, end))
    found.extend(t.spans(body_spans(_PHONE_US, t.data)))
    for start, end in t.spans(body_spans(_PHONE_NATIONAL, t.data, _national_length)):
        # a local number right after `+` is the start of an international one, which
        # `_PHONE_INTL` judges (`+44 20 79` is no `44 20 79`: a stream cut there holds an open
        # tail, DESIGN 4.6a). Window-safe: a `+` is in the number's whitespace-free run, and
        # the candidate has at most 7 digits, so no later start holds a local number.
        if start and t.text[start - 1] == "+" and _digit_count(t.text[start:end]) < 8:
            continue
        found.append((start, end))
    found = [_unbracketed(t.text, start, end) for start, end in found]
    found.sort()
    merged: list[Span] = []
    for start, end in found:
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    yield from merged


def _digit_count(text: str) -> int:
    return sum(ch.isdigit() for ch in text)


# A candidate's extension (`x123`, ` ext. 123`)
_EXTENSION = re.compile(r" ?(?:x|ext\.?) ?[0-9]{1,5}$")
_GROUP = re.compile(r"[0-9]+")
_CARD_GROUPS = re.compile(r"(?:^|[^0-9])[0-9]{4}[ .-][0-9]{4}[ .-][0-9]")
_DATED = re.compile(r"[0-9]+([-/.])[0-9]+\1[0-9]+ ")  # 2024-01-15 10, 15/01/2024 10


def _national_length(candidate: bytes) -> int:
    """How much of a `_PHONE_NATIONAL` candidate is a phone number: all of it, or its longest
    part that ends before one of its spaces (`555-123-4567` of `555-123-4567 1234 5678 ...`);
    0 for none. None when the candidate holds two 4-digit groups and then another group: a card
    number's (`12 4111 1111 1111 1111` is a reference and a card, `4111 1111 1111 1112` a
    mistyped card), or the start of one that a stream has not finished (`4111 1111 1111 111`:
    found as a phone there, from its second group, it blocked a stream after `4111 `, the start
    of the card the finished text holds)."""
    body = candidate.decode("ascii")  # (digits, separators, brackets, an extension)
    if _CARD_GROUPS.search(body):
        return 0
    cut = len(body)
    while cut > 0:
        if _national_shape(body[:cut]):
            return cut
        cut = body.rfind(" ", 0, cut)
    return 0


def _national_shape(number: str) -> bool:
    """Whether a number without `+CC` has a phone number's shape, judged on its characters
    alone (never on the text around it: see `_PHONE_NATIONAL`). A local number of 6-8 digits
    (`_local_number`); or 8-12 digits (15 after the international prefix `00`), in at least two
    groups or a contiguous trunk number, and none of the other numbers that share the digits and
    separators:

    - dates (`2024-01-15`, `15 01 2024`: groups of 4-2-2 or 2-2-4 digits; with a time after
      them, `2024-01-15 10`, when written with dashes or slashes) and ZIP+4 (5-4);
    - an SSN's 3-2-4 (`123-45-6789`: the `ssn` kind's, reported as an SSN);
    - runs of 4-digit groups only (`4111 1111 1111`, `2020-2023`): pieces of card numbers and
      ranges of years (but a 4-4 local number starting with 7-9, see `_local_number`);
    - dotted numbers other than 3.3.4 and 2.2.2.2.2 (`555.123.4567`, `01.33.43.04.02`):
      versions, IPv4 addresses (four groups) and decimals.

    Plain runs of digits are phones only as a trunk number (`0` then 9-10 digits, the first not
    `0`: `07299949525`; `0` then 8 digits where libphonenumber calls it a valid number of a
    country that writes its numbers so, `_valid_trunk_9`: `018310480`, Italy) or `00` and a
    possible international number (`_possible_international`)
    here, and as a 10-digit North American number (`_PHONE_US`); any other
    run (an order, account or invoice number) is not, since whether a run is a phone is said by
    the words around it (`phone:`, `call`), which a stream's window may not hold (it may start
    right at the number). What is left ambiguous and found: space-grouped amounts (`12 345 678`,
    `100 200 300`) and other grouped references of 8-12 digits (`2023-001234`): a guardrail
    over-redacts them rather than let a phone number out."""
    main = _EXTENSION.sub("", number)
    if main.isdigit():
        if main.startswith("00"):
            return _possible_international(main[2:])
        if main[0] != "0" or main[1] == "0":
            return False
        return len(main) in (10, 11) or (len(main) == 9 and _valid_trunk_9(main))
    values = _GROUP.findall(main)
    groups = [len(g) for g in values]
    digits = sum(groups)
    if digits <= 8 and _local_number(main, values):
        return True
    if not 8 <= digits <= (15 if main.startswith("00") else 12) or len(groups) < 2:
        return False
    bracketed = main.startswith("(")
    if "." in main:
        return (
            not bracketed
            and "-" not in main
            and " " not in main
            and (groups in ([3, 3, 4], [2, 2, 2, 2, 2]))
        )
    if bracketed:
        return True
    if groups[:3] in ([4, 2, 2], [2, 2, 4]) and (len(groups) == 3 or _DATED.match(main)):
        return False  # a date, or a date and its time (`2024-01-15 10:30`)
    return groups not in ([3, 2, 4], [5, 4]) and any(n != 4 for n in groups)


def _local_number(main: str, values: list[str]) -> bool:
    """Whether a number of 6-8 digits without `+CC` or a trunk prefix is a local phone number:
    3-4 digits (`555-1234`, `795 2525`) and 4-4 (`9357 8533`) with a space or a dash between
    them, and 2-2-2 with spaces (`89 97 11`), the layouts of North American local numbers and
    of the countries whose whole numbers have 6-8 digits (the Nordic countries, the Baltic
    states, Greenland, Singapore...). Proven otherwise, on the number's own characters:

    - 3-4 whose first digit is 0 or 1 (no local number starts with a trunk or service digit,
      NANP's exchange codes start with 2-9): a range such as `100-1000`;
    - 4-4 whose first digit is 0-6: years (`1999 2000`, `2020-2023`) and the first two groups
      of a card number cut by a chunk (`4111 1111`: every payment card network's numbers start
      with 2-6, ISO/IEC 7812), which a stream's chunk alone must not read as a phone;
    - 2-2-2 whose groups read as a day and a month (`15 01 24`, `24 12 31`);
    - dots (`314.1592` is a decimal) and brackets."""
    seps = set(main) - set("0123456789")
    if len(seps) != 1 or not seps <= {" ", "-"} or main.count(next(iter(seps))) != len(values) - 1:
        return False
    lengths = [len(v) for v in values]
    if lengths == [3, 4]:
        return main[0] in "23456789"
    if lengths == [4, 4]:
        return main[0] in "789"
    if lengths == [2, 2, 2] and seps == {" "}:
        a, b, c = (int(v) for v in values)
        day, month = range(1, 32), range(1, 13)
        dated = (a in day and b in month) or (a in month and b in day) or (b in month and c in day)
        return not dated
    return False


# Countries whose national numbers include 9 digits written from the trunk `0` without a space,
# and their country codes: Italy (`0183 10480`: an area code and 5-6 digits, often run
# together; its numbers keep the `0`), Belgium, Austria and Germany (short local numbers in
# small towns; the `0` is the trunk prefix)
TRUNK_9_REGIONS = {"IT": 39, "BE": 32, "AT": 43, "DE": 49}


@functools.lru_cache(maxsize=4096)
def _valid_trunk_9(number: str) -> bool:
    """Whether libphonenumber calls a contiguous `0` and 8 digits a valid number of one of
    TRUNK_9_REGIONS (the region is guessed from that list, as nothing else in a number says
    it). Lenient by nature: Italy's plan holds most such numbers (about 98% of random ones pass,
    `088706524` does not), so this keeps the shape a phone's and rejects the impossible. The
    numbers are built, not parsed (`parse` would find the same: 3,000 random ones agreed), at a
    third of the cost: 20 us for one valid nowhere, as `_possible_international`'s; cached, as a
    hostile text repeats one."""
    import phonenumbers

    for region, code in TRUNK_9_REGIONS.items():
        if region == "IT":
            candidate = phonenumbers.PhoneNumber(
                country_code=code, national_number=int(number), italian_leading_zero=True
            )
        else:
            candidate = phonenumbers.PhoneNumber(country_code=code, national_number=int(number[1:]))
        if phonenumbers.is_valid_number_for_region(candidate, region):
            return True
    return False


def _possible_international(number: str) -> bool:
    """Whether the digits after the international prefix `00` are a possible number with a
    country code, as libphonenumber says (the country code exists and the number's length is
    one that country's numbers have); a plain run of digits otherwise."""
    import phonenumbers

    try:
        return phonenumbers.is_possible_number(phonenumbers.parse("+" + number))
    except phonenumbers.NumberParseException:
        return False


def _unbracketed(text: str, start: int, end: int) -> Span:
    """A span without an unmatched bracket at either end (`(555-123-4567` of `(555-123-4567)`)."""
    if text.startswith("(", start) and ")" not in text[start:end]:
        start += 1
    if end > start and text[end - 1] == ")" and "(" not in text[start:end]:
        end -= 1
    return start, end


def _cards(t: Utf8Text) -> Iterator[Span]:
    """Within each run of digit groups, the longest stretches of consecutive groups that make
    13-19 digits (or one group of 12 under a Maestro IIN) and pass Luhn; groups shorter than 3
    digits only stand alone (never part of a grouped number), which keeps dates and phone
    fragments out, and a group that stands alone after `digits.` is a decimal fraction
    (0.4111111111111111), not a card."""
    text = t.text
    for run_start, run_end in t.spans(body_spans(_DIGIT_RUN, t.data)):
        groups: list[Span] = []
        pos = run_start
        # one separator each
        for part in text[run_start:run_end].replace("-", " ").replace(".", " ").split(" "):
            groups.append((pos, pos + len(part)))
            pos += len(part) + 1
        i = 0
        while i < len(groups):
            best = -1
            digits = ""
            for j in range(i, len(groups)):
                start, end = groups[j]
                if j > i and (end - start < 3 or groups[i][1] - groups[i][0] < 3):
                    break
                digits += text[start:end]
                if len(digits) > 19:
                    break
                if (len(digits) >= 13 or (j == i and _MAESTRO_12.fullmatch(digits))) and luhn_ok(
                    digits
                ):
                    best = j
            if best == i and i > 0 and text[groups[i][0] - 1] == ".":
                best = -1  # a decimal fraction
            if best >= 0:
                yield groups[i][0], groups[best][1]
                i = best + 1
            else:
                i += 1


def _ipv4s(t: Utf8Text) -> Iterator[Span]:
    for start, end in t.spans(body_spans(_IPV4, t.data)):
        try:
            ipaddress.IPv4Address(t.text[start:end])
        except ValueError:
            continue
        yield start, end


def _ipv6_length(candidate: str) -> int:
    """The longest prefix of `candidate`, stripped of trailing `.`/`:` one at a time (sentence
    punctuation after an address), that is an IPv6 address; 0 for none. Only prefixes of at
    most MAX_IPV6_CHARS are parsed, so a run of 100,000 colons costs one pass, not 100,000."""
    floor = len(candidate.rstrip(".:"))
    for n in range(min(len(candidate), MAX_IPV6_CHARS), max(floor, 1) - 1, -1):
        try:
            ipaddress.IPv6Address(candidate[:n])
        except ValueError:
            continue
        # a bare "::" is not an address worth reporting
        return n if any(ch not in ":." for ch in candidate[:n]) else 0
    return 0


def _ipv6s(t: Utf8Text) -> Iterator[Span]:
    for start, end in t.spans(body_spans(_IPV6, t.data)):
        n = _ipv6_length(t.text[start:end])
        if n:
            yield start, start + n


_DIGITS = b"0123456789"


def could_match(kind: str, data: bytes, digits: int) -> bool:
    """Whether `data` (with `digits` ASCII digits) holds the characters that every match of
    `kind`'s regexes needs: an email its `@`; a phone at least 6 digits (a local 2-2-2 number;
    + and 1 digit, then 6 more); an SSN 9; a card 12 (its run of digit groups); an IPv4 address 4
    digits and 3 dots; an IPv6 candidate 2 colons. Counted in C, it spares most sentences every
    scan: 7 RE2 searches, each with its Python wrapper and generators, were 23 us of prose."""
    if kind == "email":
        return b"@" in data or any(first in data for first in _SPELT_FIRST)
    if kind == "phone":
        return digits >= 6
    if kind == "ssn":
        return digits >= 9
    if kind == "credit_card":
        return digits >= 12
    if kind == "ipv4":
        return digits >= 4 and data.count(b".") >= 3
    return data.count(b":") >= 2  # ipv6


_FINDERS: dict[str, Callable[[Utf8Text], Iterator[Span]]] = {
    "email": _emails,
    "phone": _phones,
    "ssn": _simple(_SSN),
    "credit_card": _cards,
    "ipv4": _ipv4s,
    "ipv6": _ipv6s,
}


def _compile(pattern: str, max_mem: int) -> Any:
    """A custom pattern compiled by RE2 (as UTF-8); ValueError saying why it cannot be."""
    try:
        return re2.compile(pattern.encode("utf-8"), re2_options(max_mem))
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise ValueError(f"does not compile as an RE2 pattern: {reason}") from None
    except UnicodeEncodeError:
        raise ValueError("does not compile as an RE2 pattern: not valid Unicode") from None


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> Any:
    """A config pattern compiled with RE2's default memory budget (cached)."""
    return _compile(pattern, CONFIG_MAX_MEM)


class _RequestPatterns:
    """Compiled request patterns and compile failures, least recently used dropped: a client
    repeating a pattern (or a bad one) costs one compile, and memory stays bounded."""

    def __init__(self, size: int = 128) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def get(self, pattern: str) -> Any:
        with self._lock:
            hit = self._cache.get(pattern)
            if hit is not None:
                self._cache.move_to_end(pattern)
        if hit is None:
            try:
                hit = _compile(pattern, REQUEST_MAX_MEM)
            except ValueError as exc:
                hit = exc
            with self._lock:
                self._cache[pattern] = hit
                while len(self._cache) > self._size:
                    self._cache.popitem(last=False)
        if isinstance(hit, ValueError):
            raise ValueError(str(hit))
        return hit


_REQUEST_PATTERNS = _RequestPatterns()


def compile_request_pattern(pattern: str) -> Any:
    """A request's pattern compiled with the request memory budget (cached, failures too)."""
    return _REQUEST_PATTERNS.get(pattern)


def _check_shape(patterns: Mapping[str, str], limit: int) -> list[tuple[str, str]]:
    """Problems with the names, sizes and count of custom patterns (nothing compiled)."""
    if len(patterns) > limit:
        return [("patterns", f"at most {limit} patterns, got {len(patterns)}")]
    problems: list[tuple[str, str]] = []
    for name, pattern in patterns.items():
        if not 1 <= len(name) <= 64 or not set(name) <= _NAME_CHARS:
            problems.append(("patterns", f"pattern name {name!r} must be 1-64 of [A-Za-z0-9_.:-]"))
        elif name in KINDS:
            problems.append(
                ("patterns", f"pattern name {name!r} is a built-in kind; choose another")
            )
        elif not pattern or len(pattern) > MAX_PATTERN_CHARS:
            problems.append(
                ("patterns", f"pattern {name!r} must be 1-{MAX_PATTERN_CHARS} characters")
            )
    return problems


def _compile_all(patterns: Mapping[str, str], compile_one: Callable[[str], Any]) -> dict[str, Any]:
    compiled: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for name, pattern in patterns.items():
        try:
            compiled[name] = compile_one(pattern)
        except ValueError as exc:
            problems.append((f"patterns.{name}", str(exc)))
    if problems:
        raise InvalidParams("; ".join(f"{loc}: {msg}" for loc, msg in problems), problems)
    return compiled


class RegexParams(DetectorParams):
    """`threshold` is accepted for uniformity with the other detectors; every match scores 1.0.
    `allow_request_patterns` (config-only) lets requests send their own `patterns`."""

    kinds: list[Kind] = Field(default_factory=lambda: list(KINDS))
    patterns: dict[str, str] = Field(default_factory=dict)
    threshold: float | None = Field(None, ge=0, le=1)
    allow_request_patterns: bool = False

    @field_validator("patterns")
    @classmethod
    def _check_patterns(cls, patterns: dict[str, str]) -> dict[str, str]:
        problems = _check_shape(patterns, MAX_PATTERNS)
        if problems:
            raise ValueError(problems[0][1])
        return patterns


def find_pii(text: str, kinds: list[str], patterns: Mapping[str, Any]) -> list[Detection]:
    """Every match in `text`'s normalised view (DESIGN 4.6b), spans in `text`, sorted by
    (start, end); `patterns` are compiled custom patterns (compile_pattern /
    compile_request_pattern)."""
    return _scan(text, kinds, patterns, None)


# Unicode tag characters (U+E0020-U+E007E): each an invisible copy of an ASCII character, which
# a program or a model reading the text decodes (`decode.tag_payloads`). An answer can carry an
# address in them past a reader; they are also read as the ASCII they copy, one for one (so
# spans are the same), and what that reading holds is reported too.
_TAG = re.compile("[\U000e0020-\U000e007e]")
_TAG_TO_ASCII = {cp: cp - 0xE0000 for cp in range(0xE0020, 0xE007F)}


def _scan(
    text: str, kinds: list[str], patterns: Mapping[str, Any], cancelled: threading.Event | None
) -> list[Detection]:
    """`_scan_view`'s detections, and where the text holds tag characters, those of the text
    with them read as the ASCII they copy (one character for one: the same spans)."""
    found = _scan_view(text, kinds, patterns, cancelled)
    if text.isascii() or _TAG.search(text) is None:
        return _detections(text, found)
    builtin, custom = _scan_view(text.translate(_TAG_TO_ASCII), kinds, patterns, cancelled)
    return _detections(
        text,
        (
            _with_unmarked(found[0], builtin),  # (what the text itself holds comes first)
            sorted(set(found[1] + custom)),
        ),
    )


def _scan_view(
    text: str, kinds: list[str], patterns: Mapping[str, Any], cancelled: threading.Event | None
) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """Matches in the normalised view of `text`, mapped back to `text`. Pure ASCII cannot hold
    an invisible or look-alike character: it is scanned as it is, with no view and no map.
    Text under a right-to-left override is scanned a second time in the order a reader sees
    it (`\u202emoc.elpmaxe@oj` shows jo@example.com): a value leaks in either order, so both
    are judged, and a value seen in display order covers every character it was drawn from
    (and those between: an override is reversed in place, so a value inside it is a stretch of
    the text, and one that straddles its edge covers the text from the first to the last)."""
    if is_plain(text):
        builtin, custom = _find(Utf8Text(text), kinds, patterns, cancelled)
        spelt = _spelt_numbers(text, kinds, cancelled) + _encoded_values(text, kinds, cancelled)
        return (_with_unmarked(builtin, spelt) if spelt else builtin), custom
    view = normalise(text)
    builtin, custom = _find(Utf8Text(view.text), kinds, patterns, cancelled)
    spelt = _spelt_numbers(view.text, kinds, cancelled)
    spelt += _encoded_values(view.text, kinds, cancelled)
    if spelt:
        builtin = _with_unmarked(builtin, spelt)
    if not view.identity:
        builtin = [(*view.span(s, e), name) for s, e, name in builtin]
        custom = [(*view.span(s, e), name) for s, e, name in custom]
    if "email" in kinds and "@" in view.text:
        script = script_view(text)
        intl = [(*script.span(s, e), "email") for s, e in _intl_emails(script.text)]
        if intl:
            builtin = _outermost(builtin + intl)
    if patterns and not text.isascii():
        # a custom pattern is written in its phrase's script (`бомба`, `café`), which the
        # view folds to ASCII look-alikes (`бoмбa`, `cafe`): judged in the script view too
        script = script_view(text)
        if script.text != view.text:
            more_custom = _find(Utf8Text(script.text), [], patterns, cancelled)[1]
            custom = sorted(set(custom + [(*script.span(s, e), n) for s, e, n in more_custom]))
    plain = unmarked_view(text)
    if plain is not None:
        # markup decoded once, as a renderer does, can also hide what a reader of the raw text
        # sees (`%555-123-4567`: `%55` is a `U`): the view with markup as it is is judged too,
        # and a value found only there is kept (one inside a value found in the decoded view,
        # which covers an escape whole, is that value)
        more_builtin, more_custom = _find(Utf8Text(plain.text), kinds, patterns, cancelled)
        builtin = _with_unmarked(builtin, [(*plain.span(s, e), n) for s, e, n in more_builtin])
        custom = _with_unmarked(custom, [(*plain.span(s, e), n) for s, e, n in more_custom])
    shown = display_order(text)
    if shown is not None:
        shown_text, order = shown
        shown_view = normalise(shown_text)

        def back(s: int, e: int) -> Span:
            s, e = shown_view.span(s, e)
            drawn = order[s:e]  # never empty: every match is
            return min(drawn), max(drawn) + 1

        more_builtin, more_custom = _find(Utf8Text(shown_view.text), kinds, patterns, cancelled)
        # each order's values (the same value seen in both is reported once): a value in one
        # order is not hidden by a longer one in the other, which may be an artifact of the
        # reversal (`a@a\u202e.com thanks` shows a@a.sknaht moc.)
        builtin = sorted(set(builtin + [(*back(s, e), name) for s, e, name in more_builtin]))
        custom = sorted(set(custom + [(*back(s, e), name) for s, e, name in more_custom]))
    return builtin, custom


NUMBER_KINDS = ("phone", "ssn", "credit_card")
# A value in base64 (`am9AZXhhbXBsZS5jb20=` is jo@example.com: a model asked to encode one
# writes it so, and a reader decodes it at once): a whitespace-free run of the alphabet
# (standard or URL-safe), 12-1,000 characters (RE2's most repetitions), decoded; when the decoded text is printable and
# holds a value of a kind, the whole run is that kind. Longer runs are no value; at most
# MAX_ENCODED_RUNS runs of a text are decoded (bounded work).
_BASE64_RUN = bounded_pattern(
    r"A-Za-z0-9+/_\-=", r"[A-Za-z0-9+/_-]{12,1000}={0,2}", r"A-Za-z0-9+/_\-="
)
MAX_ENCODED_RUNS = 64
# twelve characters of the alphabet in a row (fixed length: linear in `re`), and somewhere a
# digit or a `+`, `/` or `=` (base64 of a value has them: its `@`, `.` and digits encode so)
_BASE64_HINT = re.compile(r"[A-Za-z0-9+/_-]{12}")
_BASE64_MARKS = re.compile(r"[0-9+/=]")


def _base64_text(run: str) -> str | None:
    """`run` decoded from base64 (either alphabet, padding optional) when that gives printable
    text; None otherwise (a hash, a key, a word)."""
    body = run.rstrip("=")
    if len(body) % 4 == 1:
        return None
    try:
        raw = base64.b64decode(
            body + "=" * (-len(body) % 4),
            altchars=b"-_" if "-" in body or "_" in body else None,
            validate=True,
        )
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return text if text.isprintable() else None


def _encoded_values(
    text: str, kinds: list[str], cancelled: threading.Event | None
) -> list[tuple[int, int, str]]:
    """Base64 runs of `text` whose decoded text holds a value of `kinds`, each as a whole run
    of that kind (`_BASE64_RUN`)."""
    if _BASE64_MARKS.search(text) is None or _BASE64_HINT.search(text) is None:
        return []  # (a `re` look spares most texts the RE2 search's Python wrapper)
    t = Utf8Text(text)
    out: list[tuple[int, int, str]] = []
    for n, (start, end) in enumerate(t.spans(body_spans(_BASE64_RUN, t.data))):
        if n >= MAX_ENCODED_RUNS:
            break
        decoded = _base64_text(text[start:end])
        if decoded is None:
            continue
        found, _ = _find(Utf8Text(decoded), kinds, {}, cancelled)
        if found:
            out.append((start, end, found[0][2]))
    return out


def _spelt_numbers(
    text: str, kinds: list[str], cancelled: threading.Event | None
) -> list[tuple[int, int, str]]:
    """Phone, SSN and card numbers in `text` (a normalised view) spelt as words, written one
    digit at a time or with look-alike letters among their digits (number_spellings), spans in
    `text`: only the finds that hold a rewritten run (the rest are the plain scan's)."""
    wanted = [k for k in kinds if k in NUMBER_KINDS]
    numbers = number_view(text) if wanted else None
    if numbers is None:
        return []
    view, rewritten = numbers
    found, _ = _find(Utf8Text(view.text), wanted, {}, cancelled)
    return [
        (*view.span(s, e), kind)
        for s, e, kind in found
        if any(s < b and a < e for a, b in rewritten)
    ]


def _with_unmarked(
    found: list[tuple[int, int, str]], more: list[tuple[int, int, str]]
) -> list[tuple[int, int, str]]:
    """`found` and the matches of `more` that lie inside none of them. One sweep over both in
    order of start (a text of many values must not cost their product): `m` lies inside one of
    `found` iff the furthest end of those starting at or before it reaches its end."""
    found = sorted(found)
    kept = set(found)
    i, reach = 0, -1
    for m in sorted(more):
        while i < len(found) and found[i][0] <= m[0]:
            reach = max(reach, found[i][1])
            i += 1
        if reach < m[1]:
            kept.add(m)
    return sorted(kept)


def _outermost(found: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Built-in matches sorted, without those inside (or equal to) an earlier, longer one."""
    found = sorted(found, key=lambda m: (m[0], -m[1], KINDS.index(m[2])))
    kept: list[tuple[int, int, str]] = []
    reach = -1
    for start, end, kind in found:
        if end <= reach:  # inside (or equal to) an earlier, longer match
            continue
        kept.append((start, end, kind))
        reach = max(reach, end)
    return kept


# Letters of the scripts written without a space between words (Chinese, Japanese, Thai, Lao,
# Khmer, Myanmar) and Korean syllables (whose particles are written onto the word before:
# `010-1234-5678\ub85c`): beside a value they are the next word, not part of a longer token as
# a Latin letter is (`id4111111111111111`). `\u7535\u8bdd555-123-4567\u3002` and
# `\u96fb\u8a71\u306f555-123-4567\u3067\u3059` hold a phone number, which the kinds' neighbour
# checks missed (any letter glued it). The built-in kinds judge the text with each such letter
# read as an ideographic space (`unspaced_as_spaces`: one character for one, so spans are the
# same; the view holds no U+3000, NFKD makes it a space). Digits of these scripts are not in
# the ranges (the view made them ASCII); custom patterns judge the text as it is.
_UNSPACED = re.compile(
    "[\u0e01-\u0e4f\u0e81-\u0ecf\u1000-\u103f\u1100-\u11ff\u1780-\u17d3\u3041-\u30ff"
    "\u3131-\u318e\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003134f]"
)


def unspaced_as_spaces(text: str) -> str:
    """`text` with the letters of scripts written without spaces read as spaces (`_UNSPACED`),
    one character for one; `text` itself when it holds none (one C scan)."""
    if text.isascii() or _UNSPACED.search(text) is None:
        return text
    return _UNSPACED.sub("\u3000", text)


# An internationalized address (RFC 6531: a local part and a domain in any script, `\u0438\u0432\u0430\u043d@
# \u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444`, `\u5c71\u7530@\u4f8b\u3048.jp`, `\u03b4\u03b7\u03bc\u03ae\u03c4\u03c1\u03b7\u03c2@example.gr`), found in the script
# view (letters in their script: the view spells a Cyrillic local part half in Latin look-alikes,
# `\u0438bah`, which the ASCII pattern found from its `b`). A top-level label in ASCII ends at its
# last ASCII letter (`jo@\u4f8b\u3048.jp\u307e\u3067`: the next word is glued on in Japanese).
_EMAIL_INTL = bounded_pattern(
    "",
    r"[\p{L}\p{N}][\p{L}\p{N}\p{M}._%+-]{0,63}@"
    r"(?:[\p{L}\p{N}](?:[\p{L}\p{N}\p{M}-]{0,61}[\p{L}\p{N}\p{M}])?\.)+"
    r"(?:[A-Za-z]{2,63}|[\p{L}\p{M}]{2,63})",
    "",
)
# a local part's ASCII tail after a letter of a script written without spaces (`_UNSPACED`): a
# word of prose glued on (`\u30e1\u30fc\u30eb\u306fjo@example.com`), not part of the address
_GLUED_LOCAL = re.compile(_UNSPACED.pattern + r"[A-Za-z0-9._%+-]*[A-Za-z][A-Za-z0-9._%+-]*\Z")


def _intl_emails(text: str) -> Iterator[Span]:
    """`_EMAIL_INTL`'s matches in `text` (a script view) that hold a character outside ASCII
    (the others are `_EMAIL`'s), without a glued-on word before an ASCII local part."""
    t = Utf8Text(text)
    for start, end in t.spans(body_spans(_EMAIL_INTL, t.data)):
        if text[start:end].isascii():
            continue
        at = text.index("@", start)
        glued = _GLUED_LOCAL.search(text, start, at)
        if glued is not None:
            start = glued.start() + 1
            if text[start:end].isascii():
                continue
        yield start, end


def _find(
    t: Utf8Text,
    kinds: list[str],
    patterns: Mapping[str, Any],
    cancelled: threading.Event | None,
) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """The built-in matches (one per value: see `_outermost`) and the custom ones in `t`."""
    builtin: list[tuple[int, int, str]] = []
    spaced = unspaced_as_spaces(t.text) if kinds else t.text
    bt = t if spaced is t.text else Utf8Text(spaced)
    data = bt.data
    digits = len(data) - len(data.translate(None, _DIGITS))
    for kind in KINDS:
        if kind in kinds and could_match(kind, data, digits):
            _check_cancelled(cancelled)
            builtin.extend((s, e, kind) for s, e in _FINDERS[kind](bt))
    custom: list[tuple[int, int, str]] = []
    for name, rx in patterns.items():
        _check_cancelled(cancelled)
        custom.extend((s, e, name) for s, e in t.spans(_pattern_spans(rx, t.data)))
    return (_outermost(builtin) if builtin else builtin), custom


def _detections(
    text: str, found: tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]
) -> list[Detection]:
    """Detections of `text` from its matches (spans in `text`), sorted by (start, end, name)."""
    builtin, custom = found
    if not custom:
        if not builtin:
            return []  # most sentences: no allocation, no sort
        kept = builtin
    else:
        kept = builtin + custom
    kept.sort(key=lambda m: (m[0], m[1], m[2]))
    # model_construct: these values are ours and well-typed, and validating each of the tens of
    # thousands a large document can hold cost more than the scan that found them. They share
    # one fields-set (what pydantic would record: these six): a set per detection was 40,000
    # more objects for the garbage collector to walk, with the event loop stopped, per 1 MB
    make = Detection.model_construct
    return [
        make(
            _PII_FIELDS,
            start=s,
            end=e,
            text=text[s:e],
            detection=name,
            detection_type="pii",
            score=1.0,
        )
        for s, e, name in kept
    ]


_PII_FIELDS = {"start", "end", "text", "detection", "detection_type", "score"}


def _check_cancelled(cancelled: threading.Event | None) -> None:
    if cancelled is not None and cancelled.is_set():
        raise DetectorError("regex: scan abandoned (the caller went away)")


_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def scan_executor() -> ThreadPoolExecutor:
    """Threads of their own for long scans: a flood of them never occupies the default
    executor, which aiohttp needs for DNS lookups."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            workers = max(2, min(4, os.cpu_count() or 1))
            _EXECUTOR = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="regex-scan")
        return _EXECUTOR


class RegexDetector(Detector):
    name = "regex"
    description = (
        "PII by pattern: email, phone (international, North American, other national and "
        "local layouts), US SSN, credit card (Luhn), "
        "IPv4, IPv6, plus custom {name: regex} patterns (RE2 syntax, from the config; from "
        "requests only with allow_request_patterns). detection_type 'pii', detection = the "
        "kind or pattern name, exact spans, score 1.0."
    )
    Params: ClassVar[type[RegexParams]] = RegexParams
    finds_spans: ClassVar[bool] = True
    REQUEST_PARAMS: ClassVar[frozenset[str]] = frozenset({"kinds", "threshold"})

    def __init__(self, params: Mapping[str, Any] | None = None, *, device: str = "auto") -> None:
        super().__init__(params, device=device)
        self._compiled = {name: compile_pattern(rx) for name, rx in self.params.patterns.items()}

    @classmethod
    def parse_params(cls, params: Mapping[str, Any] | None) -> RegexParams:
        """Config params: every custom pattern must compile in RE2 (the error names it)."""
        p = parse_params(RegexParams, params)
        _compile_all(p.patterns, compile_pattern)
        return p

    @classmethod
    def request_param_names(cls, config: Mapping[str, Any]) -> frozenset[str]:
        if config.get("allow_request_patterns") is True:
            return cls.REQUEST_PARAMS | {"patterns"}
        return cls.REQUEST_PARAMS

    @classmethod
    def validate_request(cls, config: Mapping[str, Any], request: Any) -> RegexParams:
        if isinstance(request, Mapping) and "patterns" in request:
            if config.get("allow_request_patterns") is not True:
                raise InvalidParams.at(
                    "patterns",
                    "custom patterns come from the detector's config; a request may send "
                    "them only when the config sets allow_request_patterns: true",
                )
            patterns = request["patterns"]
            if isinstance(patterns, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in patterns.items()
            ):
                problems = _check_shape(patterns, MAX_REQUEST_PATTERNS)
                if problems:
                    message = "; ".join(f"{loc}: {msg}" for loc, msg in problems)
                    raise InvalidParams(message, problems)
                _compile_all(patterns, compile_request_pattern)
            # anything else is not a {name: pattern} map: pydantic names the problem below
        return super().validate_request(config, request)

    def crosses_natural_cuts(self, params: Mapping[str, Any] | None) -> bool:
        """The built-in kinds cross no natural cut: a match holds a line break only after a
        lone digit or a number word (a number written a digit a line, number_spellings.py),
        which is no natural cut, and whitespace after a `.` only in a spaced e-mail's ` . `,
        which is none either; never after `?`, `!` or a closer (the view folds every
        whitespace character to whitespace, so no invisible trick changes that; the seam
        properties and `test_no_builtin_match_crosses_a_natural_cut` hold it). A custom
        pattern may match anything, so with one every cut is looked across."""
        return bool(self.params.patterns) or bool(params and params.get("patterns"))

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        p: RegexParams = self.effective_params(params)
        from_request = bool(params) and "patterns" in (params or {})
        if from_request:
            compiled = {name: compile_request_pattern(rx) for name, rx in p.patterns.items()}
        else:
            compiled = self._compiled
        kinds = list(p.kinds)
        # Long contents (and every content, with a request's own patterns) go to the thread in
        # one hand-off, and RE2 releases the GIL while it matches, so they run while the loop
        # scans the short ones itself, yielding to other tasks after every INLINE_CHARS.
        bulk = sum(map(len, contents)) > BULK_CHARS
        threaded = [
            i for i, c in enumerate(contents) if from_request or bulk or len(c) > INLINE_CHARS
        ]
        found: list[list[Detection]] = [[] for _ in contents]
        cancelled = threading.Event()
        in_thread: asyncio.Future[list[list[Detection]]] | None = None
        if threaded:

            def run() -> list[list[Detection]]:
                return [_scan(contents[i], kinds, compiled, cancelled) for i in threaded]

            in_thread = asyncio.get_running_loop().run_in_executor(scan_executor(), run)
        try:
            skip, since_yield = set(threaded), 0
            for i, content in enumerate(contents):
                if i in skip:
                    continue
                if since_yield + len(content) > INLINE_CHARS:
                    await asyncio.sleep(0)
                    since_yield = 0
                found[i] = _scan(content, kinds, compiled, None)
                since_yield += len(content)
            if in_thread is not None:
                for i, detections in zip(threaded, await in_thread, strict=True):
                    found[i] = detections
        except BaseException:
            cancelled.set()  # the thread stops at its next pattern or content
            if in_thread is not None:
                in_thread.cancel()
            raise
        return found

    def open_tail(
        self, text: str, params: dict[str, Any] | None = None, *, cut: bool = False
    ) -> Detection | None:
        """The tail of `text` that could still grow into a match of one of the built-in kinds
        this request enables (see `open_tail`, and its `cut`), as a detection of that kind;
        custom patterns have no such test (RE2 cannot say whether a text is a prefix of a
        match)."""
        p: RegexParams = self.effective_params(params)
        tail = open_tail(text, p.kinds, cut=cut)
        if tail is None:
            return None
        start, kind = tail
        return Detection.model_construct(
            _PII_FIELDS,
            start=start,
            end=len(text),
            text=text[start:],
            detection=kind,
            detection_type="pii",
            score=1.0,
        )

    def held_from(self, text: str, at: int, params: dict[str, Any] | None = None) -> int | None:
        """The start of a number spelt as words or a digit at a time that goes on across `at`
        (number_spellings.run_across, on the view): spelt, a card is longer than a seam
        window's SEAM_CHARS (`four three seven eight ...` is 92 characters), and a window cut
        inside it released its first words before the rest arrived."""
        if not any(k in self.effective_params(params).kinds for k in NUMBER_KINDS):
            return None
        lo = max(0, at - HELD_SOURCE_CHARS)
        part = text[lo : at + HELD_SOURCE_CHARS]
        if not may_hold_a_run(part):
            return None  # (asked at every boundary a stream's window cuts: C counts first)
        if is_plain(part):
            start = run_across(part, at - lo)
            return None if start is None else lo + start
        view = normalise(part)
        # the view position of the first character at or after `at`
        v, hi = 0, len(view.text)  # (positions grow with the view: a binary search)
        while v < hi:
            mid = (v + hi) // 2
            if view.position(mid) < at - lo:
                v = mid + 1
            else:
                hi = mid
        start = run_across(view.text, v)
        return None if start is None else lo + view.span(start, start + 1)[0]


# Original characters each side of a window's cut that `held_from` reads: four times a run's
# reach (number_spellings.MAX_RUN_CHARS), room for invisible characters inside one
HELD_SOURCE_CHARS = 1024


# -- tails: a stream that ends inside an entity (DESIGN 4.6a) ----------------------------------

# Original characters of a text's end that `open_tail` looks at (invisible ones count here: a
# longer run of them is judged as it is), and view characters a tail may span: an e-mail is at
# most 64 + 1 + 255, a number (19 digits and their separators, a `+`, parentheses) far less.
OPEN_TAIL_SOURCE_CHARS = 4096
OPEN_TAIL_VIEW_CHARS = 64 + 1 + 255
NUMBER_TAIL_VIEW_CHARS = 48

# The same patterns as the kinds' RE2 ones above, in the `regex` package, whose partial matching
# says whether a text's end is the beginning of a match (RE2 cannot). They only ever run on a
# bounded tail (the NUMBER_TAIL_VIEW_CHARS or OPEN_TAIL_VIEW_CHARS above), never on a whole text.
_PATTERNS = {
    "email": _EMAIL,
    "email_spelt": _EMAIL_SPELT,
    "email_intl": _EMAIL_INTL,
    "phone": _PHONE_INTL,
    "phone_us": _PHONE_US,
    "ssn": _SSN,
    "credit_card": _DIGIT_RUN,
    "ipv4": _IPV4,
}


@functools.cache
def _partial(kind: str) -> Any:
    import regex  # the partial-match engine; nltk (the sentence chunker) needs it too

    return regex.compile(_PATTERNS[kind].pattern.decode())


def _partial_start(
    rx: Any, view: str, pos: int, first: frozenset[str], *, separated: bool = False
) -> int | None:
    """The start of the leftmost match body of `rx` (one of the `_builtin` forms: a neighbour,
    the body, a neighbour) from `pos` that runs to the end of `view`, as a partial match (more
    text could complete it) or a complete one; None when none does. `first`: the characters a
    body starts with (a partial match has no group spans to say where it starts; the leading
    neighbour is one or two characters, none of them such a character: `\\n` before a phone
    number is two, and its `n` starts no number). `separated`: a complete match that one
    separator of digit groups ends the view after runs to the end too (`4111 1111 1111 `: a
    run of twelve digits, no card yet, may go on after its space)."""
    end = len(view)
    while pos <= end:
        m = rx.search(view, pos, partial=True)
        if m is None:
            return None
        if separated and not m.partial and m.end(1) == end - 1 and view[-1] in " .-":
            pass  # (the body runs to the end but for its separator)
        elif not m.partial and m.end(1) < end:
            pos = m.end(1)  # a complete match before the end: look after it
            continue
        start = m.start()
        for _ in range(2):  # the leading neighbour was consumed (no body starts with one)
            if start < end and view[start] not in first:
                start += 1
        return start if start < end else None
    return None


# where a spelt address's `@` begins (`_EMAIL_SPELT`), and how far before it its local part
# reaches
SPELT_LOCAL_MOST = 64 + 4 * (64 + 9)
_SPELT_AT_BEGUN = re.compile(r"[\[({<][ \t]{0,2}(?i:at)|@")
_SPELT_DOT_AFTER = re.compile(
    r"[A-Za-z0-9](?:[ \t]{0,2}\.|[ \t]{0,2}[\[({<][ \t]{0,2}(?i:dot)|[ \t](?i:dot)[ \t])"
)
_NUMBER_FIRST = frozenset("0123456789+(")
_BODY_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") | _NUMBER_FIRST


class _Alphanumeric:
    """What an internationalized address starts with: a letter or digit of any script (no
    neighbour is consumed before `_EMAIL_INTL`'s body)."""

    def __contains__(self, ch: object) -> bool:
        return isinstance(ch, str) and ch.isalnum()


_ANY_FIRST: Any = _Alphanumeric()


# The most digits a match of each number kind holds: a longer run of digit groups can only still
# grow into one in its last groups (a card is found within a run of groups, see `_cards`).
_MOST_DIGITS = {"phone": 15, "phone_us": 11, "ssn": 9, "credit_card": 19, "ipv4": 12}


def _last_digits(view: str, start: int, most: int) -> int:
    """`start`, moved forward by whole digit groups until what follows holds at most `most`
    digits (then at the start of a group)."""
    digits = sum(ch.isdigit() for ch in view[start:])
    i, end = start, len(view)
    while digits > most:
        while i < end and not view[i].isdigit():
            i += 1
        while i < end and view[i].isdigit():
            i += 1
            digits -= 1
        while i < end and not view[i].isdigit():
            i += 1
    return i


def _card_groups(view: str, start: int) -> int:
    """`start`, moved forward by whole digit groups until every group but the last (which
    may still grow) has 3 digits or more: shorter groups only stand alone in a card number
    (see `_cards`), so `1 2 3 4 5 6 7 8 9` is none, and never grows into one."""
    end = len(view)
    groups: list[tuple[int, int]] = []  # (start, digits) of each group from `start`
    i = start
    while i < end:
        while i < end and not view[i].isdigit():
            i += 1
        at = i
        while i < end and view[i].isdigit():
            i += 1
        if i > at:
            groups.append((at, i - at))
    for k in range(len(groups)):
        if all(n >= 3 for _, n in groups[k:-1]):
            return start if k == 0 else groups[k][0]
    return end


def _evidence(kind: str, tail: str) -> bool:
    """Enough of an entity that withholding the tail is worth it: an e-mail's `@`, six digits
    of a phone (with a separator, not a dot) or SSN, nine of a card, two dots and seven digits
    of an IPv4 address. A year (`in 2023`), a range (`2020-2023`), a version (`3.11.4.`), a
    bare number (`8336817`) or `555 1` are not."""
    digits = sum(ch.isdigit() for ch in tail)
    if kind in ("email", "email_intl"):
        return "@" in tail
    if kind == "email_spelt":  # its `@`, spelt (`[at`, its bracket to come, will do)
        ats = list(_SPELT_AT_BEGUN.finditer(tail))
        if not ats:
            return False
        # a bare `@` with a space beside it is prose as often (`Mail me @ home`, `meet @ 5`):
        # only a domain's dot after it (`jo @ example . c`) makes it an address's head
        at = ats[-1]
        return at.group() != "@" or _SPELT_DOT_AFTER.search(tail, at.end()) is not None
    if kind == "ssn":
        return digits >= 6
    if kind in ("phone", "phone_us"):
        # a bare run of digits (`population 8336817`) is a number that ended, and a dotted one
        # (`192.168.1`) an address before a phone: neither is withheld as a cut phone
        return digits >= 6 and not tail.isdigit() and "." not in tail
    if kind == "credit_card":
        return digits >= 9
    return tail.count(".") >= 2 and digits >= 7  # ipv4 (not a version: 3.11.4, 10.15.7.)


# An answer cut short (a token or time budget, a stop the model did not choose: `open_tail`'s
# `cut`): the beginning of a number past its first group, which an ended number, a decimal or a
# small range is not (`in 2024`, `2024.`, `3.11`, `117.98`, `4111 `, `1841-`, `(555`, `1-2`).
# A phone's or an SSN's: a group of three digits and a dash or bracket (`555-`, `123-45-`,
# `(555)`), a `+` and two digits, or two groups holding four digits or more, the first of three
# at most (`555 1`, `1 555`; `1841-3` is none), a dot only between groups of three (`555.123`).
# A card's: two groups holding five digits or more (`4111 1111`; `4111-` is a head like
# `4111 `), but for a year and a dash (`2025-01`, `(2009-2011`: a date or a range; no card's
# number starts with 19 or 20). An IPv4 address's: groups of three digits around a dot
# (`192.168`; `10.0.0` and `22.09.20` are released). Chosen on the dev halves of
# bench/cut_tails.py's texts.
_CUT_NUMBER = re.compile(r"(?<![0-9])[0-9]{3}[-)]|\+[0-9]{2}")
_CUT_GROUPS = re.compile(r"[0-9][ )-]+[0-9]|(?<![0-9])[0-9]{3}\.[0-9]{3}")
_CUT_CARD = re.compile(r"[0-9][ -]+[0-9]|[0-9]{3}\.[0-9]{3}")
_FIRST_GROUP = re.compile(r"[0-9]+")
_YEAR_DASH = re.compile(r"\(?(?:19|20)[0-9]{2}-")
_CUT_IPV4 = re.compile(r"(?<![0-9])[0-9]{3}\.[0-9]{3}")
# ... and an e-mail's local part at the very end: a run of its characters with one dot, or a
# `+`, between a letter and what follows (`jo.smith`, `jo+news`; not `jo.`, `well-known`,
# `v3.11`, `U.S.`, `www.example.com`, nor the `snake_case` names of technical text), not inside
# a URL or code (after `/`, `` ` ``), nor after an `@` (a domain: the `@` rule's)
_CUT_LOCAL_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}\Z")
_CUT_LOCAL_SEPARATED = re.compile(r"[A-Za-z][.+][A-Za-z0-9]")
_NOT_BEFORE_LOCAL_PART = frozenset("/@:=&?#`._%+-") | frozenset(
    string.ascii_letters + string.digits
)


def _cut_evidence(kind: str, tail: str) -> bool:
    """Enough of an entity to withhold the tail of an answer cut short (see _CUT_NUMBER): less
    than `_evidence` asks of an open stream. An e-mail's own test is `_cut_local_part`."""
    if kind in _EMAIL_KINDS:
        return False
    if kind == "ipv4":
        return _CUT_IPV4.search(tail) is not None
    digits = sum(ch.isdigit() for ch in tail)
    if kind == "credit_card":
        return digits >= 5 and _CUT_CARD.search(tail) is not None and not _YEAR_DASH.match(tail)
    first = _FIRST_GROUP.search(tail)
    return _CUT_NUMBER.search(tail) is not None or (
        digits >= 4
        and first is not None
        and len(first.group()) <= 3
        and _CUT_GROUPS.search(tail) is not None
    )


def _cut_local_part(view: str) -> int | None:
    """Where an e-mail's local part that ends `view` starts (see _CUT_LOCAL_PART); None for
    none."""
    m = _CUT_LOCAL_PART.search(view, max(0, len(view) - 65))
    if m is None:
        return None
    start = m.start()
    if start > 0 and view[start - 1] in _NOT_BEFORE_LOCAL_PART:
        return None  # a longer run (past 64 characters), a URL's path, a domain
    if view.count(".", start) > 1 or _CUT_LOCAL_SEPARATED.search(view, start) is None:
        return None
    return start


_EMAIL_KINDS = ("email", "email_spelt", "email_intl")
# what may follow a value at the end of a sentence (and the full-width and ideographic forms
# of it that Chinese and Japanese are written with: `\u7535\u8bdd555-123-4567\u3002`)
_CLOSING = (
    ".,;:!?)]}\"'\u2019\u201d \u3002\u3001\uff0e\uff0c\uff1b\uff1a\uff01\uff1f\uff09"
    "\u300d\u300f\u3011\u3000"
)


def open_tail(
    text: str, kinds: list[str] | tuple[str, ...] = KINDS, *, cut: bool = False
) -> tuple[int, str] | None:
    """(start, kind) of the longest suffix of `text` that could still grow into a match of one
    of `kinds` and holds enough evidence of one (`_evidence`), judged on the normalised view
    (DESIGN 4.6b); None when there is none, or when the suffix already is a match (a scan finds
    it). A stream that ends there (stop sequence, token budget) must not release it raw.

    `cut`: the answer was cut short, not ended by the model (a token or time budget, a stop
    sequence): the same request with a smaller budget cuts it anywhere, so a tail that is a
    beginning of an entity past its first group is withheld (`_cut_evidence`: `555-`,
    `4111 1111`, `123-45-`; an e-mail's local part, `jo.smith`; a spelt run of CUT_DIGITS),
    where an open stream's evidence would release it (a tail oracle). A number or word that
    ended is still released (`in 2024`, `version 3.11`, `jo.`).

    The rule: the end of the view is the beginning of a match of the kind's own pattern (the
    `regex` package's partial matching, on at most the last OPEN_TAIL_VIEW_CHARS view
    characters for an e-mail and NUMBER_TAIL_VIEW_CHARS for the numbers), and what would be
    matched so far has the evidence. IPv6 addresses are not tested (every run of hex digits and
    a colon is the beginning of one); a cut one is released as it is."""
    source_at = max(0, len(text) - OPEN_TAIL_SOURCE_CHARS)
    source = text[source_at:]
    # A match followed only by closing punctuation ends the text (`call 555-123-4567.`): the
    # scan reports the match, and the `.` is the sentence's end, not a separator of a longer
    # number (dots are card separators): read as an open card, an answer ending in a phone
    # number lost its last sentence to `[credit_card]`
    closed = source.rstrip(_CLOSING)
    if (
        closed != source
        and closed
        and any(d.end == len(closed) for d in find_pii(closed, list(kinds), {}))
    ):
        return None
    # an escape the text ends inside of (`jo@example.co&#10`) could still become any character:
    # the tail is judged without it (and the detection runs to the end, over it)
    unfinished = unfinished_markup(source)
    view = normalise(source if unfinished is None else source[:unfinished])
    # (as the scan reads it: letters of unspaced scripts as spaces, `\u7535\u8bdd555-123-45`; Chinese
    # numerals at the end as digits, `\u4e94\u4e94\u4e94-\u4e00\u4e8c`: one character for one)
    written = cjk_tail_as_digits(view.text)
    v = unspaced_as_spaces(written)
    best: tuple[int, str] | None = None
    candidates = [k for k in KINDS if k in kinds and k != "ipv6"]
    if "phone" in candidates:  # (a tie goes to the first: a phone before a card)
        candidates.insert(candidates.index("phone") + 1, "phone_us")
    if "email" in candidates:
        candidates.insert(candidates.index("email") + 1, "email_spelt")
        if (
            not v.isascii()
        ):  # (an address in another script: `\u0438\u0432\u0430\u043d@\u043f\u0440\u0438`)
            candidates.insert(candidates.index("email") + 2, "email_intl")
    number_at = max(0, len(v) - NUMBER_TAIL_VIEW_CHARS)
    if sum(ch.isdigit() for ch in v[number_at:]) < 3:  # no number has less evidence (ipv4)
        candidates = [k for k in candidates if k in _EMAIL_KINDS]
    for kind in candidates:
        if kind in ("email", "email_intl"):
            at = v.rfind("@", max(0, len(v) - OPEN_TAIL_VIEW_CHARS))
            if at < 0:
                continue
            pos = max(0, at - 66)  # the local part is at most 64, and a neighbour
        elif kind == "email_spelt":
            ats = list(_SPELT_AT_BEGUN.finditer(v, max(0, len(v) - OPEN_TAIL_VIEW_CHARS)))
            if not ats:
                continue
            pos = max(0, ats[-1].start() - SPELT_LOCAL_MOST)
        else:
            pos = number_at
        first = (
            _ANY_FIRST
            if kind == "email_intl"
            else _BODY_FIRST
            if kind in _EMAIL_KINDS
            else _NUMBER_FIRST
        )
        # (an internationalized address is read with its letters: `\u5c71\u7530@\u4f8b\u3048`)
        start = _partial_start(
            _partial(kind),
            written if kind == "email_intl" else v,
            pos,
            first,
            separated=cut and kind not in _EMAIL_KINDS,
        )
        if start is not None and kind == "email_intl":
            at = written.find("@", start)
            glued = _GLUED_LOCAL.search(written, start, at) if at >= 0 else None
            start = start if glued is None else glued.start() + 1
        if start is not None and kind not in _EMAIL_KINDS:
            start = _last_digits(v, start, _MOST_DIGITS[kind])
        if start is not None and kind == "credit_card":
            start = _card_groups(v, start)
        if start is None or not (
            _evidence(kind, v[start:]) or (cut and _cut_evidence(kind, v[start:]))
        ):
            continue
        name = {"phone_us": "phone", "email_spelt": "email", "email_intl": "email"}.get(kind, kind)
        if best is None or start < best[0]:
            best = (start, name)
    if cut and "email" in kinds and (local := _cut_local_part(v)) is not None:
        if best is None or local < best[0]:
            best = (local, "email")
    numbers = any(k in kinds for k in NUMBER_KINDS)
    spelt = None if not numbers else open_run(v, CUT_DIGITS) if cut else open_run(v)
    if spelt is not None and (best is None or spelt < best[0]):
        # a number spelt as words or a digit at a time, cut short (number_spellings)
        best = (spelt, next(k for k in NUMBER_KINDS if k in kinds))
    if best is None:
        return None
    start = source_at + view.span(best[0], len(v))[0]
    suffix = text[start:]
    if any(d.end == len(suffix) for d in find_pii(suffix, [best[1]], {})):
        return None  # a match already: the scan reports it
    return start, best[1]
