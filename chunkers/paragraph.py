"""`paragraph`: split at blank lines."""

from __future__ import annotations

import re
from collections import deque

from .base import INF, Emitter, Pipeline, Span, TextBuffer

_RE_SPACES = re.compile(r"\s*")
_RE_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_RE_LINE = re.compile(r"[\r\n]")
_RE_LINE_OR_NONSPACE = re.compile(r"[\r\n]|\S")
_RE_NONSPACE = re.compile(r"\S")


class ParagraphCutter:
    """Cuts at the start of every whitespace run that holds two or more line breaks (`\\r\\n`,
    `\\r` or `\\n`; `\\r\\n` counts once), so the blank line and the indentation after it belong
    to the following paragraph. A run at the very start or end of the text is not a cut (leading
    whitespace belongs to the first paragraph, trailing whitespace to the last).

    Incrementally a cut is committed once its run is complete (a non-space character follows).
    It advances on every wake-up (a line break, or the `max_chars` safety cut's length), not
    only after a line break: text without any still moves the frontier, so the safety cut can
    close an over-long paragraph."""

    __slots__ = ("_buf", "_final", "_pos", "cuts", "dirty", "wake_len", "wake_rx")

    def __init__(self, buf: TextBuffer) -> None:
        self._buf = buf
        self.cuts: deque[int] = deque()
        self.dirty = False
        self._final = False
        self._pos = 0  # never inside a whitespace run
        self.wake_rx: re.Pattern[str] | None = _RE_LINE
        self.wake_len = INF

    def ready(self, parts: list[str]) -> bool:
        return True

    def frontier(self) -> int:
        return INF if self._final else self._pos

    def keep_from(self) -> int:
        return self._pos

    def advance(self, final: bool) -> None:
        self.dirty = False
        buf = self._buf
        t, base, n = buf.text, buf.base, buf.n
        while True:
            lo = self._pos - base
            m = _RE_LINE.search(t, lo)
            if m is None:
                # Stop before a trailing whitespace run: it may still grow a line break (its
                # first non-space character settles it, so that wakes the cutter too).
                rest = t[lo:]
                kept = len(rest.rstrip())
                self._pos += kept
                if kept < len(rest) and not final:
                    self.wake_rx = _RE_LINE_OR_NONSPACE
                    return
                break
            # The whitespace run around this line break (found from the break, not with one
            # regex, which would backtrack quadratically over a long run of spaces).
            s = self._pos + len(t[lo : m.start()].rstrip())
            e = _RE_SPACES.match(t, m.start()).end() + base
            run = t[s - base : e - base]
            if e == n and not final:  # the run may go on
                self._pos = s
                many = len(_RE_LINE_BREAK.findall(run)) >= 2
                self.wake_rx = _RE_NONSPACE if many else _RE_LINE_OR_NONSPACE
                return
            if 0 < s and e < n and len(_RE_LINE_BREAK.findall(run)) >= 2:
                self.cuts.append(s)
            self._pos = e
        if final:
            self._final = True
        self.wake_rx = _RE_LINE  # only a line break can start a new separator


class ParagraphChunker:
    """Paragraphs separated by blank lines (see `ParagraphCutter`); a paragraph longer than
    `max_chars` is split at the last whitespace within the limit (hard cut if there is none),
    so text without blank lines is still judged and released every `max_chars` characters."""

    __slots__ = ("max_chars",)

    def __init__(self, max_chars: int = 2000) -> None:
        self.max_chars = max_chars

    def incremental(self) -> Pipeline:
        buf = TextBuffer()
        cutter = ParagraphCutter(buf)
        return Pipeline(buf, [cutter], Emitter(buf, cutter, self.max_chars, eager=True))

    def chunk(self, text: str) -> list[Span]:
        """The incremental form fed everything at once, so the two cannot disagree."""
        state = self.incremental()
        return state.feed(text) + state.flush()

    def __repr__(self) -> str:
        return f"ParagraphChunker(max_chars={self.max_chars})"
