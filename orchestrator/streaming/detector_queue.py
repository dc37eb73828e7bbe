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
from .findings import Finding, keep
from .inbox import Inbox

Result = DetectorResult[Finding]


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
        answered: asyncio.Event | None = None,
    ) -> None:
        """`answered` is set after every call: the engine reader, held while the detectors are
        behind, learns that they caught up without waiting for the consumer."""
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
        self._answered = answered

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
            if self._answered is not None:
                self._answered.set()
            for span, detections in zip(batch, replies, strict=True):
                self._inbox.put(to_result(detector, span, detections))
        self._inbox.put(DetectorFinished(detector.detector_id))


def to_result(detector: RequestedDetector, span: Span, detections: list[Detection]) -> Result:
    return DetectorResult(
        detector.detector_id, span.start, span.end, keep(detector, span, detections)
    )
