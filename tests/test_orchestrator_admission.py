"""Admission comes before work: a generation request refused for lack of a stream slot (429) or
because the server is draining (503) costs no engine round trip, on every generation surface.

Building a pipeline may ask the engine (its advertised limits in `GET /v1/models`, a token count
in `POST /v1/tokenize` for a long prompt), so the serving loop takes the slot first. A real tiny
engine counts every request it gets; the only slot is held by a stream-content request whose body
the test keeps open (stream-content takes its slot before it reads the body)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from generation import models
from generation.server import create_app
from orchestrator.app import (
    CHAT_DETECTION_ONLY_PATH,
    CHAT_PATH,
    CONTENT_PATH,
    CONTEXT_DETECTION_PATH,
    GENERATED_DETECTION_PATH,
    GENERATION_DETECTION_PATH,
    RESPONSES_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
)
from orchestrator.state import STATE
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    MODEL,
    NDJSON,
    Orchestrator,
    generation_body,
    native_config,
    remote,
    sse_events,
)
from tests.wait_support import finished, until

# long enough that validating it against the engine's context needs the engine's token count
PROMPT = "a " * 300
FMS_OVERLOADED = {
    "code": 429,
    "details": "too many concurrent streams (limit 1)",
    "type": "overloaded",
}
FMS_DRAINING = {"code": 503, "details": "the server is shutting down", "type": "server_shutdown"}


def openai(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "error": {
            "message": body["details"],
            "type": body["type"],
            "param": None,
            "code": body["code"],
        }
    }


def requests() -> list[tuple[str, dict[str, Any], bool]]:
    """(path, body, OpenAI surface) for every generation surface, streaming and unary."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    resp = {"model": MODEL, "input": PROMPT, "max_output_tokens": 8}
    fms = generation_body(PROMPT, params={"max_new_tokens": 8})
    return [
        (STREAMING_PATH, fms, False),
        (UNARY_PATH, fms, False),
        (CHAT_PATH, {**chat, "stream": True}, True),
        (CHAT_PATH, chat, True),
        (RESPONSES_PATH, {**resp, "stream": True}, True),
        (RESPONSES_PATH, resp, True),
    ]


async def test_a_refused_request_costs_no_engine_round_trip(
    aiohttp_server: Any, tiny_model: models.LoadedModel
) -> None:
    calls: Counter[tuple[str, str]] = Counter()

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health":  # the orchestrator's health poller, not a request's cost
            calls[(request.method, request.path)] += 1
        return await handler(request)

    engine_app = create_app(tiny_model)
    engine_app.middlewares.insert(0, count)
    engine = await aiohttp_server(engine_app)
    config = native_config(
        str(engine.make_url("")).rstrip("/"),
        server={"max_concurrent_streams": 1, "body_idle_timeout_s": 60},
        detectors={"pii": {"type": "text_contents", "builtin": "regex", "chunker_id": "sentence"}},
    )
    release = asyncio.Event()

    async def held_body() -> AsyncIterator[bytes]:
        yield json.dumps({"content": "Hello.", "detectors": {"pii": {}}}).encode() + b"\n"
        await release.wait()

    async with Orchestrator(config) as orch:
        assert orch.session is not None and orch.runner is not None
        state = orch.runner.app[STATE]
        session = orch.session

        async def hold() -> int:
            async with session.post(
                orch.url + STREAM_CONTENT_PATH, data=held_body(), headers={"Content-Type": NDJSON}
            ) as r:
                await r.read()
                return r.status

        holder = asyncio.create_task(hold())
        await until(lambda: state.active_streams == 1, 30)
        for path, body, is_openai in requests():
            status, reply = await orch.post(path, body)
            assert (status, reply) == (429, openai(FMS_OVERLOADED) if is_openai else FMS_OVERLOADED)
        # what a drain does first: new streams get 503 while running ones finish
        state.draining = True
        for path, body, is_openai in requests():
            status, reply = await orch.post(path, body)
            assert (status, reply) == (503, openai(FMS_DRAINING) if is_openai else FMS_DRAINING)
        state.draining = False
        assert calls == Counter()  # not one engine request for twelve refused ones
        release.set()
        assert await holder == 200
        await until(lambda: state.active_streams == 0, 30)
        # the same request admitted: the round trips the refused ones were spared
        status, reply = await orch.post(
            UNARY_PATH, generation_body(PROMPT, params={"max_new_tokens": 8})
        )
        assert status == 200, reply
    assert calls[("GET", "/v1/models")] == 1
    assert calls[("POST", "/v1/tokenize")] >= 1
    assert calls[("POST", "/v1/generate")] == 1


