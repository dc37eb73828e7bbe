"""The static judge pass: judge sessions in a pool of fixed device buffers, replayed from CUDA
graphs on a GPU.

Why. An eager judge pass (judge_sessions.py's packed pass) is bound by the host on a GPU: an
eager forward of smollm2-135m is ~7,000 aten ops from Python (~60 ms a pass on an H200 whatever
its tokens, so judging incrementally was only 1.2x faster there than re-judging whole prefixes),
and its shapes change with every append (the prefix grows), so no graph could replay it. Here
every pass reads and writes buffers allocated once, at fixed addresses, and its shapes come
from a small grid of buckets, so each (rows, queries, width) key is captured once into a CUDA
graph and replayed with one launch (as decode_graphs.py does for decode steps):

- the pool (`JudgePool`), per layer `[slots, kv_heads, capacity + 1, head_dim]`: a session owns a
  slot from its open to its close (or expiry); its judged prefix lies in columns `0..P-1`, an
  append's chunk and the template's tail (and an answer's tokens) in the columns after it, which
  the next append overwrites: judge_sessions.py's semantics, in a slot instead of a buffer of
  its own. Column `capacity` is reserved: padding queries write there, and no pass attends to
  it (the widest window is `capacity`);
- the pass's inputs, `[rows, Q]` token ids, positions and write columns and `[rows]` slots, in
  one flat long buffer that one host-to-device copy fills (from pinned memory on CUDA);
- the mask, built on the device inside the pass from `positions`: query (r, j) attends to the
  columns `c <= positions[r, j]` of its row's window;
- the logits, at the last query of each row only (`logits_to_keep=1`).

A pass pads its sessions' rows up to a rows bucket (`row_buckets` of `MAX_BATCH`), each row's
new tokens up to a query-width bucket Q (`QUERY_BUCKETS`) and the attention width (the longest
row's prefix and new tokens) up to a width bucket (`width_buckets` of the capacity). The queries
of a row are left-padded: its real tokens are the last ones, so its verdict's logits are at the
last query whatever its count. What padding does:
- a padding query (before a row's real ones) reads token 0 at the position of the row's last
  real token (so it sees what that token sees: never an empty row of the mask) and writes its
  key and value in the reserved column, which no query reads;
- a padding row reads token 0 at position 0 of slot 0 (column 0 only: whatever it holds, a
  finite value) and writes the reserved column of slot 0 only;
- a padding column (beyond a row's last real position, up to the width) is masked: stale keys
  of a slot's earlier session, or of this session's scratch tokens, never reach a verdict.
tests/test_judge_sessions.py checks these: the verdicts are the packed pass's and those of
judging from scratch, bitwise in `--batch-invariant` mode, and a slot's real columns hold the
packed session's keys after passes with padding.

Query buckets: an append is a sentence chunk and the template's tail (bench/judge.py's and the
orchestrator's sentence chunks are 15-25 tokens, the zero-shot tail 14 tokens with smollm2's
tokenizer and 32 with GPT-2's: 30-60 queries), its first one carries the head too (27-82 tokens
more), an answer token is 1 query, a short chunk ("Done.") a few plus the tail. Doubling buckets
1 / 16 / 32 / 64 / 128 / 256 keep padding under 2x at every size; a bucket no pass uses costs
nothing (graphs are captured at first use). A longer append (a session rebuilt from its whole
text) runs at its own width, eagerly.

CUDA: a key's graph is captured at its first use (warm-up on a side stream, then the capture into
the judge's own memory pool, shared by its graphs, decode_graphs.warm_up/capture_graph), at most
`MAX_GRAPHS` of them: the grid is ~200 keys and capturing it all at start would take minutes of
start-up, while a replica's traffic settles on a few dozen (rows follow the streams, Q the chunk
sizes, width the answers' lengths); a capture costs about three eager passes, and each graph
holds its kernels' parameters; a key past the bound runs eagerly (`eager_passes`). A capture
that fails gives graphs up for good (`graph_error`, logged) and passes run eagerly. Eager passes
(any device) leave cuDNN attention out (attention_backends.py); the graphs are captured the
same way. Counters: `captures`, `replays`, `eager_passes`.

The static prefill (prefill_graphs.py) is this same pass over the decode cache's own slots
(`JudgePool(buffers=)`): a new row's context at columns `0..m-1` of the slot it will decode in,
its bucketed keys captured at start.

CPU: the packed pass stays the default: there a pass is bound by its arithmetic, and padding
costs real FLOPs (and the slot gather a copy of each window per layer). The static pass runs
eagerly on a CPU when asked (tests, `bench/judge.py --judge-pass static`): the same buckets, so
every line of it runs in the CPU suite.

Memory (CUDA): the pool is built when the engine's first judge session opens (on the worker
thread: JudgeSessions.ready), so a replica that only generates never gives its decode cache's
memory to it; or, with `--static-judge` (Engine(judge_pool_at_start=)), at the engine's start,
before the decode cache's plan (decode_graphs.plan_cache, which then sees the pool's memory
gone). Either way `JUDGE_MEMORY_FRACTION` of the memory free then, `max_sessions` slots of `POOL_CAPACITY` columns when they fit, fewer slots (not
fewer columns, down to the model's context if shorter) when not. `POOL_CAPACITY`: a judged
prefix longer than ~4k tokens is rare (a 2,000-token answer, its conversation and the template
fit) and every slot costs its whole capacity (smollm2-135m in bf16: 23 KB a token, 94 MB a slot).
A session that would pass the capacity gets 422 `context_exceeded`, one past the slots 429.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from .attention_backends import changing_shapes
from .decode_graphs import (
    StaticLayer,
    bucket,
    capture_graph,
    describe_error,
    warm_up,
)
from .judge_attention import active, as_kind, grouped_attention

log = logging.getLogger("guardstream.engine")

#: Query-width buckets of a pass (an append's chunk and tail, or one answer token).
QUERY_BUCKETS = (1, 16, 32, 64, 128, 256)
#: Columns of a slot on CUDA (or the model's context, when shorter).
POOL_CAPACITY = 4096
#: On a CPU (tests, bench): columns and slots at most.
CPU_POOL_CAPACITY = 2048
CPU_POOL_SLOTS = 32
#: Graphs held at most (keys past it run eagerly).
MAX_GRAPHS = 64
#: Share of the GPU memory free when the pool is built that it may take.
JUDGE_MEMORY_FRACTION = 0.25


class _PoolLayer(StaticLayer):
    """One layer's slots; `update` is called by the model's attention in a pass."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write every query's key and value at its (slot, column); return the pass's window,
        `[rows, kv_heads, width, head_dim]`, gathered from the rows' slots. Device ops only."""
        pool: JudgePool = self._owner  # type: ignore[assignment]
        assert self.keys is not None and self.values is not None
        slots, columns = pool.pass_slots[:, None], pool.pass_columns
        self.keys[slots, :, columns] = key_states.transpose(1, 2)
        self.values[slots, :, columns] = value_states.transpose(1, 2)
        width = pool.step_width
        return (
            self.keys[:, :, :width].index_select(0, pool.pass_slots),
            self.values[:, :, :width].index_select(0, pool.pass_slots),
        )


