"""`regex`: PII found by pattern, with exact spans and score 1.0 (a match is a decision).

Kinds: `email`, `phone` (international `+CC ...` with 8-15 digits, and US formats such as
`(555) 123-4567`, `555-123-4567`, `+1 555.123.4567`), `ssn` (US, `123-45-6789` or with spaces,
excluding numbers the SSA never issues), `credit_card` (13-19 digits, contiguous or in groups of
3+ digits separated by spaces or dashes, Luhn-checked), `ipv4` and `ipv6` (checked with
`ipaddress`). `kinds` selects which run (default all); `patterns` adds custom `{name: regex}`.

A built-in match inside another built-in match (an IPv4 inside an IPv4-mapped IPv6 address, a US
number inside an international one) is reported once, as the longer. Custom patterns are always
reported. Python's `re` has no timeout: custom patterns are bounded in size and count, but a
pathological pattern can still be slow; only trusted callers should be allowed to send them.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from .api import Detection
from .base import Detector, DetectorParams

Kind = Literal["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]
KINDS: tuple[str, ...] = ("email", "phone", "ssn", "credit_card", "ipv4", "ipv6")
MAX_PATTERNS = 32
MAX_PATTERN_CHARS = 512
THREAD_CHARS = 64 * 1024  # contents larger than this in total are scanned off the event loop
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

_EMAIL = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}(?![\w-])"
)
_PHONE_INTL = re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d){6,14}(?!\w)")
_PHONE_US = re.compile(
    r"(?<![\w+(])(?:\+?1[ .-]?)?(?:\([2-9]\d{2}\)[ .-]?|[2-9]\d{2}[ .-])\d{3}[ .-]\d{4}(?!\w)"
)
_SSN = re.compile(r"(?<![\w-])(?!000|666|9\d\d)\d{3}([- ])(?!00)\d{2}\1(?!0000)\d{4}(?![\w-])")
_DIGIT_RUN = re.compile(r"(?<![\w.,-])\d+(?:[ -]\d+)*(?!\w)")
_GROUP = re.compile(r"\d+")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w|\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])[0-9A-Fa-f:][0-9A-Fa-f:.]*(?!\w)")

Span = tuple[int, int]


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


def _regex_spans(pattern: re.Pattern[str]) -> Callable[[str], Iterator[Span]]:
    def find(text: str) -> Iterator[Span]:
        for m in pattern.finditer(text):
            yield m.start(), m.end()

    return find


def _phones(text: str) -> Iterator[Span]:
    for m in _PHONE_INTL.finditer(text):
        if 8 <= sum(ch.isdigit() for ch in m.group()) <= 15:
            yield m.start(), m.end()
    for m in _PHONE_US.finditer(text):
        yield m.start(), m.end()


def _cards(text: str) -> Iterator[Span]:
    """Within each run of digit groups, the longest stretches of consecutive groups that make
    13-19 digits and pass Luhn; groups shorter than 3 digits only stand alone (never part of a
    grouped number), which keeps dates and phone fragments out."""
    for run in _DIGIT_RUN.finditer(text):
        groups = [
            (g.start() + run.start(), g.end() + run.start()) for g in _GROUP.finditer(run.group())
        ]
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


def _ipv4s(text: str) -> Iterator[Span]:
    for m in _IPV4.finditer(text):
        try:
            ipaddress.IPv4Address(m.group())
        except ValueError:
            continue
        yield m.start(), m.end()


def _ipv6s(text: str) -> Iterator[Span]:
    for m in _IPV6.finditer(text):
        candidate = m.group()
        if candidate.count(":") < 2:
            continue
        while candidate:
            try:
                ipaddress.IPv6Address(candidate)
            except ValueError:
                if candidate[-1] in ".:":  # sentence punctuation after the address
                    candidate = candidate[:-1]
                    continue
                break
            if any(ch not in ":." for ch in candidate):  # a bare "::" is not an address
                yield m.start(), m.start() + len(candidate)
            break


_FINDERS: dict[str, Callable[[str], Iterator[Span]]] = {
    "email": _regex_spans(_EMAIL),
    "phone": _phones,
    "ssn": _regex_spans(_SSN),
    "credit_card": _cards,
    "ipv4": _ipv4s,
    "ipv6": _ipv6s,
}


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


class RegexParams(DetectorParams):
    """`threshold` is accepted for uniformity with the other detectors; every match scores 1.0."""

    kinds: list[Kind] = Field(default_factory=lambda: list(KINDS))
    patterns: dict[str, str] = Field(default_factory=dict)
    threshold: float | None = Field(None, ge=0, le=1)

    @field_validator("patterns")
    @classmethod
    def _check_patterns(cls, patterns: dict[str, str]) -> dict[str, str]:
        if len(patterns) > MAX_PATTERNS:
            raise ValueError(f"at most {MAX_PATTERNS} patterns, got {len(patterns)}")
        for name, pattern in patterns.items():
            if not _NAME_RE.match(name):
                raise ValueError(f"pattern name {name!r} must be 1-64 of [A-Za-z0-9_.:-]")
            if name in KINDS:
                raise ValueError(f"pattern name {name!r} is a built-in kind; choose another")
            if not pattern or len(pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"pattern {name!r} must be 1-{MAX_PATTERN_CHARS} characters")
            try:
                compile_pattern(pattern)
            except (re.error, RecursionError, OverflowError) as exc:
                raise ValueError(f"pattern {name!r} does not compile: {exc}") from None
        return patterns


def find_pii(text: str, kinds: list[str], patterns: dict[str, re.Pattern[str]]) -> list[Detection]:
    """Every match in `text`, sorted by (start, end)."""
    builtin: list[tuple[int, int, str]] = []
    for kind in KINDS:
        if kind in kinds:
            builtin.extend((s, e, kind) for s, e in _FINDERS[kind](text))
    builtin.sort(key=lambda m: (m[0], -m[1], KINDS.index(m[2])))
    kept: list[tuple[int, int, str]] = []
    reach = -1
    for start, end, kind in builtin:
        if end <= reach:  # inside (or equal to) an earlier, longer match
            continue
        kept.append((start, end, kind))
        reach = max(reach, end)
    for name, rx in patterns.items():
        kept.extend((m.start(), m.end(), name) for m in rx.finditer(text) if m.end() > m.start())
    kept.sort(key=lambda m: (m[0], m[1], m[2]))
    return [
        Detection(start=s, end=e, text=text[s:e], detection=name, detection_type="pii", score=1.0)
        for s, e, name in kept
    ]


class RegexDetector(Detector):
    name = "regex"
    description = (
        "PII by pattern: email, phone (international and US), US SSN, credit card (Luhn), "
        "IPv4, IPv6, plus custom {name: regex} patterns. detection_type 'pii', detection = the "
        "kind or pattern name, exact spans, score 1.0."
    )
    Params: ClassVar[type[RegexParams]] = RegexParams

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        p: RegexParams = self.effective_params(params)
        compiled = {name: compile_pattern(rx) for name, rx in p.patterns.items()}

        def run() -> list[list[Detection]]:
            return [find_pii(c, p.kinds, compiled) for c in contents]

        if sum(len(c) for c in contents) > THREAD_CHARS:
            return await asyncio.to_thread(run)
        return run()
