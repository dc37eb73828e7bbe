"""`regex`: PII found by pattern, with exact spans and score 1.0 (a match is a decision).

Kinds: `email`, `phone` (every format libphonenumber reads, international and national, such
as `+44 20 7946 0958`, `(555) 123-4567`, `123-456-7890`, `2125550100`, plus international
`+CC ...` with 8-15 digits), `ssn` (US, `123-45-6789` or with spaces,
excluding numbers the SSA never issues), `credit_card` (13-19 digits, contiguous or in groups of
3+ digits separated by spaces or dashes, Luhn-checked), `ipv4` and `ipv6` (checked with
`ipaddress`). `kinds` selects which run (default all); `patterns` adds custom `{name: regex}`.

A built-in match inside another built-in match (an IPv4 inside an IPv4-mapped IPv6 address, a US
number inside an international one) is reported once, as the longer. Custom patterns are always
reported.

Hostile input is expected (DESIGN 4, 6). Every regular expression here runs in RE2, whose
matching time is linear in the text: the built-in kinds are written without lookarounds or
backreferences (a match's neighbours are checked by consuming one character on each side, and
the scan resumes where the match itself ended, so this finds exactly what the lookaround forms
found), and custom patterns must be RE2 syntax (no lookarounds or backreferences; `\\d`, `\\w`,
`\\s`, `\\b` are ASCII, `\\pL`/`\\pN` are Unicode). Custom patterns come from the config; a
request may send them only to a detector whose config says `allow_request_patterns: true`, and
then fewer and with a smaller RE2 memory budget (so compiling one stays cheap). Digits in the
built-in kinds are ASCII `0-9`; the "not inside a word" checks use Unicode letters and numbers,
as Python's `\\w` does. Scans of long texts run in worker threads, never on the event loop.

Every kind and pattern runs on the normalised view of the content (normalise.py, DESIGN 4.6b):
`jo\\u200b@example.com`, full-width digits, Cyrillic look-alikes and U+2011 hyphens match like
their plain forms, and each span is mapped back to the characters the client sent (the invisible
ones inside a match included), so block and redact cover them. Pure ASCII skips the view.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

import numpy as np
import re2
from pydantic import Field, field_validator

from .api import Detection
from .base import Detector, DetectorError, DetectorParams, InvalidParams, parse_params
from .normalise import View, normalise

Kind = Literal["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]
KINDS: tuple[str, ...] = ("email", "phone", "ssn", "credit_card", "ipv4", "ipv6")
MAX_PATTERNS = 32  # custom patterns in a config
MAX_REQUEST_PATTERNS = 8  # custom patterns in one request (when the config allows them)
MAX_PATTERN_CHARS = 512
CONFIG_MAX_MEM = 8 << 20  # RE2's default memory budget per pattern (program + DFA cache)
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

# Python's \w for str patterns: Unicode letters and numbers, and the underscore.
_W = r"\p{L}\p{N}_"


def _options(max_mem: int) -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # errors are reported to the caller, not printed on stderr
    options.max_mem = max_mem
    return options


def _builtin(before: str, body: str, after: str) -> Any:
    """`(?<![before])body(?!after)` in RE2: the neighbours are consumed (or the text's start and
    end), the body is group 1. `before` and `after` are the contents of a negated class, or
    `after` a whole alternation when it starts with `(`."""
    tail = after if after.startswith("(") else rf"(?:[^{after}]|$)"
    pattern = rf"(?:^|[^{before}])({body}){tail}"
    return re2.compile(pattern.encode(), _options(CONFIG_MAX_MEM))


_EMAIL = _builtin(
    _W + ".%+-",
    r"[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}",
    _W + "-",
)
_PHONE_INTL = _builtin(_W + "+", r"\+[0-9]{1,3}(?:[ .-]?\([0-9]{1,4}\))?(?:[ .-]?[0-9]){6,14}", _W)
_PHONE_US = _builtin(
    _W + "+(",
    r"(?:\+?1[ .-]?)?(?:\([2-9][0-9]{2}\)[ .-]?|[2-9][0-9]{2}[ .-])[0-9]{3}[ .-][0-9]{4}",
    _W,
)
# A number-shaped run: digit groups of 2-8 (the first may stand in parentheses) joined by single
# spaces or dashes, or a contiguous national number with its trunk 0; kept as a phone when it
# has PHONE_MIN_DIGITS-15 digits and is no date, SSN or card (_number_shaped).
_PHONE_SHAPED = _builtin(
    _W + "+(.,-",
    r"(?:(?:\([0-9]{1,5}\) ?|[0-9]{2,8}[ -])(?:[0-9]{2,8}[ -]){0,4}[0-9]{2,8}|0[0-9]{9,10})",
    _W + "-",
)
# area: not 000, 666 or 9xx; group: not 00; serial: not 0000; both separators the same
_SSN = _builtin(
    _W + "-",
    r"(?:00[1-9]|0[1-9][0-9]|[1-578][0-9]{2}|6[0-57-9][0-9]|66[0-57-9])"
    r"(?:-(?:0[1-9]|[1-9][0-9])-| (?:0[1-9]|[1-9][0-9]) )"
    r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})",
    _W + "-",
)
# Runs of digit groups joined by single spaces or dashes ([0-9]+(?:[ -][0-9]+)*); only runs of
# 13 digits or more can hold a card number, so shorter ones are not even reported as
# candidates (a sub-run of a run has fewer digits, so this finds the same runs).
_DIGIT_RUN = _builtin(_W + ".,-", r"(?:[0-9][ -]?){12,}[0-9]", _W)
# not followed by a word character, nor by a dot and a digit (1.2.3.4.5 is no address)
_IPV4 = _builtin(_W + ".", r"(?:[0-9]{1,3}\.){3}[0-9]{1,3}", rf"(?:$|[^{_W}.]|\.(?:$|\P{{Nd}}))")
# A run of [0-9A-Fa-f:.] (not starting with a dot) with at least two colons: runs with fewer
# are no address, and not reporting them as candidates keeps a text of bare numbers cheap.
_IPV6 = _builtin(_W + ":.", r"(?:[0-9A-Fa-f][0-9A-Fa-f.]*)?:[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*", _W)

Span = tuple[int, int]


class _Text:
    """A content as UTF-8 bytes for RE2, with byte offsets mapped back to code points.

    Lone surrogates (JSON allows `\\ud800`) cannot be encoded; each becomes `?`, one byte for
    one code point, so offsets still line up."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.data = text.encode("utf-8", "replace")
        self._chars: np.ndarray | None = None

    def char(self, offset: int) -> int:
        if len(self.data) == len(self.text):  # ASCII
            return offset
        if self._chars is None:
            raw = np.frombuffer(self.data, dtype=np.uint8)
            chars = np.zeros(len(self.data) + 1, dtype=np.int64)
            np.cumsum(
                (raw & 0xC0) != 0x80, out=chars[1:]
            )  # code points start at non-continuation bytes
            self._chars = chars
        return int(self._chars[offset])

    def spans(self, byte_spans: Iterator[Span]) -> Iterator[Span]:
        for start, end in byte_spans:
            yield self.char(start), self.char(end)


