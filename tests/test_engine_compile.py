"""`--compile` (decode_graphs.compile_forward): the static decode step through torch.compile's
Inductor streams exactly what the eager static step does (tiny-random, float64, on a CPU:
Inductor's generated C++ there, Triton on CUDA), greedy, seeded and penalised.

Compiling is slow on a CPU (tiny-random: ~30-45 s per graph on a busy 2-core machine, cached
afterwards under torchinductor's cache directory), so this is one small test with one shape:
one row (the requests run one after another) in one width bucket."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch._dynamo.utils import counters

from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from tests.test_engine_overlap import Request, drive


def new_engine(model: LoadedModel, compile_step: bool) -> Engine:
    engine = Engine(
        model,
        max_batch_size=1,
        static_decode=True,
        static_buckets=True,
        static_capacity=64,  # one width bucket (a CPU; CUDA: from memory, a few buckets)
        gpu_memory_fraction=0.05,
        compile_step=compile_step,
    )
    with torch.inference_mode():
        engine._start_up()
    return engine


@pytest.mark.timeout(600)  # a cold compile under `make test-stress`
def test_compiled_step_streams_exactly_what_the_eager_step_does(tiny_model: LoadedModel) -> None:
    script = [
        Request(
            prompt=[(start + 37 * i) % 680 + 3 for i in range(length)],
            max_new_tokens=12,
            min_new_tokens=12 if n == 0 else 0,
            stop=[],
            sampling=sampling,
            join=n,
            cancel=None,
        )
        for n, (start, length, sampling) in enumerate(
            [
                (5, 7, SamplingParams()),
                (90, 3, SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=11)),
                (400, 12, SamplingParams(greedy=False, seed=3, repetition_penalty=1.3)),
            ]
        )
    ]
    eager = asyncio.run(drive(new_engine(tiny_model, False), script))
    graphs = counters["stats"]["unique_graphs"]
    compiled_engine = new_engine(tiny_model, True)
    compiled = asyncio.run(drive(compiled_engine, script))
    assert compiled_engine._runner.static is not None
    assert compiled_engine._runner.static.compiled
    # dynamo traced the step a few times (its shapes), not once per step: no guard on state
    # that changes every step (CPU: one shape, 1-2 graphs; CUDA: up to 3 width buckets)
    assert 1 <= counters["stats"]["unique_graphs"] - graphs <= 3
    assert compiled == eager
    assert sum(len(e.token_ids) for e in eager[0]) == 12  # min_new_tokens: 12 steps compared
    assert all(events and events[-1].finish_reason is not None for events in eager)
