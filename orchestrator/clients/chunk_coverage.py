"""Chunks are held to their contract (DESIGN 5): contiguous spans `[start, end)` that tile the
whole text. Text a chunker leaves out of its chunks is text its detectors never judge, and the
aggregator (DESIGN 4.4) stops waiting for a detector once its chunks have ended: a chunker that
gave no chunk for a tail (or left a gap) would have that tail released on the verdict of the
other detectors alone. Every chunker the registry hands out is wrapped here, so a chunker that
breaks the contract fails the request (`chunker_error`) instead.
"""

from __future__ import annotations

from typing import Any

from chunkers import Span


class ChunkGap(ValueError):
    """A chunker's spans do not tile the text it was given."""


def _check(spans: list[Span], at: int, length: int) -> int:
    """The end of `spans`, which must continue at `at` without a gap or an overlap, each its
    text's length and within the `length` characters given so far."""
    for span in spans:
        if span.start != at or not span.start <= span.end <= length:
            raise ChunkGap(f"a chunk [{span.start}, {span.end}) does not continue at {at}")
        if len(span.text) != span.end - span.start:
            raise ChunkGap(
                f"the chunk [{span.start}, {span.end}) holds {len(span.text)} characters"
            )
        at = span.end
    return at


class _CheckedState:
    """An incremental chunker's state whose spans are checked as they come; at `flush` they
    must have reached the end of the text."""

    __slots__ = ("_at", "_length", "_state")

    def __init__(self, state: Any) -> None:
        self._state = state
        self._at = 0
        self._length = 0

    def feed(self, delta: str) -> list[Span]:
        self._length += len(delta)
        spans: list[Span] = self._state.feed(delta)
        self._at = _check(spans, self._at, self._length)
        return spans

    def flush(self) -> list[Span]:
        spans: list[Span] = self._state.flush()
        self._at = _check(spans, self._at, self._length)
        if self._at != self._length:
            raise ChunkGap(f"its chunks end at {self._at} of {self._length} characters")
        return spans


class CheckedChunker:
    """A chunker whose batch and incremental outputs are checked to tile the text."""

    __slots__ = ("_chunker",)

    def __init__(self, chunker: Any) -> None:
        self._chunker = chunker

    def chunk(self, text: str) -> list[Span]:
        spans: list[Span] = self._chunker.chunk(text)
        at = _check(spans, 0, len(text))
        if at != len(text):
            raise ChunkGap(f"its chunks end at {at} of {len(text)} characters")
        return spans

    def incremental(self) -> _CheckedState:
        return _CheckedState(self._chunker.incremental())
