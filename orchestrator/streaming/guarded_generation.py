"""One generation request, guarded: input detection, generation streamed through the output
detectors, frames, and exactly one terminal event (DESIGN sections 1 and 4.3 to 4.7).

`GuardedGeneration.events()` is an async iterator of typed events (`Frame`, `Refusal`,
`Terminal`, `KeepAlive`) that the handler pulls. Background tasks (the engine reader, one per
detector queue, input detection) only post messages to one `Inbox`; the single consumer loop in
`events()` takes them, feeds the aggregator, and yields what became releasable. Nothing emits
from callbacks, a block is a returned verdict, and because the handler pulls, a client that stops
reading stops the consumer, which stops emptying the inbox, which stops the engine read.
Closing the iterator (a disconnect) cancels every task of the request.

Where output detectors gate the frames, the engine reader feeds the chunkers itself
(`_read_engine`): chunking is synchronous and cheap, and it only hands chunks to the detector
queues, so a token that completes no chunk wakes the reader alone, not the consumer too. A paced
stream (10 ms a token) spent about a tenth of its CPU on that second wake-up per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from .. import tracing
from ..api.errors import ErrorType
from ..clients.backend import GenerationChunk, GenerationError, GenerationRequest, ModelBackend
from ..clients.migration import MigratingStream
from ..clients.registry import ChunkerRegistry, RequestedDetector
from .aggregation import DetectorResult
from .cancellation import cancel_and_wait
from .detector_queue import DetectorFinished
from .events import (
    KEEP_ALIVE,
    TERMINAL_BY_FINISH,
    Event,
    Failure,
    Frame,
    IncompleteReason,
    Refusal,
    Terminal,
)
from .failures import describe, is_unexpected
from .findings import Finding, sort_findings
from .inbox import Inbox
from .read_pacing import ReadPacer
from .redaction import redact_text, redacted_finding
from .stream_judgement import JudgedFrame, StreamJudge
from .text_judgement import InputPiece, judge_pieces, judge_text

log = logging.getLogger("guardstream.stream")

# The engine is read no further ahead of the slowest output detector than this many characters
# of chunked text it has not answered yet: under a burst (a fast engine, a resumed stream) the
# pipeline alternates reading, judging and releasing instead of reading everything first.
MAX_UNJUDGED_CHARS = 1024


@dataclass
class StreamObserver:
    """Hooks for metrics; the pipeline does not depend on prometheus."""

    on_frame: Callable[[Frame, float], None] = lambda frame, hold_s: None
    on_findings: Callable[[list[Finding]], None] = lambda findings: None
    on_terminal: Callable[[str], None] = lambda name: None


# -- inbox messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _InputJudged:
    findings: list[Finding]


@dataclass(frozen=True, slots=True)
class _EngineEnded:
    pass


@dataclass(frozen=True, slots=True)
class _Crashed:
    """A background task raised: the request fails with what `describe` makes of it."""

    exc: BaseException


class _Signal:
    def __init__(self, name: str) -> None:
        self.name = name


_TIMED_OUT = _Signal("timed out")
_SHUTDOWN = _Signal("shutdown")
_KEEPALIVE_DUE = _Signal("keep-alive due")
# yielded by `_run` (never to the handler) before it waits for the inbox: what it produced from
# the messages it had is complete, so a frame held back to learn whether more follow goes out
_IDLE = _Signal("idle")


@dataclass
class _Progress:
    finish_reason: str | None = None
    generated_token_count: int = 0
    input_token_count: int | None = None
    frames_sent: int = 0
    released: int = 0
    # (text length, monotonic time it became available): for the hold-back metric
    arrivals: deque[tuple[int, float]] = field(default_factory=deque)
    generated_chars: int = 0


class GuardedGeneration:
    def __init__(
        self,
        *,
        backend: ModelBackend,
        request: GenerationRequest,
        inputs: str | list[InputPiece],
        masks: list[tuple[int, int]] | None,
        input_detectors: list[RequestedDetector],
        output_detectors: list[RequestedDetector],
        chunkers: ChunkerRegistry,
        timeout_s: float,
        seed: int | None = None,
        observer: StreamObserver | None = None,
        keepalive_s: float | None = None,
        max_buffered_chunks: int = 64,
        read_coalesce_tokens: float = 0.0,
        read_coalesce_when: Callable[[], bool] | None = None,
    ) -> None:
        """`inputs` is what input detectors judge: FMS `inputs` (with `masks`), or every piece
        of a conversation, each on its own;
        `keepalive_s` makes `events()` yield KeepAlive after that long without another event;
        `read_coalesce_tokens` paces the engine reads of a slow stream, while
        `read_coalesce_when()` says so (the orchestrator: while its loop is busy; see
        ReadPacer)."""
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
        self._keepalive_s = keepalive_s
        self._read_coalesce_tokens = read_coalesce_tokens
        self._read_coalesce_when = read_coalesce_when or (lambda: True)
        self._inbox = Inbox(max_buffered_chunks)
        self._max_batch = max_buffered_chunks
        self._detection: StreamJudge | None = None
        self._holding = False  # events() holds a frame: `_run` yields _IDLE before it waits
        self._progress = _Progress()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stream: MigratingStream | None = None
        self._shutting_down = False
        self._last_event = 0.0
        self._keepalive: asyncio.TimerHandle | None = None
        self.terminal: Terminal | None = None
        self._input_findings: list[Finding] | None = None  # redacted input, for the 1st frame
        self._span = tracing.request_span(backend.model_id)  # None unless tracing is on

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def shut_down(self) -> None:
        """Ends the stream with `failed`/`error` of type server_shutdown (a drain ran out)."""
        self._shutting_down = True
        self._inbox.put(_SHUTDOWN)

    # -- the consumer loop ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the stream; the last one is a Terminal."""
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self._timeout_s, self._inbox.put, _TIMED_OUT)
        self._last_event = loop.time()
        self._arm_keepalive()
        try:
            if self._shutting_down:
                yield self._finish(self._shutdown_terminal())
                return
            async with aclosing(self._run()) as run:
                # Each frame is held until the next event (or _IDLE) shows whether another one
                # follows at once: then it goes out with `more` set (writers send a burst of
                # frames in one write). Nothing is held across a wait for the inbox.
                held: Frame | None = None
                self._holding = False
                while True:
                    try:
                        event = await anext(run)
                    except StopAsyncIteration:
                        if held is not None:
                            yield held
                        return
                    except Exception as exc:  # a bug must still end the stream with a terminal
                        event = self._failure(exc)
                    if event is _IDLE:
                        if held is not None:
                            frame, held = held, None
                            self._holding = False
                            yield frame
                        continue
                    self._last_event = loop.time()
                    if held is not None:
                        held.more = True
                        frame, held = held, None
                        yield frame
                    if isinstance(event, Frame):
                        held = event
                        self._holding = True
                        continue
                    if isinstance(event, Terminal):
                        yield self._finish(event)
                        return
                    yield event
        finally:
            deadline.cancel()
            if self._keepalive is not None:
                self._keepalive.cancel()
            await self._stop()

    async def _run(self) -> AsyncIterator[Event | _Signal]:
        if self._input_detectors:
            self._spawn(self._judge_input())
            judged: list[Finding] | None = None
            while judged is None:
                if self._holding:
                    yield _IDLE
                for message in await self._inbox.take_all():
                    if isinstance(message, _InputJudged):
                        judged = message.findings
                        continue
                    event = self._control(message)
                    if event is not None:
                        yield event
                        if isinstance(event, Terminal):
                            return
            redactors = {d.detector_id: d for d in self._input_detectors if d.redacting}
            if any(f.detector_id not in redactors for f in judged):  # block beats redact
                async for event in self._input_refused(judged):
                    yield event
                return
            if judged:
                self._redact_input(judged, redactors)
        stream = self._backend.stream(self._request)
        self._stream = stream
        detection: StreamJudge | None = None
        if self._output_detectors:
            detection = StreamJudge(self._output_detectors, self._chunkers, self._inbox)
            detection.start(self._spawn)
            self._detection = detection
        self._spawn(self._read_engine(stream))
        engine_ended = False
        final_sent = False
        while True:
            if self._holding:
                yield _IDLE
            messages = await self._inbox.take_all()
            pending_text: list[str] = []
            for message in messages:
                if type(message) is list:  # the GenerationChunks of one engine read
                    now = time.monotonic()
                    if detection is None:
                        for chunk in message:
                            self._track(chunk, now)
                            if chunk.text or chunk.finish_reason is not None:
                                final = chunk.finish_reason is not None
                                final_sent = final
                                yield self._direct_frame(chunk.text, final)
                    else:
                        self._track_batch(message, now)
                        pending_text.extend(c.text for c in message if c.text)
                    continue
                if pending_text:  # consecutive chunks are chunked as one delta
                    assert detection is not None
                    for frame in detection.feed("".join(pending_text)):
                        yield self._judged_frame(frame, final=False)
                    pending_text = []
                if isinstance(message, _EngineEnded):
                    engine_ended = True
                    p = self._progress
                    p.finish_reason = p.finish_reason or stream.finish_reason
                    if detection is None:
                        if not final_sent:
                            yield self._direct_frame("", True)
                        yield self._finish_terminal()
                        return
                    detection.end()
                elif isinstance(message, DetectorResult | DetectorFinished):
                    assert detection is not None
                    verdict = detection.accept(message)
                    for frame in verdict.frames:
                        yield self._judged_frame(frame, final=False)
                    if verdict.blocked is not None:
                        if not engine_ended:  # a model that had finished keeps its reason
                            self._progress.finish_reason = "CANCELLED"
                        await self._stop()  # generation and every detector call end now
                        yield self._output_refusal(verdict.blocked)
                        yield self._terminal("incomplete", "content_filter")
                        return
                else:
                    event = self._control(message)
                    if event is not None:
                        yield event
                        if isinstance(event, Terminal):
                            return
                if engine_ended and detection is not None and detection.done:
                    frames = detection.final_frames()
                    for frame in frames:
                        yield self._judged_frame(frame, final=frame is frames[-1])
                    yield self._finish_terminal()
                    return
            if pending_text:
                assert detection is not None
                for frame in detection.feed("".join(pending_text)):
                    yield self._judged_frame(frame, final=False)

    def _control(self, message: object) -> Event | None:
        """Messages every phase handles the same way."""
        if message is _KEEPALIVE_DUE:
            return self._keepalive_due()
        if message is _TIMED_OUT:
            self._progress.finish_reason = "TIME_LIMIT"
            return self._terminal("incomplete", "time_limit")
        if message is _SHUTDOWN:
            return self._shutdown_terminal()
        if isinstance(message, _Crashed):
            return self._failure(message.exc)
        return None  # a straggler of an earlier phase

    # -- background tasks -----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(self._guard(coro), name=f"stream-{self._request.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._inbox.put(_Crashed(exc))

    async def _judge_input(self) -> None:
        with tracing.input_detection(self._input_detectors) as span:
            if isinstance(self._inputs, str):
                findings = await judge_text(
                    self._inputs, self._input_detectors, self._chunkers, masks=self._masks
                )
            else:
                findings = await judge_pieces(self._inputs, self._input_detectors, self._chunkers)
            if span is not None:
                span.set_attribute("guardstream.detections", len(findings))
        self._inbox.put(_InputJudged(findings))

    def _redact_input(
        self, findings: list[Finding], redactors: dict[str, RequestedDetector]
    ) -> None:
        """DESIGN 4.6a: the engine receives the prompt with every flagged span replaced; the
        client hears of it on the first frame (spans relative to the text it sent)."""
        r = self._request
        if isinstance(self._inputs, str):
            text, _ = redact_text(self._inputs, findings, redactors)
            self._request = replace(r, prompt=text)
        else:
            assert r.messages is not None
            messages = list(r.messages)
            for piece in self._inputs:
                if piece.target is None:
                    continue
                mine = [
                    f
                    for f in findings
                    if f.message_index == piece.message_index and f.field == piece.field
                ]
                if mine:
                    text, _ = redact_text(piece.text, mine, redactors)
                    messages[piece.target] = replace(messages[piece.target], content=text)
            last_user = max(i for i, m in enumerate(messages) if m.role == "user")
            self._request = replace(r, prompt=messages[last_user].content, messages=tuple(messages))
        self._input_findings = [
            redacted_finding(f, redactors[f.detector_id].replacement(f.detection), f.start, f.end)
            for f in findings
        ]

    async def _read_engine(self, stream: MigratingStream) -> None:
        """What one read of the engine delivered is chunked here when output detectors gate
        the frames, and otherwise goes to the inbox as one message (its frames leave through
        the consumer). The read waits while the detectors are behind (MAX_UNJUDGED_CHARS) and
        while the consumer is: `Inbox.has_space` counts the verdicts it has not taken too."""
        inbox, limit, detection = self._inbox, self._max_batch, self._detection
        gated = detection is not None and detection.gated
        pacer = ReadPacer(
            asyncio.get_running_loop().time,
            tokens=self._read_coalesce_tokens,
            active=self._read_coalesce_when,
        )
        while True:
            if detection is not None and detection.unjudged > MAX_UNJUDGED_CHARS:
                pacer.held_back()
                while detection.unjudged > MAX_UNJUDGED_CHARS:
                    detection.answered.clear()
                    await detection.answered.wait()
            try:
                batch = await stream.next_batch(limit)
            except StopAsyncIteration:
                break
            if not inbox.has_space():
                pacer.held_back()
            if gated:
                assert detection is not None
                await inbox.wait_space()
                self._track_batch(batch, time.monotonic())
                text = "".join([c.text for c in batch if c.text])
                if text:
                    detection.feed(text)  # gated: no frame comes back before a verdict
            else:
                await inbox.put_chunks(batch)
            delay = pacer.after_read(len(batch))
            if delay:
                await asyncio.sleep(delay)
        inbox.put(_EngineEnded())

    async def _stop(self) -> None:
        await cancel_and_wait(list(self._tasks))
        if self._stream is not None:
            await self._stream.aclose()

    # -- keep-alive -----------------------------------------------------------------------------

    def _arm_keepalive(self) -> None:
        """One lazily re-armed timer: it fires at most once per interval, and only a real
        silence turns into a KeepAlive event."""
        if self._keepalive_s is None:
            return
        loop = asyncio.get_running_loop()
        self._keepalive = loop.call_at(
            self._last_event + self._keepalive_s, self._inbox.put, _KEEPALIVE_DUE
        )

    def _keepalive_due(self) -> Event | None:
        assert self._keepalive_s is not None
        now = asyncio.get_running_loop().time()
        silent = now - self._last_event >= self._keepalive_s
        if silent:
            self._last_event = now
        self._arm_keepalive()
        return KEEP_ALIVE if silent else None

    # -- events ---------------------------------------------------------------------------------

    async def _input_refused(self, findings: list[Finding]) -> AsyncIterator[Event]:
        self._observer.on_findings(findings)
        count: int | None = None
        try:
            r = self._request
            count = await (
                self._backend.tokenize(r.prompt, r.chat)
                if r.messages is None
                else self._backend.tokenize(r.prompt, r.chat, r.messages)
            )
        except GenerationError:
            pass
        self._progress.input_token_count = count
        ids = ", ".join(f"`{i}`" for i in sorted({f.detector_id for f in findings}))
        yield Refusal(
            direction="input",
            message=f"The request was refused: detector {ids} flagged the input.",
            detections=findings,
            input_token_count=count,
            seed=self._seed,
        )
        self._progress.frames_sent += 1
        yield self._terminal("incomplete", "content_filter")

    def _output_refusal(self, detections: list[Finding]) -> Refusal:
        self._observer.on_findings(detections)
        ids = ", ".join(f"`{i}`" for i in sorted({d.detector_id for d in detections}))
        # the flagged text itself never leaves the service (DESIGN 4.6): the detections keep
        # their spans and labels, not the words (nor evidence that could quote them)
        withheld = [replace(d, text="", evidence=None, metadata=None) for d in detections]
        return Refusal(
            direction="output",
            message=f"The response was withheld: detector {ids} flagged the generated text.",
            detections=sort_findings(withheld),
            input_token_count=self._progress.input_token_count,
            seed=self._seed,
        )

    def _track(self, chunk: GenerationChunk, now: float) -> None:
        p = self._progress
        p.generated_token_count = chunk.generated_token_count
        if chunk.text:
            p.generated_chars += len(chunk.text)
            p.arrivals.append((p.generated_chars, now))
        if chunk.input_token_count is not None:
            p.input_token_count = chunk.input_token_count
        if chunk.finish_reason is not None:
            p.finish_reason = chunk.finish_reason

    def _track_batch(self, batch: list[GenerationChunk], now: float) -> None:
        """`_track` for chunks that arrived together: their text is chunked as one delta, so one
        arrival entry and the last chunk's counters say all the pipeline needs."""
        p = self._progress
        last = batch[-1]
        p.generated_token_count = last.generated_token_count
        chars = sum(len(c.text) for c in batch)
        if chars:
            p.generated_chars += chars
            p.arrivals.append((p.generated_chars, now))
        # a chunk's counters and finish reason are the stream's so far: the last one's hold
        if last.input_token_count is not None:
            p.input_token_count = last.input_token_count
        if last.finish_reason is not None:
            p.finish_reason = last.finish_reason

    def _direct_frame(self, text: str, final: bool) -> Frame:
        start = self._progress.released
        return self._frame(start, text, [], final=final)

    def _judged_frame(self, judged: JudgedFrame, *, final: bool) -> Frame:
        self._observer.on_findings(judged.detections)
        frame = self._frame(
            judged.start, judged.text, judged.detections, final=final, source_end=judged.source_end
        )
        frame.judged = True
        return frame

    def _frame(
        self,
        start: int,
        text: str,
        findings: list[Finding],
        *,
        final: bool,
        source_end: int | None = None,
    ) -> Frame:
        p = self._progress
        if final and p.finish_reason is None and self._stream is not None:
            p.finish_reason = self._stream.finish_reason
        end = start + len(text)
        p.released = end
        p.frames_sent += 1
        frame = Frame(
            start=start,
            end=end,
            text=text,
            detections=findings,
            final=final,
            finish_reason=p.finish_reason if final else None,
            generated_token_count=p.generated_token_count if final else None,
            input_token_count=p.input_token_count,
            seed=self._seed,
        )
        if self._input_findings is not None:
            frame.input_detections, self._input_findings = self._input_findings, None
        hold_s = self._hold_time(end if source_end is None else source_end)
        self._observer.on_frame(frame, hold_s)
        if self._span is not None and self._output_detectors:  # judged frames: per chunk
            tracing.frame_event(self._span, frame, hold_s)
        return frame

    def _hold_time(self, end: int) -> float:
        """Seconds since the last character of a frame ending at `end` was generated."""
        arrivals = self._progress.arrivals
        while arrivals and arrivals[0][0] < end:
            arrivals.popleft()
        if not arrivals:
            return 0.0
        return time.monotonic() - arrivals[0][1]

    def _terminal(
        self,
        kind: str,
        reason: IncompleteReason | None = None,
        error: Failure | None = None,
    ) -> Terminal:
        p = self._progress
        return Terminal(
            kind=kind,  # type: ignore[arg-type]
            finish_reason=p.finish_reason,
            generated_token_count=p.generated_token_count,
            input_token_count=p.input_token_count,
            processed_index=p.released,
            migrations=self._stream.migrations if self._stream is not None else 0,
            reason=reason,
            error=error,
        )

    def _finish_terminal(self) -> Terminal:
        kind, reason = TERMINAL_BY_FINISH.get(self._progress.finish_reason, ("completed", None))
        return self._terminal(kind, reason)

    def _failure(self, exc: BaseException) -> Terminal:
        failure = describe(exc)
        if is_unexpected(failure):
            log.error("stream %s failed", self._request.request_id, exc_info=exc)
        if isinstance(exc, TimeoutError):  # a deadline inside a client: the time budget
            self._progress.finish_reason = "TIME_LIMIT"
            return self._terminal("incomplete", "time_limit")
        self._progress.finish_reason = "ERROR"
        return self._terminal("failed" if self._progress.frames_sent else "error", error=failure)

    def _shutdown_terminal(self) -> Terminal:
        self._progress.finish_reason = "CANCELLED"
        failure = Failure(503, ErrorType.SERVER_SHUTDOWN, "the server is shutting down")
        return self._terminal("failed" if self._progress.frames_sent else "error", error=failure)

    def _finish(self, terminal: Terminal) -> Terminal:
        self.terminal = terminal
        self._observer.on_terminal(terminal.kind)
        if self._span is not None:
            tracing.record_terminal(self._span, terminal, self._progress.frames_sent)
        return terminal
