"""RE2 scans over text with code-point spans: what the pattern detectors share (regex_pii's
kinds, address.py's addresses and postal codes).

Why its own module: both detectors write their built-in kinds the same way (no lookarounds, so
RE2's linear-time matching applies: a match's neighbours are consumed as a group around the body,
and the scan resumes where the body ended) and both map RE2's byte offsets back to the code
points the client's text is indexed by."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import re2

#: RE2's default memory budget per pattern (program + DFA cache).
CONFIG_MAX_MEM = 8 << 20

# What continues a token: Unicode letters and numbers. Everything else (spaces, punctuation,
# symbols, the underscore) is a boundary: `jo@example.com--he`, `(555-123-4567)`,
# `SSN 123-45-6789-`, `_4111111111111111_` hold their values. A digit kind adds its own
# continuations (a digit run inside a longer run is not a different value): an SSN's `-` next
# to a digit, an IPv4 address's `.` next to a digit (1.2.3.4.5 is no address).
WORD_CHARS = r"\p{L}\p{N}"

Span = tuple[int, int]


def re2_options(max_mem: int) -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # errors are reported to the caller, not printed on stderr
    options.max_mem = max_mem
    return options


def bounded_pattern(before: str, body: str, after: str) -> Any:
    """`(?<![before])body(?!after)` in RE2: the neighbours are consumed (or the text's start and
    end), the body is group 1. `before` and `after` are the contents of a negated class, or a
    whole alternation when they start with `(`, or "" for no check on that side."""
    if not before:
        head = ""
    else:
        head = before if before.startswith("(") else rf"(?:^|[^{before}])"
    if not after:
        tail = ""
    else:
        tail = after if after.startswith("(") else rf"(?:[^{after}]|$)"
    pattern = rf"{head}({body}){tail}"
    return re2.compile(pattern.encode(), re2_options(CONFIG_MAX_MEM))


class Utf8Text:
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


def body_spans(
    rx: Any, data: bytes, length: Callable[[bytes], int] | None = None
) -> Iterator[Span]:
    """Byte spans of group 1 of a `bounded_pattern`, the scan resuming where each body ended (its
    trailing neighbour may be the leading neighbour of the next match; RE2 sees the text before
    `pos`, so a leading check still looks at it). A body with a leading check cannot start
    exactly where the previous one ended (its neighbour would be before `pos`), and needs not:
    every such body ends with a character its own leading check rejects. An e-mail has no check.

    `length`, when given, says how much of a body is a match (0: none). A rejected body is not
    skipped: the scan goes on from its first character, so every later start is judged, as a
    window of a stream that starts inside the body (at one of its spaces) judges it: a finder
    that skipped `2024-01-15 555 123 456` whole found nothing there, and a window starting at
    `555` found `555 123 456`."""
    pos = 0
    while True:
        m = rx.search(data, pos)
        if m is None:
            return
        start, end = m.span(1)
        if length is not None:
            n = length(data[start:end])
            if not n:
                pos = start + 1 if start <= pos else start
                continue
            end = start + n
        yield start, end
        pos = end
