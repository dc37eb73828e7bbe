"""The engine's model runner: prefill, prefill chunks, and decode steps (eager over the slot cache,
or the static step of decode_graphs.py, replayed from CUDA graphs on a GPU), with the caches the
steps run over (vLLM's `GPUModelRunner`).

One of the three parts of the worker thread (scheduler.py's `Engine` drives them). Joins copy
prefilled rows' KV entries into free slots of the running batch's cache: `SlotCache`
(kv_cache.py) for eager steps, `StaticSlotCache` for the static step; a decode step feeds every
running row its last token in one forward pass, with per-row positions and a padding mask.
Token selection is a few batched tensor ops on the model's device (sampling.py; the static step's
`DeviceSampler` inside the step). A model whose cache layers are not plain `DynamicLayer`s
(sliding-window or recurrent layers) runs one request at a time with its own cache.

Overlapped steps (`Step`). The static step's chosen tokens stay on the device, where they are the
next step's inputs (`StaticDecoder.step` writes them into its input buffer; joins write their
first tokens there, leaves move them with the rows' cache), and their copy to the host is
non-blocking: into one of two pinned buffers, followed by a CUDA event. So the worker can launch
step N+1 before it reads step N's tokens, and the host accepts step N's tokens while the device
runs step N+1. On a CPU the same logic runs with an event that is complete when recorded (the
step itself ran synchronously). The eager step selects on the host's say (per-row seen ids,
generated counts) and returns its tokens at once: it is never overlapped.

Static prefill (`static_prefill`; with the static step, so on for CUDA): a prefill writes its
rows' keys straight into their decode slots through a static pass, replayed from CUDA graphs on a
GPU (prefill_graphs.py): no `DynamicCache`, no copy at the join, and one launch instead of
~7,000 host-dispatched ops a pass. Chunked long prompts, models whose cache cannot be merged, and
the slot-cache step (a CPU's default) keep eager prefill into a `DynamicCache`.

Warm prefill (`prefill_buckets`, `warm_prefill`; on for CUDA). On a GPU each new prefill shape
costs its first use (cuBLAS/cuDNN kernel choice and plans: on an H200 the first 64
clients of a fresh engine waited 824 ms for their first token, the next 64 136 ms). So a prefill
is padded up to a bucket of rows (`row_buckets`) and width (doubling from PREFILL_MIN_WIDTH up to
the prefill chunk), and every bucket a prefill can reach runs once at start (the static
prefill's: captured into its graph at start). On a CPU both are off: padding costs compute
there (smollm2-135m, 256 new streams on 2 busy cores: TTFT p50 25-30 s exact, 48-51 s
bucketed) and first uses cost little.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .attention_backends import changing_shapes
from .decode_graphs import (
    CPU_CAPACITY,
    StaticDecoder,
    StaticSlotCache,
    bucket,
    log_progress,
    plan_free_memory,
    row_buckets,
    width_buckets,
)
from .device_sampling import DeviceSampler
from .jobs import EngineStats
from .kv_cache import SlotCache
from .models import LoadedModel
from .prefill_graphs import StaticPrefill
from .sampling import apply_repetition_penalties, default_candidates, select
from .scheduling import PREFILL_PADDING, Row

#: The narrowest prefill width bucket (`prefill_buckets`); the next ones double.
PREFILL_MIN_WIDTH = 16

log = logging.getLogger("guardstream.engine")


class StepEvent(Protocol):
    """Marks the end of a step's copy of its tokens to the host (`torch.cuda.Event` on CUDA)."""

    def synchronize(self) -> None: ...


class _Complete:
    """A CPU step's event: its tokens were on the host when the step returned."""

    def synchronize(self) -> None:
        return None


COMPLETE = _Complete()


