"""`--compile` (decode_graphs.compile_forward): the static decode step through torch.compile's
Inductor streams exactly what the eager static step does (tiny-random, float64, on a CPU:
Inductor's generated C++ there, Triton on CUDA), greedy, seeded and penalised; and a step that
fails to compile (Inductor raising, as torch 2.11's did on an H200) never stops the engine: it
serves the uncompiled step's exact tokens and says why in its log, /health and /metrics.

Compiling is slow on a CPU (tiny-random: ~30-45 s per graph on a busy 2-core machine, cached
afterwards under torchinductor's cache directory), so the engine's test has one shape: one row
(the requests run one after another) in one width bucket; the compile count over a wide bucket
grid is measured on the step itself."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import aiohttp
import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from generation import decode_graphs
from generation.decode_graphs import StaticDecoder, StaticSlotCache, row_buckets, width_buckets
from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from generation.server import STATE, create_app
from tests.engine_processes import ThreadedServer
from tests.engine_support import generate, run
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


@pytest.mark.timeout(900)
def test_one_compile_covers_a_wide_bucket_grid(
    tiny_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """On CUDA the engine runs every (rows, width) bucket through the compiled step at start and
    captures it (63 buckets for smollm2-135m on an H200): dynamic shapes must cover them with
    one graph, not a compile per bucket (each ~1-2 minutes for smollm2-135m's architecture on
    a CPU). Here row buckets 2..64 (one row runs in the 2-row graph: a 1-row bucket would be a
    second compile, dynamo specialising a size of 1) x widths 128..1024, in the capture's order
    (largest first, the first one twice): one graph, and every bucket's logits, over random
    tokens at random positions in a cache of random keys, equal the eager step's, as do one
    row's in the 2-row graph, from one trace (`specialize_float`). The log names the first compile before it starts and each compile
    after it (a start-up cut by a time limit shows how far it got)."""
    caplog.set_level(logging.INFO, logger="guardstream.engine")
    slots, capacity = 64, 1024
    model = tiny_model.model
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ids = torch.zeros((1, 1), dtype=torch.long, device=tiny_model.device)
        cache = StaticSlotCache(
            model(input_ids=ids, use_cache=True).past_key_values, slots, capacity
        )
        for buffer in (b for pair in cache.buffers() for b in pair):
            buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))
        rows, widths = row_buckets(slots), width_buckets(capacity)
        keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        compiled = StaticDecoder(
            model, cache, rows=rows, widths=widths, logits_to_keep=keep, compile_step=True
        )
        eager = StaticDecoder(model, cache, rows=rows, widths=widths, logits_to_keep=keep)
        assert compiled.row_buckets == (2, 4, 8, 16, 32, 64) and eager.row_buckets == rows
        assert compiled.shape([9]) == (2, 128) and eager.shape([9]) == (1, 128)
        keys = sorted(((r, w) for r in compiled.row_buckets for w in widths), reverse=True)
        assert len(keys) == 24
        graphs = counters["stats"]["unique_graphs"]
        restarts = len(compilation_time_metrics.get("compile_attempt_1", []))

        def randomise(r: int, w: int) -> None:
            tokens = torch.randint(3, tiny_model.vocab_size, (r,), generator=generator)
            cache.input_ids[:r].copy_(tokens)
            longest = min(w, tiny_model.max_context)  # tiny-random: 512 position embeddings
            cache.positions[:r].copy_(torch.randint(0, longest, (r,), generator=generator))

        for r, w in [keys[0], *keys]:
            randomise(r, w)
            got = compiled._model_logits(r, w).clone()
            want = eager._model_logits(r, w)  # writes the same keys into the same columns
            torch.testing.assert_close(got, want, msg=lambda m, r=r, w=w: f"{r} x {w}: {m}")
        for w in widths:  # one row, padded to two: the real row's logits are the 1-row step's
            randomise(2, w)
            got = compiled._model_logits(2, w)[:1].clone()
            torch.testing.assert_close(got, eager._model_logits(1, w), msg=f"1 row, {w} wide")
    assert compiled.compiled and compiled.compile_error is None
    assert compiled.compiles == counters["stats"]["unique_graphs"] - graphs == 1
    # traced once: no second attempt after dynamo failed to make the model's float attributes
    # (norm epsilons, attention scales) graph inputs (a third of a compile, smollm2's shape)
    assert len(compilation_time_metrics.get("compile_attempt_1", [])) == restarts
    lines = [r.getMessage() for r in caplog.records if "decode step's forward" in r.getMessage()]
    assert lines[0] == (
        "compiling the decode step's forward (torch.compile, inductor, dynamic shapes) at its "
        "first call: 64 rows x 1024 columns"
    )
    assert len(lines) == 2
    assert lines[1].startswith("compiled the decode step's forward for 64 rows x 1024 columns in ")
    assert lines[1].endswith(f" s (graphs so far: 1, {compiled.compile_seconds:.1f} s compiling)")


def exploding_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A torch.compile backend that fails the way Inductor failed on the H200 (at compile)."""
    raise TypeError("list indices must be integers or slices, not NoneType (a test)")


