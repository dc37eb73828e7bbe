"""The static decode step: fixed device buffers, replayed from CUDA graphs on a GPU.

Why. On a GPU an eager decode step is bound by the host: ~1,000 kernel launches from Python per
forward pass (~35 ms for smollm2-135m on an H100 host, against ~2.5 ms of GPU work), plus the
slot cache's host-side row index and a width that changes every step. A CUDA graph replays the
whole step with one launch, but only over memory whose addresses and shapes never change. So
everything a step reads lives in buffers allocated once, at start:

- `input_ids` and `positions` `[slots]` (long): each row's last token and its token count, which is
  also its position id and the cache column its new key is written to;
- the KV cache, per layer `[slots, kv_heads, capacity + 1, head_dim]` with a fixed capacity; row r
  lives in slot r, right-padded (the same layout as kv_cache.SlotCache, so joins and leaves copy
  only the rows that join or move); column `capacity` is reserved for the padding writes of a
  static prefill (prefill_graphs.py) and never read (a step's width is at most `capacity`);
- the attention mask is built on the device inside the step, from `positions`: row r attends to
  columns `0..positions[r]`; columns beyond are masked whatever they hold (stale keys of rows that
  left, zeros), so a row's result never depends on them;
- the logits are the graph's own output buffer.

A step pads the running rows up to a batch-size bucket (`ROW_BUCKETS`) and the attention width
(longest row + 1) up to a width bucket, and runs (CUDA: replays) the step captured for that
(rows, width) pair. Padding rows read token 0 at position 0 and write column 0 of free slots
only; padding columns are masked. Width buckets exist because attending over the whole capacity
costs attention compute proportional to the capacity at every step (8,192 columns for a
100-token stream); a grid of power-of-two widths keeps that within 2x of what is needed for a
few dozen graphs (a paged kernel, as vLLM and SGLang use, would avoid even that; it needs custom
attention kernels). The host writes the step's positions into the static buffers with one
host-to-device copy; the chosen tokens are written into `input_ids` on the device, as the next
step's inputs (a joining row's first token is fed there, a leaving row's slot takes the moved
row's), and the engine copies them to the host without blocking (model_runner.py: overlapped
steps).

`--compile` (`compile_forward`) runs the step's model forward through torch.compile's Inductor
before the graphs are captured: the same tokens (float64, tests/test_engine_compile.py), far fewer
kernels, from one compile (a compiled step has no 1-row bucket: one row runs in the 2-row
graph, see `compile_forward`). The sampler stays eager, inside the same graph (`_forward`): its
scans over the vocabulary are what Inductor failed on (pytorch/pytorch#180221, see
`compile_forward`), and its float64 arithmetic stays sampling.py's own. A step that cannot be compiled never stops the engine: the
decoder warns, drops the compiled forward and runs (and captures) the eager one
(`compile_error`, reported by /health and /metrics).

On a CPU the same step runs eagerly (no capture), with exact rows and width by default: padding
buys nothing there. A prefill writes its rows' keys straight into their slots through the static
prefill pass (prefill_graphs.py; `take_rows`), or runs eagerly into a `DynamicCache` whose rows
are copied into the static cache when they join (`add_rows`: chunked long prompts).

Memory (CUDA): rows and capacity come from free GPU memory at start (`plan_cache`): the cache gets
`gpu_memory_fraction` of what is free after loading the model, as many rows as fit up to
`max_rows` with at least `MIN_CAPACITY` columns each (or the model's whole context when it is
shorter); a capacity below the model's context lowers the context the engine advertises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .device_sampling import DeviceSampler

log = logging.getLogger("guardstream.engine")

#: Batch-size buckets a step pads its rows up to (one graph per bucket and width).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The narrowest attention width bucket; the next ones double up to the capacity.
MIN_WIDTH_BUCKET = 128
#: Capacity is a multiple of this.
CAPACITY_QUANTUM = 64
#: The fewest columns a row gets before rows are given up for them (or the whole context).
MIN_CAPACITY = 4096
#: Rows the cache holds at most by default (CUDA).
MAX_ROWS = 256
#: Columns per row of a static cache on a CPU (tests and `--static-decode` there), at most.
CPU_CAPACITY = 2048
#: A start-up line every this many decode buckets warmed up or captured (CUDA: 63 buckets):
#: a start-up cut by a time limit still shows how far it got.
PROGRESS_EVERY = 16


def bucket(n: int, buckets: Sequence[int] | None) -> int:
    """The smallest bucket >= n (n itself without buckets, or above the largest bucket)."""
    if not buckets:
        return n
    for size in buckets:
        if size >= n:
            return size
    return n


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """`ROW_BUCKETS` below `max_rows`, then `max_rows` itself (the slot count: a plan's 83 rows
    get a last bucket of 83, not 128 rows of which 45 have no memory)."""
    return (*(b for b in ROW_BUCKETS if b < max_rows), max_rows)


def width_buckets(capacity: int, smallest: int = MIN_WIDTH_BUCKET) -> tuple[int, ...]:
    """Doubling widths from `smallest` below `capacity`, then `capacity` itself."""
    out: list[int] = []
    width = smallest
    while width < capacity:
        out.append(width)
        width *= 2
    out.append(capacity)
    return tuple(out)


@dataclass(frozen=True)
class CachePlan:
    """Rows x capacity of a static cache and the bytes it takes."""

    rows: int
    capacity: int
    nbytes: int


def plan_cache(
    *,
    free_bytes: int,
    fraction: float,
    bytes_per_token: int,
    max_context: int,
    max_rows: int = MAX_ROWS,
    min_capacity: int = MIN_CAPACITY,
    quantum: int = CAPACITY_QUANTUM,
) -> CachePlan:
    """Size a static KV cache from free device memory (a pure function: tested on a CPU).

    The cache gets `fraction` of `free_bytes` (the rest is left for prefill activations, the
    graphs' pool and the allocator). Rows come first: `max_rows` rows of the whole context when
    they fit; else the capacity shrinks (a multiple of `quantum`) until `max_rows` fit, but not
    below `min_capacity` (or the whole context, when shorter); past that, rows are given up.
    At least one row of `quantum` columns, or an error when even that does not fit."""
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu memory fraction must be in (0, 1], not {fraction}")
    budget = int(free_bytes * fraction)
    context = -(-max_context // quantum) * quantum
    per_row_full = context * bytes_per_token
    if budget >= max_rows * per_row_full:
        return CachePlan(max_rows, context, max_rows * per_row_full)
    floor = min(context, -(-min_capacity // quantum) * quantum)
    capacity = (budget // (max_rows * bytes_per_token)) // quantum * quantum
    if capacity >= floor:
        return CachePlan(max_rows, capacity, max_rows * capacity * bytes_per_token)
    capacity = floor
    rows = budget // (capacity * bytes_per_token)
    if rows < 1:
        capacity = (budget // bytes_per_token) // quantum * quantum
        rows = 1
        if capacity < quantum:
            raise MemoryError(
                f"no room for a KV cache: {budget} bytes for {bytes_per_token} bytes per token"
            )
    return CachePlan(rows, capacity, rows * capacity * bytes_per_token)


def plan_free_memory(
    template: DynamicCache, fraction: float, max_context: int, max_rows: int
) -> CachePlan:
    """`plan_cache` for a cache shaped as `template` (a prefill's) on its CUDA device, from the
    memory free there now (the decode cache's and the judge pool's plans)."""
    free, _total = torch.cuda.mem_get_info(template.layers[0].keys.device)
    return plan_cache(
        free_bytes=free,
        fraction=fraction,
        bytes_per_token=cache_bytes_per_token(template),
        max_context=max_context,
        max_rows=max_rows,
    )


def cache_bytes_per_token(template: DynamicCache) -> int:
    """Bytes one token takes in every layer's keys and values (from a prefill's cache)."""
    total = 0
    for layer in template.layers:
        keys, values = layer.keys, layer.values
        total += keys.shape[1] * keys.shape[3] * keys.element_size()
        total += values.shape[1] * values.shape[3] * values.element_size()
    return total


class StaticLayer(CacheLayerMixin):
    """One layer's fixed buffers; `update` is called by the model's attention in a step."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: StaticSlotCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self._owner = owner
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("StaticLayer buffers are allocated by StaticSlotCache")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new key/value at its own column (`positions`); return the step's
        `[rows, :, :width]` window. Device ops only: no host sync, nothing sized by data."""
        owner = self._owner
        rows, width = owner.step_rows, owner.step_width
        if key_states.shape[-2] != 1 or rows == 0:
            raise RuntimeError("StaticSlotCache serves decode steps (one new token per row) only")
        assert self.keys is not None and self.values is not None
        columns = owner.positions[:rows].view(rows, 1, 1, 1)
        self.keys[:rows].scatter_(2, columns.expand_as(key_states), key_states)
        self.values[:rows].scatter_(2, columns.expand_as(value_states), value_states)
        return self.keys[:rows, :, :width], self.values[:rows, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.step_width - 1 + query_length, 0

    def get_seq_length(self) -> int:
        return max(self._owner.step_width - 1, 0)

    def get_max_length(self) -> int:
        return -1


class StaticSlotCache(Cache):
    """Fixed `[slots, kv_heads, capacity + 1, head_dim]` buffers per layer (the last column
    reserved: `reserved`) plus the step's static inputs (worker thread only). Same join/leave
    protocol as kv_cache.SlotCache: `add_rows` (or `take_rows`), `keep`, `clear`; `lengths` is
    each row's token count, row r in slot r."""

    def __init__(self, template: DynamicCache, slots: int, capacity: int) -> None:
        self.max_slots = slots  # interface of SlotCache (benchmarks read it)
        self.max_length = capacity
        layers = []
        for source in template.layers:
            k, v = source.keys, source.values
            keys = k.new_zeros((slots, k.shape[1], capacity + 1, k.shape[3]))
            values = v.new_zeros((slots, v.shape[1], capacity + 1, v.shape[3]))
            layers.append(StaticLayer(self, keys, values))
        self._static_layers = layers
        super().__init__(layers=list(layers))
        device = layers[0].keys.device
        self.input_ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, dtype=torch.long, device=device)
        self.lengths: list[int] = []
        self.step_rows = 0  # the step's (padded) rows and width: read while capturing
        self.step_width = 0
        self.copied_bytes = 0

    # ----- sizes ---------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self._static_layers[0].keys.shape[0]

    @property
    def capacity(self) -> int:
        """Columns a row may use (the buffers have one more: `reserved`)."""
        return self._static_layers[0].keys.shape[2] - 1

    @property
    def reserved(self) -> int:
        """The column no step reads: a static prefill's padding queries and rows write there."""
        return self.capacity

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (keys, values) buffers, whole (a static prefill writes into them)."""
        return [(layer.keys, layer.values) for layer in self._static_layers]  # type: ignore[misc]

    @property
    def device(self) -> torch.device:
        return self._static_layers[0].keys.device

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self._static_layers)

    # ----- joining and leaving -----------------------------------------------------------------

    def add_rows(
        self, prefill: DynamicCache, select: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Copy rows `select` of a (right-padded) prefill cache into the next free slots."""
        first = self.rows
        count = len(select)
        width = min(prefill.layers[0].keys.shape[2], self.capacity)
        if first + count > self.slots or max(lengths) >= self.capacity:
            raise RuntimeError(
                f"static KV cache full: {first + count} rows of up to {max(lengths) + 1} "
                f"tokens in {self.slots} x {self.capacity}"
            )
        index = torch.tensor(list(select), dtype=torch.long, device=self.device)
        everything = count == prefill.layers[0].keys.shape[0]
        for layer, source in zip(self._static_layers, prefill.layers, strict=True):
            keys = source.keys[:, :, :width]
            values = source.values[:, :, :width]
            if not everything:
                keys, values = keys.index_select(0, index), values.index_select(0, index)
            layer.keys[first : first + count, :, :width] = keys
            layer.values[first : first + count, :, :width] = values
            self.copied_bytes += keys.nbytes + values.nbytes
        self.lengths.extend(lengths)

    def take_rows(self, select: Sequence[int], lengths: Sequence[int]) -> None:
        """Rows a static prefill wrote in place, row i in slot `rows + i`, join: those of
        `select` (ascending; `lengths` tokens each), moved down into consecutive slots where
        rows before them did not join (finished by their first token)."""
        first = self.rows
        if first + len(select) > self.slots or (lengths and max(lengths) >= self.capacity):
            raise RuntimeError(
                f"static KV cache full: {first + len(select)} rows of up to "
                f"{max(lengths) + 1} tokens in {self.slots} x {self.capacity}"
            )
        for j, (i, width) in enumerate(zip(select, lengths, strict=True)):
            if i == j:
                continue
            assert i > j  # ascending: a source slot is never one already overwritten
            for layer in self._static_layers:
                layer.keys[first + j, :, :width].copy_(layer.keys[first + i, :, :width])
                layer.values[first + j, :, :width].copy_(layer.values[first + i, :, :width])
                self.copied_bytes += 2 * layer.keys[0, :, :width].nbytes
        self.lengths.extend(lengths)

    def keep(self, keep: Sequence[int]) -> list[int]:
        """Drop every row not in `keep`; return the new row order as old row indices (the rows
        beyond the new count move into the freed slots, as in SlotCache.keep)."""
        count = len(keep)
        kept = set(keep)
        holes = [i for i in range(count) if i not in kept]
        movers = [i for i in range(count, self.rows) if i in kept]
        order = list(range(count))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
            width = self.lengths[mover]
            for layer in self._static_layers:
                layer.keys[hole, :, :width].copy_(layer.keys[mover, :, :width])
                layer.values[hole, :, :width].copy_(layer.values[mover, :, :width])
                self.copied_bytes += 2 * layer.keys[0, :, :width].nbytes
            # the row's next input, kept on the device (a device copy: no host sync)
            self.input_ids[hole].copy_(self.input_ids[mover])
        self.lengths = [self.lengths[i] for i in order]
        return order

    def clear(self) -> None:
        """Forget every row (the buffers stay: their addresses are baked into the graphs)."""
        self.lengths = []


