"""Text in, judged frames out: the per-request machinery shared by the generation stream and the
stream-content endpoint (chunk fan-out, one DetectorQueue per detector, the FrameAggregator)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from ..clients.registry import ChunkerRegistry, RequestedDetector
from .aggregation import FrameAggregator
from .detector_queue import DetectorQueue, Result
from .fanout import ChunkFanout
from .findings import Finding, sort_findings


@dataclass(slots=True)
class JudgedFrame:
    """Text every gating detector has judged, with its detections (stream-relative)."""

    start: int
    end: int
    text: str
    detections: list[Finding] = field(default_factory=list)


class Blocked(Exception):
    """A detector whose effective `on_detection` is `block` flagged text (DESIGN 4.6)."""

    def __init__(self, detections: list[Finding]) -> None:
        super().__init__(f"blocked by {', '.join(sorted({d.detector_id for d in detections}))}")
        self.detections = detections


class TextBuffer:
    """The generated text not yet released; frames take from its head. Joining only the pending
    part keeps the cost per frame proportional to that frame, not to the whole stream."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.released = 0
        self.length = 0

    def append(self, delta: str) -> None:
        if delta:
            self._parts.append(delta)
            self.length += len(delta)

    def take(self, end: int) -> str:
        pending = "".join(self._parts)
        n = end - self.released
        out, rest = pending[:n], pending[n:]
        self._parts = [rest] if rest else []
        self.released = end
        return out


class StreamingDetection:
    """Runs a request's output detectors over a text that arrives in deltas.

    Detectors on `whole_doc_chunker` that only annotate do not gate frames: they judge the whole
    text once it is complete and their detections ride on the final frame. A blocking whole-doc
    detector does gate, so no text leaves before it has judged all of it.
    """

    def __init__(
        self,
        detectors: list[RequestedDetector],
        chunkers: ChunkerRegistry,
        emit: Callable[[JudgedFrame], None],
    ) -> None:
        self._emit = emit
        gating = [d for d in detectors if not (d.whole_doc and not d.blocking)]
        self._aggregator: FrameAggregator[Finding] | None = (
            FrameAggregator(d.detector_id for d in gating) if gating else None
        )
        gating_ids = {d.detector_id for d in gating}
        self.queues = [
            DetectorQueue(
                d,
                self._on_gating_result if d.detector_id in gating_ids else self._on_final_result,
                self._on_finish,
            )
            for d in detectors
        ]
        self._blocking = {d.detector_id for d in detectors if d.blocking}
        self._fanout = ChunkFanout(chunkers, self.queues)
        self._text = TextBuffer()
        self._final: list[Finding] = []
        self._ended = False
        self._held: list[JudgedFrame] = []

    @property
    def released(self) -> int:
        return self._text.released

    @property
    def length(self) -> int:
        return self._text.length

    async def run(self) -> None:
        """Judges until every queue is closed and drained; raises Blocked or DetectorCallError."""
        async with asyncio.TaskGroup() as tg:
            for q in self.queues:
                tg.create_task(q.run())

    def feed(self, delta: str) -> None:
        if not delta:
            return
        self._text.append(delta)
        self._fanout.feed(delta)
        if self._aggregator is None:
            self._release(self._text.length, [])

    def end(self) -> None:
        """The text is complete. Frames released from now on are held back so that the last one
        can carry what only the end knows (finish reason, whole-document detections)."""
        self._ended = True
        self._fanout.flush()

    def final_frames(self) -> list[JudgedFrame]:
        """After `run()` returned: the held frames, the last one with the whole-document
        detections merged in; an empty frame at the end of the text when none was held."""
        held, self._held = self._held, []
        if not held:
            end = self._text.released
            held = [JudgedFrame(end, end, "", [])]
        held[-1].detections = sort_findings(held[-1].detections + self._final)
        return held

    def _check_block(self, result: Result) -> None:
        if result.detections and result.detector_id in self._blocking:
            # text judged clean before the offending chunk still goes out, even when it was
            # held back for the end of the stream
            held, self._held = self._held, []
            for frame in held:
                self._emit(frame)
            raise Blocked(list(result.detections))

    def _on_gating_result(self, result: Result) -> None:
        self._check_block(result)
        assert self._aggregator is not None
        self._aggregator.push(result)
        self._drain()

    def _on_final_result(self, result: Result) -> None:
        self._check_block(result)
        self._final.extend(result.detections)

    def _on_finish(self, detector_id: str) -> None:
        if self._aggregator is not None and detector_id in self._aggregator:
            self._aggregator.finish(detector_id)
            self._drain()

    def _drain(self) -> None:
        assert self._aggregator is not None
        for frame in self._aggregator.pop_ready():
            detections = [d for r in frame.results for d in r.detections]
            self._release(frame.end, detections)

    def _release(self, end: int, detections: list[Finding]) -> None:
        start = self._text.released
        if end <= start and not detections:
            return
        frame = JudgedFrame(start, end, self._text.take(end), sort_findings(detections))
        if self._ended:
            self._held.append(frame)
        else:
            self._emit(frame)
