"""Continuous batching: one worker thread runs every forward pass of the engine.

Why not transformers' own continuous-batching manager: its sampling draws from one global torch
generator (no per-request, per-position seeds, so no exact resume of seeded streams), and its
paged-attention path targets GPUs. This loop is small and exact instead.

The worker thread owns three parts, as vLLM's engine core owns its `Scheduler`, `GPUModelRunner`
and `OutputProcessor`, and drives them one iteration at a time (`Engine._run`):
- scheduling.py, the policy: who joins (up to `max_batch_size` rows and a prefill token budget,
  grouped by length for padded prefill), which long prompt gets the next prefill chunk, who
  leaves;
- model_runner.py, the model: prefill and prefill chunks, decode steps (eager over the slot cache,
  or the static step replayed from CUDA graphs), and the caches joins and leaves copy rows into;
- output_processor.py, the tokens: accept, detokenize, stop checks, and the stream events, handed
  to the requests' event loops once per iteration.
Everything they hold is the worker thread's alone; the event loops talk to the engine only
through `submit`/`cancel`/`hold` (under `_cond`) and their mailboxes.

Each iteration: admit queued requests (prefill, first tokens, join; again for those that arrived
during that prefill, up to ADMISSION_ROUNDS admissions: a burst of new streams reaches the engine
over tens of milliseconds, and a decode step between two of its groups delays the later group's
first tokens by that step), run one chunk of a long prompt, then one decode step, then flush the
iteration's events.

Overlapped steps (`overlap`, the default; what vLLM calls async scheduling and SGLang the overlap
scheduler). A decode step is launched before the host has processed the previous one: the static
step keeps its chosen tokens on the device as the next step's inputs and copies them to the host
without blocking (model_runner.py), so the host accepts step N's tokens (detokenize, stop checks,
emit) while the device runs step N+1. A row that finished at step N was part of step N+1: that
extra token is discarded (the row is `done`), never emitted, and the row leaves the cache right
after step N's tokens are accepted, before step N+2 is launched and before a joiner can take its
slot. Joins, leaves and prefill chunks happen between steps, as without overlap; tokens, text and
finish reasons are exactly those of the synchronous engine (tests/test_engine_overlap.py). Eager
steps (a CPU's default, models served one at a time) select on the host and stay synchronous.

Exactness: a row's arithmetic differs from running alone only by masked (zero-weight) padding
columns and batch-size-dependent kernel choices, i.e. in the last bits. `tiny-random` runs in
float64 with peaked logits, so its greedy and seeded outputs are identical alone, batched, and
resumed; the tests pin that.

Limits, stated plainly: memory is bounded by `max_batch_size` rows times the longest running row
(a rectangle, not pages), not by a KV-cache byte budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator
from time import perf_counter_ns

import torch

from .decode_graphs import MAX_ROWS
from .detokenizer import make_detokenizer
from .jobs import EngineStats, EngineUnavailable, Job, StreamError
from .judge_sessions import JudgeSessions
from .model_runner import ModelRunner, Step
from .models import LoadedModel
from .output_processor import OutputProcessor
from .scheduling import (
    CPU_MAX_BATCH_SIZE,
    PREFILL_CHUNK_TOKENS,
    PREFILL_PADDING,
    Row,
    Scheduler,
    equal_length_groups,
    prefill_groups,
)

__all__ = [
    "CPU_MAX_BATCH_SIZE",
    "GPU_MEMORY_FRACTION",
    "OVERLAP",
    "PREFILL_CHUNK_TOKENS",
    "PREFILL_PADDING",
    "Engine",
    "prefill_groups",
]

log = logging.getLogger("guardstream.engine")

#: Share of the GPU memory free after loading the model that the static KV cache may take.
GPU_MEMORY_FRACTION = 0.8
#: Overlapped decode steps by default (where the step keeps its tokens on the device).
OVERLAP = True
#: Admissions per iteration at most: requests that arrived while the previous admission's
#: prefill ran are admitted before the decode step, up to this many prefill rounds (a burst of
#: new streams reaches the engine over tens of milliseconds; each decode step between its
#: groups' prefills added a step to their time to first token). Bounded: the running rows wait at
#: most this many admissions (each within `prefill_token_budget`) for their next token.
ADMISSION_ROUNDS = 4


class Engine:
    """Owns the model and the worker thread; the server submits `Job`s and reads their queues."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_batch_size: int | None = None,
        prefill_token_budget: int = 4096,
        threads: int | None = None,
        prefill_chunk_tokens: int | None = None,
        *,
        static_decode: bool | None = None,
        static_buckets: bool | None = None,
        static_capacity: int | None = None,
        cuda_graphs: bool | None = None,
        gpu_memory_fraction: float = GPU_MEMORY_FRACTION,
        overlap: bool | None = None,
        prefill_buckets: bool | None = None,
        warm_prefill: bool | None = None,
        compile_step: bool = False,
        static_prefill: bool | None = None,
        static_judge: bool | None = None,
        judge_pool_at_start: bool | None = None,
    ) -> None:
        """`prefill_chunk_tokens`: longer contexts are prefilled in chunks of this many tokens
        (None: PREFILL_CHUNK_TOKENS of the device). `max_batch_size` None: MAX_ROWS on CUDA
        (fewer when free GPU memory holds fewer), CPU_MAX_BATCH_SIZE on a CPU.

        The static decode step (decode_graphs.py; default: on for CUDA): `static_buckets` pads
        rows and attention width up to buckets (default: on for CUDA, where each bucket is a
        graph), `static_capacity` columns per row on a CPU (default: the context, at most
        CPU_CAPACITY), `cuda_graphs` captures and replays the steps (default: on for CUDA;
        never on a CPU), `gpu_memory_fraction` of free GPU memory at start sizes the cache.
        `overlap` (default OVERLAP): launch each static step before the previous one's tokens
        are processed. `prefill_buckets` pads prefills up to (rows, width) buckets (default: on
        for CUDA) and `warm_prefill` runs each bucket once at start (default: with buckets, on
        CUDA; model_runner.py). `compile_step`: the static decode step through torch.compile
        (Inductor) before graphs are captured; it implies the static step, with buckets.
        `static_prefill` (default: with the static step): whole prefills write into the static
        cache's slots through a static pass, replayed from CUDA graphs on CUDA
        (prefill_graphs.py); else they run eagerly into a DynamicCache copied at the join.
        `static_judge`: judge passes over the static pool, replayed from CUDA graphs on CUDA
        (judge_graphs.py; default: on for CUDA, packed passes on a CPU). `judge_pool_at_start`
        builds that pool at start, before the decode cache takes its share of the memory
        (default: when `static_judge` is True); else the first session's open builds it from
        the memory left then, so a replica that only generates holds no pool."""
        self.threads = threads  # CPU intra-op threads to set at start (process-wide); None: leave
        on_cuda = loaded.device.type == "cuda"
        if max_batch_size is None:
            max_batch_size = MAX_ROWS if on_cuda else CPU_MAX_BATCH_SIZE
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], not {gpu_memory_fraction}")
        if prefill_chunk_tokens is None:
            prefill_chunk_tokens = PREFILL_CHUNK_TOKENS.get(loaded.device.type, 2048)
        self.overlap = OVERLAP if overlap is None else overlap
        if compile_step:  # a compiled step needs the static buffers and few shapes
            if static_decode is False:
                raise ValueError("compile_step needs the static decode step")
            static_decode = True
            static_buckets = True if static_buckets is None else static_buckets
        buckets = on_cuda if prefill_buckets is None else prefill_buckets
        self.stats = EngineStats()
        self._sched = Scheduler(max_batch_size, prefill_token_budget, prefill_chunk_tokens)
        self._runner = ModelRunner(
            loaded,
            self.stats,
            self._sched.max_batch_size,
            static_decode=on_cuda if static_decode is None else static_decode,
            static_buckets=on_cuda if static_buckets is None else static_buckets,
            static_capacity=static_capacity,
            cuda_graphs=on_cuda and (cuda_graphs is None or cuda_graphs),
            gpu_memory_fraction=gpu_memory_fraction,
            prefill_buckets=buckets,
            warm_prefill=buckets and on_cuda if warm_prefill is None else warm_prefill,
            prefill_budget=self._sched.prefill_token_budget,
            prefill_longest=self._sched.prefill_chunk_tokens,
            compile_step=compile_step,
            static_prefill=static_prefill,
        )
        self._output = OutputProcessor(
            make_detokenizer(loaded.tokenizer),
            loaded.eos_token_ids,
            loaded.max_context,
            self.stats,
            self._retire,
        )
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._active: set[Job] = set()
        self._stopping = False
        self._held = 0
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        self._ready = threading.Event()  # the worker finished its start-up (static buffers)
        self._pending: Step | None = None  # an overlapped step whose tokens are not yet accepted
        # judge sessions (judge_sessions.py): their appends run in the worker's iterations
        self.judges = JudgeSessions(loaded, wake=self._cond, static=static_judge)
        self.judge_pool_at_start = (
            static_judge is True if judge_pool_at_start is None else judge_pool_at_start
        )

    # ----- settings (the runner's; some are final only once the engine has started) ----------

    @property
    def loaded(self) -> LoadedModel:
        """The model as served: its context lowered to the static cache's capacity, if shorter."""
        return self._runner.loaded

    @property
    def model(self) -> torch.nn.Module:
        return self._runner.model

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def max_batch_size(self) -> int:
        return self._sched.max_batch_size

    @property
    def static_decode(self) -> bool:
        return self._runner.static_decode

    @property
    def static_capacity(self) -> int | None:
        return self._runner.static_capacity

    @static_capacity.setter
    def static_capacity(self, value: int | None) -> None:
        self._runner.static_capacity = value  # read at start

    @property
    def cuda_graphs(self) -> bool:
        return self._runner.cuda_graphs

    @property
    def prefill_chunk_tokens(self) -> int:
        return self._sched.prefill_chunk_tokens

    def prefill_info(self) -> dict[str, object]:
        """How whole prefills run (/health `prefill`, /metrics): model_runner.prefill_info."""
        return self._runner.prefill_info()

    def cache_info(self) -> dict[str, object]:
        """The running batch's KV cache for /health and /metrics (ModelRunner.cache_info)."""
        return self._runner.cache_info()

    # ----- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        if self.threads is not None and self.device.type == "cpu":
            torch.set_num_threads(self.threads)  # process-wide: one engine per process
        self._thread = threading.Thread(
            target=self._run, name="guardstream-engine-worker", daemon=True
        )
        self._thread.start()
        # Serve only once the static buffers exist (and the graphs are captured): the model's
        # context and the batch size may shrink to what the device's memory holds.
        self._ready.wait()
        if self._fatal is not None:
            raise RuntimeError("the engine failed to start") from self._fatal

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker; every unfinished request gets a `generation_unavailable` error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def active_requests(self) -> int:
        with self._cond:
            return len(self._active)

    @property
    def queued_requests(self) -> int:
        """Requests submitted and not yet admitted by the worker."""
        with self._cond:
            return len(self._inbox)

    @property
    def running_batch_size(self) -> int:
        return len(self._sched.rows)

    @property
    def prefilling_requests(self) -> int:
        """Requests whose long context is being prefilled chunk by chunk."""
        return len(self._sched.prefilling)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise EngineUnavailable("the engine is shutting down")
            self._active.add(job)
            self._inbox.append(job)
            self._cond.notify()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While held, the worker starts no new step: requests queue up and then join together.

        For tests and benchmarks that need a known batch composition, and for the engine core's
        flow control (engine_core.py: its API process fell behind)."""
        with self._cond:
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Abort a request; the worker drops it before its next forward pass."""
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    # ----- worker side -----------------------------------------------------------------------

    # ----- worker side -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                try:
                    self._start_up()
                except BaseException as exc:
                    self._fatal = exc
                    raise
                finally:
                    self._ready.set()
                while True:
                    if self._pending is not None and self._idle():
                        self._finish_pending()  # before waiting: its tokens are due now
                        self._output.flush()
                    waited = perf_counter_ns()
                    joiners = self._wait_for_work()
                    self.stats.worker.ns["idle"] += perf_counter_ns() - waited
                    if joiners is None:
                        break
                    self._iterate(joiners)
        except BaseException as exc:  # a bug: fail every request loudly rather than hang them
            log.exception("engine worker crashed")
            self._fatal = exc
            self._ready.set()
        finally:
            self._fail_everything(
                StreamError(503, "generation_unavailable", "the engine is shutting down")
            )

    def _start_up(self) -> None:
        """The judge sessions' pool (static judge passes, when asked for at start) and the
        runner's buffers (static step), and the limits they set for the other parts. The pool
        first: the decode cache's plan takes its share of the memory left."""
        if self.judge_pool_at_start:
            self.judges.set_up()
        self._runner.set_up()
        self._sched.max_batch_size = self._runner.max_batch_size
        self._output.max_context = self._runner.loaded.max_context

    def _iterate(self, joiners: list[Job]) -> None:
        """One iteration of the worker: leaves, joins, a prefill chunk, a decode step (or the
        step in flight finished), then the iteration's events out."""
        times = self.stats.worker.ns
        start = perf_counter_ns()
        self._drop_cancelled()
        rounds = 0
        while joiners and rounds < ADMISSION_ROUNDS:
            self._admit(joiners)
            rounds += 1
            joiners = self._arrived() if rounds < ADMISSION_ROUNDS else []
        if self._sched.prefilling:
            self._prefill_chunk()
        times["admit"] += perf_counter_ns() - start
        if self._sched.rows:
            self._decode_step(overlap=self.overlap)
        else:
            self._finish_pending()
        start = perf_counter_ns()
        self._output.flush()
        times["deliver"] += perf_counter_ns() - start
        if self.judges.has_work:  # every queued judge append, batched, between decode steps
            start = perf_counter_ns()
            self.judges.run_pending()
            times["judge"] += perf_counter_ns() - start

    def _idle(self) -> bool:
        """Whether `_wait_for_work` would wait (held, or nothing to do)."""
        with self._cond:
            return not self._stopping and (
                bool(self._held)
                or (not self._inbox and not self._sched.busy and not self.judges.has_work)
            )

    def _wait_for_work(self) -> list[Job] | None:
        with self._cond:
            while not self._stopping and (
                self._held
                or (not self._inbox and not self._sched.busy and not self.judges.has_work)
            ):
                self._cond.wait()
            if self._stopping:
                return None
            return self._sched.choose_joiners(self._inbox, self._runner.batchable)

    def _arrived(self) -> list[Job]:
        """The requests that may join now without waiting (arrived during an admission's
        prefill), none while held or stopping."""
        with self._cond:
            if self._stopping or self._held or not self._inbox:
                return []
            return self._sched.choose_joiners(self._inbox, self._runner.batchable)

    def _fail_everything(self, error: StreamError) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._inbox)
            self._inbox.clear()
        jobs = [row.job for row in self._sched.rows if not row.done]
        jobs += [row.job for row in self._sched.prefilling] + pending
        self._pending = None
        self._clear_batch()
        self._sched.prefilling.clear()
        self.judges.close_all(EngineUnavailable("the engine is shutting down"))
        for job in jobs:
            if not job.cancelled:
                self._output.emit(job, error)
            self._retire(job)
        self._output.flush()

    def _retire(self, job: Job) -> None:
        with self._cond:
            self._active.discard(job)

    def _flush_outbox(self) -> None:
        self._output.flush()

    @property
    def _rows(self) -> list[Row]:
        return self._sched.rows

    def _drop_cancelled(self) -> None:
        gone = self._sched.cancelled()
        if not gone:
            return
        for row in gone:
            row.done = True  # a token of a step in flight is discarded
            self.stats.requests_cancelled += 1
            self._retire(row.job)
        keep = self._sched.leaving()
        if keep is not None:
            self._keep_rows(keep)

    # ----- admission and prefill ---------------------------------------------------------------

    def _admit(self, joiners: list[Job]) -> None:
        runner, output = self._runner, self._output
        ready: list[Row] = []
        for job in joiners:
            if job.cancelled:
                self.stats.requests_cancelled += 1
                self._retire(job)
                continue
            self.stats.requests_started += 1
            row = output.new_row(job)
            finish = output.replay(row)  # resumed: the same detokenizer and stop state as before
            if finish is not None:
                output.finish(row, [], finish)
                continue
            if runner.batchable and runner.logits_to_keep and self._sched.needs_chunks(row):
                self._sched.prefilling.append(row)  # chunk by chunk, between decode steps
                continue
            ready.append(row)
        lengths = [len(row.job.prompt_ids) + len(row.generated) for row in ready]
        if runner.batchable and runner.logits_to_keep:
            # Right padding: under a causal mask a real token never attends to a pad, so a row's
            # arithmetic differs from running alone only by masked columns (the last bits, as
            # in a batched decode step).
            groups = prefill_groups(lengths)
        else:  # equal lengths only: no padding at all
            groups = equal_length_groups(lengths)
        for group in groups:
            rows = [ready[i] for i in group]
            try:
                cache, tokens = runner.prefill(rows, [lengths[i] for i in group])
            except Exception as exc:
                output.fail(rows, exc)
                continue
            self._start_rows(cache, rows, tokens, [lengths[i] for i in group])
            output.flush()  # first tokens leave now, not after the other joiners' prefill

    def _start_rows(
        self, cache: object, rows: list[Row], tokens: list[int], lengths: list[int]
    ) -> None:
        """Prefilled rows (row i of `cache`, `lengths[i]` tokens) take their first tokens; those
        not finished by it join the running batch."""
        survivors = self._output.start_rows(rows, tokens)
        if not survivors:
            return
        joining = [rows[i] for i in survivors]
        try:
            self._runner.join(
                cache,  # type: ignore[arg-type]
                joining,
                survivors,
                [lengths[i] for i in survivors],
                running=len(self._sched.rows),
            )
        except Exception as exc:  # e.g. out of memory growing the slot cache mid-way
            self._fail_batch(exc, also=joining)
            return
        self._sched.rows.extend(joining)

    def _prefill_chunk(self) -> None:
        """The next chunk of the oldest long context; after its last chunk the row gets its first
        token and joins the batch, as a whole prefill's rows do."""
        row, start, end = self._sched.next_chunk()
        try:
            tokens = self._runner.prefill_chunk(row, start, end)
        except Exception as exc:
            self._sched.drop_prefilling(row)
            self._output.fail([row], exc)
            return
        if tokens is None:
            return
        self._sched.drop_prefilling(row)
        cache, row.partial = row.partial, None
        self._start_rows(cache, [row], tokens, [row.kv_len])

    # ----- decoding --------------------------------------------------------------------------

    def _decode_step(self, overlap: bool = False) -> None:
        """One decode step of the running batch. With `overlap` and a step whose tokens stay on
        the device, the step is left in flight (`_pending`) and the previous one's tokens are
        accepted meanwhile; else the step's tokens are accepted before this returns."""
        worker = self.stats.worker
        start = perf_counter_ns()
        try:
            step = self._runner.launch(list(self._sched.rows))
        except Exception as exc:
            # The cache may be half-updated: the whole batch is lost (after the tokens of the
            # step before, which were computed, are delivered).
            previous, self._pending = self._pending, None
            if previous is not None:
                self._accept_step(previous, leave=False)
            self._fail_batch(exc)
            return
        worker.ns["launch"] += perf_counter_ns() - start
        worker.decode_steps += 1
        worker.rows_stepped += len(step.rows)
        previous, self._pending = self._pending, None
        if previous is not None:
            self._accept_step(previous)
        if overlap and step.in_flight:
            self._pending = step
        else:
            self._accept_step(step)

    def _finish_pending(self) -> None:
        """Accept the tokens of the step in flight, if any."""
        step, self._pending = self._pending, None
        if step is not None:
            self._accept_step(step)

    def _accept_step(self, step: Step, leave: bool = True) -> None:
        """A step's rows take their tokens (rows done since its launch take none); finished
        rows leave the cache, unless `leave` is False (the batch is about to be dropped)."""
        times = self.stats.worker.ns
        start = perf_counter_ns()
        try:
            tokens = step.tokens()
        except Exception as exc:  # a device error surfaces where the host waits for the step
            self._fail_batch(exc)
            return
        ready = perf_counter_ns()
        times["device_wait"] += ready - start
        if self._output.accept_step(step.rows, tokens) and leave:
            keep = self._sched.leaving()
            if keep is not None:
                self._keep_rows(keep)
        times["accept"] += perf_counter_ns() - ready

    def _keep_rows(self, keep: list[int]) -> None:
        """Drop rows not in `keep`; the cache moves the last rows into the freed slots."""
        if not keep:
            self._clear_batch()
            return
        order = self._runner.keep(keep)
        rows = self._sched.rows
        self._sched.rows = [rows[i] for i in order]

    def _clear_batch(self) -> None:
        self._sched.rows = []
        self._runner.clear()

    def _fail_batch(self, exc: BaseException, also: list[Row] | None = None) -> None:
        """The running batch is lost (its cache may be half-updated): every row not done, and
        `also`, gets the error; a step in flight is dropped."""
        rows = [row for row in self._sched.rows if not row.done]
        rows += [row for row in also or [] if row not in rows and not row.done]
        self._pending = None
        self._clear_batch()
        self._output.fail(rows, exc)
