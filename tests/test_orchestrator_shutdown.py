"""Graceful shutdown of `python -m orchestrator serve`, as Kubernetes does it: SIGTERM while
streams run. Every stream gets a terminal event (the ones that finish within
`server.drain_timeout_s` complete, the rest end with `server_shutdown`), new requests get 503
during the drain, and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from orchestrator.app import STREAM_CONTENT_PATH, STREAMING_PATH
from tests.fakes.engine import FakeEngine, Fault, GatedEngine
from tests.orchestrator_support import (
    NDJSON,
    Served,
    SseEvent,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    read_sse,
    serve,
    sse_events,
    terminal,
)
from tests.wait_support import finished, until

STREAMS = 20


async def read_stream(
    session: aiohttp.ClientSession, url: str, i: int, shown: list[int] | None
) -> list[SseEvent]:
    """The events of stream i; with `shown`, its frame count so far goes in shown[i]."""
    body = generation_body(f"stream {i}")
    async with session.post(url + STREAMING_PATH, json=body) as r:
        assert r.status == 200
        if shown is None:
            return sse_events(await r.text())

        def count(events: list[SseEvent]) -> None:
            shown[i] = len(frames(events))

        return await read_sse(r, count)


async def start_streams(
    served: Served, session: aiohttp.ClientSession, shown: list[int] | None = None
) -> list[asyncio.Task]:
    return [
        asyncio.create_task(read_stream(session, served.url, i, shown), name=f"client-{i}")
        for i in range(STREAMS)
    ]


async def cut_the_drain(served: Any) -> None:
    """SIGTERM, then, once the drain has begun, a second one: the drain ends at once (as an
    operator's second Ctrl-C does), so no test waits out or races a real drain window."""
    served.proc.send_signal(signal.SIGTERM)
    await served.wait_logged("draining streams")
    served.proc.send_signal(signal.SIGTERM)


def config_for(engine: FakeEngine, drain_timeout_s: float) -> dict[str, Any]:
    return native_config(
        engine.url,
        server={"drain_timeout_s": drain_timeout_s, "max_concurrent_streams": STREAMS + 5},
    )


async def test_streams_that_finish_within_the_drain_complete(tmp_path: Path) -> None:
    engine = GatedEngine(script=[f" w{i}" for i in range(30)])
    await engine.start()
    try:
        async with (
            serve(tmp_path, config_for(engine, drain_timeout_s=60)) as served,
            aiohttp.ClientSession() as session,
        ):
            clients = await start_streams(served, session)
            await until(lambda: engine.held == STREAMS, 20)
            served.proc.send_signal(signal.SIGTERM)
            await served.wait_logged(f"draining {STREAMS} stream(s)")
            # a new request during the drain: 503 before any streaming, retryable
            async with session.post(served.url + STREAMING_PATH, json=generation_body()) as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "1"
                assert await r.json() == {
                    "code": 503,
                    "details": "the server is shutting down",
                    "type": "server_shutdown",
                }
            assert engine.held == STREAMS  # it never reached the engine
            engine.gate.set()
            results = await finished(asyncio.gather(*clients), 30, "asyncio.gather(*clients)")
            assert await finished(served.proc.wait(), 30, "served.proc.wait()") == 0
    finally:
        await engine.close()
    assert len(results) == STREAMS
    for events in results:
        end = terminal(events)
        assert end.name == "completed"
        assert assert_contiguous(frames(events)) == engine.text()
        assert end.data["processed_index"] == len(engine.text())
    assert sum(r.completed for r in engine.requests) == STREAMS
    assert served.messages()[-1] == "stopped"


async def test_streams_cut_by_a_short_drain_end_with_server_shutdown(tmp_path: Path) -> None:
    # half the streams go silent after two tokens, the others before their first (for longer than
    # the stall timeout of 30 s), so none can finish, however long the drain really takes
    half = STREAMS // 2
    engine = FakeEngine(
        script=[f" w{i}" for i in range(30)],
        fail=[Fault("stall", after_tokens=2, times=half), Fault("stall", times=half)],
    )
    await engine.start()
    try:
        async with (
            serve(tmp_path, config_for(engine, drain_timeout_s=60)) as served,
            aiohttp.ClientSession() as session,
        ):
            shown = [0] * STREAMS
            clients = await start_streams(served, session, shown)
            # every stream has reached the engine, and half the clients have both frames
            await until(
                lambda: (
                    len(engine.requests) == STREAMS and sorted(shown) == [0] * half + [2] * half
                ),
                30,
            )
            await cut_the_drain(served)  # none of them could finish, however long it took
            results = await finished(asyncio.gather(*clients), 30, "asyncio.gather(*clients)")
            assert await finished(served.proc.wait(), 30, "served.proc.wait()") == 0
        await engine.wait_disconnects(STREAMS)  # generation was cancelled, not left running
    finally:
        await engine.close()
    assert len(results) == STREAMS
    ended = sorted(terminal(events).name for events in results)
    assert ended == ["error"] * half + ["failed"] * half
    for events in results:
        end = terminal(events)
        if end.name == "failed":  # frames had been sent
            assert assert_contiguous(frames(events)) == " w0 w1"
            assert end.data["error"] == {
                "code": 503,
                "type": "server_shutdown",
                "message": "the server is shutting down",
            }
            assert end.data["finish_reason"] == "CANCELLED"
            assert end.data["processed_index"] == len(" w0 w1")
        else:  # nothing had been sent: the error event
            assert frames(events) == []
            assert end.data == {
                "code": 503,
                "details": "the server is shutting down",
                "type": "server_shutdown",
            }
    messages = served.messages()
    assert f"ending {STREAMS} stream(s) with server_shutdown" in messages
    assert messages[-1] == "stopped"


async def test_a_stream_content_reply_cut_by_the_drain_ends_with_server_shutdown(
    tmp_path: Path,
) -> None:
    """stream-content is served by the same loop, on the same pipeline core: a drain that runs
    out ends it with the error line, as it ends a generation with its terminal event (its slot
    used to hold no pipeline, so the drain never reached it and shutdown cut the reply)."""
    engine = FakeEngine()
    await engine.start()
    never = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        # no sentence ends: no frame is due before the drain
        yield (json.dumps({"detectors": {"pii": {}}, "content": "Hi"}) + "\n").encode()
        await never.wait()  # the client is still sending when the server is told to stop
        yield b""

    config = config_for(engine, drain_timeout_s=60)
    config["detectors"] = {"pii": {"builtin": "regex", "chunker_id": "sentence"}}
    try:
        async with (
            serve(tmp_path, config) as served,
            aiohttp.ClientSession() as session,
        ):
            async with session.post(
                served.url + STREAM_CONTENT_PATH, data=body(), headers={"Content-Type": NDJSON}
            ) as r:
                assert r.status == 200  # the pipeline is built and holds the stream slot
                await cut_the_drain(served)
                reply = await finished(r.text(), 30, "r.text()")
            never.set()
            assert await finished(served.proc.wait(), 30, "served.proc.wait()") == 0
    finally:
        never.set()
        await engine.close()
    assert [json.loads(line) for line in reply.splitlines()] == [
        {"code": 503, "details": "the server is shutting down", "type": "server_shutdown"}
    ]
    assert "ending 1 stream(s) with server_shutdown" in served.messages()
