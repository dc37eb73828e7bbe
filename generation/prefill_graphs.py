"""The static prefill: new rows' keys and values straight into their decode slots, replayed from
CUDA graphs on a GPU.

Why. On a GPU an eager forward of smollm2-135m is bound by the host: ~7,000 aten ops from Python,
~35-60 ms a pass whatever its tokens. Eager prefill (model_runner.py) builds a `DynamicCache`
that the join then copies into the decode cache's slots (`StaticSlotCache.add_rows`): 256 new
chat prompts of ~40-50 tokens take 3-4 such passes before their first tokens, most of the
200-250 ms TTFT an H200 measured at 256 streams (bench/gpu/results/2026-11-27-h200.md). Here a
prefill is the judge's static multi-token pass (judge_graphs.py: `StaticJudge` over a
`JudgePool`) run over the decode cache's own buffers: every row's tokens are written at columns
`0..m-1` of the slot it will decode in, so nothing is copied at the join, and each (rows,
width) key is captured into a CUDA graph and replayed with one launch, after one host-to-device
copy of the pass's inputs (token ids, positions, write columns, target slots in one flat buffer,
from pinned memory on CUDA). The mask is built on the device from the positions; logits come at
each row's last real token only.

Buckets: the prefill's own (model_runner.py): rows up to `row_buckets` of the batch's rows,
width (queries and attention width alike) doubling from PREFILL_MIN_WIDTH up to the longest
context prefilled whole (`--prefill-chunk-tokens`); without `prefill_buckets` (a CPU's default)
exact shapes. A longer context is prefilled in chunks into a `DynamicCache` as before (its
chunks attend to a prefix that grows: no fixed shape to capture) and copied at its join.

Padding never reaches a running row: a pass writes only its own rows' slots, the next free ones
(`rows..rows+n-1`, none held by a running row), and every padding write goes to the decode
cache's reserved column (`StaticSlotCache.reserved`, one column past the capacity, which no
decode step reads):
- a row's padding queries (its real tokens are the last of its Q queries: left padding, so its
  logits are at the last query whatever its length) read token 0 at its last real position (so
  they see what that token sees) and write the reserved column of their row's slot;
- a padding row reads token 0 at position 0 of slot 0 and writes slot 0's reserved column only
  (slot 0 may be a running row's: its real columns are read, never written);
- a padding column (past a row's last real token, up to the width) is masked: stale keys of the
  slot's earlier occupant never reach the row.
A row that finishes with its first token does not join: the rows after it move down to
consecutive slots (`StaticSlotCache.take_rows`), and its slot stays free (what it holds is
masked for whoever takes it next). tests/test_engine_static_prefill.py checks these.

CUDA capture policy: at start, `warm_prefills` (model_runner.py) captures every bucket a prefill
of `prefill_token_budget` tokens can reach (what it ran eagerly before: 57 keys for 256 rows and
widths 16..2048), largest first, so the first clients after start replay graphs; the eager warm-up
it replaces ran each shape twice, a capture costs about three eager passes (a warm-up run on a
side stream, the capture, the replay), so start-up grows little. Keys not warmed are captured at
first use, up to MAX_GRAPHS held; past that a pass runs eagerly (`eager_passes`). A capture that
fails gives graphs up for good (`graph_error`, logged, in /health) and passes run eagerly over
the same buffers. Counters: `captures`, `replays`, `eager_passes` (/health `prefill`, /metrics
`guardstream_engine_prefill_*`).

Memory (CUDA): no KV memory of its own (the decode cache's slots, plus one column per slot); the
flat input buffer (3 x rows x width + rows longs, ~12 MiB for 256 x 2048), and the graphs' shared
private pool: the largest pass's activations (its mask `[rows, 1, groups x width, width]` and a
gathered window per layer) and each graph's logits `[rows, vocab]`, taken from the memory the
decode cache's plan leaves (1 - `gpu_memory_fraction`).

CPU: the same pass runs eagerly whenever the static decode step runs (`--static-decode`, tests),
so every line of it runs in the CPU suite; the CPU default (slot-cache decode) keeps eager
prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .decode_graphs import StaticSlotCache
from .judge_attention import install, mask_kind
from .judge_graphs import MAX_GRAPHS, JudgePool, StaticJudge


class StaticPrefill:
    """Prefill passes over a `StaticSlotCache`'s slots: eagerly, or (CUDA, `cuda_graphs`) by
    replaying the graph of the pass's (rows, width) key (worker thread only).

    `rows` / `widths`: the buckets a pass is padded up to (None: exact)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticSlotCache,
        *,
        rows: Sequence[int] | None,
        widths: Sequence[int] | None,
        cuda_graphs: bool = False,
        max_graphs: int = MAX_GRAPHS,
    ) -> None:
        config = getattr(model, "config", None)
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        install(implementation)  # the pass's attention reads its slots' window (judge_attention)
        self.cache = cache
        most_rows = rows[-1] if rows else cache.slots
        most_width = widths[-1] if widths else cache.capacity
        pool = JudgePool(
            None, cache.slots, cache.capacity, most_rows, most_width, buffers=cache.buffers()
        )
        self.runner = StaticJudge(
            model,
            pool,
            mask_kind=mask_kind(implementation),
            rows=rows,
            queries=widths,
            widths=widths,
            cuda_graphs=cuda_graphs,
            max_graphs=max_graphs,
            name="prefill pass",
            capture_log_level=logging.DEBUG,  # warm_prefills logs the captures at start at once
        )

    def shape(self, lengths: Sequence[int]) -> tuple[int, int]:
        """The (rows, width) a pass over contexts of `lengths` tokens runs at."""
        rows, _queries, width = self.runner.shape(lengths, lengths)
        return rows, width

    def run(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """One pass writing context i into the free slot `cache.rows + i`, columns `0..m-1`;
        each row's logits at its last token, `[len(contexts), vocab]` (on CUDA a view of a
        graph's output: valid until the next pass). The rows join with `take_rows`."""
        cache = self.cache
        first = cache.rows
        longest = max(len(c) for c in contexts)
        if first + len(contexts) > cache.slots or longest >= cache.capacity:
            raise RuntimeError(
                f"static KV cache full: {first + len(contexts)} rows of up to {longest + 1} "
                f"tokens in {cache.slots} x {cache.capacity}"
            )
        return self.runner.run([(first + i, 0, c) for i, c in enumerate(contexts)])

    def info(self) -> dict[str, object]:
        """How prefill passes run, for /health and /metrics."""
        runner = self.runner
        return {
            "mode": "cuda_graphs" if runner.cuda_graphs or runner.graphs else "static",
            "graphs": runner.graphs,
            "captures": runner.captures,
            "replays": runner.replays,
            "eager_passes": runner.eager_passes,
            "graph_error": runner.graph_error,
        }