def _builtin_spans(rx: Any, data: bytes) -> Iterator[Span]:
    """Byte spans of group 1, the scan resuming where each body ended (its trailing neighbour
    may be the leading neighbour of the next match). No body can start exactly where the
    previous one ended: every built-in body ends with a character its own leading check
    rejects, so nothing is lost by not looking back."""
    pos = 0
    while True:
        m = rx.search(data, pos)
        if m is None:
            return
        start, end = m.span(1)
        yield start, end
        pos = end


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


def _simple(rx: Any) -> Callable[[_Text], Iterator[Span]]:
    def find(t: _Text) -> Iterator[Span]:
        return t.spans(_builtin_spans(rx, t.data))

    return find


def _phones(t: _Text) -> Iterator[Span]:
    """Phone numbers found by libphonenumber (`phonenumbers`) or by the two patterns, with
    overlapping finds merged into one span. libphonenumber's matcher reads every international
    and national format it knows (`123-456-7890`, `2125550100`, `+49 (0)30 1234 5678`,
    extensions) at leniency POSSIBLE, a length check only: a guardrail is permissive, a
    number-shaped string is a phone unless libphonenumber rules it out (dates, times, Luhn
    cards, SSNs are not phones to it). A find needs PHONE_MIN_DIGITS digits, so a 7-digit local
    number (`555-1234`) is not reported; the patterns keep the `+CC` forms libphonenumber does
    not know."""
    found: list[Span] = []
    for start, end in t.spans(_builtin_spans(_PHONE_INTL, t.data)):
        if 8 <= sum(ch.isdigit() for ch in t.text[start:end]) <= 15:
            found.append((start, end))
    found.extend(t.spans(_builtin_spans(_PHONE_US, t.data)))
    found.extend(_libphonenumber_spans(t.text))
    found.extend(_number_shaped(t))
    found.sort()
    merged: list[Span] = []
    for start, end in found:
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    yield from merged


