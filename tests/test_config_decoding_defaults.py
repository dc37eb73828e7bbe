"""A model's `decoding_defaults` fill in what a request leaves unset, on every surface; a value
the request sets always wins. (The default config gives smollm2 a low temperature and a
repetition penalty: at OpenAI's default temperature of 1 a 135M model answered with garbled
text, and greedy answers looped.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchestrator.app import CHAT_PATH, RESPONSES_PATH, STREAMING_PATH
from tests.fakes.engine import FakeEngine
from tests.fakes.openai_server import FakeOpenAI
from tests.orchestrator_support import MODEL, Orchestrator, generation_body, native_config

DEFAULTS = {"temperature": 0.3, "top_p": 0.9, "repetition_penalty": 1.1}
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(script=["Hello", "."])
    await fake.start()
    yield fake
    await fake.close()


def decoding_sent(engine: FakeEngine) -> list[dict[str, Any]]:
    return [r.body["decoding"] for r in engine.requests]


async def test_unset_fields_take_the_models_defaults(engine: FakeEngine) -> None:
    cfg = native_config(engine.url, model={"decoding_defaults": DEFAULTS})
    async with Orchestrator(cfg) as orch:
        await orch.stream(generation_body(params={"decoding_method": "SAMPLING", "seed": 1}))
        assert (await orch.post(CHAT_PATH, {"model": MODEL, "messages": USER}))[0] == 200
        assert (await orch.post(RESPONSES_PATH, {"model": MODEL, "input": "Hi"}))[0] == 200
    fms, chat, responses = decoding_sent(engine)
    assert {k: fms[k] for k in DEFAULTS} == DEFAULTS
    assert fms["method"] == "sampling"
    for body in (chat, responses):
        assert {k: body[k] for k in DEFAULTS} == DEFAULTS
        assert body["method"] == "sampling"


async def test_a_request_that_sets_a_field_wins(engine: FakeEngine) -> None:
    cfg = native_config(engine.url, model={"decoding_defaults": DEFAULTS})
    async with Orchestrator(cfg) as orch:
        await orch.stream(
            generation_body(params={"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0})
        )
        chat = {"model": MODEL, "messages": USER, "temperature": 0, "top_p": 0.5}
        assert (await orch.post(CHAT_PATH, chat))[0] == 200
    fms, chat_sent = decoding_sent(engine)
    assert (fms["temperature"], fms["top_p"], fms["repetition_penalty"]) == (1.0, 1.0, 1.0)
    assert fms["method"] == "greedy"
    assert chat_sent["method"] == "greedy"  # temperature 0
    assert chat_sent["top_p"] == 0.5


async def test_without_defaults_openai_surfaces_sample_at_temperature_one(
    engine: FakeEngine,
) -> None:
    async with Orchestrator(native_config(engine.url)) as orch:
        assert (await orch.post(STREAMING_PATH, generation_body()))[0] == 200
        assert (await orch.post(CHAT_PATH, {"model": MODEL, "messages": USER}))[0] == 200
    fms, chat = decoding_sent(engine)
    assert fms["method"] == "greedy" and fms["repetition_penalty"] == 1.0
    assert (chat["method"], chat["temperature"], chat["top_p"]) == ("sampling", 1.0, 1.0)
    assert chat["repetition_penalty"] == 1.0


async def test_a_default_the_server_refuses_is_dropped_on_every_surface() -> None:
    """transformers serve refuses `repetition_penalty`: a model with that default behind it
    still answers requests that never named it (the request is sent again without it)."""

    server = FakeOpenAI(script=["Hello", "."], flavour="transformers")
    await server.start()
    backend = {"type": "openai", "url": server.url, "model": "fake-model", "api": "chat"}
    cfg = native_config(server.url, model={"decoding_defaults": DEFAULTS, "backends": [backend]})
    try:
        async with Orchestrator(cfg) as orch:
            status, body = await orch.post(CHAT_PATH, {"model": MODEL, "messages": USER})
            events = await orch.stream(generation_body())
            refused = await orch.post(
                STREAMING_PATH, generation_body(params={"repetition_penalty": 1.3})
            )
    finally:
        await server.close()
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "Hello."
    assert events[-1].name == "completed"
    # the client's own value is never silently dropped
    assert refused == (
        422,
        {
            "code": 422,
            "details": "repetition_penalty: model `fake-model` cannot honour it (the server of "
            "its replica openai-0 refuses it)",
            "type": "invalid_request",
        },
    )
