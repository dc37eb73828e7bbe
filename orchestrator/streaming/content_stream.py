"""stream-content's pipeline (DESIGN 4.1): NDJSON lines of text in, judged chunks out, pulled by
the handler like the generation pipeline. The body reader posts text to the inbox (bounded: a
client that stops reading our reply stops our reading of its body) and the consumer loop feeds
the detectors and yields what became releasable. `lines` raising ApiError (a bad line, an
oversized body) ends the stream with that error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..api.errors import ErrorType, Failure
from ..clients.registry import ChunkerRegistry, RequestedDetector
from . import request_deadline
from .aggregation import DetectorResult
from .cancellation import cancel_and_wait
from .detector_queue import DetectorFinished
from .failures import describe
from .inbox import Inbox
from .stream_judgement import JudgedFrame, StreamJudge


@dataclass(frozen=True, slots=True)
class _Text:
    content: str


@dataclass(frozen=True, slots=True)
class _BodyEnded:
    pass


@dataclass(frozen=True, slots=True)
class _Crashed:
    exc: BaseException


_TIMED_OUT = object()


class ContentStream:
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
        self._inbox = Inbox(max_buffered_lines)
        self._detection = StreamJudge(detectors, chunkers, self._inbox)
        self._first = first
        self._lines = lines
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    async def results(self) -> AsyncIterator[JudgedFrame | Failure]:
        """Judged frames in stream order; a Failure is the last item when the stream broke."""
        deadline = request_deadline.deadline_clock.call_later(
            self._timeout_s, self._inbox.put, _TIMED_OUT
        )
        detection = self._detection
        detection.start(self._spawn)
        self._spawn(self._read())
        ended = False
        try:
            for frame in detection.feed(self._first):
                yield frame
            while True:
                for message in await self._inbox.take_all():
                    if isinstance(message, _Text):
                        for frame in detection.feed(message.content):
                            yield frame
                    elif isinstance(message, _BodyEnded):
                        ended = True
                        detection.end()
                    elif isinstance(message, DetectorResult | DetectorFinished):
                        for frame in detection.accept(message).frames:
                            yield frame
                    elif isinstance(message, _Crashed):
                        yield describe(message.exc)
                        return
                    elif message is _TIMED_OUT:
                        # a body still arriving is the client's slowness; a complete one
                        # waited on the detectors
                        yield (
                            Failure(
                                504, ErrorType.TIMEOUT, "the request exceeded request_timeout_s"
                            )
                            if ended
                            else Failure(
                                408,
                                ErrorType.TIMEOUT,
                                "the request body did not arrive within request_timeout_s",
                            )
                        )
                        return
                    if ended and detection.done:
                        for frame in detection.final_frames():
                            if frame.end > frame.start or frame.detections:
                                yield frame
                        return
        finally:
            deadline.cancel()
            await cancel_and_wait(list(self._tasks))

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(self._guard(coro))  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: object) -> None:
        try:
            await coro  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._inbox.put(_Crashed(exc))

    async def _read(self) -> None:
        async for content in self._lines:
            await self._inbox.put_chunk(_Text(content))
        self._inbox.put(_BodyEnded())
