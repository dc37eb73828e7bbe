"""The native engine client against a fake engine over a real socket: the body it sends and the
end-of-stream contract it enforces (DESIGN section 7)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from orchestrator.clients import line_transport, native
from orchestrator.clients.backend import (
    Continuation,
    EngineDelta,
    GenerationError,
    GenerationParams,
    GenerationRequest,
)
from orchestrator.clients.native import MODELS_REPLY_BYTES, NativeClient
from tests.fakes.clock import manual_stall_clock, ticking_stall_clock
from tests.fakes.engine import TOKEN_BASE, FakeEngine, Fault, prompt_ids
from tests.wait_support import DEADLINE_S

SCRIPT = ["Hello", ",", " wor", "ld", "!"]


async def engine(**kwargs: object) -> FakeEngine:
    e = FakeEngine(script=list(SCRIPT), **kwargs)  # type: ignore[arg-type]
    await e.start()
    return e


def request(**params: object) -> GenerationRequest:
    return GenerationRequest(prompt="Hi", params=GenerationParams(**params))  # type: ignore[arg-type]


async def collect(
    client: NativeClient,
    req: GenerationRequest,
    cont: Continuation | None = None,
    stall: float = 5.0,
    max_time: float = 0.0,
) -> list[EngineDelta]:
    items = []
    stream = client.generate(req, cont, stall_timeout_s=stall, max_time=max_time)
    try:
        async for item in stream:
            items.append(item)
    finally:
        stream.close()
    return items


async def test_normal_stream(session: aiohttp.ClientSession) -> None:
    e = await engine()
    try:
        client = NativeClient("r0", e.url, session)
        items = await collect(client, request(max_new_tokens=50))
        assert "".join(i.text for i in items) == "".join(SCRIPT)
        assert [t for i in items for t in i.token_ids] == [TOKEN_BASE + i for i in range(5)]
        assert items[0].prompt_token_ids == tuple(prompt_ids("Hi"))
        assert items[-1].finish_reason == "EOS_TOKEN"
        assert all(i.finish_reason is None for i in items[:-1])
        assert e.requests[0].completed
    finally:
        await e.close()


async def test_request_body_maps_params(session: aiohttp.ClientSession) -> None:
    e = await engine()
    try:
        client = NativeClient("r0", e.url, session)
        req = GenerationRequest(
            prompt="Hi",
            chat=True,
            params=GenerationParams(
                max_new_tokens=3,
                min_new_tokens=1,
                decoding_method="SAMPLING",
                temperature=0.7,
                top_k=5,
                top_p=0.9,
                seed=42,
                repetition_penalty=1.1,
                stop_sequences=("!",),
                max_time=2.5,
            ),
        )
        items = await collect(client, req, max_time=2.5)  # MigratingStream passes what is left
        assert items[-1].finish_reason == "MAX_TOKENS"
        body = e.requests[0].body
        assert body == {
            "prompt": "Hi",
            "chat": True,
            "max_new_tokens": 3,
            "min_new_tokens": 1,
            "decoding": {
                "method": "sampling",
                "temperature": 0.7,
                "top_k": 5,
                "top_p": 0.9,
                "seed": 42,
                "repetition_penalty": 1.1,
            },
            "stop_sequences": ["!"],
            "max_time": 2.5,
        }
    finally:
        await e.close()


async def test_resume_body(session: aiohttp.ClientSession) -> None:
    e = await engine()
    try:
        client = NativeClient("r0", e.url, session)
        cont = Continuation(
            prompt_token_ids=tuple(prompt_ids("Hi")),
            token_ids=(TOKEN_BASE, TOKEN_BASE + 1, TOKEN_BASE + 2),
            text="Hello, w",  # the third token's text only partly delivered
        )
        items = await collect(client, request(max_new_tokens=10), cont)
        body = e.requests[0].body
        assert "prompt" not in body
        assert body["input_ids"] == prompt_ids("Hi")
        assert body["resume"] == {"token_ids": [1000, 1001, 1002], "text": "Hello, w"}
        assert body["max_new_tokens"] == 10  # the original budget: the engine counts resumed
        assert "".join(i.text for i in items) == "orld!"
        assert e.resume_mismatches == []
    finally:
        await e.close()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (Fault("eof", after_tokens=2), "without complete_final"),
        (Fault("close", after_tokens=2), "connection"),
        (Fault("blank", after_tokens=1), "blank line"),
        (Fault("garbage", after_tokens=1), "undecodable"),
        (Fault("nested", after_tokens=1), "undecodable"),
        (Fault("no_data", after_tokens=1), "neither data nor error"),
        (Fault("error", after_tokens=2), "r0 reported an error"),
        (Fault("http", status=503), "HTTP 503"),
        (Fault("http", status=500), "HTTP 500"),
        (Fault("http", status=429), "HTTP 429"),
        (Fault("eof", after_tokens=5), "without complete_final"),  # after the final item
    ],
)
async def test_migratable_failures(
    session: aiohttp.ClientSession, fault: Fault, message: str
) -> None:
    e = await engine(fail=fault)
    try:
        client = NativeClient("r0", e.url, session)
        items: list[EngineDelta] = []
        stream = client.generate(request(max_new_tokens=50), None, stall_timeout_s=5, max_time=0)
        with pytest.raises(GenerationError) as info:
            async for item in stream:
                items.append(item)
        err = info.value
        assert err.migratable, err
        assert err.error_type == "generation_unavailable" and err.code == 503
        assert message in err.message
        assert "r0" in err.message
        assert len(items) == min(fault.after_tokens, 5)
    finally:
        await e.close()


async def test_data_after_complete_final_is_a_failure(session: aiohttp.ClientSession) -> None:
    e = await engine(fail=Fault("after_final"))
    try:
        client = NativeClient("r0", e.url, session)
        with pytest.raises(GenerationError, match="after complete_final") as info:
            await collect(client, request(max_new_tokens=50))
        assert info.value.migratable
    finally:
        await e.close()


async def test_stall(session: aiohttp.ClientSession) -> None:
    e = await engine(fail=Fault("stall", after_tokens=2))
    try:
        client = NativeClient("r0", e.url, session)
        with pytest.raises(GenerationError, match="stalled") as info:
            await collect(client, request(max_new_tokens=50), stall=0.3)
        assert info.value.migratable
        await e.wait_disconnects(1)  # the engine noticed we left
    finally:
        await e.close()


async def test_no_headers_is_a_stall(session: aiohttp.ClientSession) -> None:
    e = await engine(fail=Fault("hang"))
    try:
        client = NativeClient("r0", e.url, session)
        with pytest.raises(GenerationError, match="stalled") as info:
            await collect(client, request(), stall=0.3)
        assert info.value.migratable
    finally:
        await e.close()


@pytest.mark.parametrize(
    ("error_type", "expected_type", "code", "migratable"),
    [
        ("generation_unavailable", "generation_unavailable", 503, True),
        ("generation_error", "generation_error", 502, False),
        ("timeout", "timeout", 504, False),
        ("invalid_request", "generation_error", 502, False),
    ],
)
async def test_inband_error_types(
    session: aiohttp.ClientSession,
    error_type: str,
    expected_type: str,
    code: int,
    migratable: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    e = await engine(fail=Fault("error", after_tokens=1, error_type=error_type, message="boom"))
    try:
        client = NativeClient("r0", e.url, session)
        with pytest.raises(GenerationError) as info:
            await collect(client, request(max_new_tokens=50))
        err = info.value
        assert (err.error_type, err.code, err.migratable) == (expected_type, code, migratable)
        # what the engine said is the operator's (the log), never the client's (DESIGN 6)
        said = "timed out" if error_type == "timeout" else "reported an error"
        assert err.message == f"replica r0 {said}"
        assert "boom" in caplog.text
    finally:
        await e.close()


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_http_4xx_is_not_migratable(session: aiohttp.ClientSession, status: int) -> None:
    e = await engine(fail=Fault("http", status=status, message="prompt too long"))
    try:
        client = NativeClient("r0", e.url, session)
        with pytest.raises(GenerationError) as info:
            await collect(client, request())
        err = info.value
        assert not err.migratable
        # the engine refused the request itself (the client's mistake): invalid_request 422;
        # a missing route is the deployment's fault: generation_error 502
        expected = ("generation_error", 502) if status == 404 else ("invalid_request", 422)
        assert (err.error_type, err.code) == expected
        assert err.message == f"replica r0 rejected the request (HTTP {status})"  # body not quoted
    finally:
        await e.close()


async def test_connection_refused(session: aiohttp.ClientSession) -> None:
    e = await engine()
    url = e.url
    await e.close()
    client = NativeClient("r0", url, session)
    with pytest.raises(GenerationError, match="connection failed") as info:
        await collect(client, request())
    assert info.value.migratable


async def test_an_endless_line_is_cut_at_its_bound(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repro: a line that never ended was buffered whole until the stall timeout (a fast peer
    pushes gigabytes in that time). Past `MAX_LINE_BYTES` (lowered here, so the fake sends
    4 MiB, not 64) the replica failed, migratably, and its connection is dropped at once."""
    monkeypatch.setattr(line_transport, "MAX_LINE_BYTES", 1 << 20)
    e = await engine(fail=Fault("endless_line", after_tokens=2))
    try:
        client = NativeClient("r0", e.url, session)
        items: list[EngineDelta] = []
        stream = client.generate(request(max_new_tokens=50), None, stall_timeout_s=600, max_time=0)
        with pytest.raises(GenerationError) as info:
            async with asyncio.timeout(DEADLINE_S):  # the stall timeout is far off
                async for item in stream:
                    items.append(item)
        assert info.value.message == "replica r0 sent a line longer than 1048576 bytes"
        assert info.value.migratable and info.value.replica_fault
        assert "".join(i.text for i in items) == "Hello,"
        await e.wait_disconnects(1)
    finally:
        await e.close()


