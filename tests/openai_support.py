"""Helpers for the OpenAI-surface tests (Chat Completions, Responses): the official SDK pointed at
a running orchestrator, and plain-HTTP readers of the raw SSE that check every line of the
protocol on the way (used by the chat, responses, input-guardrail and redaction tests)."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import openai
from openai._models import construct_type
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.orchestrator_support import Orchestrator

CHAT_ALIAS = "/api/v2/chat/completions-detection"
RESPONSES_PATH = "/v1/responses"
TERMINALS = ("response.completed", "response.incomplete", "response.failed", "error")
STRICT_EVENT = TypeAdapter(ResponseStreamEvent)


def sdk(orch: Orchestrator) -> openai.AsyncOpenAI:
    """The official async SDK on `orch`, closed when `orch` closes."""
    client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key="unused", max_retries=0)
    orch.closers.append(client.close)
    return client


def sync_sdk(orch: Orchestrator) -> openai.OpenAI:
    """The official sync SDK on `orch`, closed when `orch` closes."""
    client = openai.OpenAI(base_url=orch.url + "/v1", api_key="unused", max_retries=0)

    async def close() -> None:
        client.close()

    orch.closers.append(close)
    return client


async def fake_detectors(*extra: tuple[str, DetectorBehaviour]) -> FakeDetectorServer:
    """The remote detectors the OpenAI-surface tests judge SCRIPT's text with, started: `clean`
    finds nothing, `great`/`you`/`email` find their word, `dies_later` fails (503) on "What"."""
    server = FakeDetectorServer()
    server.add("clean", DetectorBehaviour())
    server.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    server.add("you", DetectorBehaviour(words={"you": 0.8}, detection="pronoun"))
    server.add("email", DetectorBehaviour(words={"email": 0.95}, detection="EmailAddress"))
    server.add("dies_later", DetectorBehaviour(fail_status=503, fail_on="What"))
    for detector_id, behaviour in extra:
        server.add(detector_id, behaviour)
    await server.start()
    return server


async def raw_chunks(
    orch: Orchestrator,
    body: dict[str, Any],
    path: str = CHAT_ALIAS,
    on_content: asyncio.Event | None = None,
) -> list[Any]:
    """Every `data:` of a streamed reply, `[DONE]` as the string; fails on any other line.
    `on_content` is set once the first chunk with content arrived."""
    assert orch.session is not None
    out: list[Any] = []
    async with orch.session.post(orch.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            item = data if data == "[DONE]" else json.loads(data)
            out.append(item)
            if on_content is not None and isinstance(item, dict) and item.get("choices"):
                if item["choices"][0]["delta"].get("content"):
                    on_content.set()
    return out


def without_guardrail_annotations(data: Any) -> Any:
    """The same JSON with our `guardrail_detection` annotations taken out: what is left must
    validate strictly against the SDK's types (the annotations are checked on their own)."""
    data = copy.deepcopy(data)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("annotations"), list):
                node["annotations"] = []
            if isinstance(node.get("annotation"), dict):
                node["annotation"] = None
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(data)
    return data


def check_stream(events: list[dict[str, Any]]) -> None:
    """Sequence numbers count from 0, exactly one terminal event and it is last, and every event
    parses with the SDK: leniently (how the SDK reads a stream) and strictly (every required
    field present, every enum value one the SDK knows)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    terminals = [e["type"] for e in events if e["type"] in TERMINALS]
    assert len(terminals) == 1 and events[-1]["type"] == terminals[0]
    for event in events:
        parsed = construct_type(type_=ResponseStreamEvent, value=event)  # type: ignore[arg-type]
        assert parsed.type == event["type"]
        STRICT_EVENT.validate_python(without_guardrail_annotations(event))
        if "response" in event:
            Response.model_validate(without_guardrail_annotations(event["response"]))


async def raw_events(orch: Orchestrator, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event of a streamed Responses reply, read as raw SSE: each has an `event:` line
    naming the `type` of its `data:` JSON; fails on any other line."""
    assert orch.session is not None
    async with orch.session.post(orch.url + RESPONSES_PATH, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    events: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == name_line[len("event: ") :]
        events.append(data)
    check_stream(events)
    return events


def types(events: list[Any]) -> list[str]:
    return [e["type"] if isinstance(e, dict) else e.type for e in events]


def reassembled(chunks: list[Any]) -> list[dict[str, Any]]:
    """The tool calls of a Chat Completions stream (SDK chunks), put together as the SDK's users
    do: by `index`, the id and name from the fragment that has them, the arguments concatenated."""
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or tc.id
            if tc.function is not None:
                call["name"] = call["name"] or tc.function.name
                call["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def finishes(chunks: list[Any]) -> list[str]:
    """The finish reasons a Chat Completions stream (SDK chunks) gave, in order."""
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
