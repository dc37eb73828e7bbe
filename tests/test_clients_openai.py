"""The openai backend against a fake server speaking vLLM's streaming completions protocol over a
real socket, and migration between two such servers."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from orchestrator.clients import line_transport
from orchestrator.clients import openai as openai_client
from orchestrator.clients.backend import (
    Continuation,
    EngineDelta,
    GenerationError,
    GenerationParams,
    GenerationRequest,
    ModelBackend,
)
from orchestrator.clients.backends import build_model_backends
from orchestrator.clients.openai import OpenAIClient
from orchestrator.config import ModelConfig
from tests.fakes.clock import expire_stalls, manual_stall_clock, ticking_stall_clock
from tests.fakes.openai_server import (
    TOKEN_BASE,
    FakeOpenAI,
    OpenAIFault,
    count_tokens,
    start_fakes,
    templated,
    token_ids,
)
from tests.fakes.upstream import FakeUpstream
from tests.wait_support import DEADLINE_S, until

SCRIPT = ["Once", " upon", " a", " time", "."]
HI = {"role": "user", "content": "Hi"}
FULL = "".join(SCRIPT)


async def start(servers: list[FakeUpstream], n: int = 1, **kwargs: Any) -> list[FakeOpenAI]:
    return await start_fakes(servers, n, script=list(SCRIPT), **kwargs)


def request(prompt: str = "Hi", chat: bool = False, **params: Any) -> GenerationRequest:
    params.setdefault("max_new_tokens", 20)
    return GenerationRequest(prompt=prompt, params=GenerationParams(**params), chat=chat)


async def collect(
    client: OpenAIClient, req: GenerationRequest, cont: Continuation | None = None
) -> list[EngineDelta]:
    stream = client.generate(req, cont, stall_timeout_s=30, max_time=0)
    try:
        return [item async for item in stream]
    finally:
        stream.close()


async def test_normal_stream(session: aiohttp.ClientSession, servers: list[FakeOpenAI]) -> None:
    (s,) = await start(servers, api_key="sekret")
    client = OpenAIClient("o0", s.url, "fake-model", session, api_key="sekret")
    items = await collect(client, request(max_new_tokens=20))
    assert "".join(i.text for i in items) == FULL
    assert [t for i in items for t in i.token_ids] == [TOKEN_BASE + i for i in range(5)]
    assert items[0].prompt_token_ids == tuple(token_ids("Hi"))
    assert items[0].input_token_count == count_tokens("Hi")
    assert items[-1].finish_reason == "EOS_TOKEN"
    body = s.requests[0]
    assert body["stream"] is True and body["return_token_ids"] is True
    assert body["model"] == "fake-model" and body["prompt"] == "Hi"
    assert body["max_tokens"] == 20 and body["temperature"] == 0.0
    assert s.headers[0]["Authorization"] == "Bearer sekret"


async def test_sampling_params_and_finish_mapping(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI]
) -> None:
    (s,) = await start(servers)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    req = request(
        max_new_tokens=3,
        min_new_tokens=2,
        decoding_method="SAMPLING",
        temperature=0.8,
        top_k=10,
        top_p=0.9,
        seed=3,
        repetition_penalty=1.2,
    )
    items = await collect(client, req)
    assert items[-1].finish_reason == "MAX_TOKENS"
    body = s.requests[0]
    assert {k: body[k] for k in ("temperature", "top_k", "top_p", "seed")} == {
        "temperature": 0.8,
        "top_k": 10,
        "top_p": 0.9,
        "seed": 3,
    }
    assert body["repetition_penalty"] == 1.2 and body["min_tokens"] == 2
    items = await collect(client, request(stop_sequences=(" a",)))
    assert items[-1].finish_reason == "STOP_SEQUENCE"
    assert s.requests[1]["stop"] == [" a"]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (OpenAIFault("error", after=2), "reported an error"),
        (OpenAIFault("abort", after=2), "abort"),
        (OpenAIFault("eof", after=2), "without [DONE]"),
        (OpenAIFault("done_early", after=2), "[DONE] without a finish_reason"),
        (OpenAIFault("nested", after=2), "undecodable event"),
        (OpenAIFault("close", after=2), "connection failed"),
        (OpenAIFault("http", status=503), "HTTP 503"),
    ],
)
async def test_failures_are_migratable(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI], fault: OpenAIFault, message: str
) -> None:
    (s,) = await start(servers, fail=fault)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    items: list[EngineDelta] = []
    stream = client.generate(request(), None, stall_timeout_s=30, max_time=0)
    with pytest.raises(GenerationError) as info:
        async for item in stream:
            items.append(item)
    assert info.value.migratable and info.value.code == 503
    assert message in info.value.message
    assert len(items) == fault.after


async def test_stall(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = manual_stall_clock(monkeypatch)
    (s,) = await start(servers, fail=OpenAIFault("stall", after=1))
    client = OpenAIClient("o0", s.url, "fake-model", session)
    stream = client.generate(request(), None, stall_timeout_s=30, max_time=0)
    items: list[EngineDelta] = []

    async def read() -> None:
        async for item in stream:
            items.append(item)

    task = asyncio.create_task(read())
    await until(lambda: len(items) == 1)  # all the server sends before it goes silent
    await expire_stalls(clock, task.done)
    with pytest.raises(GenerationError, match="no event for 30 s \\(stalled\\)") as info:
        await task
    assert info.value.migratable and [i.text for i in items] == ["Once"]


@pytest.mark.parametrize(
    ("mode", "what"), [("endless_line", "a line"), ("endless_event", "an event")]
)
async def test_an_endless_event_is_cut_at_its_bound(
    session: aiohttp.ClientSession,
    servers: list[FakeOpenAI],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    what: str,
) -> None:
    """Repro: a `data:` line that never ended, or `data:` lines that never ended their event,
    were buffered whole until the stall timeout (a fast peer pushes gigabytes in that time).
    Past `MAX_LINE_BYTES` (lowered here, so the fake sends 4 MiB, not 64) the replica failed,
    migratably, and its connection is dropped at once."""
    monkeypatch.setattr(line_transport, "MAX_LINE_BYTES", 1 << 20)
    (s,) = await start(servers, fail=OpenAIFault(mode, after=2))
    client = OpenAIClient("o0", s.url, "fake-model", session)
    stream = client.generate(request(), None, stall_timeout_s=600, max_time=0)
    items: list[EngineDelta] = []
    with pytest.raises(GenerationError) as info:
        async with asyncio.timeout(DEADLINE_S):  # the stall timeout is far off
            async for item in stream:
                items.append(item)
    assert info.value.message == f"replica o0 sent {what} longer than 1048576 bytes"
    assert info.value.migratable and info.value.replica_fault
    assert "".join(i.text for i in items) == "Once upon"
    await until(lambda: s.disconnects == 1, what="the replica's connection dropped")


async def test_empty_events_do_not_hide_a_stall(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repro: every event reset the stall timer, so a replica sending `choices: []` events (as
    a keep-alive, or broken) held the request for ever (until request_timeout_s) instead of
    being declared stalled after `stall_timeout_s` without a token. Each look at the stall clock
    is 5 s later, so a few of the fake's 1,000 empty events outlast the 30 s stall timeout."""
    ticking_stall_clock(monkeypatch, tick_s=5)
    (s,) = await start(servers, fail=OpenAIFault("empty_events", after=2))
    client = OpenAIClient("o0", s.url, "fake-model", session)
    stream = client.generate(request(), None, stall_timeout_s=30, max_time=0)
    items: list[EngineDelta] = []
    with pytest.raises(GenerationError, match=r"no event for 30 s \(stalled\)") as info:
        async with asyncio.timeout(DEADLINE_S):
            async for item in stream:
                items.append(item)
    assert info.value.migratable
    assert "".join(i.text for i in items) == "Once upon"
    await until(lambda: s.disconnects == 1, what="the replica's connection dropped")


