"""Warm prefill (model_runner.py): prefills padded up to (rows, width) buckets, each bucket run
once at start, so the first request after start meets no shape the GPU's libraries have not seen.

- Exact: the bucketed engine streams exactly what the exact one does (tiny-random, float64),
  over random prompt lengths, batch compositions, joins, cancels and stops, greedy, seeded and
  penalised; on the eager step and on the static step with overlap; and in float32 under
  `--batch-invariant`, whose logits padding does not change.
- Warm: start-up runs the buckets of `warm_shapes` (and counts no prefill), and every prefill the
  scheduler can form from a queue within the prefill budget runs at one of those shapes.

The worker's iterations are driven by hand, as in test_engine_overlap.py (whose script and
driver this reuses)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from generation.model_runner import ModelRunner
from generation.models import LoadedModel
from generation.scheduler import Engine
from generation.scheduling import Scheduler, prefill_groups
from tests.engine_support import load_test_model
from tests.test_engine_overlap import Request, assert_same_streams, drive, requests

ROWS = 4
CHUNK = 24  # prompts up to this are prefilled whole (bucketed); longer ones in chunks
BUDGET = 40  # prefill token budget per iteration


def new_engine(model: LoadedModel, *, buckets: bool, static: bool, warm: bool = False) -> Engine:
    engine = Engine(
        model,
        max_batch_size=ROWS,
        prefill_token_budget=BUDGET,
        prefill_chunk_tokens=CHUNK,
        static_decode=static,
        static_capacity=128 if static else None,
        gpu_memory_fraction=0.05,  # CUDA: the cache is sized from free memory; several engines
        prefill_buckets=buckets,
        warm_prefill=warm,
    )
    with torch.inference_mode():
        engine._start_up()
    return engine


@pytest.fixture(
    scope="module",
    params=["eager", "static-overlap", "batch-invariant"],
)
def engines(
    tiny_model: LoadedModel, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine]]:
    """(exact prefill, bucketed and warmed prefill), reused across examples. `batch-invariant`:
    tiny-random in float32 under `--batch-invariant`, where padding changes no bit either."""
    static = request.param == "static-overlap"
    model = tiny_model
    if request.param == "batch-invariant":
        model = load_test_model("tiny-random", dtype="float32", batch_invariant=True)
    yield (
        new_engine(model, buckets=False, static=static),
        new_engine(model, buckets=True, static=static, warm=True),
    )


@st.composite
def scripts(draw: st.DrawFn) -> list[Request]:
    """test_engine_overlap's requests in up to 3 waves (the requests of a wave join at the same
    iteration); a wave's prompts have similar lengths, so they share a prefill group that is
    padded up to a bucket in rows and width; some prompts are long enough to be chunked."""
    script = draw(st.lists(requests(), min_size=1, max_size=7))
    bases = draw(st.lists(st.integers(1, 28), min_size=3, max_size=3))
    out = []
    for r in script:
        wave = draw(st.integers(0, 2))
        length = bases[wave] + draw(st.integers(0, 2))
        prompt = [(r.prompt[0] + 37 * i) % 680 + 3 for i in range(length)]
        cancel = None if r.cancel is None else wave + draw(st.integers(0, 6))
        out.append(Request(**{**r.__dict__, "prompt": prompt, "join": wave, "cancel": cancel}))
    return out


@settings(max_examples=20)
@given(script=scripts())
def test_bucketed_prefill_streams_exactly_what_exact_prefill_does(
    engines: tuple[Engine, Engine], script: list[Request]
) -> None:
    exact, bucketed = engines
    passes = bucketed.stats.prefill_passes
    assert_same_streams(
        script, asyncio.run(drive(exact, script)), asyncio.run(drive(bucketed, script))
    )
    assert bucketed.stats.prefill_passes > passes or all(r.cancel is not None for r in script)


def test_start_up_warms_every_prefill_bucket_and_counts_none(tiny_model: LoadedModel) -> None:
    """Rows buckets of 4 rows (1, 2, 4) x widths from 16 up to the chunk size (16, 24), each
    whose rectangle a prefill within the budget can reach (<= 4 x 1.25 x max(40, 24) = 200
    tokens): all six here. The engine without warm-up runs none."""
    engine = new_engine(tiny_model, buckets=True, static=False, warm=True)
    runner = engine._runner
    assert runner.prefill_widths == (16, 24)
    assert runner.warm_shapes == [(1, 16), (1, 24), (2, 16), (2, 24), (4, 16), (4, 24)]
    assert engine.stats.prefill_passes == engine.stats.forward_passes == 0
    cold = new_engine(tiny_model, buckets=True, static=False)
    assert cold._runner.warm_shapes == []


@pytest.fixture(scope="module")
def default_runner(tiny_model: LoadedModel) -> ModelRunner:
    """The CPU defaults (64 rows, prefill budget 4,096 tokens, 256-token passes; tiny-random's
    context is 512) with bucketed prefill, warmed (70 passes of tiny-random, a few seconds)."""
    engine = Engine(
        tiny_model,
        max_batch_size=64,
        prefill_chunk_tokens=256,
        static_decode=False,
        prefill_buckets=True,
        warm_prefill=True,
    )
    with torch.inference_mode():
        engine._start_up()
    return engine._runner


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(1, 256), min_size=1, max_size=150))
def test_every_prefill_the_scheduler_forms_runs_at_a_warmed_shape(
    default_runner: ModelRunner, lengths: list[int]
) -> None:
    """Queued prompts admitted by the scheduler's own policy (free rows, prefill budget) and
    grouped by prefill_groups, iteration after iteration: each group's bucketed shape is one
    the start-up warmed."""
    runner = default_runner
    assert runner.prefill_widths == (16, 32, 64, 128, 256)
    warmed = set(runner.warm_shapes)
    assert len(warmed) == 7 * 5
    scheduler = Scheduler(64, 4096, 256)
    inbox = deque(SimpleNamespace(prompt_ids=[0] * n, resume_ids=[]) for n in lengths)
    while inbox:
        batch = [len(job.prompt_ids) for job in scheduler.choose_joiners(inbox, True)]
        for group in prefill_groups(batch):
            shape = runner.prefill_shape(len(group), max(batch[i] for i in group))
            assert shape in warmed, (group, batch)