async def test_detection_requests_hold_a_server_wide_slot(engine: FakeEngine) -> None:
    """Repro: the detection endpoints (content, chat, context, generated, and the judging after
    generation-detection's generation) held a slot of their tenant's max_concurrent_streams
    only, not of the server's: a flood of them ran past the server's overload protection
    (429 / 503), each a share of every detector's queue. Now each request that judges or
    generates text holds a server slot while it is served; a remote detector the test gates
    holds the only one."""
    dets = FakeDetectorServer()
    gate = asyncio.Event()
    dets.add("held", DetectorBehaviour(words={"jo": 0.9}, gate=gate))
    dets.add("fact", DetectorBehaviour(words={"jo": 0.8}))
    await dets.start()
    detectors = {
        "held": remote(dets.url, "whole_doc_chunker"),
        "fact": {**remote(dets.url, "whole_doc_chunker"), "type": "text_context_doc"},
        "pii": {"type": "text_contents", "builtin": "regex", "chunker_id": "sentence"},
    }
    config = native_config(engine.url, server={"max_concurrent_streams": 1}, detectors=detectors)
    mail = "Mail jo@example.com."
    detections = [
        (CONTENT_PATH, {"content": mail, "detectors": {"pii": {}}}),
        (
            CHAT_DETECTION_ONLY_PATH,
            {"messages": [{"role": "user", "content": mail}], "detectors": {"pii": {}}},
        ),
        (
            CONTEXT_DETECTION_PATH,
            {"content": mail, "context_type": "docs", "context": ["x"], "detectors": {"fact": {}}},
        ),
        (
            GENERATED_DETECTION_PATH,
            {"prompt": "Who?", "generated_text": mail, "detectors": {"pii": {}}},
        ),
        (
            GENERATION_DETECTION_PATH,
            {"model_id": MODEL, "prompt": "Who?", "detectors": {"pii": {}}},
        ),
    ]
    others = [(STREAMING_PATH, generation_body()), (STREAM_CONTENT_PATH, b'{"content": "Hi."}\n')]
    try:
        async with Orchestrator(config) as orch:
            assert orch.session is not None and orch.runner is not None
            state = orch.runner.app[STATE]
            session = orch.session

            async def refused(expected: dict[str, Any]) -> None:
                for path, body in detections + others:
                    headers = {"Content-Type": NDJSON} if isinstance(body, bytes) else {}
                    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
                    async with session.post(orch.url + path, headers=headers, **kwargs) as r:
                        reply = (r.status, await r.json(), r.headers.get("Retry-After"))
                    assert reply == (expected["code"], expected, "1"), path

            for held in (
                (CONTENT_PATH, {"content": mail, "detectors": {"held": {}}}),
                (
                    GENERATION_DETECTION_PATH,
                    {"model_id": MODEL, "prompt": "Who?", "detectors": {"held": {}}},
                ),
            ):
                gate.clear()
                calls = len(dets.calls)
                holder = asyncio.create_task(orch.post(*held))
                await until(
                    lambda c=calls: dets.in_flight == 1 and len(dets.calls) > c, what="held"
                )
                await refused(FMS_OVERLOADED)
                state.draining = True  # what a drain does first
                await refused(FMS_DRAINING)
                state.draining = False
                gate.set()
                status, reply = await finished(holder)
                assert status == 200, reply
                await until(lambda: state.active_streams == 0, what="the slot given back")
                for path, body in detections:  # admitted now
                    status, reply = await orch.post(path, body)
                    assert status == 200, (path, reply)
            assert await orch.metric(
                "guardstream_rejected_streams_total", reason="overloaded"
            ) == 2 * len(detections + others)
    finally:
        gate.set()  # a failed run leaves no request held
        await dets.close()


async def test_a_fleet_too_busy_for_a_request_is_overloaded_on_every_surface() -> None:
    """Every replica answering 429 (each at its bound on waiting work): the service is at
    capacity, and says so as it says a full stream cap, 429 `overloaded` with Retry-After
    before any byte (in-band `error` with code 429 where the response had started: the FMS
    event stream), so clients' retry logic backs off and retries. Before, 503
    generation_unavailable: "broken", which a client's retry logic treats otherwise."""
    engines = [FakeEngine(script=["Hi", "."]) for _ in range(2)]
    for e in engines:
        await e.start()
        e.inject(Fault("http", status=429, error_type="too_many_requests", times=-1))
    config = native_config(
        engines[0].url, model={"backends": [{"type": "native", "url": e.url} for e in engines]}
    )
    details = (
        f"every replica of model `{MODEL}` is at capacity (replica native-0 answered HTTP 429)"
    )
    overloaded = {"code": 429, "details": details, "type": "overloaded"}
    try:
        async with Orchestrator(config) as orch:
            assert orch.session is not None
            for path, body, is_openai in requests():
                async with orch.session.post(orch.url + path, json=body) as r:
                    if path == STREAMING_PATH:  # the FMS event stream starts at once
                        assert r.status == 200
                        events = sse_events(await r.text())
                        assert [(e.name, e.data) for e in events] == [("error", overloaded)]
                        continue
                    assert r.status == 429, (path, await r.text())
                    assert r.headers["Retry-After"] == "1"
                    assert await r.json() == (openai(overloaded) if is_openai else overloaded)
    finally:
        for e in engines:
            await e.close()
    assert [len(e.requests) for e in engines] == [6, 6]  # each asked once per request
