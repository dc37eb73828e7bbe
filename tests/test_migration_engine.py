"""Migration with REAL engine processes (`python -m generation serve --model tiny-random`),
started and supervised by the managed backend: SIGKILL of the serving replica mid-stream, fault
injection (close / stall / error) at several token positions, a failure before the first token,
and a crashed replica that is restarted and serves again.

The oracle is an uninterrupted run of the same request: a migrated stream must be exactly equal
to it (greedy and seeded sampling), because the engine resumes exactly (DESIGN section 7).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.clients.backends import ReplicatedModelBackend
from tests.fakes.clock import expire_stalls, manual_stall_clock
from tests.migration_support import all_healthy, arm, collect, kill_serving, managed_backend
from tests.wait_support import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The quick brown fox"
GREEDY = GenerationParams(max_new_tokens=48)
SEEDED = GenerationParams(
    max_new_tokens=48, decoding_method="SAMPLING", temperature=0.9, top_k=50, top_p=0.95, seed=1234
)


CHUNK = 256  # the replicas' prefill chunk (--prefill-chunk-tokens), tokens


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def backend() -> AsyncIterator[ReplicatedModelBackend]:
    # chunks of 256 tokens on every device (CUDA's default, 2048, exceeds tiny-random's context)
    async with managed_backend(
        "tiny-random",
        start_timeout_s=120,
        stall_timeout_s=30,
        enable_fault_injection=True,
        prefill_chunk_tokens=CHUNK,
    ) as b:
        yield b


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def oracle(backend: ReplicatedModelBackend) -> dict[str, tuple[str, int, str | None]]:
    """Uninterrupted runs: text, token count and finish reason per decoding."""
    out = {}
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        stream = backend.stream(GenerationRequest(PROMPT, params))
        text = await collect(stream)
        assert stream.migrations == 0
        out[name] = (text, stream.generated_token_count, stream.finish_reason)
    assert out["greedy"][1] >= 16 and out["seeded"][1] >= 16  # long enough to cut mid-stream
    assert out["greedy"][0] != out["seeded"][0]  # the sampled run really samples
    return out


async def engine_metric(backend: ReplicatedModelBackend, name: str) -> float:
    """A counter summed over every replica's /metrics."""
    total = 0.0
    async with aiohttp.ClientSession() as s:
        for replica in backend.pool.replicas:
            async with s.get(replica.client.url + "/metrics") as r:
                page = await r.text()
            total += sum(float(x.split()[-1]) for x in page.splitlines() if x.startswith(name))
    return total