def _number_shaped(t: _Text) -> Iterator[Span]:
    """Phones in the national formats of any country (`070 4493 5104`, `(07700) 881 362`,
    `67 501 36 56`): a number-shaped run is a phone unless it is proven to be something else,
    here a date (groups of 4-2-2 or 2-2-4 digits), an SSN's 3-2-4 groups, a card (13+ digits
    passing Luhn), which the other kinds report, or a piece of a card that a chunk boundary
    cut off (groups of 4 only; an Amex number's 4-6 or 6-5): a blocking detector must name
    the card its window finds, not a phone in each chunk."""
    for start, end in t.spans(_builtin_spans(_PHONE_SHAPED, t.data)):
        groups = re2.findall(r"[0-9]+", t.text[start:end])
        digits = "".join(groups)
        shape = tuple(len(g) for g in groups)
        if not PHONE_MIN_DIGITS <= len(digits) <= 15 or shape in _NOT_PHONES:
            continue
        if all(n == 4 for n in shape):  # `4111 1111`: a card's groups, cut by a chunk
            continue
        if len(digits) >= 13 and luhn_ok(digits):
            continue
        yield start, end


# dates, US SSNs, the first two groups of an Amex number (4-6-5) and its last two
_NOT_PHONES = {(4, 2, 2), (2, 2, 4), (3, 2, 4), (4, 6), (6, 5)}
PHONE_REGION = "US"  # how libphonenumber reads a number written without `+CC`
PHONE_MIN_DIGITS = 8


def _libphonenumber_spans(text: str) -> Iterator[Span]:
    """Character spans of libphonenumber's matches (Leniency.POSSIBLE, region PHONE_REGION)."""
    from phonenumbers import Leniency, PhoneNumberMatcher  # imported on first phone-shaped text

    for match in PhoneNumberMatcher(text, PHONE_REGION, leniency=Leniency.POSSIBLE):
        if sum(ch.isdigit() for ch in match.raw_string) >= PHONE_MIN_DIGITS:
            yield match.start, match.end


def _cards(t: _Text) -> Iterator[Span]:
    """Within each run of digit groups, the longest stretches of consecutive groups that make
    13-19 digits and pass Luhn; groups shorter than 3 digits only stand alone (never part of a
    grouped number), which keeps dates and phone fragments out."""
    text = t.text
    for run_start, run_end in t.spans(_builtin_spans(_DIGIT_RUN, t.data)):
        groups: list[Span] = []
        pos = run_start
        for part in text[run_start:run_end].replace("-", " ").split(" "):  # one separator each
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
                if len(digits) >= 13 and luhn_ok(digits):
                    best = j
            if best >= 0:
                yield groups[i][0], groups[best][1]
                i = best + 1
            else:
                i += 1


def _ipv4s(t: _Text) -> Iterator[Span]:
    for start, end in t.spans(_builtin_spans(_IPV4, t.data)):
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


