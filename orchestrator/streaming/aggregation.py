"""Frame release by max `processed_index` over per-detector FIFO queues (DESIGN 4.4).

Pure and synchronous: it knows indices and results, not text, tasks or sockets, so the rule can be
property-tested on its own. The pipeline pushes each detector's results in stream order and asks for
the frames that became releasable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DetectorResult(Generic[T]):
    """One detector's verdict on one chunk: it has judged `[start, end)` of the stream."""

    detector_id: str
    start: int
    end: int
    detections: tuple[T, ...] = ()


@dataclass(frozen=True, slots=True)
class ReleasedFrame(Generic[T]):
    """Text `[start, end)` may leave the service, with these results attached."""

    start: int
    end: int
    results: tuple[DetectorResult[T], ...] = field(default=())


class AggregationError(RuntimeError):
    """A detector's results broke the stream-order contract (a bug upstream, not bad input)."""


class FrameAggregator(Generic[T]):
    """Holds one FIFO queue per detector and applies the seed rule of ADR 002:

    1. wait until every unfinished detector's queue holds at least one result;
    2. R = the largest `end` among the queue heads;
    3. wait until every unfinished detector has a result with `end >= R`;
    4. release `[released, R)` with every queued result whose `end <= R`;
    5. repeat.
    """

    def __init__(self, detector_ids: Iterable[str]) -> None:
        self._queues: dict[str, deque[DetectorResult[T]]] = {d: deque() for d in detector_ids}
        if not self._queues:
            raise ValueError("an aggregator needs at least one detector")
        self._judged: dict[str, int] = dict.fromkeys(self._queues, 0)
        self._finished: set[str] = set()
        self._released = 0

    def __contains__(self, detector_id: object) -> bool:
        return detector_id in self._queues

    @property
    def released(self) -> int:
        """Every character before this index has been released."""
        return self._released

    def judged(self, detector_id: str) -> int:
        """How far this detector has judged the stream (its processed index)."""
        return self._judged[detector_id]

    @property
    def done(self) -> bool:
        """Every detector finished and nothing is left queued."""
        return len(self._finished) == len(self._queues) and not any(self._queues.values())

    def push(self, result: DetectorResult[T]) -> None:
        """Enqueues a result; results of one detector must be contiguous and in stream order."""
        if result.detector_id not in self._queues:
            raise AggregationError(f"unknown detector {result.detector_id!r}")
        if result.detector_id in self._finished:
            raise AggregationError(f"detector {result.detector_id!r} already finished")
        expected = self._judged[result.detector_id]
        if result.start != expected or result.end < result.start:
            raise AggregationError(
                f"detector {result.detector_id!r}: result [{result.start}, {result.end}) "
                f"does not continue at {expected}"
            )
        self._judged[result.detector_id] = result.end
        self._queues[result.detector_id].append(result)

    def finish(self, detector_id: str) -> None:
        """This detector will push nothing more (its stream ended or it judged everything)."""
        self._finished.add(detector_id)

    def pop_ready(self) -> list[ReleasedFrame[T]]:
        """Every frame the rule allows to release now, in stream order."""
        frames: list[ReleasedFrame[T]] = []
        while True:
            frame = self._pop_one()
            if frame is None:
                return frames
            frames.append(frame)

    def _pop_one(self) -> ReleasedFrame[T] | None:
        queues = self._queues
        # 1. every detector still producing must have something queued
        for d, q in queues.items():
            if not q and d not in self._finished:
                return None
        heads = [q[0].end for q in queues.values() if q]
        if not heads:
            return None
        # 2. the largest head end
        r = max(heads)
        # 3. every unfinished detector must have judged up to R
        for d in queues:
            if d not in self._finished and self._judged[d] < r:
                return None
        # 4. release [released, R) with every result ending at or before R
        results: list[DetectorResult[T]] = []
        for q in queues.values():
            while q and q[0].end <= r:
                results.append(q.popleft())
        frame = ReleasedFrame(
            start=self._released, end=max(r, self._released), results=tuple(results)
        )
        self._released = frame.end
        return frame
