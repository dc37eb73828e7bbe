"""Chat Completions labels (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`,
`service_tier`) reach an `openai` chat backend beside the messages: text the client sent that
leaves the service for the upstream, whose provider logs them (an end user's e-mail address is a
common `user`). They never enter the model's prompt, so an input guardrail's finding in one does
not refuse the request: the flagged label is withheld from the upstream and the answer goes on.
On 6a2408a no input detector judged them: `user: "jo@example.com"` reached the upstream past the
shipped config's enforced input PII redaction ("masked before the model, or its logs, sees it").
Where no backend receives them (the native engine) they are dropped, and judged by nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fakes.engine import FakeEngine
from tests.fakes.openai_server import FakeOpenAI
from tests.openai_support import raw_chunks, sdk
from tests.orchestrator_support import MODEL, SCRIPT, Orchestrator, native_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

EMAIL = "jo@example.com"
DETECTORS = {
    "pii_redact": {"builtin": "regex", "chunker_id": "sentence", "on_detection": "redact"},
    "pii_block": {"builtin": "regex", "chunker_id": "sentence", "on_detection": "block"},
}
MESSAGES = [{"role": "user", "content": "Hi."}]
# each label with a value that holds the e-mail address, as the SDK's keyword sends it
FLAGGED: dict[str, Any] = {
    "user": EMAIL,
    "metadata": {"customer": EMAIL},
    "safety_identifier": f"id-{EMAIL}",
    "prompt_cache_key": f"{EMAIL}:thread-7",
    "service_tier": EMAIL,
}


def upstream_config(upstream: FakeOpenAI, guardrail: str) -> dict[str, Any]:
    config = native_config(upstream.url, detectors=DETECTORS)
    config["models"][MODEL]["backends"] = [
        {"type": "openai", "url": upstream.url, "model": "fake-model", "api": "chat"}
    ]
    config["models"][MODEL]["guardrails"] = {"input": {guardrail: {}}}
    return config


def sent(upstream: FakeOpenAI) -> dict[str, Any]:
    """The last request the upstream received, as it read it."""
    return upstream.requests[-1]


@pytest.mark.parametrize("guardrail", ["pii_redact", "pii_block"])
@pytest.mark.parametrize("label", sorted(FLAGGED))
async def test_a_flagged_label_is_withheld_from_the_upstream(
    openai_upstream: FakeOpenAI, guardrail: str, label: str
) -> None:
    """Unary through the SDK: the answer is the model's, unrefused; the upstream got the
    request without the flagged label (and nowhere else the address), the other label as
    sent."""
    async with Orchestrator(upstream_config(openai_upstream, guardrail)) as orch:
        extra = {"user": "alice"} if label != "user" else {"metadata": {"team": "blue"}}
        done = await sdk(orch).chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={label: FLAGGED[label], **extra}
        )
    assert done.choices[0].message.content == openai_upstream.answer("Hi.")
    assert done.choices[0].finish_reason == "stop"
    assert (done.model_extra or {}).get("detections") is None
    request = sent(openai_upstream)
    assert EMAIL not in json.dumps(request)
    assert label not in request
    for name, value in extra.items():
        assert request[name] == value


async def test_a_streamed_request_withholds_the_flagged_label_too(
    openai_upstream: FakeOpenAI,
) -> None:
    """Raw SSE: the answer streams as usual, and the address is in no byte the upstream got."""
    async with Orchestrator(upstream_config(openai_upstream, "pii_block")) as orch:
        body = {"model": MODEL, "messages": MESSAGES, "stream": True, "user": EMAIL}
        chunks = await raw_chunks(orch, body, path="/v1/chat/completions")
    text = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if isinstance(c, dict) and c["choices"]
    )
    assert text == openai_upstream.answer("Hi.")
    assert chunks[-1] == "[DONE]"
    assert EMAIL not in json.dumps(sent(openai_upstream))
    assert "user" not in sent(openai_upstream)


async def test_unflagged_labels_reach_the_upstream_unchanged(openai_upstream: FakeOpenAI) -> None:
    async with Orchestrator(upstream_config(openai_upstream, "pii_block")) as orch:
        labels = {"user": "alice", "metadata": {"team": "blue"}, "service_tier": "flex"}
        await sdk(orch).chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=labels)
    request = sent(openai_upstream)
    assert {k: request[k] for k in labels} == labels


async def test_labels_no_backend_receives_are_judged_by_nothing() -> None:
    """The native engine drops them: an address in `user` refuses nothing, costs no detector."""
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    try:
        config = native_config(engine.url, detectors=DETECTORS)
        config["models"][MODEL]["guardrails"] = {"input": {"pii_block": {}}}
        async with Orchestrator(config) as orch:
            done = await sdk(orch).chat.completions.create(
                model=MODEL, messages=MESSAGES, user=EMAIL, metadata={"customer": EMAIL}
            )
        assert done.choices[0].message.content == "".join(SCRIPT)
        assert done.choices[0].finish_reason == "stop"
        assert EMAIL not in json.dumps(engine.requests[-1].body)
    finally:
        await engine.close()
