"""Exact migration in bfloat16: two managed replicas of smollm2-135m started with `dtype:
bfloat16, batch_invariant: true`; SIGKILL of the serving replica mid-stream; the migrated stream's
text is byte-identical to an uninterrupted run, greedy and seeded (DESIGN section 7).

Without the mode the resumed replica prefills prompt + delivered tokens in one pass, whose bf16
arithmetic differs from the token-by-token decode that produced them, so the continuation may
differ; tests/test_migration_engine.py covers the default mode in float64.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.clients.backends import ReplicatedModelBackend
from tests.engine_support import smollm2_missing
from tests.migration_support import arm, collect, managed_backend
from tests.wait_support import until

pytestmark = [
    pytest.mark.skipif(smollm2_missing() is not None, reason=smollm2_missing() or ""),
    pytest.mark.asyncio(loop_scope="module"),
]

PROMPT = "The three most useful kitchen tools are"
GREEDY = GenerationParams(max_new_tokens=20, min_new_tokens=20)
SEEDED = GenerationParams(
    max_new_tokens=20, min_new_tokens=20, decoding_method="SAMPLING", temperature=1.0, seed=4321
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def backend() -> AsyncIterator[ReplicatedModelBackend]:
    async with managed_backend(
        "smollm2-135m",
        start_timeout_s=300,
        stall_timeout_s=120,
        dtype="bfloat16",
        batch_invariant=True,
        enable_fault_injection=True,
    ) as b:
        yield b


async def test_replicas_report_the_mode(backend: ReplicatedModelBackend) -> None:
    async with aiohttp.ClientSession() as s:
        for replica in backend.pool.replicas:
            headers = replica.client.headers
            async with s.get(replica.client.url + "/health", headers=headers) as r:
                health = await r.json()
            async with s.get(replica.client.url + "/v1/models", headers=headers) as r:
                model = (await r.json())["data"][0]
            assert (health["dtype"], health["batch_invariant"]) == ("bfloat16", True)
            assert (model["dtype"], model["batch_invariant"]) == ("bfloat16", True)


@pytest.mark.parametrize("decoding", ["greedy", "seeded"])
async def test_sigkill_mid_stream_is_byte_identical(
    backend: ReplicatedModelBackend, decoding: str
) -> None:
    params = GREEDY if decoding == "greedy" else SEEDED
    uninterrupted = backend.stream(GenerationRequest(PROMPT, params, request_id=f"ref-{decoding}"))
    expected = await collect(uninterrupted)
    assert uninterrupted.migrations == 0 and uninterrupted.generated_token_count == 20
    # the serving replica goes silent after 8 tokens: the kill lands mid-stream
    target = await arm(backend, after_tokens=8, mode="stall", times=1)
    restarts = sum(p.restarts for p in backend.processes)
    stream = backend.stream(GenerationRequest(PROMPT, params, request_id=f"kill-{decoding}"))
    text = await collect(stream, kill_after=5)
    assert stream.replicas_used[0] == target and stream.migrations == 1
    assert text.encode() == expected.encode()
    assert stream.generated_token_count == 20
    await until(lambda: sum(p.restarts for p in backend.processes) == restarts + 1, 120)