async def test_reasoning_keeps_a_replica_alive(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reasoning model streams `delta.reasoning_content` (never passed on) before its answer,
    for longer than the stall timeout (24 thoughts; each look at the stall clock is 5 s later,
    so they span minutes of a 30 s stall timeout): it is generating, not stalled. Events
    without a choice and keep-alives do not reset the stall timer; reasoning does."""
    clock = ticking_stall_clock(monkeypatch, tick_s=5)
    (s,) = await start(servers, reasoning=["Hmm"] * 24)
    client = OpenAIClient("o0", s.url, "fake-model", session, api="chat")
    stream = client.generate(request(chat=True), None, stall_timeout_s=30, max_time=0)
    items = [item async for item in stream]
    assert "".join(i.text for i in items) == FULL
    assert items[-1].finish_reason == "EOS_TOKEN"
    assert clock.now - 1000.0 > 24 * 5  # the thoughts took longer than the stall timeout


async def test_http_400_is_not_migratable(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI]
) -> None:
    (s,) = await start(servers, fail=OpenAIFault("http", status=400))
    client = OpenAIClient("o0", s.url, "fake-model", session)
    with pytest.raises(GenerationError) as info:
        await collect(client, request())
    assert not info.value.migratable and info.value.error_type == "invalid_request"
    assert info.value.code == 422


async def test_chat_prompt_goes_through_tokenize(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI]
) -> None:
    (s,) = await start(servers)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    items = await collect(client, request(prompt="Hi", chat=True))
    assert "".join(i.text for i in items) == FULL
    assert s.requests[0]["prompt"] == token_ids(templated([HI]))
    assert await client.tokenize("Hi", True) == count_tokens(templated([HI]))
    assert await client.tokenize("Hi", False) == count_tokens("Hi")


async def test_a_large_tokenize_reply_is_parsed_off_the_loop(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repro: `/tokenize`'s reply (every token id of the prompt) was parsed and checked on the
    event loop. Past LARGE_REPLY_BYTES it is parsed in a thread; a short one stays inline."""
    threads: list[int] = []
    real = openai_client.token_list

    def recording(raw: bytes) -> tuple[int, ...] | None:
        threads.append(threading.get_ident())
        return real(raw)

    monkeypatch.setattr(openai_client, "token_list", recording)
    (s,) = await start(servers)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    long = "word " * (line_transport.LARGE_REPLY_BYTES // 4)  # ids of 3 digits and a comma
    assert await client.tokenize(long, False) == count_tokens(long)
    assert await client.tokenize("Hi", False) == count_tokens("Hi")
    assert threads[0] != threading.get_ident()  # off the loop
    assert threads[1] == threading.get_ident()


async def test_migration_between_two_servers(
    session: aiohttp.ClientSession, servers: list[FakeOpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_KEY", "k1")
    a, b = await start(servers, 2, api_key="k1")
    a.faults.append(OpenAIFault("close", after=2))
    config = ModelConfig.model_validate(
        {
            "backends": [
                {
                    "type": "openai",
                    "url": s.url,
                    "model": "fake-model",
                    "api_key_env": "FAKE_VLLM_KEY",
                }
                for s in (a, b)
            ],
            "migration": {"quarantine_s": 30},
        }
    )
    backends = build_model_backends({"m": config}, session, registry=CollectorRegistry())
    backend: ModelBackend = backends["m"]
    stream = backend.stream(request(max_new_tokens=10, min_new_tokens=4))
    chunks = [c async for c in stream]
    await stream.aclose()
    assert "".join(c.text for c in chunks) == FULL
    assert [c.generated_token_count for c in chunks] == [1, 2, 3, 4, 5]
    assert stream.migrations == 1 and stream.finish_reason == "EOS_TOKEN"
    resumed = b.requests[0]
    assert resumed["prompt"] == [*token_ids("Hi"), TOKEN_BASE, TOKEN_BASE + 1]
    assert resumed["max_tokens"] == 8 and resumed["min_tokens"] == 2
    assert b.headers[0]["Authorization"] == "Bearer k1"
    assert [r["type"] for r in backend.info()] == ["openai", "openai"]