class JudgePool(Cache):
    """The sessions' slots, `[slots, kv_heads, capacity + 1, head_dim]` per layer (the last
    column reserved for padding), and a pass's inputs (worker thread only; `take` and `give`
    under the sessions' lock)."""

    def __init__(
        self,
        template: DynamicCache | None,
        slots: int,
        capacity: int,
        rows: int,
        queries: int,
        *,
        buffers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """`rows` x `queries`: the largest bucketed pass, whose inputs the flat buffer holds.
        `buffers`: every layer's (keys, values), `[slots, kv_heads, capacity + 1, head_dim]`,
        to pass over instead of buffers of the pool's own (allocated shaped as `template`'s):
        the decode cache's, for a static prefill (prefill_graphs.py)."""
        self.capacity = capacity
        if buffers is None:
            assert template is not None
            buffers = [
                (
                    s.keys.new_zeros((slots, s.keys.shape[1], capacity + 1, s.keys.shape[3])),
                    s.values.new_zeros((slots, s.values.shape[1], capacity + 1, s.values.shape[3])),
                )
                for s in template.layers
            ]
        layers = []
        for keys, values in buffers:
            assert keys.shape[0] == slots and keys.shape[2] == capacity + 1
            layers.append(_PoolLayer(self, keys, values))  # type: ignore[arg-type]
        self._pool_layers = layers
        super().__init__(layers=list(layers))
        self.slots = slots
        self.nbytes = 2 * sum(layer.keys.nbytes for layer in layers)
        self.device = device = layers[0].keys.device
        self.inputs = torch.zeros(3 * rows * queries + rows, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, dtype=torch.long, device=device)
        self.free = list(range(slots - 1, -1, -1))  # `take` pops the lowest first
        self.step_rows = self.step_width = 0  # the pass's (padded) shape, read by the layers
        self.pass_ids = self.pass_positions = self.pass_columns = self.pass_slots = self.inputs

    def keys_of(self, layer: int) -> torch.Tensor:
        """A layer's keys, all slots (tests read a slot's columns)."""
        return self._pool_layers[layer].keys

    def take(self) -> int | None:
        """A free slot, or None when every slot is held."""
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        """`slot` is free again; its columns are left as they are (masked until rewritten)."""
        self.free.append(slot)
        self.free.sort(reverse=True)

    def set_pass(self, rows: int, queries: int, width: int, flat: torch.Tensor) -> None:
        """The pass's shape and its inputs' views of `flat` (ids, positions, columns: `[rows,
        queries]`; slots `[rows]`): fixed offsets per shape, so a graph reads them in place."""
        n = rows * queries
        self.step_rows, self.step_width = rows, width
        self.pass_ids = flat[:n].view(rows, queries)
        self.pass_positions = flat[n : 2 * n].view(rows, queries)
        self.pass_columns = flat[2 * n : 3 * n].view(rows, queries)
        self.pass_slots = flat[3 * n : 3 * n + rows]


class StaticJudge:
    """Runs judge passes over a `JudgePool`: eagerly, or (CUDA, `cuda_graphs`) by replaying the
    graph of the pass's (rows, queries, width) key, captured at its first use.

    `rows` / `queries` / `widths`: the buckets a pass is padded up to (None: exact)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: JudgePool,
        *,
        mask_kind: str,
        rows: Sequence[int] | None,
        queries: Sequence[int] | None,
        widths: Sequence[int] | None,
        cuda_graphs: bool = False,
        max_graphs: int = MAX_GRAPHS,
        name: str = "judge pass",
        capture_log_level: int = logging.INFO,
    ) -> None:
        """`name` / `capture_log_level`: what the logs call these passes (a static prefill runs
        the same pass, prefill_graphs.py) and the level of a line per capture."""
        self.name = name
        self.capture_log_level = capture_log_level
        self.model = model
        self.pool = pool
        self.mask_kind = mask_kind
        self.row_buckets, self.query_buckets, self.width_buckets = (
            tuple(b) if b else None for b in (rows, queries, widths)
        )
        self.cuda_graphs = cuda_graphs and pool.device.type == "cuda"
        self.max_graphs = max_graphs
        self.graph_error: str | None = None  # why graphs were given up, when they were
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._graph_pool: object | None = None
        device = pool.device
        self._staging = (
            torch.zeros(pool.inputs.numel(), dtype=torch.long).pin_memory()
            if device.type == "cuda"
            else None
        )
        # a prepared 4D mask is taken as is: none is built (the pass's is made in `attend`)
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        self._masks: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.captures = 0
        self.replays = 0
        self.eager_passes = 0
        self.padded_tokens = 0  # tokens through the model, padding included

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def shape(self, counts: Sequence[int], ends: Sequence[int]) -> tuple[int, int, int]:
        """The (rows, queries, width) of a pass over rows of `counts` new tokens ending at
        column `ends` (exclusive)."""
        rows = bucket(len(counts), self.row_buckets)
        queries = bucket(max(counts), self.query_buckets)
        width = bucket(max(ends), self.width_buckets)
        return rows, queries, min(width, self.pool.capacity)

    def run(self, passes: Sequence[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
        """One pass over `(slot, first column, tokens)` rows: each row's tokens at the columns
        from its first one on, in its slot; returns each row's logits at its last token,
        `[len(passes), vocab]` (a view of a graph's output on CUDA: valid until the next
        pass)."""
        pool = self.pool
        n = len(passes)
        counts = [len(tokens) for _s, _p, tokens in passes]
        ends = [p + len(tokens) for _s, p, tokens in passes]
        rows, queries, width = self.shape(counts, ends)
        reserved = pool.capacity
        ids: list[int] = []
        positions: list[int] = []
        columns: list[int] = []
        for (_slot, p, tokens), t in zip(passes, counts, strict=True):
            pad = queries - t  # left-padded: the real tokens last
            ids += [0] * pad + list(tokens)
            positions += [p + t - 1] * pad + list(range(p, p + t))
            columns += [reserved] * pad + list(range(p, p + t))
        spare = (rows - n) * queries
        ids += [0] * spare
        positions += [0] * spare
        columns += [reserved] * spare
        slots = [s for s, _p, _t in passes] + [0] * (rows - n)
        host = torch.tensor(ids + positions + columns + slots, dtype=torch.long)
        flat = self._inputs(host)
        key = (rows, queries, width)
        self.padded_tokens += rows * queries
        graph = self._graphs.get(key)
        if graph is None and flat is pool.inputs and self._may_capture():
            graph = self._capture(key, flat)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return self._outputs[key][:n]
        self.eager_passes += 1
        with changing_shapes(pool.device):
            return self._forward(key, flat)[:n]

    def _inputs(self, host: torch.Tensor) -> torch.Tensor:
        """The pass's inputs on the device, in one copy: into the static buffer when they fit
        (through the pinned staging buffer on CUDA: one is enough, as every pass ends with its
        verdicts' copy to the host, so the previous copy has run), else a buffer of their own
        (a pass past the buckets: never captured)."""
        pool = self.pool
        size = host.numel()
        if size > pool.inputs.numel():
            return host.to(pool.device)
        if self._staging is not None:
            staging = self._staging[:size]
            staging.copy_(host)
            pool.inputs[:size].copy_(staging, non_blocking=True)
        else:
            pool.inputs[:size].copy_(host)
        return pool.inputs

    def _may_capture(self) -> bool:
        return self.cuda_graphs and len(self._graphs) < self.max_graphs

    def _forward(self, key: tuple[int, int, int], flat: torch.Tensor) -> torch.Tensor:
        """The pass itself, device ops over the pool and `flat` only (what a graph captures):
        the logits at each row's last query, `[rows, vocab]`."""
        rows, queries, width = key
        pool = self.pool
        pool.set_pass(rows, queries, width, flat)
        self._masks.clear()
        active(self)
        try:
            out = self.model(
                input_ids=pool.pass_ids,
                position_ids=pool.pass_positions,
                attention_mask=self._no_mask,
                past_key_values=pool,
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            active(None)
        return out.logits[:, -1, :]  # type: ignore[no-any-return]

    def attend(
        self,
        base: Callable[..., Any],
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        _mask: object,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The model's attention function `base` over the pass's window (`_PoolLayer.update`),
        grouped-query without repeated keys (`grouped_attention`), with the pass's mask instead
        of the placeholder the model hands over (`scaling`, `dropout`: in `kwargs`)."""
        mask = self._mask(query.dtype, query.shape[1] // key.shape[1])
        return grouped_attention(base, module, query, key, value, mask, **kwargs), None

    def _mask(self, dtype: torch.dtype, groups: int) -> torch.Tensor:
        """`[rows, 1, groups * queries, width]`: query (r, j) sees the columns up to its
        position, once per query head of a key/value group; built on the device once per pass
        and shared by every layer."""
        cached = self._masks.get((dtype, groups))
        if cached is not None:
            return cached
        pool = self.pool
        positions = pool.pass_positions
        visible = pool.columns[: pool.step_width][None, None, :] <= positions[:, :, None]
        visible = visible[:, None]
        if groups > 1:
            visible = visible.repeat(1, 1, groups, 1)
        mask = as_kind(visible, self.mask_kind, dtype)
        self._masks[(dtype, groups)] = mask
        return mask

    # ----- CUDA graphs -------------------------------------------------------------------------

    def _capture(
        self, key: tuple[int, int, int], flat: torch.Tensor
    ) -> torch.cuda.CUDAGraph | None:
        """`key`'s graph, captured now (its inputs are in `flat` already: the warm-up runs the
        pass, the capture records it, the caller's replay runs it again: the same writes to the
        same columns). A capture that fails gives graphs up (the pass then runs eagerly);
        running out of memory is raised as for an eager pass."""
        try:
            with changing_shapes(self.pool.device):
                warm_up([lambda: self._forward(key, flat)])
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                graph, output = capture_graph(lambda: self._forward(key, flat), self._graph_pool)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # any capture failure: passes run eagerly from now on
            self.cuda_graphs = False
            self.graph_error = describe_error(error)
            log.warning(
                "capturing a %s failed, passes run eagerly: %s", self.name, self.graph_error
            )
            torch.cuda.synchronize()
            return None
        self._graphs[key] = graph
        self._outputs[key] = output
        self.captures += 1
        log.log(
            self.capture_log_level,
            "captured %s graph %s (%d held)",
            self.name,
            key,
            len(self._graphs),
        )
        return graph
