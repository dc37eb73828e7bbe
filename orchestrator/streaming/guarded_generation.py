"""One generation request, guarded: input detection, generation streamed through the output
detectors, frames, and exactly one terminal event (DESIGN sections 1 and 4.3 to 4.7). The inbox,
the background tasks, the deadline and the drain's signal are `PipelineCore`'s, shared with
stream-content's pipeline (content_stream.py).

`GuardedGeneration.events()` is an async iterator of typed events (`Frame`, `Refusal`,
`Terminal`, `KeepAlive`) that the handler pulls. Background tasks (the engine reader, one per
detector queue, input detection) only post messages to one `Inbox`; the single consumer loop
(`_run`) takes them, hands verdicts to the detection stage, and yields what became releasable.
Nothing emits from callbacks, a block is a returned verdict, and because the handler pulls, a
client that stops reading stops the consumer, which stops emptying the inbox, which stops the
engine read. Closing the iterator (a disconnect) cancels every task of the request.

Engine text takes one path: the engine reader (`_read_engine`) feeds every read to the
detection stage (`StreamJudge`, which stream-content's body lines go through too) itself, and
posts to the inbox only what the stage released at once: nothing where detectors gate the
frames (their verdicts release them), the frames where none does (without detectors: each
engine chunk as its own frame). Chunking is synchronous and cheap, so a token that completes no chunk wakes the reader alone, not the consumer too: a paced
stream (10 ms a token) spent about a tenth of its CPU on that second wake-up per token. The
reader waits in one place, `Inbox.wait_space`, for the consumer and for the detectors alike.

The stream's counters (tokens, finish reason) are `MigratingStream`'s; the pipeline keeps only
what is its own: what it released, the frames it sent, and a finish reason it imposes (a block,
the time limit, a failure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace

from .. import tracing
from ..api.errors import ApiError, ErrorType
from ..api.input_pieces import NAME_FIELD, STOP_SEQUENCE_FIELD, label_of, request_field_pieces
from ..clients.backend import GenerationError, GenerationRequest, ModelBackend
from ..clients.migration import MigratingStream
from ..clients.registry import ChunkerRegistry, RequestedDetector
from ..errors import SHUTDOWN, describe, is_unexpected
from ..judge_templates import judged_messages
from .aggregation import DetectorResult
from .detector_queue import DetectorFinished, seam_bounds
from .events import (
    KEEP_ALIVE,
    TERMINAL_BY_FINISH,
    Event,
    Failure,
    Frame,
    IncompleteReason,
    KeepAlive,
    Refusal,
    Terminal,
    cut_short,
)
from .findings import Finding, sort_findings
from .joined_turns import judge_joined_turns
from .pipeline_core import DEADLINE, DRAIN, Crashed, PipelineCore, Signal
from .read_pacing import ReadPacer
from .redaction import redact_text, redacted_finding
from .released_stops import ReleasedStops
from .stream_judgement import Release, StreamJudge
from .text_judgement import BULK_CHARS, InputPiece, judge_pieces, judge_text, off_loop
from .tool_calls import (
    JudgedCall,
    ToolCallAssembler,
    judge_sent_back_calls,
    judge_tool_calls,
    offered_names,
    redact_arguments,
)
from .verdict_cache import TenantVerdicts

log = logging.getLogger("guardstream.stream")

# the `field` of a piece of the prompt as the request's own redacting detectors change it,
# among the judged input pieces (_judge_as_redacted)
AS_REDACTED = "as redacted"

# The engine is read no further ahead of the slowest output detector than this many characters
# of chunked text it has not answered yet: under a burst (a fast engine, a resumed stream) the
# pipeline alternates reading, judging and releasing instead of reading everything first.
MAX_UNJUDGED_CHARS = 1024


@dataclass
class StreamObserver:
    """Hooks for metrics; the pipeline does not depend on prometheus."""

    on_frame: Callable[[Frame, float], None] = lambda frame, hold_s: None
    on_findings: Callable[[list[Finding]], None] = lambda findings: None
    on_terminal: Callable[[Terminal], None] = lambda terminal: None
    # a stream that ended without a terminal (its client left, its handler was cancelled):
    # (input tokens, generated tokens) spent so far, which a tenant's budget is still charged
    on_abandoned: Callable[[int, int], None] = lambda input_tokens, generated_tokens: None


# -- inbox messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _InputJudged:
    findings: list[Finding]


@dataclass(frozen=True, slots=True)
class _EngineEnded:
    """The engine's stream ended; its tool calls, judged (streaming/tool_calls.py)."""

    tool_calls: list[JudgedCall]


