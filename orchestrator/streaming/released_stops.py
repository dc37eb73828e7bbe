"""A request's stop sequences matched on the text the client receives (DESIGN 4.6a, 4.8).

Where an output guardrail can change or withhold released text (a detector whose effective
`on_detection` is `redact` or `block`), the backend must not see the client's stop sequences:
it would match them on the raw text, and `finish_reason` (stop or not) plus where the released
text ends would tell the client whether the redacted or withheld text held its guess, one bit
per request about text that never leaves the service. So the pipeline sends no stop sequences to
the backend and `ReleasedStops` cuts the released frames itself, as a backend stop would: the
text ends right before the stop sequence (which is not sent), the last frame is the final one,
and the pipeline ends the stream with `STOP_SEQUENCE`.

Hand-written rather than `servicekit.text_gate.TextGate`: the gate picks, within one push, the
match that starts first, so with overlapping stop sequences its cut depends on where pushes
split the text. Here the frames are split where chunkers and detectors released them, not where
the model's tokens end, so the cut is defined on the text alone: the stop sequence that is
complete earliest (the longest of those completing at the same character), whatever the frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .findings import Finding, sort_findings
from .stream_judgement import Release


class ReleasedStops:
    """Cuts a stream of `Release`s at the first stop sequence in their joined text.

    Text that could be the start of a stop sequence is held back (at most the longest stop
    sequence less one character, plus any detection that straddles that tail: a detection always
    rides on the frame that holds all of it) until the next release rules it out; the final
    release lets everything out. Indices are unchanged: they already refer to the released text,
    and a frame only ends earlier than the stage's, the next one starting where it ends.
    """

    __slots__ = ("_detections", "_keep", "_stops", "_tail", "_tail_start", "stopped")

    def __init__(self, stop_sequences: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop_sequences if s))
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""  # released by the stage, not yet let out
        self._tail_start = 0  # the tail's index in the released text
        self._detections: list[Finding] = []  # held with the tail
        self.stopped = False  # a stop sequence ended the text

    def take(self, release: Release) -> Release | None:
        """What of `release` (and of what was held) may go out now; None when nothing may.
        Once a stop sequence matched, the returned release is final and later ones are None."""
        if self.stopped:
            return None
        text = self._tail + release.text
        start = self._tail_start
        merged = bool(self._detections)  # held detections come before the release's
        detections = self._detections + release.detections if merged else release.detections
        cut = self._match(text)
        if cut is not None:
            self.stopped = True
            end = start + cut
            kept = [_clipped(d, end) for d in detections if d.start < end or d.end <= end]
            return Release(
                start,
                end,
                text[:cut],
                sort_findings(kept),
                final=True,
                source_end=release.source_end,
            )
        safe = len(text) if release.final else len(text) - self._possible_start(text)
        end = start + safe
        while True:  # a detection straddling the cut is held with the tail
            straddling = [d.start for d in detections if d.start < end < d.end]
            if not straddling:
                break
            end = max(start, min(straddling))
        safe = end - start
        out = [d for d in detections if d.end <= end]
        self._detections = [d for d in detections if d.end > end]
        self._tail, self._tail_start = text[safe:], end
        if not (safe or out or release.final):
            return None
        return Release(
            start,
            end,
            text[:safe],
            sort_findings(out) if merged else out,
            release.final,
            release.source_end,
        )

    def _match(self, text: str) -> int | None:
        """Where the stop sequence complete earliest in `text` starts (None: none is).

        `text` holds no complete stop sequence in its held part (it would have matched when it
        was released), so every match is new."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            at = text.find(stop)
            if at != -1:
                candidate = (at + len(stop), at)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else best[1]

    def _possible_start(self, text: str) -> int:
        """The length of the longest end of `text` that a stop sequence starts with."""
        for length in range(min(self._keep, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0


def _clipped(d: Finding, end: int) -> Finding:
    """A detection cut at the stop: only the part of its span the client received."""
    if d.end <= end:
        return d
    return replace(d, end=end, text=d.text[: end - d.start])
