"""Output processing of the engine's worker: each row takes its chosen token (accept), the text it
releases (detokenize, stop sequences), whether it is done (EOS, budget, context, deadline), and
its stream events go out to their event loops (emit) (vLLM's `OutputProcessor`).

One of the three parts of the worker thread (scheduler.py's `Engine` drives them). It runs on
the host while (with overlapped steps) the device computes the next step, so what it costs per
row per step is what the host adds to every step: the per-row loop is written for that
(`accept_step`).

Delivery: results go to each request's sink (or queue) through a per-loop mailbox (`_Mailbox`):
one list and one `loop.call_soon_threadsafe` per step, none while the loop has not yet taken the
previous steps' results (it then takes them all at once); the loop fans them out. A `StepSink`
marked `direct` (the engine core's) is instead handed each step on this thread: no mailbox.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter_ns

import torch

from .detokenizer import Detokenizer
from .jobs import (
    EngineDelta,
    EngineStats,
    FinishReason,
    Job,
    StepSink,
    StreamError,
    WorkerTimes,
)
from .scheduling import Row

log = logging.getLogger("guardstream.engine")

Event = tuple[Job, EngineDelta | StreamError]


class OutputProcessor:
    """Accepts tokens into rows and emits their stream events (worker thread only, but for the
    mailboxes, which the event loops drain)."""

    def __init__(
        self,
        detokenizer: Callable[[], Detokenizer],
        eos: Iterable[int],
        max_context: int,
        stats: EngineStats,
        retire: Callable[[Job], None],
    ) -> None:
        """`retire` is called once per request when its last event is emitted (the engine's
        bookkeeping of active requests); `max_context` may be lowered later (a static cache
        shorter than the model's context)."""
        self._detokenizer = detokenizer
        self._eos = frozenset(eos)
        self.max_context = max_context
        self._stats = stats
        self._retire = retire
        self._outbox: list[Event] = []
        # per event loop: events posted, not yet delivered (weak: test loops come and go)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
            weakref.WeakKeyDictionary()
        )

    def new_row(self, job: Job) -> Row:
        return Row(job, self._detokenizer, self.max_context)

    # ----- accepting tokens ------------------------------------------------------------------

    def replay(self, row: Row) -> FinishReason | None:
        """Feed a resumed request's delivered tokens through the same detokenizer and stop state
        as before; say whether it is already done (then nothing is left to generate)."""
        job = row.job
        for token in job.resume_ids:
            finish = self.accept(row, token, live=False)
            if finish is not None:
                return finish
        if len(row.generated) >= job.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if len(job.prompt_ids) + len(row.generated) >= self.max_context:
            return FinishReason.MAX_TOKENS
        return None

    def accept(self, row: Row, token: int, live: bool) -> FinishReason | None:
        """Append one token to a row (generated or replayed) and say whether the row is done."""
        job = row.job
        row.generated.append(token)
        if token not in row.seen:
            row.seen.add(token)
            if row.seen_tensor is not None:
                row.seen_new.append(token)
        if live:
            self._stats.tokens_generated += 1
        row.gate.push(row.detok.push(token))
        if row.gate.stop_at is not None:
            return FinishReason.STOP_SEQUENCE
        if token in self._eos:
            return FinishReason.EOS_TOKEN
        if len(row.generated) >= job.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if len(job.prompt_ids) + len(row.generated) >= self.max_context:
            return FinishReason.MAX_TOKENS
        if live and job.deadline is not None and time.monotonic() >= job.deadline:
            return FinishReason.TIME_LIMIT
        return None

    def start_rows(self, rows: Sequence[Row], tokens: Sequence[int]) -> list[int]:
        """Prefilled rows take their first tokens; return the indices of those not finished by
        it (they join the running batch)."""
        survivors: list[int] = []
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            finish = self.accept(row, token, live=True)
            if finish is None:
                row.next_input = token
                self.emit(row.job, EngineDelta([token], row.gate.release(), len(row.generated)))
                row.gated = not row.gate.transparent  # resumed text all delivered, say
                survivors.append(i)
            else:
                self.finish(row, [token], finish)
        return survivors

    def accept_step(self, rows: Sequence[Row], tokens: Sequence[int]) -> bool:
        """Each row of a decode step takes its token; say whether any row finished (`done`).

        A row already `done` (it finished at the previous step, or was cancelled, while this
        step was already running: overlapped steps) gets nothing: its token is discarded.

        `accept` and `emit` inlined, with what is per step hoisted out of the per-row loop
        (the clock, the counters, the limits): this runs for every row of every step. Seen ids
        are kept up to date only for rows with a repetition penalty, the only readers once a row
        has joined (the device sampler keeps its own); the stop gate runs only for rows with
        stop sequences or text held back (`Row.gated`: for the others its push and release
        would hand back the delta as is); budget and context are one comparison (`Row.limit`)."""
        finished = False
        eos = self._eos
        outbox = self._outbox
        now = time.monotonic()
        accepted = 0
        for row, token in zip(rows, tokens, strict=True):
            if row.done:
                continue
            accepted += 1
            row.kv_len += 1
            generated = row.generated
            generated.append(token)
            if row.penalised and token not in row.seen:
                row.seen.add(token)
                if row.seen_tensor is not None:
                    row.seen_new.append(token)
            text = row.detok.push(token)
            count = len(generated)
            job = row.job
            gated = row.gated
            if gated:
                gate = row.gate
                gate.push(text)
                if gate.stop_at is not None:
                    self.finish(row, [token], FinishReason.STOP_SEQUENCE)
                    finished = True
                    continue
            if token in eos:
                finish = FinishReason.EOS_TOKEN
            elif count >= row.limit:
                finish = FinishReason.MAX_TOKENS
            elif job.deadline is not None and now >= job.deadline:
                finish = FinishReason.TIME_LIMIT
            else:
                row.next_input = token
                if gated:
                    text = gate.release()
                    row.gated = not gate.transparent
                outbox.append((job, EngineDelta([token], text, count)))
                continue
            if not gated:  # the gate is transparent: pushed there, the delta leaves as is
                row.gate.push(text)
            self.finish(row, [token], finish)
            finished = True
        self._stats.tokens_generated += accepted
        return finished

    def finish(self, row: Row, token_ids: list[int], reason: FinishReason) -> None:
        """The row's last item (held-back text flushed, unless a stop sequence ended it)."""
        if reason is not FinishReason.STOP_SEQUENCE:
            row.gate.push(row.detok.flush())
            if row.gate.stop_at is not None:  # the held-back tail completed a stop sequence
                reason = FinishReason.STOP_SEQUENCE
            row.gate.finish()
        row.done = True
        self.emit(row.job, EngineDelta(token_ids, row.gate.release(), len(row.generated), reason))
        self._retire(row.job)

    def fail(self, rows: Iterable[Row], exc: BaseException) -> None:
        """An error item for each row: `generation_unavailable` (another replica may succeed)
        when the device ran out of memory, else `generation_error`."""
        if is_oom(exc):
            error = StreamError(503, "generation_unavailable", f"out of memory: {exc}"[:500])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            log.exception("forward pass failed", exc_info=exc)
            error = StreamError(500, "generation_error", f"{type(exc).__name__}: {exc}"[:500])
        for row in rows:
            row.done = True
            self.emit(row.job, error)
            self._retire(row.job)

    # ----- emitting ----------------------------------------------------------------------------

    def emit(self, job: Job, event: EngineDelta | StreamError) -> None:
        self._outbox.append((job, event))

    def flush(self) -> None:
        """Hand the events emitted since the last flush to their loops: one wake-up per loop that
        is not already due to run a delivery (a loop behind the worker gets several steps in one
        go). The worker's only per-step delivery work: the events go as one list per loop, and
        the loop fans them out to the streams (`_Mailbox.deliver`)."""
        outbox = self._outbox
        if not outbox:
            return
        self._outbox = []
        sink = _step_sink(outbox)
        if sink is not None and getattr(sink, "direct", False):
            # the engine core's (engine_core.CoreSession): it sends the step itself, from this
            # thread, so its loop is neither woken nor run per step
            try:
                sink.put_step(outbox)
            except Exception:  # a sink must not raise; the worker goes on regardless
                log.exception("step sink failed")
            return
        loop = outbox[0][0].loop
        if all(job.loop is loop for job, _ in outbox):  # one loop (the server's): no grouping
            self._post(loop, outbox)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[Event]] = {}
        for job, event in outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, events in by_loop.items():
            self._post(loop, events)

    def _post(self, loop: asyncio.AbstractEventLoop, events: list[Event]) -> None:
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = _Mailbox(self._stats.worker)
        if mailbox.post(events) and not loop.is_closed():
            return  # a wake-up is already on its way
        try:
            loop.call_soon_threadsafe(mailbox.deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            for job, _ in mailbox.take():
                job.cancelled = True


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class _Mailbox:
    """Events from the worker to one event loop. The worker posts each step's events; the loop
    delivers everything posted since its last delivery. Only a post into an empty mailbox needs
    a wake-up (`call_soon_threadsafe`: a syscall and a GIL hand-off per step, which the worker
    pays): while the loop is behind, later steps just join the pending delivery."""

    __slots__ = ("_events", "_lock", "_posts", "_times")

    def __init__(self, times: WorkerTimes) -> None:
        self._times = times  # the loop's side of it: deliveries, the posts they carry, their time
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._posts = 0  # posts since the last delivery

    def post(self, events: list[Event]) -> bool:
        """Add events (worker); True when a delivery is already pending (no wake-up needed)."""
        with self._lock:
            self._posts += 1
            if not self._events:
                self._events = events  # the worker hands the list over: no copy
                return False
            self._events.extend(events)
            return True

    def take(self) -> list[Event]:
        return self._take()[0]

    def _take(self) -> tuple[list[Event], int]:
        with self._lock:
            events, self._events = self._events, []
            posts, self._posts = self._posts, 0
            return events, posts

    def deliver(self) -> None:
        """On the loop: each job's posted events, in order, in one call to its sink (a
        `StreamSink` writes them to its socket at once), or into its `asyncio.Queue`.

        One post (the loop kept up: one step's events, one per row) goes out as it came, without
        grouping; a job with two events in it (a step's token and an error, say) then gets two
        calls, in order. Several posts (the loop fell behind) are grouped by job: one call, so
        one write, per stream for all its steps."""
        start = perf_counter_ns()
        posted, posts = self._take()
        try:
            self._deliver(posted, posts)
        finally:
            times = self._times
            times.deliveries += 1
            times.delivered_posts += posts
            times.delivery_ns += perf_counter_ns() - start

    @staticmethod
    def _deliver(posted: list[Event], posts: int) -> None:
        step = _step_sink(posted)
        if step is not None:  # the engine core's: the whole delivery in one call
            try:
                step.put_step(posted)
            except Exception:  # a sink must not raise
                log.exception("step sink failed")
            return
        if posts <= 1:
            for job, event in posted:
                _hand(job, [event])
            return
        by_job: dict[Job, list[EngineDelta | StreamError]] = {}
        for job, event in posted:
            events = by_job.get(job)
            if events is None:
                by_job[job] = [event]
            else:
                events.append(event)
        for job, events in by_job.items():
            _hand(job, events)


def _step_sink(posted: list[Event]) -> StepSink | None:
    """The `StepSink` every job of a delivery shares, if they do."""
    if not posted:
        return None
    sink = posted[0][0].queue
    if not hasattr(sink, "put_step"):
        return None
    for job, _ in posted:
        if job.queue is not sink:
            return None
    return sink  # type: ignore[return-value]


def _hand(job: Job, events: list[EngineDelta | StreamError]) -> None:
    """A job's events to its sink (or queue), on its loop."""
    queue = job.queue
    if isinstance(queue, asyncio.Queue):
        for event in events:
            queue.put_nowait(event)
        return
    try:
        queue.put_many(events)
    except Exception:  # a sink must not raise; if one does, the others still get theirs
        log.exception("stream sink failed")
        job.cancelled = True