async def test_empty_items_do_not_hide_a_stall(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repro: every line reset the stall timer, so a replica sending items with no token and no
    text held the request for ever (until request_timeout_s) instead of being declared stalled
    after `stall_timeout_s` without a token. Each look at the stall clock is 5 s later, so a
    few of the fake's 1,000 empty items outlast the 30 s stall timeout."""
    ticking_stall_clock(monkeypatch, tick_s=5)
    e = await engine(fail=Fault("empty_items", after_tokens=2))
    try:
        client = NativeClient("r0", e.url, session)
        items: list[EngineDelta] = []
        stream = client.generate(request(max_new_tokens=50), None, stall_timeout_s=30, max_time=0)
        with pytest.raises(GenerationError, match=r"no item for 30 s \(stalled\)") as info:
            async with asyncio.timeout(DEADLINE_S):
                async for item in stream:
                    items.append(item)
        assert info.value.migratable
        assert "".join(i.text for i in items) == "Hello,"
        await e.wait_disconnects(1)
    finally:
        await e.close()


async def test_the_time_a_consumer_takes_is_not_a_stall(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall timer runs from the last item that said something, but only while the stream
    waits for its replica: the time the pipeline takes between two reads (a slow client) is
    not the replica's. An hour between reads, then an item already buffered: no stall."""
    clock = manual_stall_clock(monkeypatch)
    e = await engine(fail=Fault("empty_items", after_tokens=2))
    try:
        client = NativeClient("r0", e.url, session)
        stream = client.generate(request(max_new_tokens=50), None, stall_timeout_s=30, max_time=0)
        try:
            items = [await stream.__anext__() for _ in range(3)]
            assert [(i.text, i.token_ids) for i in items][2] == ("", ())  # an empty item
            clock.advance(3600)  # between two reads: the consumer's time
            item = await stream.__anext__()
            assert (item.text, item.token_ids) == ("", ())
        finally:
            stream.close()
    finally:
        await e.close()


async def test_close_drops_the_connection(session: aiohttp.ClientSession) -> None:
    e = await engine(fail=Fault("stall", after_tokens=1))  # still running when it is closed
    try:
        client = NativeClient("r0", e.url, session)
        stream = client.generate(request(max_new_tokens=100), None, stall_timeout_s=5, max_time=0)
        await stream.__anext__()
        stream.close()
        await e.wait_disconnects(1)
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    finally:
        await e.close()


async def test_an_oversized_models_reply_is_refused(session: aiohttp.ClientSession) -> None:
    """`GET /v1/models` is a few hundred bytes; it was read up to 64 MiB and parsed on the
    event loop (a second of every client's time, at every fetch, from a hostile replica)."""
    e = await engine(models_padding=MODELS_REPLY_BYTES)
    try:
        client = NativeClient("r0", e.url, session)
        with pytest.raises(GenerationError) as info:
            await client.advertised(10.0)
    finally:
        await e.close()
    assert info.value.message == f"replica r0: reply larger than {MODELS_REPLY_BYTES} bytes"


async def test_a_large_tokenize_reply_is_parsed_off_the_loop(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repro: `/v1/tokenize`'s reply (every token id of the prompt: about 1.5 MB for a 1 MB
    prompt) was parsed on the event loop, tens of milliseconds of every stream's time per
    count. Past LARGE_REPLY_BYTES it is parsed in a thread; a short one stays inline."""
    threads: list[int] = []
    real = native.tokenize_count

    def recording(raw: bytes) -> int:
        threads.append(threading.get_ident())
        return real(raw)

    monkeypatch.setattr(native, "tokenize_count", recording)
    e = await engine()
    try:
        client = NativeClient("r0", e.url, session)
        long = "x" * (line_transport.LARGE_REPLY_BYTES // 4)  # ids of 3-4 digits and a comma
        assert await client.tokenize(long, False) == len(long)
        assert await client.tokenize("Hello", False) == 5
    finally:
        await e.close()
    assert threads[0] != threading.get_ident()  # off the loop
    assert threads[1] == threading.get_ident()


async def test_tokenize_and_health(session: aiohttp.ClientSession) -> None:
    e = await engine()
    try:
        client = NativeClient("r0", e.url, session)
        assert await client.tokenize("Hello", False) == 5
        assert await client.health(10.0)
        e.healthy = False
        assert not await client.health(10.0)
    finally:
        await e.close()
    assert not await client.health(10.0)
    with pytest.raises(GenerationError) as info:
        await client.tokenize("x", False)
    assert info.value.migratable
