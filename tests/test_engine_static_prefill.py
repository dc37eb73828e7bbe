"""The static prefill (generation/prefill_graphs.py): a prefill writes its rows' keys straight into
their decode slots through a static pass (replayed from CUDA graphs on a GPU; eagerly on a CPU,
the same pass a graph captures).

- Exact: an engine whose prefills run the static pass streams exactly what the same engine with
  eager prefill (a DynamicCache copied at the join) does: tiny-random in float64, random prompt
  lengths, waves of rows joining while others run, cancels, stops, rows finished by their first
  token, greedy, seeded and penalised; exact shapes and bucketed ones (padding rows, a bucket
  wider than the prompts); and in float32 under `--batch-invariant`.
- The slots' real columns hold what `add_rows` of the eager prefill puts there: bitwise under
  `--batch-invariant`, to the last bits in float64.
- Padding never writes a running row's slot, nor a new row's columns past its tokens.
- Cheap on the host: a pass replayed from its graph dispatches a few dozen aten ops where the
  eager prefill dispatches thousands (bench/engine.py prints the same measurement).

The worker's iterations are driven by hand (test_engine_overlap.py's driver and requests,
test_engine_warm_prefill.py's waves)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from bench.engine import AtenOps, prefill_ops, stub_prefill_graph
from generation.jobs import Job
from generation.model_runner import ModelRunner, StaticRows
from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from generation.scheduling import Row
from tests.engine_support import load_test_model
from tests.test_engine_overlap import Request, assert_same_streams, drive
from tests.test_engine_static_decode import HOST_READS
from tests.test_engine_warm_prefill import BUDGET, CHUNK, ROWS, scripts


def new_engine(
    model: LoadedModel, *, static_prefill: bool, buckets: bool, **options: Any
) -> Engine:
    """The static decode step on a CPU (as test_engine_warm_prefill's), prefill static or
    eager; `buckets`: prefills and steps padded up to buckets, as on CUDA. On CUDA too the
    passes run eagerly unless `cuda_graphs`/`warm_prefill` say otherwise: these tests compare
    and count passes (an engine's CUDA default captures every shape at start, and then no
    pass is eager; the graphs' own test asks for them)."""
    options.setdefault("cuda_graphs", False)
    options.setdefault("warm_prefill", False)
    engine = Engine(
        model,
        max_batch_size=options.pop("rows", ROWS),
        prefill_token_budget=BUDGET,
        prefill_chunk_tokens=CHUNK,
        static_decode=True,
        static_buckets=buckets,
        static_capacity=128,
        gpu_memory_fraction=0.05,  # CUDA: several engines share the GPU
        prefill_buckets=buckets,
        static_prefill=static_prefill,
        **options,
    )
    with torch.inference_mode():
        engine._start_up()
    return engine


@pytest.fixture(scope="module", params=["exact", "buckets", "batch-invariant"])
def engines(
    tiny_model: LoadedModel, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine]]:
    """(eager prefill, static prefill), reused across examples. `batch-invariant`: tiny-random
    in float32 under `--batch-invariant`, bucketed."""
    model = tiny_model
    if request.param == "batch-invariant":
        model = load_test_model("tiny-random", dtype="float32", batch_invariant=True)
    buckets = request.param != "exact"
    eager = new_engine(model, static_prefill=False, buckets=buckets)
    static = new_engine(model, static_prefill=True, buckets=buckets)
    assert eager._runner.prefill_pass is None and static._runner.prefill_pass is not None
    yield eager, static


@settings(max_examples=20)
@given(script=scripts())
def test_static_prefill_streams_exactly_what_eager_prefill_does(
    engines: tuple[Engine, Engine], script: list[Request]
) -> None:
    eager, static = engines
    before = static.prefill_info()
    assert_same_streams(
        script, asyncio.run(drive(eager, script)), asyncio.run(drive(static, script))
    )
    after = static.prefill_info()
    assert after["mode"] == "static" and after["replays"] == 0 and after["captures"] == 0
    # every whole prefill ran the static pass (none into a DynamicCache), eagerly on a CPU
    assert static._runner.dynamic_prefills == 0
    assert static.stats.prefill_passes == eager.stats.prefill_passes  # the same passes
    assert after["eager_passes"] >= before["eager_passes"]  # type: ignore[operator]


async def test_a_row_finished_by_its_first_token_leaves_its_slot_to_the_next_rows(
    tiny_model: LoadedModel,
) -> None:
    """Three prompts of 4 tokens prefilled in one pass while a stream runs; the middle one
    finishes with its first token (a budget of 1): the third moves down into its slot
    (`take_rows`), and every stream is the eager-prefill engine's."""
    script = [
        Request([9, 8, 7, 6], 10, 10, [], SamplingParams(), 0, None),
        Request([5, 6, 7, 8], 6, 0, [], SamplingParams(), 2, None),
        Request([11, 12, 13, 14], 1, 0, [], SamplingParams(), 2, None),
        Request([40, 41, 42, 43], 5, 5, [], SamplingParams(greedy=False, seed=3), 2, None),
    ]
    results = []
    for static_prefill in (False, True):
        engine = new_engine(tiny_model, static_prefill=static_prefill, buckets=True)
        results.append(await drive(engine, script))
        assert engine.prefill_info()["eager_passes"] == 2  # one pass per wave
    assert results[0] == results[1]
    assert [len(events) for events in results[1]] == [10, 6, 1, 5]


def _row(engine: Engine, prompt: list[int]) -> Row:
    job = Job(
        prompt_ids=prompt,
        max_new_tokens=4,
        sampling=SamplingParams(),
        loop=None,  # type: ignore[arg-type]  # rows prefilled by hand emit nothing
        queue=asyncio.Queue(),
    )
    return engine._output.new_row(job)


PROMPTS = [[3, 5, 7, 11, 13], [17, 19], [23, 29, 31, 37, 41, 43, 47, 53, 59], [61, 67, 71]]


@pytest.mark.parametrize("dtype", ["float64", "float32-batch-invariant", "smollm2"])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_slots_hold_what_add_rows_of_the_eager_prefill_gives(
    tiny_model: LoadedModel, dtype: str, buckets: bool, request: pytest.FixtureRequest
) -> None:
    """Two running rows, then a group of four prompts of 2-9 tokens prefilled by each path into
    slots 2-5: the first tokens are the same, and every layer's keys and values in the rows'
    real columns are the same (bitwise under `--batch-invariant`; float64 to the last bits;
    smollm2-135m, grouped-query attention in float32, to kernel blocking's bits). Bucketed, the
    pass runs 4 rows x 16 columns for prompts of at most 9 tokens."""
    model = tiny_model
    if dtype == "float32-batch-invariant":
        model = load_test_model("tiny-random", dtype="float32", batch_invariant=True)
    elif dtype == "smollm2":
        model = request.getfixturevalue("smollm2_model")
    runners: list[ModelRunner] = []
    firsts = []
    with torch.inference_mode():
        for static_prefill in (False, True):
            engine = new_engine(model, static_prefill=static_prefill, buckets=buckets, rows=8)
            runner = engine._runner
            running = [_row(engine, [90, 91, 92]), _row(engine, [93])]
            cache, tokens = runner.prefill(running, [3, 1])
            runner.join(cache, running, [0, 1], [3, 1], 0)
            rows = [_row(engine, p) for p in PROMPTS]
            lengths = [len(p) for p in PROMPTS]
            cache, tokens = runner.prefill(rows, lengths)
            assert isinstance(cache, StaticRows) == static_prefill
            runner.join(cache, rows, [0, 1, 2, 3], lengths, 2)
            firsts.append(tokens)
            runners.append(runner)
    eager, static = runners
    assert static.prefill_pass is not None
    if buckets:
        assert static.prefill_pass.shape([len(p) for p in PROMPTS]) == (4, 16)
    assert firsts[0] == firsts[1]
    a, b = eager.static.cache, static.static.cache  # type: ignore[union-attr]
    assert a.lengths == b.lengths == [3, 1, *(len(p) for p in PROMPTS)]
    for (ka, va), (kb, vb) in zip(a.buffers(), b.buffers(), strict=True):
        for slot, n in enumerate(a.lengths):
            for x, y in ((ka, kb), (va, vb)):
                if dtype == "float64":
                    torch.testing.assert_close(x[slot, :, :n], y[slot, :, :n], rtol=0, atol=1e-12)
                elif dtype == "smollm2":
                    torch.testing.assert_close(x[slot, :, :n], y[slot, :, :n], rtol=0, atol=1e-3)
                else:
                    assert torch.equal(x[slot, :, :n], y[slot, :, :n]), (slot, n)


def test_padding_never_touches_a_running_row_nor_a_new_rows_later_columns(
    tiny_model: LoadedModel,
) -> None:
    """A cache whose every column holds noise (what rows that left leave behind), two running
    rows in slots 0-1, then a bucketed pass of three prompts (rows padded 3 -> 4, queries and
    width 9 -> 16): the running rows' slots are bitwise unchanged in every column (padding rows
    read slot 0 and write its reserved column only), and the new rows' columns past their tokens
    too (their padding queries write the reserved column); only the reserved column and the new
    rows' real columns changed."""
    engine = new_engine(tiny_model, static_prefill=True, buckets=True, rows=8)
    runner = engine._runner
    cache = runner.static.cache  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for keys, values in cache.buffers():
            for buffer in (keys, values):
                noise = torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype)
                buffer.copy_(noise.to(buffer.device) * 100)
        running = [_row(engine, [90, 91, 92]), _row(engine, [93, 94])]
        out, _ = runner.prefill(running, [3, 2])
        runner.join(out, running, [0, 1], [3, 2], 0)
        before = [(k.clone(), v.clone()) for k, v in cache.buffers()]
        prompts = PROMPTS[:3]
        rows = [_row(engine, p) for p in prompts]
        assert runner.prefill_pass.shape([len(p) for p in prompts]) == (4, 16)  # type: ignore[union-attr]
        runner.prefill(rows, [len(p) for p in prompts])
    changed = torch.zeros(cache.slots, cache.capacity + 1, dtype=torch.bool)
    for (k0, v0), (k1, v1) in zip(before, cache.buffers(), strict=True):
        for x, y in ((k0, k1), (v0, v1)):
            changed |= (x != y).any(dim=3).any(dim=1).cpu()
    expected = torch.zeros_like(changed)
    for i, prompt in enumerate(prompts):
        expected[2 + i, : len(prompt)] = True
    expected[:, cache.reserved] = changed[:, cache.reserved]  # padding's writes: never read
    assert torch.equal(changed, expected), changed.nonzero().tolist()
    assert changed[0, cache.reserved] or changed[2:5, cache.reserved].any()


