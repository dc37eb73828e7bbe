"""MigratingStream with fake native engines over real sockets (DESIGN section 7): resumes,
local completion, give-up rules, quarantine, cancellation, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from orchestrator.clients.backend import (
    EngineDelta,
    GenerationError,
    GenerationParams,
    GenerationRequest,
)
from orchestrator.clients.backends import ReplicatedModelBackend, build_model_backends
from orchestrator.clients.migration import MigratingStream, MigrationMetrics
from orchestrator.config import MigrationConfig, ModelConfig
from tests.fakes.clock import ManualClock, expire_stalls, manual_stall_clock
from tests.fakes.engine import DRAWN_SEED, TOKEN_BASE, FakeEngine, Fault, prompt_ids
from tests.wait_support import finished, until

SCRIPT = ["The", " cat", " sat", " on", " the", " m", "at", "."]
FULL = "".join(SCRIPT)


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    made: list[FakeEngine] = []
    yield made
    for e in made:
        await e.close()


async def start_engines(engines: list[FakeEngine], n: int, **kwargs: Any) -> list[FakeEngine]:
    for _ in range(n):
        e = FakeEngine(script=list(SCRIPT), **kwargs)
        await e.start()
        engines.append(e)
    return engines


def backend(
    session: aiohttp.ClientSession,
    engines: list[FakeEngine],
    registry: CollectorRegistry | None = None,
    **migration: Any,
) -> ReplicatedModelBackend:
    config = ModelConfig.model_validate(
        {
            "backends": [{"type": "native", "url": e.url} for e in engines],
            "migration": {"stall_timeout_s": 5, "quarantine_s": 30, **migration},
        }
    )
    built = build_model_backends({"m": config}, session, registry=registry or CollectorRegistry())
    b = built["m"]
    assert isinstance(b, ReplicatedModelBackend)
    return b


def req(prompt: str = "Hi", **params: Any) -> GenerationRequest:
    params.setdefault("max_new_tokens", 50)
    return GenerationRequest(prompt=prompt, params=GenerationParams(**params), request_id="r-1")


async def run(stream: MigratingStream) -> list[EngineDelta]:
    chunks: list[EngineDelta] = []
    await consume(stream, chunks)
    return chunks


async def consume(stream: MigratingStream, chunks: list[EngineDelta]) -> None:
    """Reads the stream into `chunks` (which a test watches from another task)."""
    async with stream:
        async for chunk in stream:
            chunks.append(chunk)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return value or 0.0


async def test_uninterrupted(session: aiohttp.ClientSession, engines: list[FakeEngine]) -> None:
    await start_engines(engines, 2)
    b = backend(session, engines)
    stream = b.stream(req())
    chunks = await run(stream)
    assert "".join(c.text for c in chunks) == FULL
    assert [c.generated_token_count for c in chunks] == list(range(1, len(SCRIPT) + 1))
    assert chunks[-1].finish_reason == "EOS_TOKEN"
    assert all(c.input_token_count == 2 for c in chunks)
    assert (stream.migrations, stream.finish_reason, stream.generated_token_count) == (
        0,
        "EOS_TOKEN",
        len(SCRIPT),
    )
    assert stream.input_token_count == 2


async def test_mid_stream_failure_resumes_on_another_replica(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=3))
    registry = CollectorRegistry()
    b = backend(session, engines, registry)
    stream = b.stream(req(max_new_tokens=40, decoding_method="SAMPLING", seed=7))
    chunks = await run(stream)
    assert "".join(c.text for c in chunks) == FULL  # seamless
    assert [c.generated_token_count for c in chunks] == list(range(1, len(SCRIPT) + 1))
    assert [t for c in chunks for t in c.token_ids] == [TOKEN_BASE + i for i in range(8)]
    assert stream.migrations == 1 and stream.finish_reason == "EOS_TOKEN"
    assert len(a.requests) == 1 and len(b2.requests) == 1
    body = b2.requests[0].body
    assert body["input_ids"] == prompt_ids("Hi")
    assert body["resume"] == {"token_ids": [1000, 1001, 1002], "text": "The cat sat"}
    assert body["max_new_tokens"] == 40
    assert body["decoding"]["seed"] == 7 and body["decoding"]["method"] == "sampling"
    assert "prompt" not in body
    assert b2.resume_mismatches == []
    assert sample(registry, "guardstream_migrations_total", model_id="m", kind="mid_stream") == 1
    assert b.info()[0]["quarantined"] and not b.info()[1]["quarantined"]


async def test_unseeded_sampling_resumes_with_the_drawn_seed(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=2))
    b = backend(session, engines)
    stream = b.stream(req(decoding_method="SAMPLING"))
    assert "".join(c.text for c in await run(stream)) == FULL
    assert "seed" not in a.requests[0].body["decoding"]
    assert b2.requests[0].body["decoding"]["seed"] == DRAWN_SEED
    assert stream.seed == DRAWN_SEED


async def test_stall_migrates(
    session: aiohttp.ClientSession, engines: list[FakeEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = manual_stall_clock(monkeypatch)
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("stall", after_tokens=2))
    b = backend(session, engines)
    stream = b.stream(req())
    chunks: list[EngineDelta] = []
    task = asyncio.create_task(consume(stream, chunks))
    await until(lambda: len(chunks) == 2)  # all that replica 0 sends before going silent
    await expire_stalls(clock, lambda: stream.migrations == 1)
    await task
    assert "".join(c.text for c in chunks) == FULL
    assert stream.migrations == 1
    await a.wait_disconnects(1)  # the stalled replica's connection was dropped
    assert b2.requests[0].body["resume"]["token_ids"] == [1000, 1001]


@pytest.mark.parametrize("mode", ["eof", "close", "stall", "error", "garbage"])
async def test_failure_after_finish_completes_without_redispatch(
    session: aiohttp.ClientSession,
    engines: list[FakeEngine],
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last item (with its finish_reason) arrived, complete_final did not."""
    clock = manual_stall_clock(monkeypatch)
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault(mode, after_tokens=len(SCRIPT)))  # type: ignore[arg-type]
    registry = CollectorRegistry()
    b = backend(session, engines, registry)
    stream = b.stream(req())
    chunks: list[EngineDelta] = []
    task = asyncio.create_task(consume(stream, chunks))
    if mode == "stall":  # the final item came and then nothing: the grace for the marker ends
        await until(lambda: len(chunks) == len(SCRIPT))
        await expire_stalls(clock, task.done)
    await task
    assert "".join(c.text for c in chunks) == FULL
    assert stream.finish_reason == "EOS_TOKEN" and stream.migrations == 0
    assert len(b2.requests) == 0
    assert sample(registry, "guardstream_migrations_total", model_id="m", kind="mid_stream") == 0


