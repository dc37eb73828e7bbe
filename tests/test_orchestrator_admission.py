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
    CHAT_PATH,
    RESPONSES_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
)
from orchestrator.state import STATE
from tests.orchestrator_support import MODEL, NDJSON, Orchestrator, generation_body, native_config
from tests.wait_support import until

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