_KEEPALIVE_DUE = Signal("keep-alive due")


class GuardedGeneration(PipelineCore):
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
        offers_tools: bool = False,
        input_verdicts: TenantVerdicts | None = None,
        request_pieces: list[InputPiece] | None = None,
    ) -> None:
        """`inputs` is what input detectors judge: FMS `inputs` (with `masks`), or every piece
        of a conversation, each on its own; `input_verdicts`: the tenant's kept input verdicts
        (verdict_cache.py: a conversation sent again judges only its new text);
        `keepalive_s` makes `events()` yield KeepAlive after that long without another event;
        `read_coalesce_tokens` paces the engine reads of a slow stream, while
        `read_coalesce_when()` says so (the orchestrator: while its loop is busy; see
        ReadPacer); `offers_tools`: the request offered the model tools (Chat Completions
        `tools`), so its surface renders tool calls; a call without is a failure, never
        dropped; `request_pieces`: the pieces of `request.extra` (`request_field_pieces`), where
        the caller made them already (off the loop)."""
        super().__init__(
            max_buffered=max_buffered_chunks,
            timeout_s=timeout_s,
            task_name=f"stream-{request.request_id}",
        )
        self._backend = backend
        self._request = request
        self._inputs = inputs
        self._masks = masks
        self._input_detectors = input_detectors
        self._input_verdicts = input_verdicts
        self._request_pieces = request_pieces
        # output detectors judge the answer's text, its tool calls' arguments, or both
        self._output_detectors = [d for d in output_detectors if "text" in d.applies_to]
        self._tool_call_detectors = [d for d in output_detectors if "tool_calls" in d.applies_to]
        self._chunkers = chunkers
        self._seed = seed
        self._observer = observer or StreamObserver()
        self._keepalive_s = keepalive_s
        self._read_coalesce_tokens = read_coalesce_tokens
        self._read_coalesce_when = read_coalesce_when or (lambda: True)
        self._max_batch = max_buffered_chunks
        self._offers_tools = offers_tools
        self._detection: StreamJudge | None = None
        self._judged = bool(self._output_detectors)  # frames went through detectors
        # DESIGN 4.6a: where an output guardrail changes or withholds released text, the stop
        # sequences are matched here on that text, never by the backend on the raw text (whose
        # stop or not would tell the client what the redacted or withheld text holds)
        self._released_stops = (
            ReleasedStops(request.params.stop_sequences)
            if request.params.stop_sequences
            and any(d.redacting or d.blocking for d in output_detectors)
            else None
        )
        # annotating whole-document detectors: after a stop matched here they judge the text the
        # client received (the stage's ran on the raw text, past the cut); that text, kept
        self._doc_annotators = [
            d for d in self._output_detectors if d.whole_doc and d.on_detection == "annotate"
        ]
        self._sent_text: list[str] | None = (
            [] if self._released_stops is not None and self._doc_annotators else None
        )
        self._cut: Release | None = None  # the release a stop sequence ended
        # what the pipeline itself decided about the stream (the rest is `self._stream`'s)
        self._finish_reason: str | None = None  # CANCELLED, TIME_LIMIT, ERROR
        self._refused_input_tokens: int | None = None  # the input refusal's count
        self._released = 0
        self._frames_sent = 0
        # (generated characters, monotonic time they arrived), per read: the hold-back metric
        self._arrivals: deque[tuple[int, float]] = deque()
        self._engine_delivered = False  # the engine delivered a chunk
        self._stream: MigratingStream | None = None
        self._last_event = 0.0
        self._keepalive: asyncio.TimerHandle | None = None
        self.terminal: Terminal | None = None
        self._input_findings: list[Finding] | None = None  # redacted input, for the 1st frame
        # (message_index, field) of the judged pieces that are request fields, not conversation
        # text (stop sequences, tool definitions), and of every piece that reaches the engine
        # but cannot be replaced (those and a tool call's name or id): _judge_input's
        self._request_fields: frozenset[tuple[int | None, str | None]] = frozenset()
        self._fixed: frozenset[tuple[int | None, str | None]] = frozenset()
        # (message_index, field) of the judged pieces of labels (`user`, `metadata`, ...), by
        # the label they are in: a finding there withholds the label (`_withhold_labels`)
        self._labels: dict[tuple[int | None, str | None], str] = {}
        self._span = tracing.request_span(backend.model_id)  # None unless tracing is on

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def redacts_input(self) -> bool:
        """Whether an input guardrail of this request redacts (DESIGN 4.6a)."""
        return any(d.redacting for d in self._input_detectors)

    # -- the consumer loop ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the stream; the last one is a Terminal."""
        loop = asyncio.get_running_loop()
        self._start()
        self._last_event = loop.time()
        self._arm_keepalive()
        try:
            if self._shutting_down:
                yield self._finish(self._shutdown_terminal())
                return
            async with aclosing(self._run()) as run:
                while True:
                    try:
                        batch = await anext(run)
                    except StopAsyncIteration:
                        return
                    except Exception as exc:  # a bug must still end the stream with a terminal
                        batch = [self._failure(exc)]
                    for event in batch:
                        self._last_event = loop.time()
                        if isinstance(event, Terminal):
                            yield self._finish(event)
                            return
                        yield event
        finally:
            if self._keepalive is not None:
                self._keepalive.cancel()
            if self.terminal is None:  # the client left: what it cost is still counted
                stream = self._stream
                self._observer.on_abandoned(
                    self._input_token_count() or 0,
                    stream.generated_token_count if stream is not None else 0,
                )
            await self._stop()

    async def _run(self) -> AsyncIterator[list[Event]]:
        """The events of each wake-up, together; a Terminal ends the last batch."""
        if self._input_detectors:
            self._spawn(self._judge_input())
            judged: list[Finding] | None = None
            while judged is None:
                out: list[Event] = []
                for message in await self._inbox.take_all():
                    if isinstance(message, _InputJudged):
                        judged = message.findings
                        continue
                    event = self._control(message)
                    if event is not None:
                        out.append(event)
                        if isinstance(event, Terminal):
                            yield out
                            return
                if out:
                    yield out
            judged = self._withhold_labels(judged)
            redactors = {d.detector_id: d for d in self._input_detectors if d.redacting}
            # block beats redact; an unjudged warning refuses nothing (its judge annotates)
            if any(f.detector_id not in redactors and not f.unjudged for f in judged):
                yield await self._input_refused(judged)
                return
            fixed = [f for f in judged if (f.message_index, f.field) in self._fixed]
            if fixed:
                # a replaced stop sequence would stop generation somewhere else, a replaced
                # tool definition would be another tool: refused
                yield [self._failure(_request_field_redacted(fixed))]
                return
            if judged:
                made = await self._judge_as_redacted(judged, redactors)
                if any(f.detector_id not in redactors for f in made):
                    yield await self._input_refused(made)
                    return
                if made:  # the request's redaction made what a redactor redacts
                    yield [self._failure(_redaction_made(made))]
                    return
                self._redact_input(judged, redactors)
        request = self._request
        if self._released_stops is not None:  # matched on the released text instead
            request = replace(request, params=replace(request.params, stop_sequences=()))
        stream = self._backend.stream(request)
        self._stream = stream
        conversation = _conversation(self._request)
        ready = None
        if any(d.client.reads_context for d in self._output_detectors):
            # the judges read it beside every chunk: made judge-ready once, off the loop past
            # BULK_CHARS (a 1 MB conversation is ~20 ms of CPU)
            ready = await _judge_ready(conversation)
        stage = StreamJudge(
            self._output_detectors,
            self._chunkers,
            self._inbox,
            conversation,
            ready,
            lead=continued_tail(self._request),
        )
        stage.start(self._spawn)
        self._detection = stage
        if self._output_detectors:  # the reader stays within MAX_UNJUDGED_CHARS of them
            self._inbox.behind = lambda: stage.unjudged > MAX_UNJUDGED_CHARS
        self._spawn(self._read_engine(stream, stage))
        engine_ended = False
        calls: list[JudgedCall] = []  # the engine's tool calls, judged, once it ended
        let_out = self._let_out
        while True:
            messages = await self._inbox.take_all()
            out: list[Release | Event] = []
            blocked: list[Finding] | None = None
            stopped = False  # a stop sequence matched on the released text (ReleasedStops)
            try:
                for message in messages:
                    if type(message) is list:  # what the stage released at an engine read
                        if stopped := let_out(message, out):
                            break
                    elif isinstance(message, DetectorResult | DetectorFinished):
                        verdict = stage.accept(message)
                        if stopped := let_out(verdict.releases, out):
                            break  # the text ended before what a block flagged
                        if verdict.blocked is not None:
                            blocked = verdict.blocked
                            break
                    elif isinstance(message, _EngineEnded):
                        engine_ended = True
                        stage.end(cut=cut_short(self._finish_reason_now()))
                        calls = message.tool_calls
                        blocked = [f for j in calls if j.blocked for f in j.blocked] or None
                        if blocked is not None:
                            break
                    else:
                        event = self._control(message)
                        if event is not None:
                            out.append(event)
                            if isinstance(event, Terminal):
                                yield self._framed(out)
                                return
                    if engine_ended and stage.done:
                        if let_out(stage.final_releases(), out):
                            self._finish_reason = "STOP_SEQUENCE"
                            await self._annotate_cut()
                        self._release_calls(calls, out)  # after the text, as generated
                        out.append(self._finish_terminal())
                        yield self._framed(out)
                        return
            except Exception as exc:  # a bug: what was released goes out before the terminal
                out.append(self._failure(exc))
                yield self._framed(out)
                return
            if stopped:  # as a backend stop: the text ends before it, generation ends now
                self._finish_reason = "STOP_SEQUENCE"
                await self._stop()
                try:
                    await self._annotate_cut()
                    out.append(self._terminal("completed"))
                except Exception as exc:  # a detector's failure: after what was released
                    out.append(self._failure(exc))
                yield self._framed(out)
                return
            if blocked is not None:
                if not engine_ended:  # a model that had finished keeps its reason
                    self._finish_reason = "CANCELLED"
                await self._stop()  # generation and every detector call end now
                out.append(self._output_refusal(blocked))
                out.append(self._terminal("incomplete", "content_filter"))
                yield self._framed(out)
                return
            if out:
                yield self._framed(out)

    def _control(self, message: object) -> Event | None:
        """Messages every phase handles the same way."""
        if message is _KEEPALIVE_DUE:
            return self._keepalive_due()
        if message is DEADLINE:
            self._finish_reason = "TIME_LIMIT"
            return self._terminal("incomplete", "time_limit")
        if message is DRAIN:
            return self._shutdown_terminal()
        if isinstance(message, Crashed):
            return self._failure(message.exc)
        return None  # a straggler of an earlier phase

    # -- background tasks -----------------------------------------------------------------------

    async def _judge_input(self) -> None:
        """The prompt's findings and those of the request fields that reach the engine too
        (DESIGN 4.6a, 4.8): its stop sequences, tagged STOP_SEQUENCE_FIELD with the sequence's
        index, and every string of the fields it forwards (tools, response_format, ...), one
        shared place for every surface: whatever the engine receives, an input guardrail
        judged."""
        stops = [
            InputPiece(text, message_index=i, field=STOP_SEQUENCE_FIELD)
            for i, text in enumerate(self._request.params.stop_sequences)
        ]
        pieces = self._request_pieces
        stops += request_field_pieces(self._request.extra) if pieces is None else pieces
        self._request_fields = frozenset((p.message_index, p.field) for p in stops)
        self._labels = {
            (p.message_index, p.field): label for p in stops if (label := label_of(p)) is not None
        }
        conversation = [] if isinstance(self._inputs, str) else self._inputs
        self._fixed = self._request_fields.difference(self._labels) | frozenset(
            (p.message_index, p.field) for p in conversation if p.fixed
        )
        with tracing.input_detection(self._input_detectors) as span:
            if isinstance(self._inputs, str):
                findings = await judge_text(
                    self._inputs,
                    self._input_detectors,
                    self._chunkers,
                    masks=self._masks,
                    verdicts=self._input_verdicts,
                )
                if stops:
                    findings += await judge_pieces(
                        stops, self._input_detectors, self._chunkers, self._input_verdicts
                    )
            else:
                pieces = [*self._inputs, *stops]
                findings = await judge_pieces(
                    pieces, self._input_detectors, self._chunkers, self._input_verdicts
                )
                # the calls sent back, their values across their boundaries (`joined_values`)
                findings += await judge_sent_back_calls(
                    self._inputs,
                    findings,
                    self._input_detectors,
                    self._chunkers,
                    self._input_verdicts,
                )
                # the user turns across their boundaries (an instruction cut into turns)
                joined = await judge_joined_turns(
                    self._inputs,
                    findings,
                    self._input_detectors,
                    self._chunkers,
                    self._input_verdicts,
                )
                if joined:
                    findings = sort_findings([*findings, *joined])
            if span is not None:
                span.set_attribute("guardstream.detections", len(findings))
        self._inbox.put(_InputJudged(findings))

    def _withhold_labels(self, findings: list[Finding]) -> list[Finding]:
        """The findings without those in labels (`user`, `metadata`, ...), each of which
        withholds its label from the backend instead: a label never reaches the model's prompt,
        so refusing the request for one would refuse what the model never reads, and sending it
        would hand the upstream what an input guardrail flagged (its provider logs them). Any
        finding withholds, whatever the detector does with the prompt (an `unjudged` warning
        too: fail closed)."""
        if not self._labels:
            return findings
        flagged = {
            self._labels[k] for f in findings if (k := (f.message_index, f.field)) in self._labels
        }
        if not flagged:
            return findings
        extra = {k: v for k, v in self._request.extra.items() if k not in flagged}
        self._request = replace(self._request, extra=extra)
        return [f for f in findings if (f.message_index, f.field) not in self._labels]

    async def _judge_as_redacted(
        self, findings: list[Finding], redactors: dict[str, RequestedDetector]
    ) -> list[Finding]:
        """The findings of every input detector in each piece of the prompt that the
        request's own redacting detectors change, as the engine will read it (DESIGN 4.6a).
        Their replacements are the request's text (its `redact_with`, or an entity its own
        patterns name), never judged with the prompt: a request that added a detector
        flagging `Sure` with `redact_with` = an injection had the engine read the injection
        past the enforced input guardrails. Judged in place, with the text around them, so a
        replacement cannot complete what the text before it begins (`Ig` + `nore all ...`).
        A piece only the enforced redactors change gets the operator's replacements: not
        judged again."""
        own = {
            (f.message_index, f.field)
            for f in findings
            if f.detector_id in redactors
            and not redactors[f.detector_id].enforced
            and not f.unjudged
        }
        if not own:
            return []
        if isinstance(self._inputs, str):
            texts = [(None, redact_text(self._inputs, findings, redactors)[0])]
        else:
            by_piece: dict[tuple[int | None, str | None], list[Finding]] = {}
            for f in findings:
                by_piece.setdefault((f.message_index, f.field), []).append(f)
            texts = [
                (p.message_index, _redacted_piece(p, by_piece[key], redactors))
                for p in self._inputs
                if p.target is not None and (key := (p.message_index, p.field)) in own
            ]
        pieces = [InputPiece(text, message_index=i, field=AS_REDACTED) for i, text in texts]
        self._request_fields |= frozenset((p.message_index, AS_REDACTED) for p in pieces)
        found = await judge_pieces(
            pieces, self._input_detectors, self._chunkers, self._input_verdicts
        )
        # (an unjudged warning on it is reported on no text the client sent)
        return [f for f in found if not f.unjudged]

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
            # each piece's findings, grouped once: a filter of all findings per piece cost
            # their product (20,000 one-address messages: 400 million comparisons on the loop)
            by_piece: dict[tuple[int | None, str | None], list[Finding]] = {}
            for f in findings:
                by_piece.setdefault((f.message_index, f.field), []).append(f)
            for piece in self._inputs:
                if piece.target is None:
                    continue
                mine = by_piece.get((piece.message_index, piece.field))
                if mine:
                    text = _redacted_piece(piece, mine, redactors)
                    message = messages[piece.target]
                    if piece.field == NAME_FIELD:  # the speaker's name, rendered by the template
                        messages[piece.target] = replace(message, name=text)
                    elif piece.tool_call is None:
                        messages[piece.target] = replace(message, content=text)
                    else:  # a tool call's arguments: the redaction stays inside the call
                        calls = list(message.tool_calls or ())
                        call = calls[piece.tool_call]
                        calls[piece.tool_call] = {
                            **call,
                            "function": {**call["function"], "arguments": text},
                        }
                        messages[piece.target] = replace(message, tool_calls=tuple(calls))
            last_user = max(i for i, m in enumerate(messages) if m.role == "user")
            self._request = replace(r, prompt=messages[last_user].content, messages=tuple(messages))
        # (an unjudged warning is reported as it is: nothing was replaced)
        self._input_findings = [
            f
            if f.unjudged
            else redacted_finding(
                f, redactors[f.detector_id].replacement(f.detection), f.start, f.end
            )
            for f in findings
        ]

    async def _read_engine(self, stream: MigratingStream, stage: StreamJudge) -> None:
        """Each read of the engine goes to the detection stage, and what it released at once
        to the inbox as one message. Before each read the reader waits while the consumer is
        behind (a client that stops reading) or the detectors are (MAX_UNJUDGED_CHARS)."""
        inbox, limit, arrivals = self._inbox, self._max_batch, self._arrivals
        pacer = ReadPacer(
            asyncio.get_running_loop().time,
            tokens=self._read_coalesce_tokens,
            active=self._read_coalesce_when,
        )
        generated = 0
        feed, monotonic = stage.feed_deltas, time.monotonic
        calls = ToolCallAssembler()
        while True:
            if not inbox.has_space():
                pacer.held_back()
                await inbox.wait_space()
            try:
                batch = await stream.next_batch(limit)
            except StopAsyncIteration:
                break
            deltas = [c.text for c in batch]
            for c in batch:
                if c.tool_calls:
                    if not self._offers_tools:
                        raise GenerationError(
                            "the model called a tool, but the request offered it none"
                        )
                    calls.feed(c.tool_calls)
            chars = sum(map(len, deltas)) if len(deltas) > 1 else len(deltas[0])
            self._engine_delivered = True
            if chars:
                generated += chars
                arrivals.append((generated, monotonic()))
            frames = feed(deltas, batch[-1].finish_reason is not None)
            if frames:
                inbox.put_batch(frames, len(batch))
            delay = pacer.after_read(len(batch))
            if delay:
                await asyncio.sleep(delay)
        whole = calls.finish()
        offered = offered_names(self._request.extra.get("tools")) if whole else frozenset()
        if any(c.name not in offered for c in whole):
            # its name is text the model wrote that no guardrail judged (an offered name is
            # the client's own, judged as input): the call is never sent
            raise GenerationError("the model called a tool the request did not offer")
        judged = (
            await judge_tool_calls(whole, self._tool_call_detectors, self._chunkers)
            if whole
            else []
        )
        inbox.put(_EngineEnded(judged))

    async def _stop(self) -> None:
        await self._stop_tasks()
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

    async def _input_refused(self, findings: list[Finding]) -> list[Event]:
        self._observer.on_findings(findings)
        r = self._request
        # counted where the refused input does not leave this deployment (an `openai` server
        # never receives it, not even to count it)
        count = await (
            self._backend.count_privately(r.prompt, r.chat)
            if r.messages is None
            else self._backend.count_privately(r.prompt, r.chat, r.messages)
        )
        self._refused_input_tokens = count
        ids = ", ".join(f"`{i}`" for i in sorted({f.detector_id for f in findings}))
        # a request field's finding (a stop sequence, a tool definition) is not listed: its
        # span is relative to no text the surfaces report input spans against (the prompt, a
        # message)
        shown = [f for f in findings if not self._in_request_field(f)]
        what = "the input" if shown else _request_field_name(findings[0])
        refusal = Refusal(
            direction="input",
            message=f"The request was refused: detector {ids} flagged {what}.",
            detections=shown,
            input_token_count=count,
            seed=self._seed,
        )
        self._frames_sent += 1
        return [refusal, self._terminal("incomplete", "content_filter")]

    def _in_request_field(self, f: Finding) -> bool:
        return (f.message_index, f.field) in self._request_fields

    def _release_calls(self, judged: list[JudgedCall], out: list[Release | Event]) -> None:
        """The judged tool calls of the ended stream, none of them blocked, as events."""
        for j in judged:
            if j.call.detections:
                self._observer.on_findings(j.call.detections)
            self._frames_sent += 1
            out.append(j.call)

    def _output_refusal(self, detections: list[Finding]) -> Refusal:
        self._observer.on_findings(detections)
        ids = ", ".join(f"`{i}`" for i in sorted({d.detector_id for d in detections}))
        what = (
            "a tool call"
            if all(d.tool_call_index is not None for d in detections)
            else "the generated text"
        )
        # the flagged text itself never leaves the service (DESIGN 4.6): the detections keep
        # their spans and labels, not the words (nor evidence that could quote them)
        withheld = [replace(d, text="", evidence=None, metadata=None) for d in detections]
        return Refusal(
            direction="output",
            message=f"The response was withheld: detector {ids} flagged {what}.",
            detections=sort_findings(withheld),
            input_token_count=self._input_token_count(),
            seed=self._seed,
        )

    def _let_out(self, releases: list[Release], out: list[Release | Event]) -> bool:
        """The stage's releases, counted, into `out`; with stop sequences matched here, cut at
        the first one. True once a stop sequence ended the text."""
        stops = self._released_stops
        if stops is None:
            out.extend(map(self._staged, releases))
            return False
        sent = self._sent_text
        for release in releases:
            cut = stops.take(release)
            if cut is not None:
                if stops.stopped and sent is not None:  # judged again, on the sent text
                    ids = {d.detector_id for d in self._doc_annotators}
                    cut.detections = [d for d in cut.detections if d.detector_id not in ids]
                    self._cut = cut
                out.append(self._staged(cut))
                if sent is not None:
                    sent.append(cut.text)
            if stops.stopped:
                return True
        return False

    async def _annotate_cut(self) -> None:
        """After a stop sequence ended the text here: the annotating whole-document detectors'
        detections on the text the client received, on the final frame (as after a backend's
        stop, they judge the answer that ends before it; never text past the cut)."""
        cut, sent = self._cut, self._sent_text
        if cut is None or sent is None:
            return
        found = await judge_text("".join(sent), self._doc_annotators, self._chunkers)
        if found:
            self._observer.on_findings(found)
            cut.detections = sort_findings(cut.detections + found)

    def _staged(self, release: Release) -> Release:
        """What the detection stage released, counted at once: a terminal decided in the same
        wake-up reports it (`processed_index`, `failed` rather than `error`)."""
        if release.detections:
            self._observer.on_findings(release.detections)
        self._released = release.end
        self._frames_sent += 1
        return release

    def _framed(self, out: list[Release | Event]) -> list[Event]:
        """One wake-up's events, each release made its Frame, complete: the stream's counters,
        and `more` where another event follows at once (writers send the burst in one write)."""
        if self._input_findings is not None:
            self._say_redacted_input(out)
        last = len(out) - 1
        return [
            self._frame(event, i < last) if type(event) is Release else event  # type: ignore[arg-type]
            for i, event in enumerate(out)
        ]

    def _say_redacted_input(self, out: list[Release | Event]) -> None:
        """The redacted input's findings ride on the first frame; where a refusal, a tool call
        or a terminal comes before any frame (the answer's first sentence blocked), an empty
        frame carries them first: without it no surface said the input was redacted, and the
        Responses object echoed the raw `instructions`. An error terminal needs none (no
        response exists to echo anything)."""
        for i, event in enumerate(out):
            if type(event) is Release:
                return
            if isinstance(event, KeepAlive):
                continue
            if isinstance(event, Terminal) and event.error is not None:
                return
            out.insert(i, Release(self._released, self._released, "", []))
            return

    def _frame(self, release: Release, more: bool) -> Frame:
        stream = self._stream
        assert stream is not None
        final = release.final
        input_detections, self._input_findings = self._input_findings, None  # the first frame's
        if input_detections:  # returned to the client: counted like every other detection
            self._observer.on_findings(input_detections)
        # positional, in Frame's field order: a frame per token without detectors, and keyword
        # arguments cost twice as much (0.8 us more a frame, measured)
        frame = Frame(
            release.start,
            release.end,
            release.text,
            release.detections,
            final,
            (self._finish_reason or stream.finish_reason) if final else None,  # finish_reason
            stream.generated_token_count if final else None,  # generated_token_count
            stream.input_token_count or 0,  # input_token_count (a chunk's: 0 until known)
            self._seed,
            self._judged,
            input_detections,
            more,
            release.source_end,
        )
        hold_s = self._hold_time(release.end if release.source_end is None else release.source_end)
        self._observer.on_frame(frame, hold_s)
        if self._span is not None and self._judged:  # judged frames: per chunk
            tracing.frame_event(self._span, frame, hold_s)
        return frame

    def _hold_time(self, end: int) -> float:
        """Seconds since the last character of a frame ending at `end` was generated."""
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] < end:
            arrivals.popleft()
        if not arrivals:
            return 0.0
        return time.monotonic() - arrivals[0][1]

    def _input_token_count(self) -> int | None:
        """The stream's count; 0 while it is unknown once the engine delivered something (as
        every chunk says), None before."""
        stream = self._stream
        if stream is None:
            return self._refused_input_tokens
        count = stream.input_token_count
        return 0 if count is None and self._engine_delivered else count

    def _terminal(
        self,
        kind: str,
        reason: IncompleteReason | None = None,
        error: Failure | None = None,
    ) -> Terminal:
        stream = self._stream
        return Terminal(
            kind=kind,  # type: ignore[arg-type]
            finish_reason=self._finish_reason_now(),
            generated_token_count=stream.generated_token_count if stream is not None else 0,
            input_token_count=self._input_token_count(),
            processed_index=self._released,
            migrations=stream.migrations if stream is not None else 0,
            reason=reason,
            error=error,
        )

    def _finish_reason_now(self) -> str | None:
        """The pipeline's own reason (a block, the time limit, a failure) or the model's."""
        if self._finish_reason is not None or self._stream is None:
            return self._finish_reason
        return self._stream.finish_reason

    def _finish_terminal(self) -> Terminal:
        kind, reason = TERMINAL_BY_FINISH.get(self._finish_reason_now(), ("completed", None))
        return self._terminal(kind, reason)

    def _failure(self, exc: BaseException) -> Terminal:
        failure = describe(exc)
        if is_unexpected(failure):
            log.error("stream %s failed", self._request.request_id, exc_info=exc)
        if isinstance(exc, TimeoutError):  # a deadline inside a client: the time budget
            self._finish_reason = "TIME_LIMIT"
            return self._terminal("incomplete", "time_limit")
        self._finish_reason = "ERROR"
        return self._terminal("failed" if self._frames_sent else "error", error=failure)

    def _shutdown_terminal(self) -> Terminal:
        self._finish_reason = "CANCELLED"
        return self._terminal("failed" if self._frames_sent else "error", error=SHUTDOWN)

    def _finish(self, terminal: Terminal) -> Terminal:
        self.terminal = terminal
        self._observer.on_terminal(terminal)
        if self._span is not None:
            tracing.record_terminal(self._span, terminal, self._frames_sent)
        return terminal


