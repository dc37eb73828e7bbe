"""Every client-visible field of the generation surfaces, behind an `openai` chat backend, under an
enforced output guardrail that redacts or blocks an e-mail address (DESIGN 4.6, 4.6a, 4.8, 4.9):
the raw bytes a client gets hold no piece of the address, whatever the request asks for
(streamed or unary, `stream_options.include_usage`, a client stop sequence that the raw text
holds inside the address, a token budget that ends past it) and whichever field carries it
(content, detections, annotations, refusals, `response.output_text.done`, the terminal
event's whole response object, usage chunks). Options that would add a channel are refused
before the upstream is called (log probabilities, several choices, predicted outputs, audio,
completions' `echo`/`suffix`/`best_of`, a structured Responses format, Responses `include`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.fakes.openai_server import FakeOpenAI
from tests.orchestrator_support import MODEL, Orchestrator, native_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCRIPT = ["Mail", " jo", "@", "example", ".", "com", " now", ".", " Bye", "."]
PIECES = (b"jo@", b"@example", b"example.com", b"example\\u002ecom")
REDACTING, BLOCKING = "redacting", "blocking"
DETECTORS = {
    "pii_redact": {"builtin": "regex", "chunker_id": "sentence", "on_detection": "redact"},
    "pii_block": {"builtin": "regex", "chunker_id": "sentence", "on_detection": "block"},
}
CHAT, RESPONSES, COMPLETIONS = (
    "/v1/chat/completions",
    "/v1/responses",
    "/api/v2/text/completions-detection",
)
HI = [{"role": "user", "content": "Hi."}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def upstream() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI(script=SCRIPT)
    await server.start()
    yield server
    await server.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def orch(upstream: FakeOpenAI) -> AsyncIterator[Orchestrator]:
    """One model per enforced output guardrail, both on the same upstream."""
    config = native_config(upstream.url, detectors=DETECTORS)
    model = config["models"].pop(MODEL)
    model["backends"] = [
        {"type": "openai", "url": upstream.url, "model": "fake-model", "api": "chat"}
    ]
    for name, detector in ((REDACTING, "pii_redact"), (BLOCKING, "pii_block")):
        config["models"][name] = {**model, "guardrails": {"output": {detector: {}}}}
    async with Orchestrator(config) as o:
        yield o


def body(path: str, model: str, **options: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": model, "messages": HI, **options}
    if path == RESPONSES:
        return {"model": model, "input": "Hi.", **options}
    return {"model": model, "prompt": "Hi.", **options}


OPTIONS: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {}),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True}}),
    (CHAT, {"stream": True, "stop": ["@"]}),  # inside the address in the raw text
    (CHAT, {"stop": [".com"]}),
    (CHAT, {"stream": True, "max_tokens": 7}),  # ends right after it
    (CHAT, {"max_tokens": 4}),  # ends inside it: `jo@example`
    (RESPONSES, {}),
    (RESPONSES, {"stream": True}),
    (RESPONSES, {"stream": True, "max_output_tokens": 5}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}}),
    (COMPLETIONS, {"stop": ["@"]}),
    (COMPLETIONS, {"max_tokens": 3}),
]


@pytest.mark.parametrize("model", [REDACTING, BLOCKING])
@pytest.mark.parametrize(("path", "options"), OPTIONS)
async def test_no_field_carries_a_piece_of_the_address(
    orch: Orchestrator, path: str, options: dict[str, Any], model: str
) -> None:
    assert orch.session is not None
    async with orch.session.post(orch.url + path, json=body(path, model, **options)) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    for piece in PIECES:
        assert piece not in raw, (piece, raw)
    if model == BLOCKING:
        assert b"content_filter" in raw
    else:
        assert b"[email]" in raw or b"Mail" not in raw  # a budget before it says nothing


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"logprobs": True}, "logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"n": 2}, "n"),
    (CHAT, {"prediction": {"type": "content", "content": "Mail jo"}}, "prediction"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (COMPLETIONS, {"echo": True}, "echo"),
    (COMPLETIONS, {"suffix": " ok"}, "suffix"),
    (COMPLETIONS, {"best_of": 2}, "best_of"),
    (COMPLETIONS, {"logprobs": 2}, "logprobs"),
    (RESPONSES, {"top_logprobs": 2}, "top_logprobs"),
    (RESPONSES, {"include": ["message.output_text.logprobs"]}, "include"),
    (RESPONSES, {"text": {"format": {"type": "json_object"}}}, "text"),
]


@pytest.mark.parametrize(("path", "options", "param"), REFUSED)
async def test_options_that_would_add_a_channel_are_refused_before_the_upstream(
    orch: Orchestrator, upstream: FakeOpenAI, path: str, options: dict[str, Any], param: str
) -> None:
    seen = len(upstream.requests)
    status, reply = await orch.post(path, body(path, REDACTING, **options))
    assert status == 422, reply
    text = json.dumps(reply)
    assert param in text
    assert len(upstream.requests) == seen