@pytest.mark.timeout(600)
def test_a_step_that_fails_to_compile_runs_uncompiled_and_says_so(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--compile` whose compile raises (here: a backend that raises; on CUDA at start-up, in
    the capture's warm-up runs; on a CPU at the first step): the engine starts, streams exactly
    the tokens of the uncompiled static step (greedy and seeded sampling, over real HTTP),
    warns once naming the error, and /health and /metrics report the fallback."""
    monkeypatch.setattr(decode_graphs, "COMPILE_BACKEND", exploding_backend)
    bodies = [
        {"prompt": "Hello", "max_new_tokens": 12, "min_new_tokens": 12},
        {
            "prompt": "The capital of France is",
            "max_new_tokens": 10,
            "decoding": {"method": "sampling", "temperature": 0.8, "top_p": 0.9, "seed": 11},
        },
    ]

    async def scenario(url: str) -> tuple[list[Any], dict[str, Any], str]:
        async with aiohttp.ClientSession() as session:
            streams = [await generate(session, url, body) for body in bodies]
            async with session.get(url + "/health") as resp:
                health = await resp.json()
            async with session.get(url + "/metrics") as resp:
                metrics = await resp.text()
        return [(s.status, s.token_ids, s.text, s.finish_reason) for s in streams], health, metrics

    with ThreadedServer(
        lambda: create_app(tiny_model, static_decode=True, static_buckets=True)
    ) as server:
        eager, eager_health, _ = run(scenario(server.url))
    with (
        caplog.at_level(logging.WARNING, logger="guardstream.engine"),
        ThreadedServer(lambda: create_app(tiny_model, compile_step=True)) as server,
    ):
        assert server.app is not None
        fallen, health, metrics = run(scenario(server.url))
        static = server.app[STATE].engine._runner.static
        assert static is not None and not static.compiled

    assert fallen == eager
    assert [status for status, *_ in fallen] == [200, 200]
    assert len(fallen[0][1]) == 12 and len(fallen[1][1]) > 0
    assert eager_health["kv_cache"]["compile_error"] is None
    error = (
        "BackendCompilerFailed: backend='exploding_backend' raised: TypeError: list indices must "
        "be integers or slices, not NoneType (a test)"
    )
    assert health["status"] == "ok"
    assert health["kv_cache"]["compiled"] is False
    assert health["kv_cache"]["compile_error"] == error
    # the same kind of step (CUDA: graphs captured, uncompiled; a CPU: the static step eagerly)
    assert health["kv_cache"]["mode"] == eager_health["kv_cache"]["mode"]
    lines = metrics.splitlines()
    assert "guardstream_engine_decode_compile_failed 1.0" in lines
    assert "guardstream_engine_decode_compiled 0.0" in lines
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings.count(f"compiling the decode step failed, it runs uncompiled: {error}") == 1
