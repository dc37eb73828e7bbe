"""`request_timeout_s` bounds every endpoint and `stream-content` takes only NDJSON (DESIGN 4):
a detector that never answers and a client that never finishes its body both end in a timeout
error. Nothing here races the clock: the waits that time out never end on their own, and the
streamed requests run out of time on a manual clock (tests/fakes/clock.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from orchestrator.app import CONTENT_PATH, STREAM_CONTENT_PATH, UNARY_PATH
from tests.fakes.clock import manual_deadline_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.orchestrator_support import (
    NDJSON,
    Orchestrator,
    generation_body,
    native_config,
    remote,
    terminal,
)
from tests.wait_support import finished, until

T = TypeVar("T")


async def stuck_detectors() -> FakeDetectorServer:
    server = FakeDetectorServer()
    server.add("stuck", DetectorBehaviour(gate=asyncio.Event()))  # never opened
    server.add("clean", DetectorBehaviour())
    await server.start()
    return server


def timeout_config(engine_url: str, dets: FakeDetectorServer, timeout_s: float = 1) -> dict:
    return native_config(
        engine_url,
        detectors={"stuck": remote(dets.url), "clean": remote(dets.url)},
        server={"request_timeout_s": timeout_s},
    )


async def test_the_content_endpoint_is_bounded_by_request_timeout_s(engine) -> None:
    """A real second: the content endpoint's bound is `asyncio.timeout`, on the loop's clock.
    Nothing races it: the stuck detector never answers."""
    dets = await stuck_detectors()
    try:
        async with Orchestrator(timeout_config(engine.url, dets)) as orch:
            content = await orch.post(CONTENT_PATH, {"content": "Hi.", "detectors": {"stuck": {}}})
    finally:
        await dets.close()
    assert content == (
        504,
        {
            "code": 504,
            "details": "the detectors did not answer within request_timeout_s",
            "type": "timeout",
        },
    )


async def test_every_streamed_endpoint_is_bounded_by_request_timeout_s(engine, monkeypatch) -> None:
    """Each request's time runs out on a manual clock, moved once the stuck detector holds the
    request's call: the timeout, and nothing else, ends it."""
    clock = manual_deadline_clock(monkeypatch)
    dets = await stuck_detectors()

    async def timed_out(request: Awaitable[T]) -> T:
        task = asyncio.ensure_future(request)
        await until(lambda: task.done() or (clock.armed and dets.in_flight), what="the call")
        assert not task.done(), task.result()
        clock.advance(3600)
        return await finished(task, what="the request's end after its deadline")

    try:
        async with Orchestrator(timeout_config(engine.url, dets, timeout_s=3600)) as orch:
            streamed = await timed_out(orch.stream(generation_body(output={"stuck": {}})))
            unary = await timed_out(orch.post(UNARY_PATH, generation_body(output={"stuck": {}})))
            chat = await timed_out(
                orch.post(
                    "/v1/chat/completions",
                    {
                        "model": "fake-model",
                        "messages": [{"role": "user", "content": "Hi"}],
                        "detectors": {"output": {"stuck": {}}},
                    },
                )
            )
            lines = await timed_out(
                orch.post(
                    STREAM_CONTENT_PATH,
                    json.dumps({"detectors": {"stuck": {}}, "content": "Hi. There."}) + "\n",
                )
            )
    finally:
        await dets.close()
    end = terminal(streamed)
    assert end.name == "incomplete" and end.data["incomplete_details"] == {"reason": "time_limit"}
    assert unary[0] == 200 and unary[1]["incomplete_details"] == {"reason": "time_limit"}
    assert chat[0] == 200 and chat[1]["choices"][0]["finish_reason"] == "length"
    # one line, the error: the stuck detector judged nothing before the time ran out
    assert lines == (
        200,
        {"code": 504, "details": "the request exceeded request_timeout_s", "type": "timeout"},
    )


async def test_stream_content_slow_body_times_out(engine) -> None:
    dets = await stuck_detectors()
    never = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield (json.dumps({"detectors": {"clean": {}}, "content": "Hi. "}) + "\n").encode()
        await never.wait()  # the client never sends the rest
        yield b""

    try:
        async with Orchestrator(timeout_config(engine.url, dets)) as orch:
            assert orch.session is not None
            async with orch.session.post(
                orch.url + STREAM_CONTENT_PATH, data=body(), headers={"Content-Type": NDJSON}
            ) as r:
                assert r.status == 200
                reply = await r.text()
            never.set()
    finally:
        await dets.close()
    assert json.loads(reply.splitlines()[-1]) == {
        "code": 408,
        "details": "the request body did not arrive within request_timeout_s",
        "type": "timeout",
    }


async def test_stream_content_wants_ndjson(engine) -> None:
    dets = await stuck_detectors()
    line = json.dumps({"detectors": {"clean": {}}, "content": "Hi."}) + "\n"
    try:
        async with Orchestrator(timeout_config(engine.url, dets)) as orch:
            for ctype in ("application/json", "text/plain", "multipart/form-data"):
                status, body = await orch.post(
                    STREAM_CONTENT_PATH, line, headers={"Content-Type": ctype}
                )
                assert status == 415, ctype
                assert body == {
                    "code": 415,
                    "details": f"expected content-type application/x-ndjson, got {ctype}",
                    "type": "invalid_request",
                }
            assert (await orch.post(STREAM_CONTENT_PATH, line))[0] == 200
    finally:
        await dets.close()
    assert dets.calls == [("clean", ["Hi."], {})]


def test_stream_content_results_serialise_a_lone_surrogate() -> None:
    """JSON allows "\ud800"; a detection quoting it back must serialise (pydantic's JSON
    serializer refuses it, and an exception after the reply started left it hanging)."""
    from orchestrator.streaming.events import Frame
    from orchestrator.streaming.findings import Finding
    from orchestrator.streaming.ndjson_writer import NdjsonWriter

    finding = Finding(4, 5, "\ud800", "odd", "test", "odd", 0.9)
    line = NdjsonWriter().render(Frame(0, 10, "bad \ud800 char", [finding]))
    assert json.loads(line)["detections"][0]["text"] == "\ud800"
