"""One request of the task endpoints: input detection, generation streamed through the output
detectors, classified frames, and exactly one terminal event (DESIGN 4.3 to 4.7).

The work runs in its own task and hands events to the consumer through a queue; when the
consumer goes away (client disconnect) the task is cancelled, which closes the engine stream and
every detector call of the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field

from ..api.errors import ErrorType
from ..api.responses import (
    UNSUITABLE_INPUT,
    UNSUITABLE_OUTPUT,
    ClassifiedFrame,
    RefusalDone,
    TerminalSummary,
    TokenClassificationResults,
)
from ..clients.detectors import DetectorCallError
from ..clients.generation import GenerationChunk, GenerationError, GenerationRequest, ModelBackend
from ..clients.registry import ChunkerRegistry, RequestedDetector
from .aggregation import AggregationError
from .detection import Blocked, JudgedFrame, StreamingDetection
from .events import (
    StreamEvent,
    failure_event,
    finish_event,
    frame_event,
    incomplete_event,
    refusal_events,
)
from .fanout import ChunkerFailure
from .findings import Finding
from .text_judgement import judge_text

log = logging.getLogger("guardstream.stream")


@dataclass
class StreamObserver:
    """Hooks for metrics; the pipeline does not depend on prometheus."""

    on_frame: Callable[[ClassifiedFrame, float], None] = lambda frame, hold_s: None
    on_findings: Callable[[list[Finding]], None] = lambda findings: None
    on_terminal: Callable[[str], None] = lambda name: None


@dataclass
class _Progress:
    finish_reason: str | None = None
    generated_token_count: int = 0
    input_token_count: int | None = None
    frames_sent: int = 0
    # (text length, monotonic time it became available): for the hold-back metric
    arrivals: deque[tuple[int, float]] = field(default_factory=deque)
    generated_chars: int = 0


def first_error(exc: BaseException) -> BaseException:
    """The exception that explains a TaskGroup failure (the others are its cancellations)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or list(exc.exceptions))[0]
    return exc


