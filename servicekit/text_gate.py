"""Stop sequences and hold-back, one way wherever text leaves: the engine applies a request's stop
sequences with it, and the orchestrator's OpenAI client enforces them with it on a stream it reads
as text (a server that sends no token ids may send the stop string), so both stop at the same
place. It lives here because the orchestrator imports nothing from `generation` (DESIGN 1)."""

from __future__ import annotations

from collections.abc import Sequence


class TextGate:
    """Stop sequences and hold-back: decides which produced text may leave the engine.

    Text that could be the start of a stop sequence is held until later text rules it out. The
    first stop sequence found ends the text (it and everything after it are never released).
    Matching runs once per pushed delta and picks the match that starts first, so the outcome
    depends only on the sequence of deltas: a resumed stream that replays the same tokens reaches
    the same decision as the uninterrupted one. Memory and work per push are bounded by the delta
    plus the longest stop sequence, not by the stream length.
    """

    __slots__ = (
        "_buffer",
        "_buffer_start",
        "_emitted",
        "_keep",
        "_length",
        "_safe_upto",
        "_stops",
        "_tail",
        "stop_at",
    )

    def __init__(self, stop_sequences: Sequence[str], already_delivered: int = 0) -> None:
        self._stops = [s for s in stop_sequences if s]
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""  # the last `_keep` characters of all produced text
        self._length = 0  # characters produced so far
        self._safe_upto = 0  # text[:_safe_upto] can never become part of a stop sequence
        self._emitted = already_delivered  # text[:_emitted] has reached the client
        self._buffer = ""  # text[_buffer_start:], produced but not yet released
        self._buffer_start = 0
        self.stop_at: int | None = None  # where the first stop sequence starts, once found

    @property
    def transparent(self) -> bool:
        """No stop sequences and nothing held back or owed to `already_delivered`: every delta
        pushed from now on is released as is (a caller may use the delta itself and skip
        `push` and `release`: the gate's state stays valid for later pushes)."""
        return not self._stops and self._emitted == self._length

    @property
    def produced(self) -> int:
        """Characters produced so far."""
        return self._length

    def push(self, delta: str) -> None:
        """Add produced text; find a stop sequence or advance what is safe."""
        if self.stop_at is not None or not delta:
            return
        if not self._stops:  # nothing to scan for: all text is safe (the common case)
            self._length += len(delta)
            self._buffer += delta
            self._safe_upto = self._length
            return
        combined = self._tail + delta
        base = self._length - len(self._tail)
        self._length += len(delta)
        self._buffer += delta
        self._tail = combined[-self._keep :] if self._keep else ""
        # Any match here is new: an older one would have ended the text at an earlier push.
        best = min((p for p in (combined.find(s) for s in self._stops) if p != -1), default=-1)
        if best != -1:
            self.stop_at = base + best
            self._safe_upto = self.stop_at
            return
        held = 0
        for length in range(min(self._keep, len(combined)), 0, -1):
            tail = combined[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                held = length
                break
        self._safe_upto = max(self._safe_upto, self._length - held)

    def finish(self) -> None:
        """No more text: everything before a stop sequence is safe."""
        if self.stop_at is None:
            self._safe_upto = self._length

    def release(self) -> str:
        """The text that may leave now and has not left yet."""
        out = ""
        if self._safe_upto > self._emitted:
            lo = self._emitted - self._buffer_start
            out = self._buffer[lo : self._safe_upto - self._buffer_start]
            self._emitted = self._safe_upto
        cut = min(self._emitted, self._length)  # text before `cut` is never needed again
        if cut > self._buffer_start:
            self._buffer = self._buffer[cut - self._buffer_start :]
            self._buffer_start = cut
        return out