def _request_field_name(f: Finding) -> str:
    """A request field's name in a refusal: `a stop sequence`, or the top-level field."""
    if f.field == STOP_SEQUENCE_FIELD:
        return "a stop sequence"
    if f.field == AS_REDACTED:
        return "the input as the request's own detectors redact it"
    return f"`{(f.field or '').split('.', 1)[0]}`"


def _request_field_redacted(findings: list[Finding]) -> ApiError:
    """422 for a request field a redacting input guardrail flagged: a stop sequence or a
    forwarded field such as a tool definition (DESIGN 4.6a: the input redaction must cover
    them, or they are refused; a replaced one would change what the request asks for)."""
    first = min(
        findings,
        key=lambda f: (f.field != STOP_SEQUENCE_FIELD, f.message_index or 0, f.detector_id),
    )
    if first.field == STOP_SEQUENCE_FIELD:
        where, kind = f"stop sequence {first.message_index}", "stop sequence"
    elif first.message_index is None:
        where, kind = f"{first.field}", "request field"
    else:  # a tool call's name or id in the conversation
        where, kind = f"message {first.message_index}'s {first.field}", "call name or id"
    return ApiError(
        422,
        ErrorType.INVALID_REQUEST,
        f"{where} holds text that input detector `{first.detector_id}` redacts (a redacted "
        f"{kind} would change what the request asks for)",
    )


