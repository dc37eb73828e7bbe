"""One detector's queue of chunks within one stream (DESIGN 4.4).

Chunks are judged in stream order; whatever accumulated while a call was in flight goes out in the
next call as one multi-content request, so a fast stream costs few detector round trips.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from chunkers import Span
from detectors.api import Detection

from ..clients.registry import RequestedDetector
from .aggregation import DetectorResult
from .findings import Finding, keep

Result = DetectorResult[Finding]


class DetectorQueue:
    """Feeds one detector its chunks and hands each verdict, thresholded and made
    stream-relative, to `on_result` in stream order."""

    def __init__(
        self,
        detector: RequestedDetector,
        on_result: Callable[[Result], None],
        on_finish: Callable[[str], None],
        *,
        max_batch: int = 32,
    ) -> None:
        self.detector = detector
        self._on_result = on_result
        self._on_finish = on_finish
        self._max_batch = max_batch
        self._pending: deque[Span] = deque()
        self._closed = False
        self._wakeup = asyncio.Event()
        self.calls = 0

    def put(self, span: Span) -> None:
        self._pending.append(span)
        self._wakeup.set()

    def close(self) -> None:
        """No more chunks will come; the queue finishes once the pending ones are judged."""
        self._closed = True
        self._wakeup.set()

    async def run(self) -> None:
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
            for span, detections in zip(batch, replies, strict=True):
                self._on_result(to_result(detector, span, detections))
        self._on_finish(detector.detector_id)


def to_result(detector: RequestedDetector, span: Span, detections: list[Detection]) -> Result:
    return DetectorResult(
        detector.detector_id, span.start, span.end, keep(detector, span, detections)
    )
