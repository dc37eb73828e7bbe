"""The detection endpoints' character limit (`server.max_detection_chars`, lowered by a
tenant's `limits.max_detection_chars`): a detector model reads a text several times at a cost
per character, so the body limit alone let one 1 MiB `content` request hold a CPU for minutes.
Over the real HTTP server on 127.0.0.1 with a fake detector service that records every call:
one character over the limit is a 422 naming the field and the limit before any detector is
called; exactly the limit is judged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchestrator.app import CONTENT_PATH, STREAM_CONTENT_PATH
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import NDJSON, Orchestrator, native_config, remote

CHAT = "/api/v2/text/detection/chat"
CONTEXT = "/api/v2/text/detection/context"
GENERATED = "/api/v2/text/detection/generated"
LIMIT = 50
# what the limit counts of these tools: every string, keys included
TOOLS = [{"type": "function", "function": {"name": "f"}}]
TOOLS_CHARS = len("typefunctionfunctionnamef")
KEY = "key-of-tenant-a"


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    server.add("chat", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    server.add("doc", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    server.add("gen", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    await server.start()
    yield server
    await server.close()


def config(engine: FakeEngine, dets: FakeDetectorServer, **server: Any) -> dict[str, Any]:
    detectors = {
        "great": remote(dets.url),
        "chat": {**remote(dets.url, "whole_doc_chunker"), "type": "text_chat"},
        "doc": {**remote(dets.url, "whole_doc_chunker"), "type": "text_context_doc"},
        "gen": {**remote(dets.url, "whole_doc_chunker"), "type": "text_generation"},
    }
    return native_config(engine.url, detectors=detectors, server=server)


def refused(details: str) -> tuple[int, dict[str, Any]]:
    return 422, {"code": 422, "details": details, "type": "invalid_request"}


def calls(dets: FakeDetectorServer) -> int:
    return len(dets.calls) + len(dets.kind_calls)


async def test_content_over_the_limit_is_422_before_any_detector(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    async with Orchestrator(config(engine, dets, max_detection_chars=LIMIT)) as orch:
        body = {"content": "x" * (LIMIT + 1), "detectors": {"great": {}}}
        assert await orch.post(CONTENT_PATH, body) == refused(
            f"content: {LIMIT + 1} characters exceed the detection limit of {LIMIT}"
        )
        assert calls(dets) == 0
        status, reply = await orch.post(CONTENT_PATH, {**body, "content": "x" * LIMIT})
    assert (status, reply) == (200, {"detections": []})
    assert [c[1] for c in dets.calls] == [["x" * LIMIT]]


async def test_chat_counts_messages_and_tools_together(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    def body(chars: int) -> dict[str, Any]:
        first = chars // 2
        messages = [
            {"role": "user", "content": "u" * first},
            {"role": "assistant", "content": [{"type": "text", "text": "a" * (chars - first)}]},
        ]
        return {"detectors": {"chat": {}, "great": {}}, "messages": messages, "tools": TOOLS}

    over = LIMIT + 1 - TOOLS_CHARS
    too_many = refused(
        f"messages: {over} characters, with the {TOOLS_CHARS} of tools, exceed the "
        f"detection limit of {LIMIT}"
    )
    async with Orchestrator(config(engine, dets, max_detection_chars=LIMIT)) as orch:
        assert await orch.post(CHAT, body(over)) == too_many
        assert calls(dets) == 0
        status, reply = await orch.post(CHAT, body(over - 1))
        assert (status, reply) == (200, {"detections": []})
        assert [path for path, _, _ in dets.kind_calls] == ["/api/v1/text/chat"]
        assert dets.calls  # the text_contents detector judged the messages
        # a message's name reaches a chat detector: it counts
        named = body(over - 1 - len("n"))
        named["messages"][0]["name"] = "n"
        assert (await orch.post(CHAT, named))[0] == 200
        before = calls(dets)
        named["messages"][0]["name"] = "nn"
        assert await orch.post(CHAT, named) == too_many
        assert calls(dets) == before


async def test_context_counts_content_and_documents_together(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    def body(context_chars: int) -> dict[str, Any]:
        docs = ["d" * (context_chars - 1), "e"]
        return {
            "detectors": {"doc": {}},
            "content": "c" * 20,
            "context_type": "docs",
            "context": docs,
        }

    async with Orchestrator(config(engine, dets, max_detection_chars=LIMIT)) as orch:
        assert await orch.post(CONTEXT, body(LIMIT - 19)) == refused(
            f"context: {LIMIT - 19} characters, with the 20 of content, exceed the detection "
            f"limit of {LIMIT}"
        )
        assert calls(dets) == 0
        assert await orch.post(CONTEXT, body(LIMIT - 20)) == (200, {"detections": []})
    assert calls(dets) == 1


async def test_generated_counts_prompt_and_generated_text_together(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    def body(generated: int) -> dict[str, Any]:
        return {
            "detectors": {"gen": {}, "great": {}},
            "prompt": "p" * 10,
            "generated_text": "g" * generated,
        }

    async with Orchestrator(config(engine, dets, max_detection_chars=LIMIT)) as orch:
        assert await orch.post(GENERATED, body(LIMIT - 9)) == refused(
            f"generated_text: {LIMIT - 9} characters, with the 10 of prompt, exceed the "
            f"detection limit of {LIMIT}"
        )
        assert calls(dets) == 0
        assert await orch.post(GENERATED, body(LIMIT - 10)) == (200, {"detections": []})
    assert calls(dets) == 2


async def test_stream_content_first_line_over_the_limit_is_an_http_422(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    first = {"detectors": {"great": {}}, "content": "x" * (LIMIT + 1)}
    async with Orchestrator(config(engine, dets, max_detection_chars=LIMIT)) as orch:
        reply = await orch.post(STREAM_CONTENT_PATH, json.dumps(first) + "\n")
    assert reply == refused(
        f"content: {LIMIT + 1} characters exceed the detection limit of {LIMIT}"
    )
    assert calls(dets) == 0


async def test_stream_content_ends_in_band_once_the_lines_pass_the_limit(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    """The stream's characters so far are bounded: the line that passes the limit ends the
    stream with DESIGN's error line, unjudged, and nothing of it or after it reaches a
    detector. Exactly the limit is judged to its end."""
    sentence = "So great. "  # 10 characters: 5 lines are the limit
    first = json.dumps({"detectors": {"great": {}}, "content": sentence})
    line = json.dumps({"content": sentence})
    async with Orchestrator(config(engine, dets, max_detection_chars=LIMIT)) as orch:
        status, text = await orch.post(STREAM_CONTENT_PATH, "\n".join([first] + [line] * 4))
        assert status == 200
        results = [json.loads(x) for x in text.splitlines()]
        assert "code" not in results[-1] and results[-1]["processed_index"] == LIMIT
        judged = "".join(c for _, contents, _ in dets.calls for c in contents)
        assert judged == sentence * 5
        dets.calls.clear()

        # the sixth line is sent once the first results are out: the stream was judging
        started = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            yield ("\n".join([first] + [line] * 4) + "\n").encode()
            await started.wait()
            yield (line + "\n" + line + "\n").encode()

        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAM_CONTENT_PATH, data=body(), headers={"Content-Type": NDJSON}
        ) as r:
            assert r.status == 200
            assert json.loads(await r.content.readline())["start_index"] == 0
            started.set()
            out = [json.loads(x) for x in (await r.text()).splitlines()]
    assert (
        out[-1]
        == refused(
            f"content: {LIMIT + len(sentence)} characters exceed the detection limit of {LIMIT}"
        )[1]
    )
    assert all(o["processed_index"] <= LIMIT for o in out[:-1])
    judged = "".join(c for _, contents, _ in dets.calls for c in contents)
    assert (sentence * 5).startswith(judged)  # the lines past the limit: never judged


async def test_a_tenant_lowers_the_limit(
    engine: FakeEngine, dets: FakeDetectorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANT_A_KEYS", KEY)
    monkeypatch.setenv("TENANT_B_KEYS", "key-of-tenant-b")
    cfg = config(engine, dets, max_detection_chars=LIMIT)
    cfg["tenants"] = {
        "a": {"keys_env": "TENANT_A_KEYS", "limits": {"max_detection_chars": 10}},
        # a tenant's limit only lowers the server's
        "b": {"keys_env": "TENANT_B_KEYS", "limits": {"max_detection_chars": 10 * LIMIT}},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    async with Orchestrator(cfg) as orch:
        body = {"content": "x" * (LIMIT + 1), "detectors": {"great": {}}}
        b = {"Authorization": "Bearer key-of-tenant-b"}
        assert await orch.post(CONTENT_PATH, body, headers=b) == refused(
            f"content: {LIMIT + 1} characters exceed the detection limit of {LIMIT}"
        )
        body = {"content": "x" * 11, "detectors": {"great": {}}}
        assert await orch.post(CONTENT_PATH, body, headers=headers) == refused(
            "content: 11 characters exceed the detection limit of 10"
        )
        assert calls(dets) == 0
        body["content"] = "x" * 10
        assert await orch.post(CONTENT_PATH, body, headers=headers) == (200, {"detections": []})
    assert calls(dets) == 1


async def test_chat_of_many_messages_is_counted_off_the_loop_the_same(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    """Past 1,024 messages the count runs in the bulk executor: the same count."""

    def body(count: int) -> dict[str, Any]:
        return {"detectors": {"chat": {}}, "messages": [{"role": "user", "content": "m"}] * count}

    async with Orchestrator(config(engine, dets, max_detection_chars=2000)) as orch:
        assert await orch.post(CHAT, body(2001)) == refused(
            "messages: 2001 characters exceed the detection limit of 2000"
        )
        assert calls(dets) == 0
        assert await orch.post(CHAT, body(2000)) == (200, {"detections": []})
    assert calls(dets) == 1