def _redaction_made(findings: list[Finding]) -> ApiError:
    """422 for a request whose own redaction puts into the prompt what a redacting input
    guardrail redacts (an e-mail in its `redact_with`): redacting a replacement again is no
    answer, and the request is the client's to fix."""
    ids = ", ".join(f"`{i}`" for i in sorted({f.detector_id for f in findings}))
    return ApiError(
        422,
        ErrorType.INVALID_REQUEST,
        f"the input as the request's own detectors redact it holds text that input detector "
        f"{ids} redacts (a replacement must not make what a guardrail replaces)",
    )


async def _judge_ready(
    conversation: tuple[tuple[str, str], ...],
) -> tuple[tuple[str, str], ...]:
    """`judged_messages(conversation)`, in a bulk thread when it is long."""
    if sum(len(content) for _, content in conversation) > BULK_CHARS:
        return await off_loop(lambda: judged_messages(conversation))
    return judged_messages(conversation)


def continued_tail(request: GenerationRequest) -> str:
    """The end of the text the answer continues, as the engine reads it (after input redaction):
    a raw prompt (no chat template), or a final assistant message the server is asked to
    continue (`continue_final_message`, where an operator forwards it). An entity it starts and
    the answer finishes is one entity (DESIGN 4.6a): `... is john.smith@` + `example.com`. As
    much of it as a seam window takes (`seam_bounds`: SEAM_CHARS, and the whitespace-free run
    there), so any entity the windows see whole is seen whole across this seam too. (An `openai`
    chat backend gets a raw prompt as a user message, a new turn: its answer is judged after the
    prompt all the same, which can only add findings that straddle the two.)"""
    messages = request.messages
    if messages is None:
        text = "" if request.chat else request.prompt
    elif request.extra.get("continue_final_message") is True and messages[-1].role == "assistant":
        text = messages[-1].content
    else:  # a new turn: the answer starts its own text
        return ""
    start, _, _ = seam_bounds(text, 0, len(text), len(text))
    return text[start:]


def _conversation(request: GenerationRequest) -> tuple[tuple[str, str], ...]:
    """What output judges read before the answer: the conversation the engine answers (after
    input redaction), or an FMS prompt as the user's one message."""
    if request.messages is not None:
        return tuple((m.role, m.content) for m in request.messages)
    return (("user", request.prompt),)


def _redacted_piece(
    piece: InputPiece, findings: list[Finding], redactors: dict[str, RequestedDetector]
) -> str:
    """A piece of the prompt as the engine will read it: a tool call's arguments redacted
    inside their JSON values (they stay JSON), any other text in place."""
    if piece.arguments:
        return redact_arguments(piece.text, findings, redactors)
    return redact_text(piece.text, findings, redactors)[0]