def test_the_captured_pass_reads_nothing_back_to_the_host(tiny_model: LoadedModel) -> None:
    """What a prefill graph captures (StaticJudge._forward over the decode slots), run under a
    dispatch mode: nothing read back, nothing sized by data."""
    engine = new_engine(tiny_model, static_prefill=True, buckets=True)
    static = engine._runner.prefill_pass
    assert static is not None
    with torch.inference_mode():
        runner = static.runner
        host = torch.zeros(3 * 4 * 16 + 4, dtype=torch.long)
        flat = runner._inputs(host)
        recorder = AtenOps()
        with recorder:
            logits = runner._forward((4, 16, 16), flat)
    assert logits.shape[0] == 4
    assert not HOST_READS & set(recorder.ops), recorder.ops


def test_a_replayed_prefill_pass_dispatches_a_few_dozen_ops_not_thousands(
    tiny_model: LoadedModel,
) -> None:
    """16 prompts of 20-35 tokens: the eager prefill dispatches ~150 aten ops (tiny-random has 2
    layers; smollm2-135m's 30 give thousands: bench/engine.py), a replayed static pass (its
    graph stubbed on a CPU) a handful whatever the model (the inputs' copy, the replay, the
    first tokens' selection), and it replays."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + i)] for i in range(16)]
    with torch.inference_mode():
        eager = new_engine(tiny_model, static_prefill=False, buckets=True, rows=16)
        static = new_engine(tiny_model, static_prefill=True, buckets=True, rows=16)
        stub_prefill_graph(static, [len(p) for p in prompts])
        eager_ops, _ = prefill_ops(eager, prompts)
        static_ops, _ = prefill_ops(static, prompts)
    assert static.prefill_info()["replays"] == 1
    assert static_ops <= 20 and eager_ops >= 100 and eager_ops > 10 * static_ops, (
        static_ops,
        eager_ops,
    )


def test_replayed_prefill_graphs_stream_what_the_eager_static_pass_does(
    tiny_model: LoadedModel,
) -> None:
    """CUDA only: an engine whose prefills replay graphs captured at start (warm prefill) streams
    what the same engine with graphs off does, and its prefills were replayed, none eager."""
    if tiny_model.device.type != "cuda":
        pytest.skip("CUDA graphs need GUARDSTREAM_TEST_DEVICE=cuda")
    script = [
        Request([9, 8, 7, 6], 10, 10, [], SamplingParams(), 0, None),
        Request(list(range(3, 23)), 6, 0, [], SamplingParams(), 2, None),
        Request([11, 12, 13, 14], 1, 0, [], SamplingParams(), 2, None),
        Request([40, 41, 42], 5, 5, [], SamplingParams(greedy=False, seed=3), 3, None),
    ]
    results = []
    for graphs in (False, True):
        engine = new_engine(
            tiny_model, static_prefill=True, buckets=True, cuda_graphs=graphs, warm_prefill=graphs
        )
        results.append(asyncio.run(drive(engine, script)))
        info = engine.prefill_info()
        if graphs:
            assert info["mode"] == "cuda_graphs" and info["graph_error"] is None
            assert info["graphs"] == len(engine._runner.warm_shapes) > 0
            assert info["replays"] == engine.stats.prefill_passes and info["eager_passes"] == 0
    assert results[0] == results[1]