async def test_budget_spent_without_finish_reason_completes_locally(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2, omit_finish_reason=True)
    a.inject(Fault("eof", after_tokens=4))
    b = backend(session, engines)
    stream = b.stream(req(max_new_tokens=4))
    chunks = await run(stream)
    assert "".join(c.text for c in chunks) == "".join(SCRIPT[:4])
    assert chunks[-1].finish_reason == "MAX_TOKENS" and chunks[-1].text == ""
    assert chunks[-1].generated_token_count == 4
    assert stream.finish_reason == "MAX_TOKENS" and stream.migrations == 0
    assert len(b2.requests) == 0


async def test_failure_before_first_token_is_a_new_request(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=0))
    registry = CollectorRegistry()
    b = backend(session, engines, registry)
    stream = b.stream(req(prompt="Hello there"))
    chunks = await run(stream)
    assert "".join(c.text for c in chunks) == FULL
    assert stream.migrations == 1
    body = b2.requests[0].body
    assert body["prompt"] == "Hello there" and "resume" not in body and "input_ids" not in body
    assert (
        sample(registry, "guardstream_migrations_total", model_id="m", kind="before_first_token")
        == 1
    )


async def test_http_503_before_first_token_migrates(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, _ = await start_engines(engines, 2)
    a.inject(Fault("http", status=503))
    b = backend(session, engines)
    stream = b.stream(req())
    assert "".join(c.text for c in await run(stream)) == FULL
    assert stream.migrations == 1


async def test_an_internal_error_moves_the_request_without_quarantining_its_replica(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """A replica that answers HTTP 500 is alive and its handler failed on this request: the
    request goes to another replica (never the same one again) and the first stays in
    service."""
    a, b2, _ = await start_engines(engines, 3)
    a.inject(Fault("http", status=500))
    registry = CollectorRegistry()
    b = backend(session, engines, registry)
    stream = b.stream(req())
    assert "".join(c.text for c in await run(stream)) == FULL
    assert stream.migrations == 1 and (len(a.requests), len(b2.requests)) == (1, 1)
    assert [r["quarantined"] for r in b.info()] == [False, False, False]
    assert sample(
        registry, "guardstream_replica_failures_total", model_id="m", replica="native-0"
    ) in (0, None)


async def test_a_request_two_replicas_answer_with_an_internal_error_is_given_up(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """The second HTTP 500 for one request makes it the request's fault: it ends (502, the
    replicas' answer and why) and no replica is quarantined. Before, each 500 quarantined its
    replica and migrated: one request that made every engine fail (a tool call's arguments
    nested past what json parses, once) took every replica of the model out in turn."""
    engines_ = await start_engines(engines, 3)
    for e in engines_:
        e.inject(Fault("http", status=500, times=-1))
    registry = CollectorRegistry()
    b = backend(session, engines, registry)
    with pytest.raises(GenerationError) as info:
        await run(b.stream(req()))
    assert (info.value.error_type, info.value.code) == ("generation_error", 502)
    assert info.value.message == (
        "replica native-1 answered HTTP 500 (not migrated: 2 replicas answered this request "
        "with an internal error)"
    )
    assert [len(e.requests) for e in engines_] == [1, 1, 0]
    assert [r["quarantined"] for r in b.info()] == [False, False, False]
    assert (
        sample(
            registry,
            "guardstream_generation_unmigratable_total",
            model_id="m",
            reason="internal_error",
        )
        == 1
    )


async def test_limit_zero_surfaces_the_original_error(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=2))
    registry = CollectorRegistry()
    b = backend(session, engines, registry, limit=0)
    stream = b.stream(req())
    got: list[str] = []
    with pytest.raises(GenerationError) as info:
        async with stream:
            async for chunk in stream:
                got.append(chunk.text)
    err = info.value
    assert (err.error_type, err.code, err.migratable) == ("generation_unavailable", 503, False)
    assert "replica native-0" in err.message and "migration limit 0" in err.message
    assert "".join(got) == "The cat"
    assert len(b2.requests) == 0
    assert sample(registry, "guardstream_migrations_exhausted_total", model_id="m") == 1


async def test_limit_exhausted_surfaces_the_first_error(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2, c = await start_engines(engines, 3)
    a.inject(Fault("close", after_tokens=1))
    b2.inject(Fault("error", after_tokens=1, message="engine overloaded"))
    b = backend(session, engines, limit=1)
    stream = b.stream(req())
    with pytest.raises(GenerationError) as info:
        await run(stream)
    assert "native-0" in info.value.message and "connection failed" in info.value.message
    assert stream.migrations == 1
    assert len(c.requests) == 0


async def test_all_replicas_down(session: aiohttp.ClientSession, engines: list[FakeEngine]) -> None:
    await start_engines(engines, 2)
    for e in engines:
        await e.close()
    b = backend(session, engines)
    # before any health probe: both are tried, both refuse
    with pytest.raises(GenerationError) as info:
        await run(b.stream(req()))
    assert info.value.error_type == "generation_unavailable" and info.value.code == 503
    # once probed (and quarantined): refused before any dispatch
    b2 = backend(session, engines)
    await b2.pool.probe_all()
    assert [r["status"] for r in b2.info()] == ["UNHEALTHY", "UNHEALTHY"]
    with pytest.raises(GenerationError, match="no healthy replica") as info:
        await run(b2.stream(req()))
    assert info.value.error_type == "generation_unavailable" and info.value.code == 503
    with pytest.raises(GenerationError, match="no healthy replica"):
        await b2.tokenize("x", False)


async def test_above_max_seq_len_is_not_migrated(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=3))
    registry = CollectorRegistry()
    b = backend(session, engines, registry, max_seq_len=4)  # 2 prompt + 3 generated > 4
    with pytest.raises(GenerationError, match="max_seq_len 4") as info:
        await run(b.stream(req()))
    assert info.value.error_type == "generation_unavailable"
    assert len(b2.requests) == 0
    assert (
        sample(
            registry,
            "guardstream_generation_unmigratable_total",
            model_id="m",
            reason="max_seq_len",
        )
        == 1
    )


async def test_non_migratable_error_is_not_migrated(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("error", after_tokens=2, error_type="generation_error", message="bad input"))
    b = backend(session, engines)
    with pytest.raises(GenerationError, match="reported an error") as info:
        await run(b.stream(req()))
    assert (info.value.error_type, info.value.code) == ("generation_error", 502)
    assert len(b2.requests) == 0
    assert not b.info()[0]["quarantined"]  # the request was at fault, not the replica


async def test_quarantine_is_respected(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2, c = await start_engines(engines, 3)
    a.inject(Fault("close", after_tokens=1))
    b2.inject(Fault("close", after_tokens=2))
    b = backend(session, engines, quarantine_s=30)
    clock = ManualClock()
    b.pool.clock = clock
    stream = b.stream(req())
    assert "".join(c.text for c in await run(stream)) == FULL
    assert stream.migrations == 2
    assert (len(a.requests), len(b2.requests), len(c.requests)) == (1, 1, 1)
    # new requests avoid both quarantined replicas ...
    for _ in range(2):
        await run(b.stream(req()))
    assert (len(a.requests), len(b2.requests), len(c.requests)) == (1, 1, 3)
    clock.advance(29.9)
    await run(b.stream(req()))
    assert (len(a.requests), len(b2.requests), len(c.requests)) == (1, 1, 4)
    assert [r["quarantined"] for r in b.info()] == [True, True, False]
    # ... until the quarantine ends, quarantine_s after the failure
    clock.advance(0.1)
    assert [r["quarantined"] for r in b.info()] == [False, False, False]
    await run(b.stream(req()))
    await run(b.stream(req()))
    assert len(a.requests) + len(b2.requests) == 4


async def test_least_active_then_round_robin(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    await start_engines(engines, 3)
    b = backend(session, engines)
    # round-robin while idle
    for _ in range(3):
        await run(b.stream(req(max_new_tokens=1)))
    assert [len(e.requests) for e in engines] == [1, 1, 1]
    # a long stream holds replica 0 (it goes silent after one token): the next ones go elsewhere
    engines[0].inject(Fault("stall", after_tokens=1))
    long = b.stream(req())
    await long.__anext__()
    assert b.info()[0]["active"] == 1
    for _ in range(4):
        await run(b.stream(req(max_new_tokens=1)))
    assert [len(e.requests) for e in engines] == [2, 3, 3]
    await long.aclose()
    assert b.info()[0]["active"] == 0


async def test_aclose_drops_the_connection_and_never_redispatches(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("stall", after_tokens=1))  # the stream is still running when it is closed
    b = backend(session, engines)
    stream = b.stream(req())
    first = await stream.__anext__()
    assert first.text == "The"
    await stream.aclose()
    await a.wait_disconnects(1)
    assert len(b2.requests) == 0 and stream.migrations == 0
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert b.info()[0]["active"] == 0 and not b.info()[0]["quarantined"]


async def test_task_cancel_drops_the_connection_and_never_redispatches(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("stall", after_tokens=1))  # the stream is still running when it is cancelled
    b = backend(session, engines)
    stream = b.stream(req())
    got: list[str] = []

    async def consume() -> None:
        try:
            async for chunk in stream:
                got.append(chunk.text)
        finally:
            await stream.aclose()

    task = asyncio.create_task(consume())
    await until(lambda: bool(got))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await a.wait_disconnects(1)
    assert len(b2.requests) == 0 and stream.migrations == 0
    assert b.info()[0]["active"] == 0


async def test_aclose_from_another_task_while_reading(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """aclose() while another task awaits the next chunk: the read ends, nothing re-dispatched."""
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("stall", after_tokens=1))
    b = backend(session, engines)
    stream = b.stream(req())
    got: list[str] = []

    async def read() -> list[str]:
        async for c in stream:
            got.append(c.text)
        return got

    task = asyncio.create_task(read())
    await until(lambda: got == ["The"])  # the reader now waits for a token that never comes
    await stream.aclose()
    assert await finished(task, 10, "task") == ["The"]
    await a.wait_disconnects(1)
    assert len(b2.requests) == 0


async def test_health_polling_and_info(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    a, b2 = await start_engines(engines, 2)
    b = backend(session, engines)
    assert [r["status"] for r in b.info()] == ["UNKNOWN", "UNKNOWN"]
    b.pool.health_interval_s = 0.05
    b2.healthy = False
    await b.start()
    try:
        await until(lambda: [r["status"] for r in b.info()] == ["HEALTHY", "UNHEALTHY"])
        info = b.info()[0]
        assert info["name"] == "native-0" and info["type"] == "native" and info["url"] == a.url
        assert info["active"] == 0
        # the unhealthy replica is not chosen
        for _ in range(3):
            await run(b.stream(req(max_new_tokens=1)))
        assert (len(a.requests), len(b2.requests)) == (3, 0)
        assert await b.tokenize("abc", False) == 3
    finally:
        await b.close()


async def test_metrics_default_registry_is_private() -> None:
    m1, m2 = MigrationMetrics(), MigrationMetrics()  # no duplicate-registration error
    m1.migrations.labels("m", "mid_stream").inc()
    assert m2.registry.get_sample_value(
        "guardstream_migrations_total", {"model_id": "m", "kind": "mid_stream"}
    ) in (None, 0.0)


async def test_migration_log_names_request_replica_attempt_tokens(
    session: aiohttp.ClientSession,
    engines: list[FakeEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, _ = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=3))
    b = backend(session, engines)
    with caplog.at_level("INFO", logger="guardstream.migration"):
        await run(b.stream(req()))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "guardstream.migration")
    assert "request r-1: replica native-0 failed (attempt 1, 3 tokens delivered)" in text
    assert "attempt 2 on replica native-1 after 3 delivered tokens" in text


def test_migration_config_defaults() -> None:
    cfg = MigrationConfig()
    assert (cfg.limit, cfg.max_seq_len, cfg.stall_timeout_s, cfg.quarantine_s) == (3, 8192, 30, 5)


async def test_a_busy_replica_moves_the_request_without_quarantining_it(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """An engine at its bound answers 429 (generation/server.py: too many waiting requests, or
    its tokenizer's queue full): it is alive and busy, so the request goes to another replica
    and the busy one stays in service, no failure counted against it. Before, a 429
    quarantined it: an orchestrator's own burst took a healthy model out for quarantine_s."""
    a, b2, _ = await start_engines(engines, 3)
    a.inject(Fault("http", status=429, error_type="too_many_requests"))
    registry = CollectorRegistry()
    b = backend(session, engines, registry)
    stream = b.stream(req())
    assert "".join(c.text for c in await run(stream)) == FULL
    # a busy answer is not a migration (nothing was delivered, no stream died)
    assert stream.migrations == 0 and (len(a.requests), len(b2.requests)) == (1, 1)
    assert [r["quarantined"] for r in b.info()] == [False, False, False]
    assert sample(
        registry, "guardstream_replica_failures_total", model_id="m", replica="native-0"
    ) in (0, None)


async def test_a_request_every_replica_is_too_busy_for_is_overloaded(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """Every replica answering 429: each is asked once (never the same busy one again), no
    replica is quarantined (nor counted as an internal error's), and the request ends as what
    it is, a fleet at capacity: 429 `overloaded` (with Retry-After, on every surface), which
    clients' retry logic expects. Before, it ended 503 generation_unavailable ("broken"). A
    busy answer is not a migration: none is counted, whatever the migration limit."""
    engines_ = await start_engines(engines, 3)
    for e in engines_:
        e.inject(Fault("http", status=429, error_type="too_many_requests", times=-1))
    registry = CollectorRegistry()
    b = backend(session, engines, registry, limit=1)
    stream = b.stream(req())
    with pytest.raises(GenerationError) as info:
        await run(stream)
    assert (info.value.error_type, info.value.code) == ("overloaded", 429)
    assert info.value.message == (
        "every replica of model `m` is at capacity (replica native-0 answered HTTP 429)"
    )
    assert [len(e.requests) for e in engines_] == [1, 1, 1]
    assert [r["quarantined"] for r in b.info()] == [False, False, False]
    assert stream.migrations == 0
    for kind in ("before_first_token", "mid_stream"):
        assert sample(registry, "guardstream_migrations_total", model_id="m", kind=kind) == 0


async def test_a_busy_replica_is_passed_over_with_migration_off(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """`migration.limit: 0` disables migration, not load balancing: a replica that answered
    429 before any token gets the request elsewhere, and no migration is counted. Before, the
    busy answer was a migration past the limit: 503 with another replica idle."""
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("http", status=429, error_type="too_many_requests"))
    b = backend(session, engines, limit=0)
    stream = b.stream(req())
    assert "".join(c.text for c in await run(stream)) == FULL
    assert stream.migrations == 0 and (len(a.requests), len(b2.requests)) == (1, 1)


async def test_a_stream_that_died_with_the_rest_busy_ends_unavailable(
    session: aiohttp.ClientSession, engines: list[FakeEngine]
) -> None:
    """A replica that died mid-stream, and every other one busy: the stream is broken, not
    refused for load (the client already has text): 503 generation_unavailable with the
    original failure, one migration counted (the dying replica's), none for the busy one."""
    a, b2 = await start_engines(engines, 2)
    a.inject(Fault("close", after_tokens=2))
    b2.inject(Fault("http", status=429, error_type="too_many_requests", times=-1))
    b = backend(session, engines, limit=3)
    stream = b.stream(req())
    chunks: list[EngineDelta] = []
    with pytest.raises(GenerationError) as info:
        await consume(stream, chunks)
    assert (info.value.error_type, info.value.code) == ("generation_unavailable", 503)
    assert "(not migrated: every other replica is busy or unavailable)" in info.value.message
    assert "".join(c.text for c in chunks) == "".join(SCRIPT[:2])
    assert stream.migrations == 1 and (len(a.requests), len(b2.requests)) == (1, 1)
