"""One detector's queue of chunks within one stream (DESIGN 4.4).

Chunks are judged in stream order; whatever accumulated while a call was in flight goes out in the
next call as one multi-content request, so a fast stream costs few detector round trips. Verdicts
are posted to the pipeline's inbox: the queue never calls back into the pipeline.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from chunkers import Span
from detectors.api import Detection

from ..clients.registry import RequestedDetector
from .aggregation import DetectorResult
from .findings import Finding, kept_findings
from .inbox import Inbox

Result = DetectorResult[Finding]

# A redacting detector judges overlapping windows, so that no entity escapes by straddling a
# chunk boundary (or arriving one character per token): each call judges the new chunks plus the
# unreleased tail of the previous window, and reports only up to a "safe" end at least
# SEAM_CHARS before the window's end, moved back to the start of the whitespace-free run there
# (at most SEAM_RUN_CHARS back) and never inside a detection. What lies after it is judged again,
# whole, by the next window. An entity up to SEAM_CHARS long (phone and card numbers with
# spaces), or without whitespace up to SEAM_RUN_CHARS long (e-mails, URLs, keys), is therefore
# always seen whole by one call before any of it is released.
SEAM_CHARS = 64
SEAM_RUN_CHARS = 256


@dataclass(frozen=True, slots=True)
class DetectorFinished:
    """This detector judged every chunk it will ever get."""

    detector_id: str


class DetectorQueue:
    def __init__(
        self,
        detector: RequestedDetector,
        inbox: Inbox,
        *,
        max_batch: int = 32,
    ) -> None:
        self.detector = detector
        self._inbox = inbox
        self._max_batch = max_batch
        self._pending: deque[Span] = deque()
        self._closed = False
        self._wakeup = asyncio.Event()
        self.calls = 0
        # characters put and not answered yet: the pipeline reads the engine no further ahead
        # of this detector than a bound (a burst must not starve judging and release)
        self.unjudged = 0
        # a classifier redacts the chunk it was given, judged alone: no windows (DESIGN 4.6a)
        self._windowed = (
            detector.redacting and not detector.whole_doc and not detector.judges_chunks
        )
        self._seamed = detector.blocking and not detector.whole_doc
        self._carry = ""  # windowed: text from `_carry_start` to the next chunk, not reported
        self._carry_start = 0

    def put(self, span: Span) -> None:
        self._pending.append(span)
        self.unjudged += len(span.text)
        self._wakeup.set()

    def close(self) -> None:
        """No more chunks will come; the queue finishes once the pending ones are judged."""
        self._closed = True
        self._wakeup.set()

    async def run(self) -> None:
        """Judges until closed and drained; a failed call raises (the pipeline's task wrapper
        turns it into a failure message)."""
        if self._windowed:
            await self._run_windowed()
            return
        if self._seamed:
            await self._run_seamed()
            return
        detector = self.detector
        while True:
            if not self._pending:
                if self._closed:
                    break
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = [
                self._pending.popleft() for _ in range(min(self._max_batch, len(self._pending)))
            ]
            self.calls += 1
            replies = await detector.client.detect([s.text for s in batch], detector.params)
            self.unjudged -= sum(len(s.text) for s in batch)
            self._inbox.answered()  # a reader held while detectors are behind looks again
            for span, detections in zip(batch, replies, strict=True):
                self._inbox.put(to_result(detector, span, detections))
        self._inbox.put(DetectorFinished(detector.detector_id))

    async def _run_windowed(self) -> None:
        """Every pending chunk in one window with the carried tail (see SEAM_CHARS)."""
        detector = self.detector
        while True:
            if not self._pending and not (self._closed and self._carry):
                if self._closed:
                    break
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self._pending)
            self._pending.clear()
            start = self._carry_start
            text = self._carry + "".join([s.text for s in batch])
            end = start + len(text)
            final = self._closed and not self._pending
            self.calls += 1
            [detections] = await detector.client.detect([text], detector.params)
            self.unjudged -= sum(len(s.text) for s in batch)
            self._inbox.answered()
            found = kept_findings(detector, Span(start, end, text), detections)
            final = final or (self._closed and not self._pending)
            safe = end if final else safe_end(text, start, found)
            self._carry = text[safe - start :]
            self._carry_start = safe
            reported = tuple(f for f in found if f.end <= safe)
            self._inbox.put(DetectorResult(detector.detector_id, start, safe, reported))
        self._inbox.put(DetectorFinished(detector.detector_id))

    async def _run_seamed(self) -> None:
        """A blocking detector judges each chunk alone (as any detector does) and also a window
        across each chunk boundary, keeping what straddles it: an entity cut in two by the
        boundary blocks like any other. A clean chunk is posted only once the window across
        its end had SEAM_CHARS (and the rest of the whitespace-free run there) after the
        boundary, or the text ended, so no part of an entity is released before it is seen
        whole. A flagged one is posted at once, after the clean chunks held before it (judged
        with the text there was: only a straddling entity's head could be among them)."""
        detector = self.detector
        held: list[tuple[Span, tuple[Finding, ...]]] = []
        while True:
            if not self._pending:
                if self._closed:
                    break
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self._pending)
            self._pending.clear()
            chain = [span for span, _ in held] + batch
            text = "".join([s.text for s in chain])
            base = chain[0].start
            seams = [seam_window(text, base, nxt.start) for nxt in chain[1:]]
            self.calls += 1
            replies = await detector.client.detect(
                [s.text for s in batch] + [w.text for w, _ in seams], detector.params
            )
            self.unjudged -= sum(len(s.text) for s in batch)
            self._inbox.answered()
            own = [
                kept_findings(detector, span, dets)
                for span, dets in zip(batch, replies, strict=False)
            ]
            judged = held + list(zip(batch, own, strict=True))
            straddling = [
                tuple(
                    f
                    for f in kept_findings(detector, window, dets)
                    # (a detection of the whole window counts too: it may be an entity that
                    # fills it, and for a block any detection is reason enough)
                    if f.start < nxt.start < f.end
                )
                for (window, _), nxt, dets in zip(
                    seams, chain[1:], replies[len(batch) :], strict=True
                )
            ]
            final = self._closed and not self._pending
            posted = 0
            for i, (span, found) in enumerate(judged):
                flags = found + (straddling[i] if i < len(straddling) else ())
                if flags:  # the block: everything before it goes out first
                    for span0, found0 in judged[posted:i]:
                        self._post(span0, found0)
                    self._post(span, flags)
                    posted = len(judged)
                    break
            else:
                for i, (span, found) in enumerate(judged):
                    complete = i < len(seams) and seams[i][1]
                    if not (final or complete):
                        break
                    self._post(span, found)
                    posted = i + 1
            held = judged[posted:]
        for span, found in held:  # the text ended: nothing follows the held chunks
            self._post(span, found)
        self._inbox.put(DetectorFinished(detector.detector_id))

    def _post(self, span: Span, found: tuple[Finding, ...]) -> None:
        self._inbox.put(DetectorResult(self.detector.detector_id, span.start, span.end, found))