#: torch.compile's backend for `compile_forward` (a test swaps in one that raises).
COMPILE_BACKEND: str | Callable[..., Any] = "inductor"


def compile_forward(forward: Callable[[int, int], torch.Tensor], shapes: int) -> Any:
    """`forward` (the model's part of a step at a (rows, width) bucket) through torch.compile's
    Inductor: the ~1,000 kernels of an eager step fused into far fewer. Dynamic shapes: a few
    compiles cover every bucket, where static ones would compile each of the dozens of buckets
    (each ~1-2 minutes for smollm2-135m's 30 layers on a CPU). Measured on a CPU over the full
    CUDA grid (rows 1..256 x widths 128..8192, 63 buckets, in the capture's order), tiny-random
    and a 2-layer model of smollm2's architecture: 2 graphs, rows and width symbolic (rows >=
    2), then one row specialised (dynamo specialises sizes of 0 and 1; `backed_size_oblivious`,
    which would not, fails to compile this step: PendingUnbackedSymbolNotFound). So a compiled
    `StaticDecoder` with row buckets has no 1-row bucket: one graph covers every bucket.
    `StaticDecoder.compiles` counts them and the start-up log names each. The recompile limit
    is raised to the buckets' count so no bucket falls back to eager. Not "reduce-overhead":
    the engine captures its own CUDA graphs around the compiled step.

    The sampler is not compiled (StaticDecoder._forward). Its cumulative sums run over the whole
    vocabulary of a few rows, which Inductor on CUDA turns into a split scan (TritonSplitScanKernel,
    no x dimension in its blocks), and they read per-row values broadcast along the vocabulary
    (the row's max logit, its temperature): torch 2.11's Triton codegen then fails with
    `InductorError: TypeError: list indices must be integers or slices, not NoneType` in
    `TritonSymbols.get_block_shape` (pytorch/pytorch#180221, fixed by pytorch/pytorch#180369;
    seen on an H200 with smollm2-135m's 49,152-token vocabulary, not with tiny-random's). No
    Inductor setting turns split scans off (block pointers, TMA, cooperative reductions and
    nd-tiling are other paths), so the narrowest way round is to keep the scans out of the
    graph Inductor compiles."""
    import torch._dynamo

    config = torch._dynamo.config
    # Floats constant: with dynamic shapes dynamo makes every float attribute of the model (norm
    # epsilons, attention scales, the embedding's norm_type) a graph input, fails to turn some
    # into tensors (`scaled_dot_product_attention`'s scale, `F.embedding`'s norm_type), and
    # traces the whole step again with them constant: a third of a compile thrown away
    # (smollm2-135m's 30 layers on a CPU: 65 of 204 s). The engine compiles nothing else.
    config.specialize_float = True
    config.recompile_limit = max(config.recompile_limit, shapes + 8)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * shapes + 64)
    return torch.compile(forward, dynamic=True, backend=COMPILE_BACKEND)


