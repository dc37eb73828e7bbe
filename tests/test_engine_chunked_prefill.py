"""Chunked prefill: a context longer than `prefill_chunk_tokens` is prefilled one chunk per worker
iteration, between the running rows' decode steps, into a cache of its own; after its last chunk
the row takes its first token and joins the batch. Its tokens are exactly those of a whole
prefill, greedy, seeded and resumed (tiny-random, float64), and a request cancelled mid-prefill
leaves without a token."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from generation import attention_backends
from generation.jobs import EngineDelta
from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from tests.engine_support import (
    CHUNK,
    Event,
    RecordingQueue,
    long_prompt,
    make_job,
    run_alone,
    spy_cudnn_attention,
    tokens_of,
    warm,
)


@pytest.fixture
async def chunked(tiny_model: LoadedModel) -> Engine:
    engine = Engine(tiny_model, prefill_chunk_tokens=CHUNK)
    engine.start()
    await warm(engine)
    yield engine  # type: ignore[misc]
    engine.stop()


@pytest.fixture
async def whole(tiny_model: LoadedModel) -> Engine:
    engine = Engine(tiny_model, prefill_chunk_tokens=10_000)
    engine.start()
    await warm(engine)
    yield engine  # type: ignore[misc]
    engine.stop()


#: The decode paths the interleaving test runs on every device: the device's default engine (eager
#: and synchronous on a CPU; the static step, overlapped, on CUDA), and the static step with and
#: without overlap (CUDA graphs on a GPU, the same logic unreplayed on a CPU).
DECODE_PATHS = {
    "default": {},
    "static-synchronous": {"static_decode": True, "overlap": False},
    "static-overlapped": {"static_decode": True, "overlap": True},
}


@pytest.mark.parametrize("path", list(DECODE_PATHS))
async def test_running_rows_decode_between_the_chunks_of_a_long_prompt(
    tiny_model: LoadedModel, path: str
) -> None:
    """A (short) and B (200 tokens) arrive together. Each iteration runs one of B's 13 chunks,
    then a decode step of A. B's first token is emitted by its last chunk, before that
    iteration's step: by then A has run its prefill and 12 decode steps. Synchronously A has
    received all 13 of those tokens; overlapped, the 12th step is still in flight (its tokens are
    accepted after the next step's launch), so A has received 12."""
    engine = Engine(
        tiny_model, prefill_chunk_tokens=CHUNK, static_capacity=256, **DECODE_PATHS[path]
    )
    engine.start()
    try:
        await warm(engine)
        overlapped = engine.overlap and engine._runner.overlappable
        if path != "default":
            assert engine.static_decode and overlapped == DECODE_PATHS[path]["overlap"]
        log: list[tuple[str, Event]] = []
        a = make_job([11, 12, 13, 14, 15], 40, RecordingQueue("A", log))
        b = make_job(long_prompt(200), 8, RecordingQueue("B", log))
        chunks_before = engine.stats.prefill_chunks
        prefills_before = engine.stats.prefill_passes
        steps_before = engine.stats.decode_steps
        with engine.hold():
            engine.submit(a)
            engine.submit(b)
        a_tokens, b_tokens = await asyncio.gather(tokens_of(a.queue), tokens_of(b.queue))
    finally:
        engine.stop()
    assert len(a_tokens) == 40 and len(b_tokens) == 8
    first_b = next(i for i, (name, _) in enumerate(log) if name == "B")
    a_before = sum(
        len(item.token_ids)
        for name, item in log[:first_b]
        if name == "A" and isinstance(item, EngineDelta)
    )
    chunks = math.ceil(200 / CHUNK)
    # A's prefill token, then one decode step per earlier chunk, less the one in flight
    assert a_before == chunks - overlapped
    assert engine.stats.prefill_chunks - chunks_before == chunks
    assert engine.stats.prefill_passes - prefills_before == 2  # A whole, B's last chunk
    # A's 39 steps (B's 7 among them); overlapped, each stream's last step is discarded
    assert engine.stats.decode_steps - steps_before == 39 + overlapped


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(),
        SamplingParams(greedy=False, temperature=1.3, top_k=20, seed=77),
        SamplingParams(greedy=False, temperature=0.9, top_p=0.8, seed=5),
    ],
    ids=["greedy", "top_k", "top_p"],
)
async def test_a_chunked_prefill_gives_the_tokens_of_a_whole_one(
    chunked: Engine, whole: Engine, sampling: SamplingParams
) -> None:
    """Also for a resumed stream, whose context (prompt and resumed tokens) is chunked whole."""
    prompt = long_prompt(150, offset=3)
    expected = await run_alone(whole, make_job(prompt, 30, asyncio.Queue(), sampling=sampling))
    got = await run_alone(chunked, make_job(prompt, 30, asyncio.Queue(), sampling=sampling))
    assert got == expected
    resumed = make_job(prompt, 30, asyncio.Queue(), sampling=sampling, resume_ids=expected[:12])
    chunks_before = chunked.stats.prefill_chunks
    assert await run_alone(chunked, resumed) == expected[12:]
    assert chunked.stats.prefill_chunks - chunks_before == math.ceil((150 + 12) / CHUNK)


async def test_a_request_cancelled_mid_prefill_leaves_without_a_token(
    tiny_model: LoadedModel,
) -> None:
    """The worker's iterations driven by hand (no thread), so the cancel lands mid-prefill."""
    engine = Engine(tiny_model, prefill_chunk_tokens=CHUNK)
    first, a, b = (asyncio.Queue[Event]() for _ in range(3))
    with torch.inference_mode():
        engine._admit([make_job([5, 6, 7], 2, first)])  # learns the cache layout
        engine._admit([make_job([11, 12, 13], 20, a), job_b := make_job(long_prompt(200), 8, b)])
        for _ in range(3):
            engine._prefill_chunk()
            engine._decode_step()
        assert engine.prefilling_requests == 1
        engine.cancel(job_b)
        engine._drop_cancelled()
        assert engine.prefilling_requests == 0
        while engine._rows:
            engine._decode_step()
        engine._flush_outbox()
    assert len(await tokens_of(a)) == 20
    assert b.empty()
    assert engine.stats.requests_cancelled == 1
    assert engine.stats.prefill_chunks == 3


async def test_prefill_chunks_and_eager_steps_attend_without_cudnn_attention(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of a long prompt attends over every chunk before it, and an eager decode step is
    one column wider than the last: shapes new at every pass, for which cuDNN attention builds
    a plan on CUDA. Both run with cuDNN attention off (generation/attention_backends.py), with
    the tokens of passes where every backend is allowed."""
    seen = spy_cudnn_attention(monkeypatch)
    prompt = long_prompt(100)
    chunks = math.ceil(len(prompt) / CHUNK)
    layers = tiny_model.model.config.num_hidden_layers
    backends = attention_backends.CHANGING_SHAPE_BACKENDS
    tokens = []
    for allowed in (None, backends):
        monkeypatch.setattr(attention_backends, "CHANGING_SHAPE_BACKENDS", allowed)
        engine = Engine(tiny_model, prefill_chunk_tokens=CHUNK, static_decode=False)
        engine.start()
        try:
            await warm(engine)
            seen.clear()
            job = make_job(prompt, 8, asyncio.Queue())
            engine.submit(job)
            tokens.append(await tokens_of(job.queue))
        finally:
            engine.stop()
        # the first token comes with the last chunk, then 7 eager steps
        assert len(seen) == layers * (chunks + 7)
        assert not any(seen) if allowed else all(seen)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