def seam_window(text: str, base: int, boundary: int) -> tuple[Span, bool]:
    """The text around a chunk boundary: SEAM_CHARS each side, widened to the ends of the
    whitespace-free runs there (at most SEAM_RUN_CHARS more), within `text` (which starts at
    stream index `base`); and whether the text after the boundary was long enough for all of
    it (more text could not change the window)."""
    b = boundary - base
    lo = max(0, b - SEAM_CHARS)
    floor = max(0, lo - SEAM_RUN_CHARS)
    while lo > floor and not text[lo - 1].isspace():
        lo -= 1
    want = b + SEAM_CHARS
    hi = min(len(text), want)
    ceiling = min(len(text), want + SEAM_RUN_CHARS)
    while hi < ceiling and not text[hi].isspace():
        hi += 1
    complete = want <= len(text) and (hi < len(text) or hi == want + SEAM_RUN_CHARS)
    return Span(base + lo, base + hi, text[lo:hi]), complete


def safe_end(text: str, start: int, found: tuple[Finding, ...]) -> int:
    """How far a window `[start, start + len(text))` may be reported (see SEAM_CHARS)."""
    p = start + len(text) - SEAM_CHARS
    if p <= start:
        return start
    q = p
    lo = max(start, p - SEAM_RUN_CHARS)
    while q > lo and not text[q - 1 - start].isspace():
        q -= 1
    if q == lo and lo > start and not text[q - 1 - start].isspace():
        q = p  # a whitespace-free run longer than SEAM_RUN_CHARS: cut it where the bound is
    moved = True
    while moved:  # never inside a detection: it is reported whole, now or by the next window
        moved = False
        for f in found:
            if f.start < q < f.end:
                q = f.start
                moved = True
    return max(q, start)


def to_result(detector: RequestedDetector, span: Span, detections: list[Detection]) -> Result:
    return DetectorResult(
        detector.detector_id, span.start, span.end, kept_findings(detector, span, detections)
    )
