"""stream-content's pipeline (DESIGN 4.1): NDJSON lines of text in, judged chunks out, pulled by
the serving loop like the generation pipeline and built on the same core (`PipelineCore`: the
inbox, the guarded tasks, the deadline, the drain's signal). The body reader posts text to the
inbox (bounded: a client that stops reading our reply stops our reading of its body) and the
consumer loop feeds the detectors and yields what became releasable, then one `Terminal`:
`completed`, or `error`/`failed` with the `Failure` (a bad line or an oversized body raising
ApiError in `lines`, a detector's failure, the deadline, a drain)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from ..api.errors import Failure
from ..clients.registry import ChunkerRegistry, RequestedDetector
from ..errors import BODY_TIMED_OUT, REQUEST_TIMED_OUT, SHUTDOWN, describe, is_unexpected
from .aggregation import DetectorResult
from .detector_queue import DetectorFinished
from .events import Frame, Terminal
from .pipeline_core import DEADLINE, DRAIN, Crashed, PipelineCore
from .stream_judgement import Release, StreamJudge

log = logging.getLogger("guardstream.stream_content")


@dataclass(frozen=True, slots=True)
class _Text:
    content: str


@dataclass(frozen=True, slots=True)
class _BodyEnded:
    pass


class ContentStream(PipelineCore):
    def __init__(
        self,
        detectors: list[RequestedDetector],
        chunkers: ChunkerRegistry,
        first: str,
        lines: AsyncIterator[str],
        *,
        timeout_s: float,
        max_buffered_lines: int = 64,
    ) -> None:
        super().__init__(
            max_buffered=max_buffered_lines, timeout_s=timeout_s, task_name="stream-content"
        )
        self._detection = StreamJudge(detectors, chunkers, self._inbox)
        self._first = first
        self._lines = lines
        self._frames_sent = 0

    async def events(self) -> AsyncIterator[Frame | Terminal]:
        """Judged frames in stream order, then exactly one Terminal."""
        self._start()
        try:
            if self._shutting_down:
                yield self._failed(SHUTDOWN)
                return
            async with aclosing(self._run()) as run:
                try:
                    async for event in run:
                        if isinstance(event, Frame):
                            self._frames_sent += 1
                        yield event
                except Exception as exc:  # a bug must still end the stream with a terminal
                    yield self._failed(self._describe(exc))
        finally:
            await self._stop_tasks()

    async def _run(self) -> AsyncIterator[Frame | Terminal]:
        detection = self._detection
        detection.start(self._spawn)
        self._spawn(self._read())
        ended = False
        for release in detection.feed(self._first):
            yield _frame(release)
        while True:
            for message in await self._inbox.take_all():
                if isinstance(message, _Text):
                    for release in detection.feed(message.content):
                        yield _frame(release)
                elif isinstance(message, _BodyEnded):
                    ended = True
                    detection.end()
                elif isinstance(message, DetectorResult | DetectorFinished):
                    for release in detection.accept(message).releases:
                        yield _frame(release)
                elif isinstance(message, Crashed):
                    yield self._failed(self._describe(message.exc))
                    return
                elif message is DEADLINE:
                    # a body still arriving is the client's slowness; a complete one waited
                    # on the detectors
                    yield self._failed(REQUEST_TIMED_OUT if ended else BODY_TIMED_OUT)
                    return
                elif message is DRAIN:
                    yield self._failed(SHUTDOWN)
                    return
                if ended and detection.done:
                    for release in detection.final_releases():
                        if release.end > release.start or release.detections:
                            yield _frame(release)
                    yield Terminal("completed", processed_index=detection.released)
                    return

    def _describe(self, exc: BaseException) -> Failure:
        failure = describe(exc)
        if is_unexpected(failure):
            log.error("stream-content failed", exc_info=exc)
        return failure

    def _failed(self, failure: Failure) -> Terminal:
        kind = "failed" if self._frames_sent else "error"
        return Terminal(kind, processed_index=self._detection.released, error=failure)

    async def _read(self) -> None:
        async for content in self._lines:
            await self._inbox.put_chunk(_Text(content))
        self._inbox.put(_BodyEnded())


def _frame(release: Release) -> Frame:
    """A content stream's frame: the judged text and its detections (no generation counters)."""
    return Frame(release.start, release.end, release.text, release.detections, final=release.final)
