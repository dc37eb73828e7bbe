"""Continuous batching: one worker thread runs every forward pass of the engine.

Why not transformers' own continuous-batching manager: its sampling draws from one global torch
generator (no per-request, per-position seeds, so no exact resume of seeded streams), and its
paged-attention path targets GPUs. This loop is small and exact instead.

Design. Requests join between steps: joiners are prefilled together in groups of similar length
(right-padded, the padding at most `PREFILL_PADDING` of the tokens; one forward pass instead of one
per request) and their KV entries are copied into free slots of the running batch's `SlotCache`
(kv_cache.py): preallocated per-layer buffers where row r lives in slot r, right-padded, so
neither joining nor leaving copies the other rows' cache, and a decode step
writes one column per row instead of re-concatenating the cache as `DynamicCache` does. Each decode
step feeds every running row its last token in ONE forward pass, with per-row `position_ids` (real
positions, independent of padding) and a padding mask. Finished or cancelled rows leave by moving
the last rows into their slots. Token selection for the whole batch is a few batched tensor ops on
the model's device (sampling.py). Results go to each request's queue through a per-loop
mailbox (`_Mailbox`): one `loop.call_soon_threadsafe` per step, none while the loop has not yet
taken the previous steps' results (it then takes them all at once).

Scheduling: each iteration admits queued requests up to `max_batch_size` rows and a prefill
token budget, runs one chunk of at most `prefill_chunk_tokens` of a long prompt, then one decode
step. Chunked prefill: a prompt longer than a chunk is prefilled a chunk per iteration into a
cache of its own, and joins the batch after its last chunk, so the running rows keep getting a
token per iteration instead of waiting for the whole prefill (on a CPU, smollm2-135m: a
2,048-token prompt is one 3.9 s pass, or 8 passes of 0.3-0.65 s, later chunks attending to more,
4.2 s in all; 4 running streams then waited at most ~1 s for a token instead of 4 s).
Limits, stated plainly: memory is bounded by
`max_batch_size` rows times the longest running row (a rectangle, not pages), not by a KV-cache
byte budget; a model whose cache layers are not plain `DynamicLayer`s (sliding-window or recurrent
layers) is served one request at a time with its own cache.

On CUDA (and on a CPU with `static_decode`) the decode step is decode_graphs.py's static step
instead: fixed device buffers, rows padded to a bucket, selection on the device
(device_sampling.py), one CUDA graph per (rows, width) bucket replayed every step.

Exactness: a row's arithmetic differs from running alone only by masked (zero-weight) padding
columns and batch-size-dependent kernel choices, i.e. in the last bits. `tiny-random` runs in
float64 with peaked logits, so its greedy and seeded outputs are identical alone, batched, and
resumed; the tests pin that.

Length (over ~800 lines, on purpose): `Engine` is the worker thread's loop together with all the
state only that thread touches (rows, caches, the outbox); cut into modules, that single-owner
rule would have to hold across files. Its parts live beside it: jobs.py (what goes in and comes
out), kv_cache.py and decode_graphs.py (caches, the static step), sampling.py and
device_sampling.py (selection), detokenizer.py (text), servicekit/text_gate.py (stop sequences).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from servicekit.text_gate import TextGate

from .decode_graphs import (
    CPU_CAPACITY,
    MAX_ROWS,
    StaticDecoder,
    StaticSlotCache,
    cache_bytes_per_token,
    plan_cache,
    row_buckets,
    width_buckets,
)
from .detokenizer import Detokenizer, make_detokenizer
from .device_sampling import DeviceSampler
from .jobs import (
    EngineStats,
    EngineUnavailable,
    FinishReason,
    Job,
    StreamError,
    StreamItem,
    StreamQueue,
)
from .kv_cache import SlotCache
from .models import LoadedModel
from .sampling import apply_repetition_penalties, default_candidates, select

log = logging.getLogger("guardstream.engine")

#: Joiners of different lengths prefill in one right-padded forward pass while the padding adds at
#: most this share of computed tokens. On a CPU, 16 chat prompts of 34-49 tokens took 1.5 s in one
#: pass against 2.5-2.9 s one by one (smollm2-135m): a short prefill is bound by reading weights.
PREFILL_PADDING = 0.25
#: Tokens per prefill chunk by device: a chunk stalls the running rows for its forward pass.
PREFILL_CHUNK_TOKENS = {"cpu": 256, "cuda": 2048}
#: Rows of the running batch on a CPU by default (CUDA: from free memory, up to MAX_ROWS).
CPU_MAX_BATCH_SIZE = 64
#: Share of the GPU memory free after loading the model that the static KV cache may take.
GPU_MEMORY_FRACTION = 0.8


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """Indices of `lengths` grouped for padded prefill: by ascending length, a group closes when
    its rectangle (rows x longest) would exceed its tokens by more than `padding`."""
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if current and (len(current) + 1) * n > (1 + padding) * (tokens + n):
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        groups.append(current)
    return groups


class _Row:
    """Per-request state inside the worker."""

    __slots__ = (
        "detok",
        "gate",
        "generated",
        "job",
        "kv_len",
        "next_input",
        "partial",
        "penalised",
        "prefilled",
        "prompt_length",
        "seen",
        "seen_new",
        "seen_tensor",
    )

    def __init__(self, job: Job, detokenizer: Callable[[], Detokenizer]) -> None:
        self.job = job
        self.generated: list[int] = []
        self.detok = detokenizer()
        self.gate = TextGate(job.stop_sequences, already_delivered=job.resume_text_len)
        self.seen: set[int] = set(job.prompt_ids)  # after joining: penalised rows only
        self.penalised = job.sampling.repetition_penalty != 1.0
        self.prompt_length = len(job.prompt_ids)
        self.seen_new: list[int] = []  # seen ids not yet in seen_tensor (penalised rows only)
        self.seen_tensor: torch.Tensor | None = None  # unique seen ids on the model's device
        self.kv_len = 0  # tokens of this row in the KV cache
        self.next_input = -1  # sampled token not yet fed to the model
        self.partial: DynamicCache | None = None  # chunked prefill: the chunks done so far
        self.prefilled = 0  # chunked prefill: tokens in `partial`

    def context(self) -> list[int]:
        """What the model must have seen before this row's next token: prompt and generated."""
        return self.job.prompt_ids + self.generated

    def seen_ids(self, device: torch.device) -> torch.Tensor:
        """The unique token ids this row has seen (prompt and generated), as a device tensor."""
        if self.seen_tensor is None:
            self.seen_tensor = torch.tensor(sorted(self.seen), dtype=torch.long, device=device)
            self.seen_new = []
        elif self.seen_new:
            new = torch.tensor(self.seen_new, dtype=torch.long, device=device)
            self.seen_tensor = torch.cat([self.seen_tensor, new])
            self.seen_new = []
        return self.seen_tensor


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
    ) -> None:
        """`prefill_chunk_tokens`: longer contexts are prefilled in chunks of this many tokens
        (None: PREFILL_CHUNK_TOKENS of the device). `max_batch_size` None: MAX_ROWS on CUDA
        (fewer when free GPU memory holds fewer), CPU_MAX_BATCH_SIZE on a CPU.

        The static decode step (decode_graphs.py; default: on for CUDA): `static_buckets` pads
        rows and attention width up to buckets (default: on for CUDA, where each bucket is a
        graph), `static_capacity` columns per row on a CPU (default: the context, at most
        CPU_CAPACITY), `cuda_graphs` captures and replays the steps (default: on for CUDA;
        never on a CPU), `gpu_memory_fraction` of free GPU memory at start sizes the cache."""
        self.loaded = loaded
        self.threads = threads  # CPU intra-op threads to set at start (process-wide); None: leave
        self.model = loaded.model
        self.device = loaded.device
        on_cuda = loaded.device.type == "cuda"
        if max_batch_size is None:
            max_batch_size = MAX_ROWS if on_cuda else CPU_MAX_BATCH_SIZE
        self.max_batch_size = max(1, max_batch_size)
        self.static_decode = on_cuda if static_decode is None else static_decode
        self.static_buckets = on_cuda if static_buckets is None else static_buckets
        self.static_capacity = static_capacity
        self.cuda_graphs = on_cuda and (cuda_graphs is None or cuda_graphs)
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], not {gpu_memory_fraction}")
        self.gpu_memory_fraction = gpu_memory_fraction
        self.prefill_token_budget = max(1, prefill_token_budget)
        if prefill_chunk_tokens is None:
            prefill_chunk_tokens = PREFILL_CHUNK_TOKENS.get(loaded.device.type, 2048)
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)
        self.stats = EngineStats()
        self._detokenizer = make_detokenizer(loaded.tokenizer)
        self._candidates = default_candidates(self.device)
        self._eos = sorted(loaded.eos_token_ids)
        self._eos_set = frozenset(self._eos)
        self._eos_tensor = torch.tensor(self._eos, dtype=torch.long, device=self.device)
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._active: set[Job] = set()
        self._stopping = False
        self._held = 0
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        # Batch state (worker thread only).
        self._rows: list[_Row] = []  # row r of the batch: slot r of the slot cache
        self._prefilling: deque[_Row] = deque()  # long contexts, a chunk per iteration, in order
        self._kv: SlotCache | None = None  # batchable models: the running batch's cache
        self._static: StaticDecoder | None = None  # the static step's decoder and cache
        self._ready = threading.Event()  # the worker finished its start-up (static buffers)
        self._solo: DynamicCache | None = None  # other models: the one running row's own cache
        self._batchable: bool | None = None  # learnt from the first prefill's cache layout
        self._outbox: list[tuple[Job, StreamItem | StreamError]] = []
        # per event loop: events posted, not yet delivered (weak: test loops come and go)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
            weakref.WeakKeyDictionary()
        )
        # Prefill computes logits for the last position only when the model supports it.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

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
        return len(self._rows)

    @property
    def prefilling_requests(self) -> int:
        """Requests whose long context is being prefilled chunk by chunk."""
        return len(self._prefilling)

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

        For tests and benchmarks that need a known batch composition, not for serving."""
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

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                try:
                    if self.static_decode:
                        self._set_up_static()
                except BaseException as exc:
                    self._fatal = exc
                    raise
                finally:
                    self._ready.set()
                while True:
                    joiners = self._wait_for_work()
                    if joiners is None:
                        break
                    self._drop_cancelled()
                    if joiners:
                        self._admit(joiners)
                    if self._prefilling:
                        self._prefill_chunk()
                    if self._rows:
                        self._decode_step()
                    self._flush_outbox()
        except BaseException as exc:  # a bug: fail every request loudly rather than hang them
            log.exception("engine worker crashed")
            self._fatal = exc
            self._ready.set()
        finally:
            self._fail_everything(
                StreamError(503, "generation_unavailable", "the engine is shutting down")
            )

    def _set_up_static(self) -> None:
        """Allocate the static decode step's buffers (and capture its graphs on CUDA): a
        one-token prefill shows the cache's layout; on CUDA, rows and capacity come from the
        memory free now (decode_graphs.plan_cache)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        template = self.model(input_ids=ids, use_cache=True).past_key_values
        self._batchable = isinstance(template, DynamicCache) and all(
            type(layer) is DynamicLayer for layer in template.layers
        )
        if not self._batchable:
            log.warning("this model's KV cache cannot be merged; requests run one at a time")
            self.static_decode = False
            return
        context = self.loaded.max_context
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            plan = plan_cache(
                free_bytes=free,
                fraction=self.gpu_memory_fraction,
                bytes_per_token=cache_bytes_per_token(template),
                max_context=context,
                max_rows=self.max_batch_size,
            )
            slots, capacity = plan.rows, plan.capacity
        else:
            slots = self.max_batch_size
            capacity = self.static_capacity or min(context, CPU_CAPACITY)
        self.max_batch_size = slots
        cache = StaticSlotCache(template, slots, capacity)
        sampler = DeviceSampler(
            slots,
            vocab_size=self.loaded.vocab_size,
            logits_width=self.loaded.model_vocab_size,
            eos_ids=self._eos,
            device=self.device,
        )
        self._static = StaticDecoder(
            self.model,
            cache,
            rows=row_buckets(slots) if self.static_buckets else None,
            widths=width_buckets(capacity) if self.static_buckets else None,
            logits_to_keep=self._logits_to_keep,
            sampler=sampler,
        )
        if capacity < context:  # the context this engine can hold, advertised by the server
            self.loaded = dataclasses.replace(self.loaded, max_context=capacity)
        log.info(
            "static decode: %d rows x %d tokens, %.1f MiB of KV cache",
            slots,
            capacity,
            cache.nbytes / 2**20,
        )
        if self.cuda_graphs:
            self._static.capture()

    def cache_info(self) -> dict[str, object]:
        """The running batch's KV cache for /health and /metrics: `rows` x `capacity` it can
        hold, what it uses now, the bytes it holds, and how decode steps run."""
        static = self._static
        if static is not None:
            cache = static.cache
            lengths = list(cache.lengths)
            return {
                "mode": "cuda_graphs" if static.graphs else "static",
                "rows": cache.slots,
                "capacity": cache.capacity,
                "rows_used": len(lengths),
                "tokens_used": sum(lengths),
                "bytes": cache.nbytes,
                "graphs": static.graphs,
            }
        kv = self._kv
        lengths = list(kv.lengths) if kv is not None else []
        return {
            "mode": "eager",
            "rows": self.max_batch_size,
            "capacity": self.loaded.max_context,
            "rows_used": len(lengths),
            "tokens_used": sum(lengths),
            "bytes": kv.nbytes if kv is not None else 0,
            "graphs": 0,
        }

    def _wait_for_work(self) -> list[Job] | None:
        with self._cond:
            while not self._stopping and (
                self._held or (not self._inbox and not self._rows and not self._prefilling)
            ):
                self._cond.wait()
            if self._stopping:
                return None
            free = self.max_batch_size - len(self._rows) - len(self._prefilling)
            if self._batchable is False:  # a cache we cannot merge: one request at a time
                free = 0 if self._rows else 1
            joiners: list[Job] = []
            budget = self.prefill_token_budget
            while self._inbox and len(joiners) < free:
                job = self._inbox[0]
                cost = len(job.prompt_ids) + len(job.resume_ids)
                if joiners and cost > budget:
                    break
                joiners.append(self._inbox.popleft())
                budget -= cost
                if self._batchable is None:  # learn the cache layout from one request first
                    break
            return joiners

    def _fail_everything(self, error: StreamError) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._inbox)
            self._inbox.clear()
        jobs = [row.job for row in self._rows] + [row.job for row in self._prefilling] + pending
        self._clear_batch()
        self._prefilling.clear()
        for job in jobs:
            if not job.cancelled:
                self._emit(job, error)
            self._retire(job)
        self._flush_outbox()

    def _emit(self, job: Job, event: StreamItem | StreamError) -> None:
        self._outbox.append((job, event))

    def _retire(self, job: Job) -> None:
        with self._cond:
            self._active.discard(job)

    def _flush_outbox(self) -> None:
        """Hand this step's events to their loops: one wake-up per loop that is not already
        due to run a delivery (a loop behind the worker gets several steps in one go)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, StreamItem | StreamError]]] = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, events in by_loop.items():
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = _Mailbox()
            if mailbox.post(events) and not loop.is_closed():
                continue  # a wake-up is already on its way
            try:
                loop.call_soon_threadsafe(mailbox.deliver)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for job, _ in mailbox.take():
                    job.cancelled = True

    def _drop_cancelled(self) -> None:
        if any(row.job.cancelled for row in self._prefilling):
            for row in self._prefilling:
                if row.job.cancelled:
                    self.stats.requests_cancelled += 1
                    self._retire(row.job)
            self._prefilling = deque(row for row in self._prefilling if not row.job.cancelled)
        keep = [i for i, row in enumerate(self._rows) if not row.job.cancelled]
        if len(keep) != len(self._rows):
            for row in self._rows:
                if row.job.cancelled:
                    self.stats.requests_cancelled += 1
                    self._retire(row.job)
            self._keep_rows(keep)

    # ----- admission and prefill ---------------------------------------------------------------

    def _admit(self, joiners: list[Job]) -> None:
        ready: list[_Row] = []
        for job in joiners:
            if job.cancelled:
                self.stats.requests_cancelled += 1
                self._retire(job)
                continue
            self.stats.requests_started += 1
            row = _Row(job, self._detokenizer)
            finish = None
            for token in job.resume_ids:  # replay: the same detokenizer and stop state as before
                finish = self._accept(row, token, live=False)
                if finish is not None:
                    break
            if finish is None and len(row.generated) >= job.max_new_tokens:
                finish = FinishReason.MAX_TOKENS
            if (
                finish is None
                and len(job.prompt_ids) + len(row.generated) >= self.loaded.max_context
            ):
                finish = FinishReason.MAX_TOKENS
            if finish is not None:
                self._finish(row, [], finish)
                continue
            if (
                self._batchable
                and self._logits_to_keep
                and len(job.prompt_ids) + len(row.generated) > self.prefill_chunk_tokens
            ):
                self._prefilling.append(row)  # chunk by chunk, between decode steps
                continue
            ready.append(row)
        lengths = [len(row.job.prompt_ids) + len(row.generated) for row in ready]
        if self._batchable and self._logits_to_keep:
            # Right padding: under a causal mask a real token never attends to a pad, so a row's
            # arithmetic differs from running alone only by masked columns (the last bits, as
            # in a batched decode step).
            groups = prefill_groups(lengths)
        else:  # equal lengths only: no padding at all
            by_length: dict[int, list[int]] = {}
            for i, n in enumerate(lengths):
                by_length.setdefault(n, []).append(i)
            groups = list(by_length.values())
        for group in groups:
            self._prefill([ready[i] for i in group], [lengths[i] for i in group])
            self._flush_outbox()  # first tokens leave now, not after the other joiners' prefill

    def _prefill(self, rows: list[_Row], lengths: list[int]) -> None:
        width = max(lengths)
        ids = torch.tensor(
            [
                row.job.prompt_ids + row.generated + [row.job.prompt_ids[-1]] * (width - n)
                for row, n in zip(rows, lengths, strict=True)
            ],
            dtype=torch.long,
            device=self.device,
        )
        extra: dict[str, object] = {}
        last_column: torch.Tensor | None = None
        if any(n != width for n in lengths):
            columns = torch.arange(width, device=self.device)
            ends = torch.tensor(lengths, dtype=torch.long, device=self.device)
            extra["attention_mask"] = (columns[None, :] < ends[:, None]).long()
            # logits only at each row's last real position, not the whole rectangle's
            keep = sorted(set(lengths))
            extra["logits_to_keep"] = torch.tensor([n - 1 for n in keep], device=self.device)
            last_column = torch.tensor(
                [keep.index(n) for n in lengths], dtype=torch.long, device=self.device
            )
        elif self._logits_to_keep:
            extra["logits_to_keep"] = 1
        try:
            out = self.model(input_ids=ids, use_cache=True, **extra)
            self.stats.forward_passes += 1
            self.stats.prefill_passes += 1
            cache = out.past_key_values
            if self._batchable is None:
                self._batchable = isinstance(cache, DynamicCache) and all(
                    type(layer) is DynamicLayer for layer in cache.layers
                )
                if not self._batchable:
                    log.warning(
                        "this model's KV cache cannot be merged; requests run one at a time"
                    )
            if last_column is None:
                logits = out.logits[:, -1, :]
            else:
                logits = out.logits[torch.arange(len(rows), device=self.device), last_column]
            tokens = self._select(logits, rows)
        except Exception as exc:
            self._fail_rows(rows, exc)
            return
        self._start_rows(cache, rows, tokens, lengths)

    def _start_rows(
        self, cache: DynamicCache, rows: list[_Row], tokens: list[int], lengths: list[int]
    ) -> None:
        """Prefilled rows (row i of `cache`, `lengths[i]` tokens) take their first tokens; those
        not finished by it join the running batch."""
        for row, n in zip(rows, lengths, strict=True):
            row.kv_len = n
        survivors: list[int] = []
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            finish = self._accept(row, token, live=True)
            if finish is None:
                row.next_input = token
                self._emit(row.job, StreamItem([token], row.gate.release(), len(row.generated)))
                survivors.append(i)
            else:
                self._finish(row, [token], finish)
        if survivors:
            joining = [rows[i] for i in survivors]
            try:
                self._join(cache, joining, survivors, [lengths[i] for i in survivors])
            except Exception as exc:  # e.g. out of memory growing the slot cache mid-way
                running = self._rows + [row for row in joining if row not in self._rows]
                self._clear_batch()
                self._fail_rows(running, exc)

    def _prefill_chunk(self) -> None:
        """The next chunk of the oldest long context; after its last chunk the row gets its first
        token and joins the batch, as a whole prefill's rows do."""
        row = self._prefilling[0]
        context = row.context()
        start = row.prefilled
        end = min(len(context), start + self.prefill_chunk_tokens)
        ids = torch.tensor([context[start:end]], dtype=torch.long, device=self.device)
        try:
            out = self.model(
                input_ids=ids, past_key_values=row.partial, use_cache=True, logits_to_keep=1
            )
            self.stats.forward_passes += 1
            self.stats.prefill_chunks += 1
            row.partial, row.prefilled = out.past_key_values, end
            if end < len(context):
                return
            self._prefilling.popleft()
            self.stats.prefill_passes += 1
            tokens = self._select(out.logits[:, -1, :], [row])
        except Exception as exc:
            if self._prefilling and self._prefilling[0] is row:
                self._prefilling.popleft()
            self._fail_rows([row], exc)
            return
        cache, row.partial = row.partial, None
        self._start_rows(cache, [row], tokens, [len(context)])

    def _join(
        self, cache: DynamicCache, rows: list[_Row], select: list[int], lengths: list[int]
    ) -> None:
        """Append prefilled rows (rows `select` of `cache`, `lengths` tokens each) to the running
        batch."""
        if self._static is not None:
            first = self._static.cache.rows
            self._static.cache.add_rows(cache, select, lengths)
            sampler = self._static.sampler
            if sampler is not None:  # the rows' settings, between steps (never in a graph)
                for slot, row in enumerate(rows, start=first):
                    sampler.set_row(
                        slot,
                        row.job.sampling,
                        min_new_tokens=row.job.min_new_tokens,
                        generated=len(row.generated),
                        seen_ids=sorted(row.seen),
                    )
        elif self._batchable:
            if self._kv is None:
                self._kv = SlotCache(
                    len(cache.layers), self.max_batch_size, self.loaded.max_context
                )
            self._kv.add_rows(cache, select, lengths)
        else:  # one row at a time: it keeps the cache its model made
            assert not self._rows and len(rows) == 1
            self._solo = cache
        self._rows.extend(rows)
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(self._rows))

    # ----- decoding --------------------------------------------------------------------------

    def _decode_step(self) -> None:
        rows = self._rows
        try:
            static = self._static
            if static is not None and static.cache.rows:
                out = static.step([row.next_input for row in rows])
                static.advance()
                # the step's one device-to-host read: the chosen tokens (or the logits)
                tokens = out.tolist() if static.samples else self._select(out, rows)
            else:
                tokens = self._select(self._eager_step(rows), rows)
            self.stats.forward_passes += 1
            self.stats.decode_steps += 1
            size = len(rows)
            self.stats.batch_sizes[size] = self.stats.batch_sizes.get(size, 0) + 1
        except Exception as exc:
            # The cache may be half-updated: the whole batch is lost.
            self._clear_batch()
            self._fail_rows(rows, exc)
            return
        self._after_step(rows, tokens)

    def _eager_step(self, rows: list[_Row]) -> torch.Tensor:
        """A decode step over the slot cache (or a solo row's own cache); the last logits."""
        device = self.device
        input_ids = torch.tensor(
            [[row.next_input] for row in rows], dtype=torch.long, device=device
        )
        past: SlotCache | DynamicCache
        if self._kv is not None and self._kv.rows:
            positions = self._kv.begin_step()
            mask = self._kv.attention_mask()
            past = self._kv
        else:
            assert self._solo is not None and len(rows) == 1
            positions = torch.tensor([rows[0].kv_len], dtype=torch.long, device=device)
            mask = torch.ones((1, rows[0].kv_len + 1), dtype=torch.long, device=device)
            past = self._solo
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions[:, None],
            past_key_values=past,
            use_cache=True,
        )
        if past is self._kv:
            self._kv.end_step()
        return out.logits[:, -1, :]

    def _after_step(self, rows: list[_Row], tokens: list[int]) -> None:
        """Each row takes its token; finished rows leave the batch.

        `_accept` and `_emit` inlined, with what is per step hoisted out of the per-row loop
        (the clock, the counters, the limits): this runs for every row of every step, on the
        worker thread between forward passes. Seen ids are kept up to date only for rows with a
        repetition penalty, the only readers once a row has joined (the device sampler keeps
        its own); the stop gate scans only for rows with stop sequences (TextGate)."""
        keep: list[int] = []
        eos = self._eos_set
        max_context = self.loaded.max_context
        outbox = self._outbox
        now = time.monotonic()
        self.stats.tokens_generated += len(rows)
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            row.kv_len += 1
            job = row.job
            generated = row.generated
            generated.append(token)
            if row.penalised and token not in row.seen:
                row.seen.add(token)
                if row.seen_tensor is not None:
                    row.seen_new.append(token)
            gate = row.gate
            gate.push(row.detok.push(token))
            count = len(generated)
            if gate.stop_at is not None:
                finish = FinishReason.STOP_SEQUENCE
            elif token in eos:
                finish = FinishReason.EOS_TOKEN
            elif count >= job.max_new_tokens or row.prompt_length + count >= max_context:
                finish = FinishReason.MAX_TOKENS
            elif job.deadline is not None and now >= job.deadline:
                finish = FinishReason.TIME_LIMIT
            else:
                row.next_input = token
                outbox.append((job, StreamItem([token], gate.release(), count)))
                keep.append(i)
                continue
            self._finish(row, [token], finish)
        if len(keep) != len(rows):
            self._keep_rows(keep)

    def _keep_rows(self, keep: list[int]) -> None:
        """Drop rows not in `keep`; the slot cache moves the last rows into the freed slots."""
        if not keep:
            self._clear_batch()
            return
        if self._static is not None and self._static.cache.rows:
            order = self._static.cache.keep(keep)
            sampler = self._static.sampler
            if sampler is not None:  # the moved rows' settings follow their cache
                for slot, old in enumerate(order):
                    if old != slot:
                        sampler.move_row(old, slot)
            self._rows = [self._rows[i] for i in order]
        elif self._kv is not None and self._kv.rows:
            order = self._kv.keep(keep)
            self._rows = [self._rows[i] for i in order]
        else:
            self._rows = [self._rows[i] for i in keep]

    def _clear_batch(self) -> None:
        self._rows = []
        self._solo = None
        if self._kv is not None:
            self._kv.clear()
        if self._static is not None:
            self._static.cache.clear()

    def _select(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Next token per row: one batched selection on the logits' device (sampling.py)."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        vocab = self.loaded.vocab_size
        if logits.shape[-1] > vocab:  # padding rows of the output layer are not tokens
            logits[:, vocab:] = float("-inf")
        suppress = [i for i, row in enumerate(rows) if len(row.generated) < row.job.min_new_tokens]
        if suppress and self._eos:
            index = torch.tensor(suppress, dtype=torch.long, device=logits.device)
            logits[index[:, None], self._eos_tensor[None, :]] = float("-inf")
        penalised = [i for i, row in enumerate(rows) if row.job.sampling.repetition_penalty != 1.0]
        if penalised:
            apply_repetition_penalties(
                logits,
                penalised,
                [rows[i].seen_ids(logits.device) for i in penalised],
                [rows[i].job.sampling.repetition_penalty for i in penalised],
            )
        return select(
            logits,
            [row.job.sampling for row in rows],
            [len(row.generated) for row in rows],
            self._candidates,
        )

    def _accept(self, row: _Row, token: int, live: bool) -> FinishReason | None:
        """Append one token to a row (generated or replayed) and say whether the row is done."""
        job = row.job
        row.generated.append(token)
        if token not in row.seen:
            row.seen.add(token)
            if row.seen_tensor is not None:
                row.seen_new.append(token)
        if live:
            self.stats.tokens_generated += 1
        row.gate.push(row.detok.push(token))
        if row.gate.stop_at is not None:
            return FinishReason.STOP_SEQUENCE
        if token in self._eos_set:
            return FinishReason.EOS_TOKEN
        if len(row.generated) >= job.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if len(job.prompt_ids) + len(row.generated) >= self.loaded.max_context:
            return FinishReason.MAX_TOKENS
        if live and job.deadline is not None and time.monotonic() >= job.deadline:
            return FinishReason.TIME_LIMIT
        return None

    def _finish(self, row: _Row, token_ids: list[int], reason: FinishReason) -> None:
        if reason is not FinishReason.STOP_SEQUENCE:
            row.gate.push(row.detok.flush())
            if row.gate.stop_at is not None:  # the held-back tail completed a stop sequence
                reason = FinishReason.STOP_SEQUENCE
            row.gate.finish()
        self._emit(row.job, StreamItem(token_ids, row.gate.release(), len(row.generated), reason))
        self._retire(row.job)

    def _fail_rows(self, rows: Iterable[_Row], exc: BaseException) -> None:
        if _is_oom(exc):
            error = StreamError(503, "generation_unavailable", f"out of memory: {exc}"[:500])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            log.exception("forward pass failed", exc_info=exc)
            error = StreamError(500, "generation_error", f"{type(exc).__name__}: {exc}"[:500])
        for row in rows:
            self._emit(row.job, error)
            self._retire(row.job)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class _Mailbox:
    """Events from the worker to one event loop. The worker posts each step's events; the loop
    delivers everything posted since its last delivery. Only a post into an empty mailbox needs
    a wake-up (`call_soon_threadsafe`: a syscall and a GIL hand-off per step, which the worker
    pays): while the loop is behind, later steps just join the pending delivery."""

    __slots__ = ("_events", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[Job, StreamItem | StreamError]] = []

    def post(self, events: list[tuple[Job, StreamItem | StreamError]]) -> bool:
        """Add events (worker); True when a delivery is already pending (no wake-up needed)."""
        with self._lock:
            pending = bool(self._events)
            self._events.extend(events)
            return pending

    def take(self) -> list[tuple[Job, StreamItem | StreamError]]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def deliver(self) -> None:
        """On the loop: every posted event into its job's queue, in order (a `StreamQueue`
        takes each job's events in one call)."""
        by_job: dict[Job, list[StreamItem | StreamError]] = {}
        for job, event in self.take():
            by_job.setdefault(job, []).append(event)
        for job, events in by_job.items():
            queue = job.queue
            if isinstance(queue, StreamQueue):
                queue.put_many(events)
            else:
                for event in events:
                    queue.put_nowait(event)