def record_step_event(device: torch.device) -> StepEvent:
    """An event recorded after the work queued so far on `device` (a benchmark simulating a
    device replaces this function)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return event
    return COMPLETE


@dataclasses.dataclass(frozen=True)
class StaticRows:
    """A static prefill's rows: written in place into the decode cache's next `count` free
    slots (`join` takes them with `StaticSlotCache.take_rows`)."""

    first: int
    count: int


class Step:
    """A launched decode step: the rows it ran (in slot order at launch) and their tokens, on the
    host once `tokens()` returns (it waits for the step's event when the copy is in flight)."""

    __slots__ = ("_buffer", "_event", "_tokens", "rows")

    def __init__(
        self,
        rows: list[Row],
        tokens: list[int] | None = None,
        buffer: torch.Tensor | None = None,
        event: StepEvent | None = None,
    ) -> None:
        self.rows = rows
        self._tokens = tokens
        self._buffer = buffer
        self._event = event

    @property
    def in_flight(self) -> bool:
        """Whether the tokens are still to be read (a static step): the step may be overlapped."""
        return self._tokens is None

    def tokens(self) -> list[int]:
        if self._tokens is None:
            assert self._buffer is not None and self._event is not None
            self._event.synchronize()
            self._tokens = self._buffer[: len(self.rows)].tolist()
            self._buffer = self._event = None
        return self._tokens


class ModelRunner:
    """The model, the running batch's cache and the forward passes (worker thread only)."""

    def __init__(
        self,
        loaded: LoadedModel,
        stats: EngineStats,
        max_batch_size: int,
        *,
        static_decode: bool,
        static_buckets: bool,
        static_capacity: int | None,
        cuda_graphs: bool,
        gpu_memory_fraction: float,
        prefill_buckets: bool = False,
        warm_prefill: bool = False,
        prefill_budget: int = 4096,
        prefill_longest: int = 2048,
        compile_step: bool = False,
        static_prefill: bool | None = None,
    ) -> None:
        """`static_prefill` (default: with `static_decode`): prefills write into the static
        cache's slots through the static pass (prefill_graphs.py). `prefill_buckets`: pad each prefill's rows and width up to buckets (`prefill_shape`);
        `warm_prefill`: run once at start every bucket that a prefill of at most
        `prefill_budget` real tokens, none longer than `prefill_longest`, can take
        (`warm_prefills`); `compile_step`: the static step through torch.compile
        (decode_graphs.compile_forward)."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.stats = stats
        self.max_batch_size = max_batch_size
        self.static_decode = static_decode
        self.static_buckets = static_buckets
        self.static_capacity = static_capacity
        self.cuda_graphs = cuda_graphs
        self.gpu_memory_fraction = gpu_memory_fraction
        self.prefill_buckets = prefill_buckets
        self.warm_prefill = warm_prefill
        self.prefill_budget = prefill_budget
        self.prefill_longest = prefill_longest
        self.compile_step = compile_step
        self.static_prefill = static_decode if static_prefill is None else static_prefill
        self.prefill_pass: StaticPrefill | None = None  # the static prefill (set_up makes it)
        self.dynamic_prefills = 0  # whole prefills into a DynamicCache (the eager path)
        self.warm_shapes: list[tuple[int, int]] = []  # the prefill shapes run at start
        self._candidates = default_candidates(self.device)
        self._eos = sorted(loaded.eos_token_ids)
        self._eos_tensor = torch.tensor(self._eos, dtype=torch.long, device=self.device)
        self.kv: SlotCache | None = None  # batchable models: the running batch's cache
        self.static: StaticDecoder | None = None  # the static step's decoder and cache
        self.solo: DynamicCache | None = None  # other models: the one running row's own cache
        self.batchable: bool | None = None  # learnt from the first prefill's cache layout
        self._host_tokens: list[torch.Tensor] = []  # static steps: two host buffers, alternating
        self._parity = 0
        # Prefill computes logits for the last position only when the model supports it.
        self.logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    # ----- start-up ------------------------------------------------------------------------------

    def set_up(self) -> None:
        """Allocate the static decode step's buffers (and capture its graphs on CUDA): a
        one-token prefill shows the cache's layout; on CUDA, rows and capacity come from the
        memory free now (decode_graphs.plan_cache). Lowers `max_batch_size` and the context of
        `loaded` to what the cache holds."""
        if not (self.static_decode or self.warm_prefill):
            return
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        template = self.model(input_ids=ids, use_cache=True).past_key_values
        self.batchable = isinstance(template, DynamicCache) and all(
            type(layer) is DynamicLayer for layer in template.layers
        )
        if not self.batchable:
            log.warning("this model's KV cache cannot be merged; requests run one at a time")
            self.static_decode = False
            return
        if self.static_decode:
            self._set_up_static(template)
        if self.warm_prefill:  # after the static cache took its memory, as when serving
            self.warm_prefills()

    def _set_up_static(self, template: DynamicCache) -> None:
        """The static step's cache, sampler and host buffers (and graphs on CUDA)."""
        context = self.loaded.max_context
        if self.device.type == "cuda":
            plan = plan_free_memory(
                template, self.gpu_memory_fraction, context, self.max_batch_size
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
        self.static = StaticDecoder(
            self.model,
            cache,
            rows=row_buckets(slots) if self.static_buckets else None,
            widths=width_buckets(capacity) if self.static_buckets else None,
            logits_to_keep=self.logits_to_keep,
            sampler=sampler,
            compile_step=self.compile_step,
        )
        pinned = self.device.type == "cuda"
        self._host_tokens = [
            torch.zeros(slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)
        ]
        if capacity < context:  # the context this engine can hold, advertised by the server
            self.loaded = dataclasses.replace(self.loaded, max_context=capacity)
        if self.static_prefill and self.logits_to_keep:
            self.prefill_pass = StaticPrefill(
                self.model,
                cache,
                rows=row_buckets(slots) if self.prefill_buckets else None,
                widths=self.prefill_widths if self.prefill_buckets else None,
                cuda_graphs=self.cuda_graphs,
            )
        log.info(
            "static decode: %d rows x %d tokens, %.1f MiB of KV cache",
            slots,
            capacity,
            cache.nbytes / 2**20,
        )
        if self.cuda_graphs:
            self.static.capture()

    def cache_info(self) -> dict[str, object]:
        """The running batch's KV cache for /health and /metrics: `rows` x `capacity` it can
        hold, what it uses now, the bytes it holds, and how decode steps run (`compiled`: the
        step's forward through torch.compile; `compile_error`: why `--compile` was given up)."""
        static = self.static
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
                "compiled": static.compiled,
                "compile_error": static.compile_error,
            }
        kv = self.kv
        lengths = list(kv.lengths) if kv is not None else []
        return {
            "mode": "eager",
            "rows": self.max_batch_size,
            "capacity": self.loaded.max_context,
            "rows_used": len(lengths),
            "tokens_used": sum(lengths),
            "bytes": kv.nbytes if kv is not None else 0,
            "graphs": 0,
            "compiled": False,
            "compile_error": None,
        }

    def prefill_info(self) -> dict[str, object]:
        """How whole prefills run, for /health (`prefill`) and /metrics: `mode` static (the
        static pass, eagerly), cuda_graphs (replayed) or eager (into a DynamicCache); the
        static pass's graphs held, captured and replayed; `eager_passes`: prefill passes not
        replayed from a graph (the static pass's eager runs and the DynamicCache prefills;
        chunks of long prompts are counted by `prefill_chunks`)."""
        static = self.prefill_pass
        if static is None:
            return {
                "mode": "eager",
                "graphs": 0,
                "captures": 0,
                "replays": 0,
                "eager_passes": self.dynamic_prefills,
                "graph_error": None,
            }
        info = static.info()
        info["eager_passes"] = static.runner.eager_passes + self.dynamic_prefills
        return info

    @property
    def overlappable(self) -> bool:
        """Whether decode steps keep their tokens on the device (the static step with its
        sampler): only those can be launched before the previous step's tokens are read."""
        return self.static is not None and self.static.samples

    # ----- prefill -------------------------------------------------------------------------------

    def prefill_shape(self, rows: int, width: int) -> tuple[int, int]:
        """The (rows, width) a prefill of `rows` contexts, the longest `width` tokens, runs at:
        bucketed with `prefill_buckets` (a cache whose rows can be merged only), else exact."""
        if not (self.prefill_buckets and self.batchable and self.logits_to_keep):
            return rows, width
        # never wider than the model's context (learnt position embeddings end there)
        most = max(width, self.loaded.max_context)
        return bucket(rows, row_buckets(self.max_batch_size)), min(
            bucket(width, self.prefill_widths), most
        )

    @property
    def prefill_widths(self) -> tuple[int, ...]:
        """Prefill width buckets: doubling from PREFILL_MIN_WIDTH up to the longest context
        prefilled in one pass (`prefill_longest`; longer ones are chunked, unbucketed)."""
        longest = min(self.prefill_longest, self.loaded.max_context)
        return width_buckets(longest, min(PREFILL_MIN_WIDTH, longest))

    def prefill(
        self, rows: list[Row], lengths: list[int]
    ) -> tuple[DynamicCache | StaticRows, list[int]]:
        """Rows' contexts (`lengths[i]` tokens each) prefilled in one pass; their cache (a
        `DynamicCache`, or `StaticRows` when the static prefill wrote them into their decode
        slots) and first tokens."""
        if self.prefill_pass is not None:
            return self._static_prefill(rows, lengths)
        return self._dynamic_prefill(rows, lengths)

    def _static_prefill(self, rows: list[Row], lengths: list[int]) -> tuple[StaticRows, list[int]]:
        """The static pass (prefill_graphs.py) into the decode cache's next free slots."""
        static = self.prefill_pass
        assert static is not None
        first = static.cache.rows
        contexts = [
            (row.job.prompt_ids + row.generated)[:m] for row, m in zip(rows, lengths, strict=True)
        ]
        logits = static.run(contexts)
        self.stats.forward_passes += 1
        self.stats.prefill_passes += 1
        for row, m in zip(rows, lengths, strict=True):
            row.kv_len = m
        return StaticRows(first, len(rows)), self.select(logits, rows)

    def _dynamic_prefill(
        self, rows: list[Row], lengths: list[int]
    ) -> tuple[DynamicCache, list[int]]:
        """One right-padded forward pass over the rows' contexts (`lengths[i]` tokens each);
        their cache (row i: `rows[i]`; rows past them, if any, are bucket padding) and first
        tokens. With `prefill_buckets` the pass is padded up to a bucket's rows and width (copies
        of the last row, extra columns masked): under a causal mask a real token never attends
        to padding, so a row's arithmetic differs from the exact pass only as a batched one does
        (nothing in float64 or `--batch-invariant`), and the GPU sees only the shapes
        `warm_prefills` ran at start."""
        n = len(rows)
        padded_rows, width = self.prefill_shape(n, max(lengths))
        contexts = [row.job.prompt_ids + row.generated for row in rows]
        lengths = list(lengths) + [lengths[-1]] * (padded_rows - n)
        contexts += [contexts[-1]] * (padded_rows - n)
        out = self._prefill_forward(
            [c[:m] + [c[m - 1]] * (width - m) for c, m in zip(contexts, lengths, strict=True)],
            lengths,
        )
        self.stats.forward_passes += 1
        self.stats.prefill_passes += 1
        self.dynamic_prefills += 1
        cache = out.past_key_values
        if self.batchable is None:
            self.batchable = isinstance(cache, DynamicCache) and all(
                type(layer) is DynamicLayer for layer in cache.layers
            )
            if not self.batchable:
                log.warning("this model's KV cache cannot be merged; requests run one at a time")
        for row, m in zip(rows, lengths, strict=False):
            row.kv_len = m
        return cache, self.select(out.logits[:n], rows)

    def _prefill_forward(self, ids: list[list[int]], lengths: list[int]) -> Any:
        """The forward pass over right-padded `ids` (row i: `lengths[i]` real tokens); its
        output, with `logits` `[rows, vocab]` at each row's last real position."""
        width = len(ids[0])
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
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
        elif self.logits_to_keep:
            extra["logits_to_keep"] = 1
        out = self.model(input_ids=tensor, use_cache=True, **extra)
        if last_column is None:
            out.logits = out.logits[:, -1, :]
        else:
            out.logits = out.logits[torch.arange(len(ids), device=self.device), last_column]
        return out

    def warm_prefills(self) -> None:
        """Run every prefill bucket once (CUDA, at start: cuBLAS and cuDNN choose kernels and
        build plans per new shape, which cost the first request after start ~0.7 s on an H200):
        each (rows, width) bucket whose rectangle a prefill of `prefill_budget` real tokens can
        reach, with padding (a masked pass) and without. Nothing is kept or counted. With the
        static prefill, each is captured into its graph instead (`_warm_static`)."""
        if not (self.prefill_buckets and self.batchable and self.logits_to_keep):
            return
        rows_list = row_buckets(self.max_batch_size)
        # prefill_groups pads a group by at most PREFILL_PADDING, and buckets at most double
        # rows and width: no group of `prefill_budget` real tokens exceeds this rectangle
        most = int(4 * (1 + PREFILL_PADDING) * max(self.prefill_budget, self.prefill_longest))
        shapes = [(r, w) for r in rows_list for w in self.prefill_widths if r * w <= most]
        started = time.perf_counter()
        log.info(
            "prefill warm-up: %d shapes%s",
            len(shapes),
            "" if self.prefill_pass is None else ", through the static prefill",
        )
        if self.prefill_pass is not None:
            self._warm_static(shapes, started)
            shapes = []
        for done, (r, w) in enumerate(shapes, 1):
            log_progress("prefill warm-up", done - 1, len(shapes), "shapes", started)
            try:
                for short in (0, 1):  # no padding, then the last row one token short
                    lengths = [w] * (r - 1) + [w - short if w > 1 else w]
                    self._prefill_forward([[0] * w] * r, lengths)
            except torch.OutOfMemoryError:  # a real prefill of this shape would fail too
                log.warning("prefill warm-up: %d x %d tokens do not fit; stopped there", r, w)
                break
            self.warm_shapes.append((r, w))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        static = self.prefill_pass
        log.info(
            "warmed %d prefill shapes (rows %s x widths %s) in %.1f s%s",
            len(self.warm_shapes),
            rows_list,
            self.prefill_widths,
            time.perf_counter() - started,
            ""
            if static is None
            else f", static prefill: {static.runner.graphs} captured into CUDA graphs"
            + (
                f" (graphs given up: {static.runner.graph_error})"
                if static.runner.graph_error
                else ""
            ),
        )

    def _warm_static(self, shapes: list[tuple[int, int]], started: float) -> None:
        """Each (rows, width) of `shapes` through the static prefill once, largest first (the
        graphs' shared pool then has room for the smaller ones), into the empty cache's slots:
        on CUDA each is captured into its graph (prefill_graphs.py: up to MAX_GRAPHS). The
        pass's replay and eager counters start from 0 afterwards (captures stay counted)."""
        static = self.prefill_pass
        assert static is not None and static.cache.rows == 0
        longest = static.cache.capacity - 1  # a row's columns, and the one its next token takes
        ordered = sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)
        for done, (r, w) in enumerate(ordered):
            log_progress("prefill warm-up", done, len(ordered), "shapes", started)
            m = min(w, longest)
            try:  # the last row one token short, as a real group's shorter rows are
                static.run([[0] * m] * (r - 1) + [[0] * max(m - 1, 1)])
            except torch.OutOfMemoryError:  # a real prefill of this shape would fail too
                log.warning("prefill warm-up: %d x %d tokens do not fit; skipped", r, w)
                continue
            self.warm_shapes.append((r, w))
        self.warm_shapes.sort()
        static.runner.replays = static.runner.eager_passes = static.runner.padded_tokens = 0

    def prefill_chunk(self, row: Row, start: int, end: int) -> list[int] | None:
        """Tokens `start:end` of a long context into the row's own cache (`partial`); after its
        last chunk, its first token (and its whole cache is `partial`)."""
        context = row.context()
        ids = torch.tensor([context[start:end]], dtype=torch.long, device=self.device)
        with changing_shapes(self.device):  # the chunk against every chunk before it
            out = self.model(
                input_ids=ids, past_key_values=row.partial, use_cache=True, logits_to_keep=1
            )
        self.stats.forward_passes += 1
        self.stats.prefill_chunks += 1
        row.partial, row.prefilled = out.past_key_values, end
        if end < len(context):
            return None
        self.stats.prefill_passes += 1
        row.kv_len = len(context)
        return self.select(out.logits[:, -1, :], [row])

    # ----- the running batch ---------------------------------------------------------------------

    def join(
        self,
        cache: DynamicCache | StaticRows,
        rows: list[Row],
        select: list[int],
        lengths: list[int],
        running: int,
    ) -> None:
        """Append prefilled rows (rows `select` of `cache`, `lengths` tokens each, their first
        token in `next_input`) to the running batch's cache after its `running` rows (rows a
        static prefill wrote into their slots already: `select` of them stay)."""
        if self.static is not None:
            first = self.static.cache.rows
            if isinstance(cache, StaticRows):
                assert cache.first == first, (cache, first)
                self.static.cache.take_rows(select, lengths)
            else:
                self.static.cache.add_rows(cache, select, lengths)
            self.static.feed(first, [row.next_input for row in rows])
            sampler = self.static.sampler
            if sampler is not None:  # the rows' settings, between steps (never in a graph)
                for slot, row in enumerate(rows, start=first):
                    sampler.set_row(
                        slot,
                        row.job.sampling,
                        min_new_tokens=row.job.min_new_tokens,
                        generated=len(row.generated),
                        seen_ids=sorted(row.seen),
                    )
        elif self.batchable:
            assert isinstance(cache, DynamicCache)
            if self.kv is None:
                self.kv = SlotCache(len(cache.layers), self.max_batch_size, self.loaded.max_context)
            self.kv.add_rows(cache, select, lengths)
        else:  # one row at a time: it keeps the cache its model made
            assert running == 0 and len(rows) == 1 and isinstance(cache, DynamicCache)
            self.solo = cache
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, running + len(rows))

    def keep(self, keep: list[int]) -> list[int]:
        """Drop rows not in `keep` (not empty) from the cache; the new row order as old row
        indices (the cache moves the last rows into the freed slots)."""
        if self.static is not None and self.static.cache.rows:
            order = self.static.cache.keep(keep)
            sampler = self.static.sampler
            if sampler is not None:  # the moved rows' settings follow their cache
                for slot, old in enumerate(order):
                    if old != slot:
                        sampler.move_row(old, slot)
            return order
        if self.kv is not None and self.kv.rows:
            return self.kv.keep(keep)
        return keep

    def clear(self) -> None:
        self.solo = None
        if self.kv is not None:
            self.kv.clear()
        if self.static is not None:
            self.static.cache.clear()

    # ----- decoding ------------------------------------------------------------------------------

    def launch(self, rows: list[Row]) -> Step:
        """One decode step over the running batch. The static step returns with its tokens'
        copy to the host in flight (`Step.tokens` waits for it); the eager step with them."""
        static = self.static
        if static is not None and static.cache.rows:
            assert static.samples
            chosen = static.step()  # inputs: the tokens already in its device buffer
            static.advance()
            buffer = self._host_tokens[self._parity]
            self._parity ^= 1
            buffer[: len(rows)].copy_(chosen, non_blocking=True)
            step = Step(rows, buffer=buffer, event=record_step_event(self.device))
        else:
            step = Step(rows, tokens=self.select(self._eager_step(rows), rows))
        self.stats.forward_passes += 1
        self.stats.decode_steps += 1
        size = len(rows)
        self.stats.batch_sizes[size] = self.stats.batch_sizes.get(size, 0) + 1
        return step

    def _eager_step(self, rows: list[Row]) -> torch.Tensor:
        """A decode step over the slot cache (or a solo row's own cache); the last logits."""
        device = self.device
        input_ids = torch.tensor(
            [[row.next_input] for row in rows], dtype=torch.long, device=device
        )
        past: SlotCache | DynamicCache
        if self.kv is not None and self.kv.rows:
            positions = self.kv.begin_step()
            mask = self.kv.attention_mask()
            past = self.kv
        else:
            assert self.solo is not None and len(rows) == 1
            positions = torch.tensor([rows[0].kv_len], dtype=torch.long, device=device)
            mask = torch.ones((1, rows[0].kv_len + 1), dtype=torch.long, device=device)
            past = self.solo
        with changing_shapes(device):  # one column wider every step
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions[:, None],
                past_key_values=past,
                use_cache=True,
            )
        if past is self.kv:
            self.kv.end_step()
        return out.logits[:, -1, :]

    def select(self, logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
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