def dynamo_graphs() -> int:
    """Graphs torch.compile's dynamo has compiled in this process so far (every compile or
    recompile of any function adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def log_progress(what: str, done: int, total: int, unit: str, started: float) -> None:
    """A start-up line every `PROGRESS_EVERY` of `total` things done (not after the last: the
    stage's own summary line says that), with the seconds since the stage `started`."""
    if 0 < done < total and done % PROGRESS_EVERY == 0:
        log.info("%s: %d of %d %s, %.1f s", what, done, total, unit, time.perf_counter() - started)


def describe_error(error: BaseException, limit: int = 300) -> str:
    """`Type: the message's first paragraph` on one line, at most `limit` characters (a log line,
    /health): Inductor's errors name the failure there and add advice after a blank line."""
    paragraph = str(error).strip().split("\n\n")[0]
    message = " ".join(line.strip() for line in paragraph.splitlines() if line.strip())
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def warm_up(runs: Sequence[Callable[[], object]]) -> None:
    """Each of `runs` once, eagerly, on a side stream, before they are captured, as PyTorch's
    CUDA-graph notes ask: lazy initialisation, kernel choice and autotuning, workspaces and the
    allocator's warm-up happen outside the capture. CUDA only."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for run in runs:
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(
    run: Callable[[], torch.Tensor], pool: object
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run` captured into a CUDA graph that allocates from `pool` (shared by a decoder's or a
    judge's graphs: they replay one at a time on one stream), and its output tensor, which every
    replay rewrites. The capture runs nothing: replay it for a result (`warm_up` first)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


class StaticDecoder:
    """Runs decode steps over a `StaticSlotCache`: eagerly, or (CUDA) by replaying the graph
    captured for the step's (rows bucket, width bucket) at `capture`.

    `rows` / `widths`: the buckets a step is padded up to; None: exact (no padding, which is
    what an eager step on a CPU wants)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticSlotCache,
        *,
        rows: Sequence[int] | None = None,
        widths: Sequence[int] | None = None,
        logits_to_keep: bool = True,
        sampler: DeviceSampler | None = None,
        compile_step: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.row_buckets = tuple(rows) if rows else None
        self._uncompiled_rows = self.row_buckets  # the buckets again if compiling is given up
        if compile_step and self.row_buckets and self.row_buckets[:2] == (1, 2):
            # A step of one row runs in the 2-row graph: dynamo specialises a size of 1, so a
            # 1-row bucket costs a compile of its own (2 graphs for every bucket, against 1),
            # the longest part of a compiled start: smollm2-135m's architecture on a CPU
            # compiled 102 s (rows >= 2) + 59 s (1 row). A step's weights are read once for
            # all its rows, so a GPU runs 2 rows in about the time of 1.
            self.row_buckets = self.row_buckets[1:]
        self.width_buckets = tuple(widths) if widths else None
        self._logits_to_keep = logits_to_keep
        config = getattr(model, "config", None)
        # sdpa and flex read a boolean mask (True: attend); eager attention adds the mask.
        self._additive = getattr(config, "_attn_implementation", "sdpa") == "eager"
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool: object | None = None
        self._staging: torch.Tensor | None = None
        self.steps = 0
        self.replays = 0
        self.compiled = compile_step  # the model's forward runs compiled (False after a failure)
        self.compile_error: str | None = None  # why compiling failed, when it did
        self._compiled: Any = None
        self._compiled_keys: set[tuple[int, int]] = set()  # graphs captured compiled
        self.compiles = 0  # graphs dynamo compiled for the step's forward (`_model_logits`)
        self.compile_seconds = 0.0  # the calls that compiled them took this long
        self._announced = False  # the first compiled call was logged
        if compile_step:
            self._compiled = compile_forward(
                self._logits, len(self.row_buckets or (0,)) * len(self.width_buckets or (0,))
            )

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def shape(self, lengths: Sequence[int]) -> tuple[int, int]:
        """The (rows, width) a step over rows of `lengths` tokens runs at."""
        rows = bucket(len(lengths), self.row_buckets)
        width = bucket(max(lengths) + 1, self.width_buckets)
        return min(rows, self.cache.slots), min(width, self.cache.capacity)

    @property
    def samples(self) -> bool:
        """Whether `step` returns chosen tokens (a `DeviceSampler` runs inside the step)."""
        return self.sampler is not None

    def step(self, tokens: Sequence[int] | None = None) -> torch.Tensor:
        """One decode step: row r of the cache takes `tokens[r]` (None: the tokens already in
        the device's input buffer, i.e. the previous step's choices and the joiners' `feed`);
        returns the real rows' next tokens `[rows]` with a sampler (`samples`), which also become
        the next step's inputs on the device, else their logits `[rows, vocab]` (a view of a
        static buffer, valid until the next step). `advance` then counts the fed tokens."""
        cache = self.cache
        n = cache.rows
        assert n > 0 and (tokens is None or len(tokens) == n)
        rows, width = self.shape(cache.lengths)
        pad = rows - n
        # One host-to-device copy of the step's inputs; padding rows: token 0 at position 0.
        fed = list(tokens) + [0] * pad if tokens is not None else [0] * rows
        host = torch.tensor([fed, cache.lengths + [0] * pad], dtype=torch.long)
        if cache.device.type == "cuda":
            # two staging buffers, alternating: with overlapped steps the host writes the next
            # step's inputs while the previous step's copy may not have run yet
            staging = self._pinned(cache.slots)[self.steps % 2][:, :rows]
            staging.copy_(host)
            if tokens is not None:
                cache.input_ids[:rows].copy_(staging[0], non_blocking=True)
            cache.positions[:rows].copy_(staging[1], non_blocking=True)
        else:
            if tokens is not None:
                cache.input_ids[:rows].copy_(host[0])
            cache.positions[:rows].copy_(host[1])
        if tokens is None and pad:
            cache.input_ids[n:rows].zero_()
        key = (rows, width)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            logits = self._outputs[key]
            self.replays += 1
        else:
            logits = self._forward(rows, width)
        self.steps += 1
        if self.sampler is not None:  # the chosen tokens are the next step's inputs, on device
            cache.input_ids[:n].copy_(logits[:n])
        return logits[:n]

    def feed(self, first: int, tokens: Sequence[int]) -> None:
        """The next input of rows `first..` (rows that just joined: their first token)."""
        if tokens:
            values = torch.tensor(list(tokens), dtype=torch.long)
            self.cache.input_ids[first : first + len(tokens)].copy_(values)

    def advance(self) -> None:
        """Every row holds one more token (after a step's tokens were accepted)."""
        self.cache.lengths = [n + 1 for n in self.cache.lengths]

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        """The step itself: device ops over the static buffers only (what a graph captures):
        the forward pass (compiled with `compiled`), then (with a sampler, never compiled:
        `compile_forward`) the selection of every row's next token."""
        logits = self._model_logits(rows, width)
        if self.sampler is not None:
            return self.sampler.sample(logits)
        return logits

    def _model_logits(self, rows: int, width: int) -> torch.Tensor:
        """The model's part of a step, compiled while compiling works. A compiled forward that
        raises (Inductor failing on some kernel, at its first call for a shape) is given up for
        good and the step runs eagerly: nothing of the failed call ran, or it wrote the same
        cache columns the eager call rewrites. Running out of memory is not a compile failure
        (the caller handles it as for the eager step)."""
        compiled = self._compiled
        if compiled is not None:
            graphs = dynamo_graphs()
            started = time.perf_counter()
            if not self._announced:  # before it: a start-up cut while compiling says so
                self._announced = True
                log.info(
                    "compiling the decode step's forward (torch.compile, %s, dynamic shapes) "
                    "at its first call: %d rows x %d columns",
                    getattr(COMPILE_BACKEND, "__name__", COMPILE_BACKEND),
                    rows,
                    width,
                )
            try:
                logits = compiled(rows, width)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # any compile failure: run uncompiled
                self._give_up_compiling(error)
            else:
                self._count_compiles(dynamo_graphs() - graphs, rows, width, started)
                return logits  # type: ignore[no-any-return]
        return self._logits(rows, width)

    def _count_compiles(self, new: int, rows: int, width: int, started: float) -> None:
        """Count and log the graphs a compiled call just compiled (none: a cached graph ran)."""
        if new <= 0:
            return
        seconds = time.perf_counter() - started
        self.compiles += new
        self.compile_seconds += seconds
        log.info(
            "compiled the decode step's forward for %d rows x %d columns in %.1f s "
            "(graphs so far: %d, %.1f s compiling)",
            rows,
            width,
            seconds,
            self.compiles,
            self.compile_seconds,
        )

    def _give_up_compiling(self, error: BaseException) -> None:
        self._compiled = None
        self.compiled = False
        self.row_buckets = self._uncompiled_rows
        self.compile_error = describe_error(error)
        log.warning("compiling the decode step failed, it runs uncompiled: %s", self.compile_error)

    def _logits(self, rows: int, width: int) -> torch.Tensor:
        """The forward pass of a step over the static buffers: each row's last logits."""
        cache = self.cache
        cache.step_rows, cache.step_width = rows, width
        positions = cache.positions[:rows]
        visible = cache.columns[:width][None, :] <= positions[:, None]  # [rows, width]
        mask = visible[:, None, None, :]
        if self._additive:
            dtype = cache.layers[0].keys.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        extra: dict[str, object] = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(
            input_ids=cache.input_ids[:rows, None],
            attention_mask=mask,
            position_ids=positions[:, None],
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        return out.logits[:, -1, :]

    def _pinned(self, slots: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.zeros((2, 2, slots), dtype=torch.long).pin_memory()
        return self._staging

    # ----- CUDA graphs -------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture one graph per (rows bucket, width bucket), largest first (the pool then has
        room for the smaller ones), all sharing one private memory pool. CUDA only.

        As PyTorch's CUDA-graph notes ask: a few eager runs on a side stream first (lazy
        initialisation, autotuning, allocator warm-up, and with `compiled` the compiles), then
        the capture. The captured steps write padding rows and masked columns only; the cache
        holds no rows yet (and the sampler's slots, advanced by these runs, are set afresh when
        rows join). A compiled step that fails here is given up and the eager step is captured
        instead: in a warm-up run (`_model_logits` falls back, and every graph is captured
        eagerly), or in the capture itself (then every graph is captured again, eagerly: no
        mix of compiled and eager buckets)."""
        compiled = self.compiled
        try:
            self._capture()
            if self.compiled or not self._compiled_keys:
                return
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # a compiled step that cannot be captured
            if not compiled:
                raise
            if self.compiled:
                self._give_up_compiling(error)
        self._graphs.clear()
        self._outputs.clear()
        torch.cuda.synchronize()
        self._capture()

    def _capture(self) -> None:
        cache = self.cache
        assert cache.device.type == "cuda" and cache.rows == 0
        rows_list = self.row_buckets or (cache.slots,)
        widths = self.width_buckets or (cache.capacity,)
        keys = sorted(
            {(min(r, cache.slots), min(w, cache.capacity)) for r in rows_list for w in widths},
            reverse=True,
        )
        started = time.perf_counter()
        cache.input_ids.zero_()
        cache.positions.zero_()
        # every shape once eagerly (kernel choice, workspaces; compiled: the compiles)
        runs = [keys[0], *keys]
        log.info(
            "decode step warm-up: %d runs over %d buckets%s",
            len(runs),
            len(keys),
            ", compiled (the first calls compile)" if self.compiled else "",
        )

        def run(done: int, key: tuple[int, int]) -> None:
            self._forward(*key)
            log_progress("decode step warm-up", done, len(runs), "runs", started)

        warm_up([lambda done=done, key=key: run(done, key) for done, key in enumerate(runs, 1)])
        self._pool = torch.cuda.graph_pool_handle()
        self._compiled_keys.clear()
        for done, key in enumerate(keys, 1):
            if self.compiled:
                self._compiled_keys.add(key)
            self._graphs[key], self._outputs[key] = capture_graph(
                lambda key=key: self._forward(*key), self._pool
            )
            log_progress("decode graph capture", done, len(keys), "buckets", started)
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs (rows %s x widths %s) in %.1f s%s",
            len(keys),
            rows_list,
            widths,
            time.perf_counter() - started,
            f", compiled first ({self.compiles} graphs compiled in {self.compile_seconds:.1f} s)"
            if self.compiled
            else f", uncompiled ({self.compile_error})"
            if self.compile_error
            else "",
        )