async def test_a_long_prompt_prefilled_in_chunks_resumes_exactly(
    backend: ReplicatedModelBackend,
) -> None:
    """A prompt over the engine's chunk (CHUNK tokens) is prefilled in chunks, and so is
    the resumed context (prompt and delivered tokens) on the other replica: the migrated stream
    equals the uninterrupted one."""
    prompt = " ".join(f"w{i}" for i in range(76))  # ~300 tiny-random tokens
    async with aiohttp.ClientSession() as s:
        for replica in backend.pool.replicas:  # a replica learns its cache layout first
            body = {"prompt": "Hi", "max_new_tokens": 1}
            headers = replica.client.headers
            async with s.post(replica.client.url + "/v1/generate", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
    chunks = "guardstream_engine_prefill_chunks_total"
    before = await engine_metric(backend, chunks)
    stream = backend.stream(GenerationRequest(prompt, GREEDY, request_id="long-whole"))
    expected = await collect(stream)
    length = stream.input_token_count
    assert length is not None and CHUNK < length < 512 - 48
    assert stream.migrations == 0 and stream.generated_token_count == 48
    after = 20
    target = await arm(backend, after_tokens=after, mode="error", times=1)
    stream = backend.stream(GenerationRequest(prompt, GREEDY, request_id="long-migrated"))
    assert await collect(stream) == expected
    assert stream.replicas_used[0] == target and stream.migrations == 1
    per_prompt = math.ceil(length / CHUNK)
    resumed = math.ceil((length + after) / CHUNK)
    assert await engine_metric(backend, chunks) - before == 2 * per_prompt + resumed


@pytest.mark.parametrize("decoding", ["greedy", "seeded"])
async def test_sigkill_mid_stream_is_seamless(
    backend: ReplicatedModelBackend, oracle: dict[str, tuple[str, int, str | None]], decoding: str
) -> None:
    # the replica goes silent after 8 tokens, so the kill lands mid-stream however far the
    # engine could have run ahead of a slow client
    target = await arm(backend, after_tokens=8, mode="stall", times=1)
    restarts = sum(p.restarts for p in backend.processes)
    params = GREEDY if decoding == "greedy" else SEEDED
    stream = backend.stream(GenerationRequest(PROMPT, params, request_id=f"kill-{decoding}"))
    text = await collect(stream, kill_after=5)
    assert stream.replicas_used[0] == target
    expected_text, expected_count, expected_finish = oracle[decoding]
    assert text == expected_text
    assert stream.migrations == 1
    assert stream.generated_token_count == expected_count
    assert stream.finish_reason == expected_finish
    # the killed replica is restarted by its supervisor
    await until(lambda: sum(p.restarts for p in backend.processes) == restarts + 1, 60)


@pytest.mark.parametrize("mode", ["close", "stall", "error"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
async def test_fault_injection(
    backend: ReplicatedModelBackend,
    oracle: dict[str, tuple[str, int, str | None]],
    mode: str,
    position: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = manual_stall_clock(monkeypatch)  # no stream stalls but the one the test declares
    expected_text, count, finish = oracle["greedy"]
    after = {"first": 0, "middle": count // 2, "last": count}[position]
    target = await arm(backend, after_tokens=after, mode=mode, times=1)
    stream = backend.stream(GenerationRequest(PROMPT, GREEDY, request_id=f"{mode}-{position}"))
    parts: list[str] = []
    task = asyncio.create_task(collect(stream, parts=parts))
    if mode == "stall":  # the replica went silent once the client has all it sent
        await until(lambda: len(parts) == after, 60)
        await expire_stalls(clock, lambda: stream.migrations == 1 or task.done())
    text = await task
    assert text == expected_text
    assert stream.replicas_used[0] == target
    assert stream.generated_token_count == count and stream.finish_reason == finish
    if position == "last":
        # the model had finished before complete_final: no re-dispatch
        assert stream.migrations == 0 and stream.replicas_used == [target]
    else:
        assert stream.migrations == 1 and stream.replicas_used[1] != target


async def test_crashed_replica_restarts_and_serves_again(
    backend: ReplicatedModelBackend, oracle: dict[str, tuple[str, int, str | None]]
) -> None:
    await all_healthy(backend)
    proc = backend.processes[0]
    old_pid, restarts = proc.pid, proc.restarts
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    await until(lambda: proc.restarts == restarts + 1 and proc.pid != old_pid, 60)
    await all_healthy(backend)
    served: set[str] = set()
    for i in range(3):
        stream = backend.stream(GenerationRequest(PROMPT, GREEDY, request_id=f"after-{i}"))
        assert await collect(stream) == oracle["greedy"][0]
        served.update(stream.replicas_used)
    assert backend.replicas[0].name in served


async def test_concurrent_streams_survive_a_kill(
    backend: ReplicatedModelBackend, oracle: dict[str, tuple[str, int, str | None]]
) -> None:
    """Both replicas busy; one dies: its streams move to the other, all stay exact."""
    # streams 0 and 2 go to the replica that the next request goes to (least active, then round
    # robin); it goes silent after 8 tokens, so they are still running when it dies
    target = await arm(backend, after_tokens=8, mode="stall", times=2)
    streams = [
        backend.stream(GenerationRequest(PROMPT, GREEDY if i % 2 else SEEDED, request_id=f"c{i}"))
        for i in range(4)
    ]
    started = asyncio.Event()

    async def run(i: int) -> str:
        parts: list[str] = []
        async with streams[i]:
            async for chunk in streams[i]:
                parts.append(chunk.text)
                if len(parts) == 3:
                    started.set()
        return "".join(parts)

    tasks = [asyncio.create_task(run(i)) for i in range(4)]
    await started.wait()
    await kill_serving(streams[0])
    texts = await asyncio.gather(*tasks)
    for i, text in enumerate(texts):
        assert text == oracle["greedy" if i % 2 else "seeded"][0]
    assert [s.replicas_used[0] == target for s in streams] == [True, False, True, False]
    assert [s.migrations for s in streams] == [1, 0, 1, 0]
    await all_healthy(backend)
