"""Redaction (DESIGN 4.6a): flagged spans replaced in the text a client receives, and every index
it sees moved onto that text.

Output is redacted at release, never earlier: the engine, migration and the detectors work on
the original text, and only the released frames are rewritten. `StreamRedactor` keeps the
redactions known so far (every redacting detector has judged past a frame's end before the frame
is released, so a span overlapping it is known by then), applies them to each released piece,
and maps original stream indices to released ones for every detection. Spans that overlap are
merged into one replacement (the first's); a span that straddles a frame's end puts its
replacement in the frame where it starts and drops the rest from the next.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import replace

from ..clients.registry import RequestedDetector
from .findings import Finding


def redacted_finding(finding: Finding, replacement: str, start: int, end: int) -> Finding:
    """What a client sees of a redacted span: where the replacement is, and the replacement;
    nothing that could quote the original (`evidence`, `metadata`)."""
    return replace(
        finding,
        start=start,
        end=end,
        text=replacement,
        evidence=None,
        metadata=None,
        redacted=True,
    )


def redact_text(
    text: str, findings: list[Finding], redactors: dict[str, RequestedDetector]
) -> tuple[str, list[Finding]]:
    """A whole text at once (an input, the content endpoint): the redacted text and every
    finding moved onto it; findings of detectors in `redactors` become redacted ones."""
    r = StreamRedactor()
    r.add(findings, redactors)
    out = r.release(text, 0, len(text))
    return out, r.map_findings(findings, redactors)


class StreamRedactor:
    """Redactions of one stream, applied in stream order as text is released."""

    def __init__(self) -> None:
        # known spans not yet applied: (start, end, replacement), sorted by start; taken from
        # the front (a list's pop(0) made 10^5 redactions of one text cost their square)
        self._pending: deque[tuple[int, int, str]] = deque()
        # applied redactions, by start: original [start, end) -> released [start, end)
        self._orig_starts: list[int] = []
        self._applied: list[tuple[int, int, int, int, str]] = []
        self._open_end: int | None = None  # end of the last applied span, while unreleased
        self.orig_released = 0
        self.out_released = 0
        self._out: list[str] = []  # released text (for detections that overlap a redaction)

    def add(self, findings: list[Finding], redactors: dict[str, RequestedDetector]) -> None:
        """Spans to redact: the findings of redacting detectors (others are ignored)."""
        new = [
            (f.start, f.end, redactors[f.detector_id].replacement(f.detection))
            for f in findings
            if f.detector_id in redactors and f.end > f.start and not f.unjudged
        ]
        if new:
            self._pending.extend(new)
            # spans that tie take the replacement that sorts first, not the one found first: the
            # released text must not depend on the order detections arrived in (a chunk's match
            # and the whole stream's open tail can cover the same span under two labels)
            self._pending = deque(sorted(self._pending, key=lambda s: (s[0], -s[1], s[2])))

    def release(self, text: str, start: int, end: int) -> str:
        """The released form of original text `[start, end)` (the next piece in order)."""
        assert start == self.orig_released, (start, self.orig_released)
        self.orig_released = end
        if not self._pending and self._open_end is None:
            out = text
        else:
            out = self._apply(text, start, end)
        self.out_released += len(out)
        self._out.append(out)
        return out

    def _apply(self, text: str, start: int, end: int) -> str:
        pieces: list[str] = []
        written = 0  # characters in `pieces`
        pos = start  # original index reached
        pending = self._pending
        while True:
            if self._open_end is not None:
                # spans starting inside the open redaction merge into it (its replacement)
                while pending and pending[0][0] < self._open_end:
                    _, e, _ = pending.popleft()
                    if e > self._open_end:
                        s0, _, os_, oe, repl = self._applied[-1]
                        self._applied[-1] = (s0, e, os_, oe, repl)
                        self._open_end = e
                if self._open_end >= end:
                    if self._open_end == end:
                        self._open_end = None
                    return "".join(pieces)
                pos = max(pos, self._open_end)
                self._open_end = None
            if not pending or pending[0][0] >= end:
                pieces.append(text[pos - start :])
                return "".join(pieces)
            s, e, repl = pending.popleft()
            s = max(s, pos)  # (a span is always known before any of it is released)
            head = text[pos - start : s - start]
            pieces.append(head)
            written += len(head)
            out_start = self.out_released + written
            pieces.append(repl)
            written += len(repl)
            self._orig_starts.append(s)
            self._applied.append((s, e, out_start, out_start + len(repl), repl))
            self._open_end = e
            pos = s

    # -- index mapping ------------------------------------------------------------------------

    def _locate(self, i: int) -> tuple[int, tuple[int, int, int, int, str] | None]:
        """The released index of original index `i` (a redaction's start maps to where its
        replacement starts), or the redaction `i` lies strictly inside."""
        k = bisect.bisect_right(self._orig_starts, i) - 1
        if k < 0:
            return i, None
        s, e, out_start, out_end, _ = self._applied[k]
        if s < i < e:
            return -1, self._applied[k]
        if i == s:
            return out_start, None
        return out_end + (i - e), None

    def map_start(self, i: int) -> int:
        pos, inside = self._locate(i)
        return inside[2] if inside is not None else pos

    def map_end(self, i: int) -> int:
        pos, inside = self._locate(i)
        return inside[3] if inside is not None else pos

    def map_findings(
        self, findings: list[Finding], redactors: dict[str, RequestedDetector]
    ) -> list[Finding]:
        """Findings moved onto the released text. A redacting detector's finding says where
        its replacement is; any other finding that covers redacted text quotes the released
        text, never the original."""
        if not self._applied or not findings:
            return findings
        out: list[Finding] = []
        released: str | None = None
        for f in findings:
            start, end = self.map_start(f.start), self.map_end(f.end)
            if f.detector_id in redactors and not f.unjudged:
                k = bisect.bisect_right(self._orig_starts, f.start) - 1
                repl = self._applied[k][4] if k >= 0 else ""
                out.append(redacted_finding(f, repl, start, end))
            elif self._overlaps(f.start, f.end):
                if released is None:
                    released = "".join(self._out)
                    self._out = [released]
                text = released[start:end]
                out.append(
                    replace(f, start=start, end=end, text=text, evidence=None, metadata=None)
                )
            elif start != f.start or end != f.end:
                out.append(replace(f, start=start, end=end))
            else:
                out.append(f)
        return out

    def _overlaps(self, start: int, end: int) -> bool:
        k = bisect.bisect_left(self._orig_starts, end) - 1
        # redactions do not overlap one another: only the last one starting before `end` can
        return k >= 0 and self._applied[k][1] > start