class GuardedGeneration:
    def __init__(
        self,
        *,
        backend: ModelBackend,
        request: GenerationRequest,
        inputs: str,
        masks: list[tuple[int, int]] | None,
        input_detectors: list[RequestedDetector],
        output_detectors: list[RequestedDetector],
        chunkers: ChunkerRegistry,
        timeout_s: float,
        seed: int | None = None,
        observer: StreamObserver | None = None,
    ) -> None:
        self._backend = backend
        self._request = request
        self._inputs = inputs
        self._masks = masks
        self._input_detectors = input_detectors
        self._output_detectors = output_detectors
        self._chunkers = chunkers
        self._timeout_s = timeout_s
        self._seed = seed
        self._observer = observer or StreamObserver()
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._progress = _Progress()
        self._released = 0
        self._migrations = 0
        self._task: asyncio.Task[None] | None = None
        self._shutting_down = False

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event of the stream; the last one is terminal."""
        task = asyncio.create_task(self._run(), name=f"stream-{self._request.request_id}")
        self._task = task
        try:
            while True:
                event = await self._queue.get()
                yield event
                if event.terminal:
                    return
        finally:
            if not task.done():
                task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    # -- the work -------------------------------------------------------------------------------

    async def _run(self) -> None:
        timeout = asyncio.timeout(self._timeout_s)
        if self._shutting_down:  # shut down before the task ran
            self._end_for_shutdown()
            return
        try:
            async with timeout:
                await self._guarded()
        except TimeoutError:
            if not timeout.expired():
                raise
            self._progress.finish_reason = "TIME_LIMIT"
            self._terminal(incomplete_event(self._summary(), "time_limit"))
        except asyncio.CancelledError:
            if not self._shutting_down:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self._end_for_shutdown()
        except BaseException as group:
            self._fail(first_error(group))

    def _end_for_shutdown(self) -> None:
        self._progress.finish_reason = "CANCELLED"
        self._terminal(
            failure_event(
                self._summary(),
                self._progress.frames_sent,
                503,
                ErrorType.SERVER_SHUTDOWN,
                "the server is shutting down",
            )
        )

    def shut_down(self) -> None:
        """Ends the stream now with `failed`/`error` of type server_shutdown (a drain ran out).
        A pipeline whose task has not started yet remembers it and ends as soon as it starts."""
        self._shutting_down = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _fail(self, exc: BaseException) -> None:
        p = self._progress
        if isinstance(exc, Blocked):
            p.finish_reason = "CANCELLED"
            self._refuse(exc.detections)
            return
        if isinstance(exc, TimeoutError):  # raised inside a task group by our own deadline
            p.finish_reason = "TIME_LIMIT"
            self._terminal(incomplete_event(self._summary(), "time_limit"))
            return
        p.finish_reason = "ERROR"
        if isinstance(exc, DetectorCallError):
            code, etype, msg = 502, ErrorType.DETECTOR_ERROR, str(exc)
        elif isinstance(exc, GenerationError):
            code, etype, msg = exc.code, ErrorType(exc.error_type), str(exc)
        elif isinstance(exc, ChunkerFailure):
            code, etype, msg = 500, ErrorType.CHUNKER_ERROR, str(exc)
        else:
            if not isinstance(exc, AggregationError):
                log.error("stream %s failed", self._request.request_id, exc_info=exc)
            code, etype, msg = 500, ErrorType.SERVER_ERROR, "internal error"
        self._terminal(failure_event(self._summary(), p.frames_sent, code, etype, msg))

    async def _guarded(self) -> None:
        if self._input_detectors:
            findings = await judge_text(
                self._inputs, self._input_detectors, self._chunkers, regions=self._masks
            )
            if findings:
                await self._input_refused(findings)
                return
        stream = self._backend.stream(self._request)
        try:
            if self._output_detectors:
                await self._with_detection(stream)
            else:
                await self._direct(stream)
        finally:
            self._migrations = stream.migrations
            await stream.aclose()
        self._terminal(finish_event(self._summary()))

    async def _input_refused(self, findings: list[Finding]) -> None:
        self._observer.on_findings(findings)
        count: int | None = None
        with suppress(GenerationError):
            count = await self._backend.tokenize(self._inputs, self._request.chat)
        self._progress.input_token_count = count
        frame = ClassifiedFrame(
            token_classification_results=TokenClassificationResults(
                input=[f.to_tcr() for f in findings]
            ),
            start_index=0,
            processed_index=0,
            input_token_count=count,
            seed=self._seed,
            warnings=[UNSUITABLE_INPUT],
        )
        self._send(frame)
        self._terminal(incomplete_event(self._summary(), "content_filter"))

    async def _direct(self, stream: AsyncIterator[GenerationChunk]) -> None:
        """No output detectors: every generation item is a frame at once."""
        final_sent = False
        async for chunk in stream:
            self._track(chunk)
            if not chunk.text and chunk.finish_reason is None:
                continue
            start = self._released
            self._released += len(chunk.text)
            final = chunk.finish_reason is not None
            self._send(self._frame(start, chunk.text, [], final=final))
            final_sent = final
        self._progress.finish_reason = self._progress.finish_reason or stream_finish(stream)
        if not final_sent:
            self._send(self._frame(self._released, "", [], final=True))

    async def _with_detection(self, stream: AsyncIterator[GenerationChunk]) -> None:
        detection = StreamingDetection(self._output_detectors, self._chunkers, self._on_judged)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(detection.run())
            async for chunk in stream:
                self._track(chunk)
                detection.feed(chunk.text)
            self._progress.finish_reason = self._progress.finish_reason or stream_finish(stream)
            detection.end()
        frames = detection.final_frames()
        for frame in frames:
            self._observer.on_findings(frame.detections)
            self._send(self._judged_frame(frame, final=frame is frames[-1]))

    def _on_judged(self, frame: JudgedFrame) -> None:
        self._observer.on_findings(frame.detections)
        self._send(self._judged_frame(frame, final=False))

    # -- frames and events ----------------------------------------------------------------------

    def _track(self, chunk: GenerationChunk) -> None:
        p = self._progress
        p.generated_token_count = chunk.generated_token_count
        if chunk.text:
            p.generated_chars += len(chunk.text)
            p.arrivals.append((p.generated_chars, time.monotonic()))
        if chunk.input_token_count is not None:
            p.input_token_count = chunk.input_token_count
        if chunk.finish_reason is not None:
            p.finish_reason = chunk.finish_reason

    def _judged_frame(self, frame: JudgedFrame, *, final: bool) -> ClassifiedFrame:
        self._released = frame.end
        return self._frame(frame.start, frame.text, frame.detections, final=final, detectors=True)

    def _frame(
        self,
        start: int,
        text: str,
        findings: list[Finding],
        *,
        final: bool,
        detectors: bool = False,
    ) -> ClassifiedFrame:
        p = self._progress
        return ClassifiedFrame(
            generated_text=text,
            token_classification_results=TokenClassificationResults(
                output=[f.to_tcr() for f in findings] if detectors else None
            ),
            start_index=start,
            processed_index=start + len(text),
            finish_reason=p.finish_reason if final else None,  # type: ignore[arg-type]
            generated_token_count=p.generated_token_count if final else None,
            input_token_count=p.input_token_count,
            seed=self._seed,
            warnings=[UNSUITABLE_OUTPUT] if findings else None,
        )

    def _send(self, frame: ClassifiedFrame) -> None:
        self._progress.frames_sent += 1
        self._observer.on_frame(frame, self._hold_time(frame.processed_index or 0))
        self._queue.put_nowait(frame_event(frame))

    def _hold_time(self, end: int) -> float:
        """Seconds since the last character of a frame ending at `end` was generated."""
        arrivals = self._progress.arrivals
        while arrivals and arrivals[0][0] < end:
            arrivals.popleft()
        if not arrivals:
            return 0.0
        return time.monotonic() - arrivals[0][1]

    def _summary(self) -> TerminalSummary:
        p = self._progress
        return TerminalSummary(
            finish_reason=p.finish_reason,  # type: ignore[arg-type]
            generated_token_count=p.generated_token_count,
            input_token_count=p.input_token_count,
            processed_index=self._released,
            migrations=self._migrations,
        )

    def _refuse(self, detections: list[Finding]) -> None:
        ids = ", ".join(f"`{i}`" for i in sorted({d.detector_id for d in detections}))
        message = f"The response was withheld: detector {ids} flagged the generated text."
        done = RefusalDone(refusal=message, detections=[d.to_tcr() for d in detections])
        for event in refusal_events(message, done):
            self._queue.put_nowait(event)
        self._terminal(incomplete_event(self._summary(), "content_filter"))

    def _terminal(self, event: StreamEvent) -> None:
        self._observer.on_terminal(event.name or "")
        self._queue.put_nowait(event)


def stream_finish(stream: object) -> str | None:
    return getattr(stream, "finish_reason", None)
