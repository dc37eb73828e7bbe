"""`whole_doc`: one chunk, the whole text, at end of stream."""

from __future__ import annotations

from .base import Span


class _WholeDocState:
    """Keeps the deltas; the one chunk exists only once the stream has ended."""

    __slots__ = ("_closed", "_parts")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._closed = False

    def feed(self, delta: str) -> list[Span]:
        if self._closed:
            raise RuntimeError("feed() after flush(): an incremental chunker serves one stream")
        if delta:
            self._parts.append(delta)
        return []

    def flush(self) -> list[Span]:
        if self._closed:
            return []
        self._closed = True
        text = "".join(self._parts)
        self._parts = []
        return [Span(0, len(text), text)] if text else []


class WholeDocChunker:
    """The whole text as one chunk (none for empty text), emitted only by `flush`."""

    __slots__ = ()

    def incremental(self) -> _WholeDocState:
        return _WholeDocState()

    def chunk(self, text: str) -> list[Span]:
        return [Span(0, len(text), text)] if text else []

    def __repr__(self) -> str:
        return "WholeDocChunker()"