def _ipv6s(t: _Text) -> Iterator[Span]:
    for start, end in t.spans(_builtin_spans(_IPV6, t.data)):
        n = _ipv6_length(t.text[start:end])
        if n:
            yield start, start + n


_DIGITS = b"0123456789"


def could_match(kind: str, data: bytes, digits: int) -> bool:
    """Whether `data` (with `digits` ASCII digits) holds the characters that every match of
    `kind`'s regexes needs: an email its `@`; a phone at least 7 digits (+ and 1 digit, then 6
    more; a US number has 10); an SSN 9; a card 13 (its run of digit groups); an IPv4 address 4
    digits and 3 dots; an IPv6 candidate 2 colons. Counted in C, it spares most sentences every
    scan: 7 RE2 searches, each with its Python wrapper and generators, were 23 us of prose."""
    if kind == "email":
        return b"@" in data
    if kind == "phone":
        return digits >= 7
    if kind == "ssn":
        return digits >= 9
    if kind == "credit_card":
        return digits >= 13
    if kind == "ipv4":
        return digits >= 4 and data.count(b".") >= 3
    return data.count(b":") >= 2  # ipv6


_FINDERS: dict[str, Callable[[_Text], Iterator[Span]]] = {
    "email": _simple(_EMAIL),
    "phone": _phones,
    "ssn": _simple(_SSN),
    "credit_card": _cards,
    "ipv4": _ipv4s,
    "ipv6": _ipv6s,
}


def _compile(pattern: str, max_mem: int) -> Any:
    """A custom pattern compiled by RE2 (as UTF-8); ValueError saying why it cannot be."""
    try:
        return re2.compile(pattern.encode("utf-8"), _options(max_mem))
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


def _scan(
    text: str, kinds: list[str], patterns: Mapping[str, Any], cancelled: threading.Event | None
) -> list[Detection]:
    """Matches in the normalised view of `text`, mapped back to `text`. Pure ASCII cannot hold
    an invisible or look-alike character: it is scanned as it is, with no view and no map."""
    if text.isascii():
        return _find(_Text(text), kinds, patterns, cancelled, None)
    view = normalise(text)
    return _find(_Text(view.text), kinds, patterns, cancelled, view)


def _find(
    t: _Text,
    kinds: list[str],
    patterns: Mapping[str, Any],
    cancelled: threading.Event | None,
    view: View | None,
) -> list[Detection]:
    builtin: list[tuple[int, int, str]] = []
    data = t.data
    digits = len(data) - len(data.translate(None, _DIGITS))
    for kind in KINDS:
        if kind in kinds and could_match(kind, data, digits):
            _check_cancelled(cancelled)
            builtin.extend((s, e, kind) for s, e in _FINDERS[kind](t))
    builtin.sort(key=lambda m: (m[0], -m[1], KINDS.index(m[2])))
    kept: list[tuple[int, int, str]] = []
    reach = -1
    for start, end, kind in builtin:
        if end <= reach:  # inside (or equal to) an earlier, longer match
            continue
        kept.append((start, end, kind))
        reach = max(reach, end)
    for name, rx in patterns.items():
        _check_cancelled(cancelled)
        kept.extend((s, e, name) for s, e in t.spans(_pattern_spans(rx, t.data)))
    kept.sort(key=lambda m: (m[0], m[1], m[2]))
    text = t.text
    if view is not None and not view.identity:
        text = view.original  # each span covers the original characters of what matched
        kept = [(*view.span(s, e), name) for s, e, name in kept]
    elif view is not None:
        text = view.original  # same positions; the text reported is what the client sent
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
        "PII by pattern: email, phone (international and US), US SSN, credit card (Luhn), "
        "IPv4, IPv6, plus custom {name: regex} patterns (RE2 syntax, from the config; from "
        "requests only with allow_request_patterns). detection_type 'pii', detection = the "
        "kind or pattern name, exact spans, score 1.0."
    )
    Params: ClassVar[type[RegexParams]] = RegexParams
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
