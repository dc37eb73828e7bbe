"""Redaction end to end (DESIGN 4.6a, issue 23) over real sockets: the orchestrator on 127.0.0.1
with the built-in `regex` detector, a fake native engine streaming e-mails, phone and card
numbers one character per token across sentence and `max_chars` boundaries, and the official
`openai` SDK or raw HTTP as the client. The client's raw bytes never hold an entity; the released
text equals the redacted whole answer; every index points into the text the client received;
the engine receives a redacted prompt."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.app import create_app
from orchestrator.config import ConfigError, parse_config
from orchestrator.streaming.chat_writer import ChatChunkWriter
from orchestrator.streaming.guarded_generation import GuardedGeneration
from orchestrator.streaming.redaction import redact_text
from orchestrator.streaming.responses_writer import ResponsesFold, ResponsesWriter
from tests.fakes.clock import manual_deadline_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.fakes.upstream import start_site
from tests.openai_support import raw_chunks, raw_events
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    remote,
    sse_events,
    terminal,
)
from tests.wait_support import finished, until

ENTITIES = ["jo@example.com", "555-123-4567", "4111 1111 1111 1111"]
ANSWER = (
    "Write to jo@example.com today. Or call 555-123-4567, please. Card 4111 1111 1111 1111 works."
)
REDACTED = "Write to [email] today. Or call [phone], please. Card [credit_card] works."
STREAMING = "/api/v1/task/server-streaming-classification-with-text-generation"
UNARY = "/api/v1/task/classification-with-text-generation"
CONTENT = "/api/v2/text/detection/content"
REDACT = {"pii": {"on_detection": "redact"}}


def tokens(text: str) -> list[str]:
    """Words as tokens, every entity one character per token."""
    out: list[str] = []
    pos = 0
    for m in re.finditer("|".join(re.escape(e) for e in ENTITIES), text):
        out += re.findall(r"\s*\S+|\s+", text[pos : m.start()])
        out += list(m.group())
        pos = m.end()
    return out + re.findall(r"\s*\S+|\s+", text[pos:])


def spans(entities: list[tuple[str, str]], text: str = REDACTED) -> list[tuple[int, int, str, str]]:
    """(start, end, replacement, entity) of each replacement in `text`, in order."""
    out = []
    pos = 0
    for replacement, entity in entities:
        start = text.index(replacement, pos)
        out.append((start, start + len(replacement), replacement, entity))
        pos = start + len(replacement)
    return out


EXPECTED = spans([("[email]", "email"), ("[phone]", "phone"), ("[credit_card]", "credit_card")])


def tcr(start: int, end: int, word: str, entity: str) -> dict[str, Any]:
    return {
        "start": start,
        "end": end,
        "word": word,
        "entity": entity,
        "entity_group": "pii",
        "detector_id": "pii",
        "score": 1.0,
        "redacted": True,
    }


EXPECTED_TCRS = [tcr(*s) for s in EXPECTED]


def config(engine: FakeEngine, *, max_chars: int = 16, **model: Any) -> dict[str, Any]:
    """`max_chars` 16 puts chunk boundaries inside the entities."""
    return native_config(
        engine.url,
        detectors={"pii": {"builtin": "regex", "chunker_id": "sentence"}},
        chunkers={"sentence": {"type": "sentence", "max_chars": max_chars}},
        model=model or None,
    )


@pytest.fixture
async def pii_engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(script=tokens(ANSWER))
    await fake.start()
    yield fake
    await fake.close()


def no_entity(raw: str) -> None:
    for entity in ENTITIES:
        assert entity not in raw
        assert json.dumps(entity)[1:-1] not in raw


async def raw_post(orch: Orchestrator, path: str, body: dict[str, Any]) -> str:
    assert orch.session is not None
    async with orch.session.post(orch.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.text()


# -- output -----------------------------------------------------------------------------------


async def test_fms_stream_redacts_entities_split_across_tokens_and_chunks(pii_engine) -> None:
    assert "".join(tokens(ANSWER)) == ANSWER and len(tokens(ANSWER)) > 50
    async with Orchestrator(config(pii_engine)) as orch:
        raw = await raw_post(orch, STREAMING, generation_body(output=REDACT))
    no_entity(raw)
    events = sse_events(raw)
    got = frames(events)
    assert assert_contiguous(got) == REDACTED  # start/processed_index on the released text
    detections = [d for f in got for d in f["token_classification_results"]["output"]]
    assert detections == EXPECTED_TCRS
    for f in got:  # each detection rides on the frame holding its replacement
        for d in f["token_classification_results"]["output"]:
            assert f["start_index"] <= d["start"] < d["end"] <= f["processed_index"]
    end = terminal(events)
    assert end.name == "completed"
    assert end.data["processed_index"] == len(REDACTED)


async def test_fms_unary_redacts(pii_engine) -> None:
    async with Orchestrator(config(pii_engine)) as orch:
        raw = await raw_post(orch, UNARY, generation_body(output=REDACT))
    no_entity(raw)
    body = json.loads(raw)
    assert body["generated_text"] == REDACTED
    assert body["token_classification_results"]["output"] == EXPECTED_TCRS


async def test_chat_sdk_stream_and_unary_redact(pii_engine) -> None:
    async with Orchestrator(config(pii_engine)) as orch:
        client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0)
        extra = {"detectors": {"output": REDACT}}
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, extra_body=extra
        )
        chunks = [c async for c in stream]
        unary = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
        raw = await raw_chunks(
            orch,
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
             "detectors": {"output": REDACT}},
            path="/v1/chat/completions",
        )  # fmt: skip
    no_entity(json.dumps(raw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REDACTED
    results = [
        r
        for c in chunks
        for group in ((c.model_extra or {}).get("detections") or {}).get("output", [])
        for r in group["results"]
    ]
    assert results == EXPECTED_TCRS
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert unary.choices[0].message.content == REDACTED
    assert (unary.model_extra or {})["detections"]["output"] == [
        {"choice_index": 0, "results": EXPECTED_TCRS}
    ]


def annotation(start: int, end: int, text: str, entity: str) -> dict[str, Any]:
    return {
        "type": "guardrail_detection",
        "start_index": start,
        "end_index": end,
        "text": text,
        "detector_id": "pii",
        "detection": entity,
        "detection_type": "pii",
        "score": 1.0,
        "redacted": True,
    }


async def test_responses_stream_and_unary_redact(pii_engine) -> None:
    request = {"model": MODEL, "input": "hi", "detectors": {"output": REDACT}}
    async with Orchestrator(config(pii_engine)) as orch:
        events = await raw_events(orch, request)
        client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0)
        unary = await client.responses.create(
            model=MODEL, input="hi", extra_body={"detectors": {"output": REDACT}}
        )
    no_entity(json.dumps(events))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == REDACTED
    notes = [
        e["annotation"] for e in events if e["type"] == "response.output_text.annotation.added"
    ]
    assert notes == [annotation(*s) for s in EXPECTED]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert final["output"][0]["content"][0]["text"] == REDACTED
    assert final["guardrails"]["output"] == notes
    assert unary.output_text == REDACTED
    assert (unary.model_extra or {})["guardrails"]["output"] == notes


async def test_enforced_redact_cannot_be_weakened_by_a_client(pii_engine) -> None:
    cfg = config(pii_engine, guardrails={"output": {"pii": {"on_detection": "redact"}}})
    async with Orchestrator(cfg) as orch:
        raw = await raw_post(
            orch, UNARY, generation_body(output={"pii": {"on_detection": "annotate"}})
        )
        plain = await raw_post(orch, UNARY, generation_body())
    for body in (raw, plain):
        no_entity(body)
        assert json.loads(body)["generated_text"] == REDACTED


async def test_redact_with_template_and_fixed_string(pii_engine) -> None:
    async with Orchestrator(config(pii_engine)) as orch:
        templated = await raw_post(
            orch,
            UNARY,
            generation_body(
                output={"pii": {"on_detection": "redact", "redact_with": "<{entity}>"}}
            ),
        )
        fixed = await raw_post(
            orch,
            UNARY,
            generation_body(output={"pii": {"on_detection": "redact", "redact_with": "***"}}),
        )
    assert json.loads(templated)["generated_text"] == (
        "Write to <email> today. Or call <phone>, please. Card <credit_card> works."
    )
    assert (
        json.loads(fixed)["generated_text"]
        == "Write to *** today. Or call ***, please. Card *** works."
    )


async def test_block_beats_redact(pii_engine) -> None:
    cfg = config(pii_engine)
    cfg["chunkers"]["big"] = {"type": "sentence", "max_chars": 500}
    cfg["detectors"]["cards"] = {
        "builtin": "regex",
        "chunker_id": "big",
        "params": {"kinds": ["credit_card"]},
        "on_detection": "block",
    }
    async with Orchestrator(cfg) as orch:
        raw = await raw_post(orch, STREAMING, generation_body(output={**REDACT, "cards": {}}))
    no_entity(raw)
    events = sse_events(raw)
    text = "".join(f["generated_text"] for f in frames(events))
    assert REDACTED.startswith(text) and "[credit_card]" not in text
    assert [e.name for e in events if e.name][-3:] == [
        "refusal.delta",
        "refusal.done",
        "incomplete",
    ]


async def test_text_without_a_boundary_flows_in_max_chars_frames() -> None:
    """5,000 characters of code without a period: several frames of at most max_chars (the
    default 500), the first one while the engine still holds the rest back."""
    line = "x_value = compute(x_value, 42) + other_thing\n"
    code = line * (5000 // len(line) + 1)
    script = re.findall(r"\s*\S+", code)
    engine = FakeEngine(script=script, hold_after=len(script) // 2)
    await engine.start()
    try:
        cfg = native_config(
            engine.url,
            detectors={"pii": {"builtin": "regex", "chunker_id": "sentence"}},
            chunkers={"sentence": {"type": "sentence"}},
        )
        seen_while_held: list[int] = []

        def on_event(events: list[Any]) -> None:
            got = [e for e in events if e.name is None]
            if got and not engine.release.is_set():
                seen_while_held.append(len(got))
                engine.release.set()

        async with Orchestrator(cfg) as orch:
            events = await finished(
                orch.stream(
                    generation_body(output={"pii": {}}, params={"max_new_tokens": len(script)}),
                    on_event=on_event,
                ),
                60,
                "orch.stream(generation_body(output={'pii': {}}, params={'...",
            )
    finally:
        await engine.close()
    got = frames(events)
    assert assert_contiguous(got) == "".join(script)
    sizes = [len(f["generated_text"]) for f in got]
    assert len([s for s in sizes if s]) >= 10
    assert max(sizes) <= 500
    assert seen_while_held  # a frame reached the client before the engine sent the second half


# -- input ------------------------------------------------------------------------------------


async def test_fms_input_is_redacted_before_the_engine(engine) -> None:
    inputs = "Mail jo@example.com or call 555-123-4567."
    cfg = config(engine)
    async with Orchestrator(cfg) as orch:
        raw = await raw_post(orch, STREAMING, generation_body(inputs, input=REDACT))
    [request] = engine.requests
    assert request.body["prompt"] == "Mail [email] or call [phone]."
    got = frames(sse_events(raw))
    assert got[0]["token_classification_results"]["input"] == [
        {**tcr(5, 19, "[email]", "email")},
        {**tcr(28, 40, "[phone]", "phone")},
    ]
    assert terminal(sse_events(raw)).name == "completed"


async def test_chat_input_messages_are_redacted_before_the_engine(engine) -> None:
    messages = [
        {"role": "system", "content": "The user is jo@example.com."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Call 555-123-4567 then."},
        {"role": "user", "content": [{"type": "text", "text": "Card 4111 1111 1111 1111"}]},
    ]
    async with Orchestrator(config(engine)) as orch:
        client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            stream=True,
            extra_body={"detectors": {"input": REDACT}},
        )
        chunks = [c async for c in stream]
        unary = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            extra_body={"detectors": {"input": REDACT}},
        )
    for request in engine.requests:
        assert request.body["messages"] == [
            {"role": "system", "content": "The user is [email]."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Call [phone] then."},
            {"role": "user", "content": "Card [credit_card]"},
        ]
    expected = [
        {"message_index": 0, "results": [tcr(12, 26, "[email]", "email")]},
        {"message_index": 2, "results": [tcr(5, 17, "[phone]", "phone")]},
        {"message_index": 3, "results": [tcr(5, 24, "[credit_card]", "credit_card")]},
    ]
    with_input = [c for c in chunks if ((c.model_extra or {}).get("detections") or {}).get("input")]
    assert len(with_input) == 1
    assert (with_input[0].model_extra or {})["detections"]["input"] == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert (unary.model_extra or {})["detections"]["input"] == expected
    assert unary.choices[0].message.content  # generated, not refused
    assert "warnings" not in (unary.model_extra or {})


class _Walked(list):  # type: ignore[type-arg]
    """A list that counts the walks over it."""

    walks = 0

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()


async def test_many_redacted_messages_cost_linear_work(engine, monkeypatch) -> None:
    """Repro: each message was redacted with the findings filtered out of all of them, so
    20,000 messages of one address each (a 1 MiB body) cost 400 million comparisons on the
    event loop (4 s here). Findings are grouped by message once: the findings are walked a
    fixed number of times, not once per message."""
    walked: list[_Walked] = []
    redact_input = GuardedGeneration._redact_input

    def counting(self: GuardedGeneration, findings: list[Any], redactors: Any) -> None:
        walked.append(_Walked(findings))
        redact_input(self, walked[-1], redactors)

    monkeypatch.setattr(GuardedGeneration, "_redact_input", counting)
    count = 20_000
    messages = [{"role": "user", "content": f"a@b{i}.co"} for i in range(count)]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "detectors": {"input": REDACT}}
    async with Orchestrator(config(engine, limits={"max_input_chars": 2_000_000})) as orch:
        raw = await raw_post(orch, "/v1/chat/completions", body)
    [sent] = engine.requests
    assert sent.body["messages"] == [{"role": "user", "content": "[email]"}] * count
    detections = json.loads(raw)["detections"]["input"]
    assert [d["message_index"] for d in detections] == list(range(count))
    [findings] = walked
    assert len(findings) == count and findings.walks <= 3


async def test_responses_instructions_and_items_are_redacted_before_the_engine(engine) -> None:
    request = {
        "model": MODEL,
        "instructions": "Reply to jo@example.com.",
        "input": [{"role": "user", "content": "My number is 555-123-4567"}],
        "detectors": {"input": REDACT},
    }
    async with Orchestrator(config(engine)) as orch:
        events = await raw_events(orch, request)
    [sent] = engine.requests
    assert sent.body["messages"] == [
        {"role": "system", "content": "Reply to [email]."},
        {"role": "user", "content": "My number is [phone]"},
    ]
    final = events[-1]
    assert final["type"] == "response.completed"
    assert final["response"]["guardrails"]["input"] == [
        {**annotation(9, 23, "[email]", "email"), "field": "instructions", "message_index": None},
        {**annotation(13, 25, "[phone]", "phone"), "field": "input", "message_index": 0},
    ]


STOP_REDACTED = (
    "stop sequence 1 holds text that input detector `pii` redacts (a redacted stop sequence "
    "would change what the request asks for)"
)


async def test_a_stop_sequence_an_input_guardrail_redacts_is_refused_with_422(engine) -> None:
    """Repro: `stop: ["jo@example.com"]` reached the engine raw while the prompt was redacted.
    Stop sequences are input too (DESIGN 4.6a); replacing one would change when generation
    stops, so the request is refused: before the response on Chat Completions and FMS unary, as
    the in-band error of an FMS stream (its response starts at once)."""
    stops = ["\n\n", "jo@example.com"]
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stop": stops,
        "detectors": {"input": REDACT},
    }
    fms = generation_body("Hi", input=REDACT, params={"stop_sequences": stops})
    async with Orchestrator(config(engine)) as orch:
        unary_chat = await orch.post("/v1/chat/completions", chat)
        stream_chat = await orch.post("/v1/chat/completions", {**chat, "stream": True})
        unary = await orch.post(UNARY, fms)
        events = await orch.stream(fms)
    assert engine.requests == []
    openai_error = {
        "error": {"message": STOP_REDACTED, "type": "invalid_request", "param": None, "code": 422}
    }
    assert unary_chat == (422, openai_error)
    assert stream_chat == (422, openai_error)
    assert unary == (422, {"code": 422, "details": STOP_REDACTED, "type": "invalid_request"})
    assert terminal(events).data == {
        "code": 422,
        "details": STOP_REDACTED,
        "type": "invalid_request",
    }


async def test_a_stop_sequence_a_blocking_input_guardrail_flags_is_an_input_hit(engine) -> None:
    """A blocking detector that flags a stop sequence refuses the request like any input hit
    (content_filter); the spans of the refusal stay relative to the text they name, so a stop
    sequence's own finding is not listed among them."""
    block = {"pii": {"on_detection": "block"}}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stop": "jo@example.com",
        "detectors": {"input": block},
    }
    fms = generation_body("Hi", input=block, params={"stop_sequences": ["jo@example.com"]})
    async with Orchestrator(config(engine)) as orch:
        status, unary_chat = await orch.post("/v1/chat/completions", chat)
        events = await orch.stream(fms)
    assert engine.requests == []
    assert status == 200
    [choice] = unary_chat["choices"]
    assert choice["finish_reason"] == "content_filter"
    assert choice["message"]["refusal"] == (
        "The request was refused: detector `pii` flagged a stop sequence."
    )
    assert terminal(events).data["incomplete_details"] == {"reason": "content_filter"}
    [frame] = frames(events)
    assert frame["token_classification_results"]["input"] == []
    assert [w["id"] for w in frame["warnings"]] == ["UNSUITABLE_INPUT"]


async def test_clean_stop_sequences_reach_the_engine_as_sent(engine) -> None:
    fms = generation_body("Mail jo@example.com", input=REDACT, params={"stop_sequences": ["."]})
    async with Orchestrator(config(engine)) as orch:
        events = await orch.stream(fms)
    [request] = engine.requests
    assert request.body["stop_sequences"] == ["."]
    assert request.body["prompt"] == "Mail [email]"
    assert terminal(events).name == "completed"


async def test_responses_echo_the_redacted_instructions_and_no_raw_metadata(engine) -> None:
    """Repro: the response object (every lifecycle event and the unary reply) echoed the raw
    `instructions` and `metadata` while the engine got `[email]`. It echoes what was judged,
    redacted; `metadata` is never judged (it never reaches the engine), so while an input
    guardrail redacts it is not echoed at all."""
    request = {
        "model": MODEL,
        "instructions": "Reply to jo@example.com.",
        "input": "Hi",
        "metadata": {"contact": "jo@example.com"},
        "detectors": {"input": REDACT},
    }
    async with Orchestrator(config(engine)) as orch:
        stream_raw = await raw_post(orch, "/v1/responses", {**request, "stream": True})
        unary_raw = await raw_post(orch, "/v1/responses", request)
        plain = await raw_post(orch, "/v1/responses", {**request, "detectors": None})
    assert [r.body["messages"][0]["content"] for r in engine.requests[:2]] == [
        "Reply to [email].",
        "Reply to [email].",
    ]
    no_entity(stream_raw)
    no_entity(unary_raw)
    objects = [
        json.loads(line[len("data: ") :])["response"]
        for line in stream_raw.splitlines()
        if line.startswith("data: ") and '"response"' in line
    ]
    assert len(objects) == 3  # created, in_progress, completed
    objects.append(json.loads(unary_raw))
    for obj in objects:
        assert obj["instructions"] == "Reply to [email]."
        assert obj["metadata"] == {}
    # without an input guardrail that redacts, both are echoed as sent
    assert json.loads(plain)["instructions"] == "Reply to jo@example.com."
    assert json.loads(plain)["metadata"] == {"contact": "jo@example.com"}


async def test_input_block_beats_redact(engine) -> None:
    cfg = config(engine)
    cfg["detectors"]["mail_block"] = {
        "builtin": "regex",
        "chunker_id": "sentence",
        "params": {"kinds": ["email"]},
    }
    body = generation_body(
        "Mail jo@example.com", input={**REDACT, "mail_block": {"on_detection": "block"}}
    )
    async with Orchestrator(cfg) as orch:
        events = await orch.stream(body)
    assert engine.requests == []
    assert terminal(events).data["incomplete_details"] == {"reason": "content_filter"}


async def test_an_entity_cut_by_max_chars_still_trips_a_blocking_input_guardrail(engine) -> None:
    """max_chars 16 cuts each entity of the prompt in two (at a whitespace or, in an e-mail,
    anywhere): the windows across the cuts still find them, on every surface."""
    for entity, prompt in [
        ("credit_card", "Card 4111 1111 1111 1111 ok"),
        ("phone", "Please call 555 123 4567 now"),
        ("email", "abcdefghij klmnojo@example.com"),
    ]:
        async with Orchestrator(config(engine)) as orch:
            events = await orch.stream(
                generation_body(prompt, input={"pii": {"on_detection": "block"}})
            )
            status, chat = await orch.post(
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "system", "content": prompt},
                 {"role": "user", "content": "ok"}], "detectors": {"input": {"pii": {}}}},
            )  # fmt: skip
        assert terminal(events).data["incomplete_details"] == {"reason": "content_filter"}
        [frame] = frames(events)
        assert [d["entity"] for d in frame["token_classification_results"]["input"]] == [entity]
        assert status == 200 and chat["choices"][0]["finish_reason"] == "content_filter"
    assert engine.requests == []


async def test_an_entity_cut_by_max_chars_is_reported_once_whole(engine) -> None:
    """A chunk cut inside an e-mail (max_chars 16) finds its part (`a299@example.co`), the
    window across the cut the whole: only the whole is said, on the content endpoint and as an
    input guardrail's detections."""
    content = "x a299@example.com and b300@example.com."
    whole = [(2, 18, "a299@example.com"), (23, 39, "b300@example.com")]
    async with Orchestrator(config(engine)) as orch:
        status, body = await orch.post(CONTENT, {"content": content, "detectors": {"pii": {}}})
        events = await orch.stream(generation_body(content, input={"pii": {}}))
    assert status == 200, body
    assert [(d["start"], d["end"], d["text"]) for d in body["detections"]] == whole
    [frame] = frames(events)
    found = frame["token_classification_results"]["input"]
    assert [(d["start"], d["end"], d["word"]) for d in found] == whole


# -- the content endpoint ---------------------------------------------------------------------


async def test_content_endpoint_returns_the_redacted_text(engine) -> None:
    async with Orchestrator(config(engine)) as orch:
        status, body = await orch.post(
            CONTENT, {"content": ANSWER, "detectors": {"pii": {}}, "redact": True}
        )
        status_plain, plain = await orch.post(
            CONTENT, {"content": ANSWER, "detectors": {"pii": {}}}
        )
    assert status == 200, body
    assert body["redacted_content"] == REDACTED
    assert body["detections"] == [
        {
            "start": s,
            "end": e,
            "text": text,
            "detection": entity,
            "detection_type": "pii",
            "detector_id": "pii",
            "score": 1.0,
            "redacted": True,
        }
        for s, e, text, entity in EXPECTED
    ]
    assert status_plain == 200 and "redacted_content" not in plain
    # without `redact`, the original texts (the client sent them) and no `redacted`; the card
    # number, which max_chars 16 cuts in two, is found in the window across that cut
    assert [d["text"] for d in plain["detections"]] == ENTITIES
    assert all("redacted" not in d for d in plain["detections"])


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"on_detection": "redact", "redact_with": 5}, "redact_with"),
        ({"on_detection": "redact", "redact_with": ["x"]}, "redact_with"),
        ({"on_detection": "mask"}, "on_detection"),
    ],
)
async def test_bad_redaction_params_are_422_naming_the_field(engine, params, field) -> None:
    async with Orchestrator(config(engine)) as orch:
        status, body = await orch.post(UNARY, generation_body(output={"pii": params}))
        chat_status, chat = await orch.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
             "detectors": {"output": {"pii": params}}},
        )  # fmt: skip
        content_status, content = await orch.post(
            CONTENT, {"content": "x", "detectors": {"pii": {}}, "redact": "yes"}
        )
    assert status == 422 and body["type"] == "invalid_request" and field in body["details"]
    assert chat_status == 422 and field in chat["error"]["message"]
    assert content_status == 422 and "redact" in content["details"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["detectors"]["pii"].update(redact_with=5), "detectors.pii.redact_with"),
        (lambda c: c["detectors"]["pii"].update(on_detection="mask"), "detectors.pii.on_detection"),
        (
            lambda c: c["detectors"]["pii"].update(params={"redact_with": 1}),
            "detectors.pii.params.redact_with: must be a string",
        ),
        (
            lambda c: c["models"][MODEL].update(
                guardrails={"output": {"pii": {"on_detection": "mask"}}}
            ),
            f"models.{MODEL}.guardrails.output.pii.on_detection: must be annotate, block or redact",
        ),
        (
            lambda c: c["models"][MODEL].update(
                guardrails={"input": {"pii": {"on_detection": "redact", "redact_with": 3}}}
            ),
            f"models.{MODEL}.guardrails.input.pii.redact_with: must be a string",
        ),
        (
            lambda c: c["chunkers"]["sentence"].update(max_chars=0),
            "chunkers.sentence.max_chars: must be >= 1",
        ),
        (
            lambda c: c["chunkers"].update(p={"type": "paragraph", "max_chars": 0}),
            "chunkers.p.max_chars: must be >= 1",
        ),
    ],
)
def test_bad_redaction_config_names_the_field(mutate, message: str) -> None:
    cfg = native_config(
        "http://127.0.0.1:9",
        detectors={"pii": {"builtin": "regex", "chunker_id": "sentence"}},
        chunkers={"sentence": {"type": "sentence"}},
    )
    mutate(cfg)
    with pytest.raises((ConfigError, ValueError)) as info:
        parse_config(cfg)
    assert message in str(info.value)


async def test_no_entity_in_info_logs(pii_engine, caplog: pytest.LogCaptureFixture) -> None:
    """Output and input redaction, the content endpoint: nothing logged at INFO quotes them."""
    caplog.set_level(logging.INFO)
    async with Orchestrator(config(pii_engine)) as orch:
        await raw_post(orch, STREAMING, generation_body(ANSWER, input=REDACT, output=REDACT))
        await raw_post(orch, UNARY, generation_body(output=REDACT))
        await orch.post(CONTENT, {"content": ANSWER, "detectors": {"pii": {}}, "redact": True})
    assert caplog.records  # the service did log (start-up, requests)
    for record in caplog.records:
        no_entity(record.getMessage())


async def test_no_entity_in_debug_logs_or_traces(pii_engine, caplog) -> None:
    """DESIGN 4.6a: flagged characters never leave the service, not in logs (DEBUG included,
    every logger) and not in traces: every span's name, attributes, events and status, with
    tracing on (an in-memory exporter), on every surface, input and output redacted."""
    caplog.set_level(logging.DEBUG)
    exporter = InMemorySpanExporter()
    app = create_app(parse_config(config(pii_engine)), device="cpu", span_exporter=exporter)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        url = await start_site(runner)
        orch = Orchestrator(config(pii_engine))
        orch.url = url
        async with aiohttp.ClientSession() as orch.session:
            await raw_post(orch, STREAMING, generation_body(ANSWER, input=REDACT, output=REDACT))
            await raw_post(orch, UNARY, generation_body(ANSWER, input=REDACT, output=REDACT))
            chat = {"model": MODEL, "messages": [{"role": "user", "content": ANSWER}]}
            both = {"input": REDACT, "output": REDACT}
            await raw_post(orch, "/v1/chat/completions", {**chat, "detectors": both})
            await raw_post(
                orch, "/v1/chat/completions", {**chat, "detectors": both, "stream": True}
            )
            responses = {"model": MODEL, "input": ANSWER, "instructions": ANSWER, "detectors": both}
            await raw_post(orch, "/v1/responses", responses)
            await raw_post(orch, "/v1/responses", {**responses, "stream": True})
            await orch.post(CONTENT, {"content": ANSWER, "detectors": {"pii": {}}, "redact": True})
            async with orch.session.get(url + "/health") as r:  # its access line is DEBUG
                assert r.status == 200
    finally:
        await runner.cleanup()
    assert any(r.levelno == logging.DEBUG for r in caplog.records)  # DEBUG was captured
    for record in caplog.records:
        no_entity(record.getMessage())
    spans = exporter.get_finished_spans()
    assert any(s.name == "detector pii" for s in spans)
    for span in spans:
        no_entity(span.name)
        no_entity(repr(dict(span.attributes or {})))
        no_entity(span.status.description or "")
        for event in span.events:
            no_entity(event.name)
            no_entity(repr(dict(event.attributes or {})))


async def test_migration_mid_entity_resumes_from_the_original_tokens() -> None:
    """A replica dies in the middle of an e-mail; the other one resumes from the original
    tokens (the engine never sees a replacement) and the client gets the redacted answer."""
    script = tokens(ANSWER)
    cut = script.index("@")  # the first replica sends "Write to jo" and dies
    first, second = FakeEngine(script=script), FakeEngine(script=script)
    for e in (first, second):
        await e.start()
    first.inject(Fault("close", after_tokens=cut))
    cfg = config(first)
    cfg["models"][MODEL]["backends"] = [
        {"type": "native", "url": first.url},
        {"type": "native", "url": second.url},
    ]
    cfg["models"][MODEL]["migration"] = {"limit": 2, "quarantine_s": 30}
    try:
        async with Orchestrator(cfg) as orch:
            raw = await raw_post(orch, STREAMING, generation_body(output=REDACT))
    finally:
        for e in (first, second):
            await e.close()
    no_entity(raw)
    events = sse_events(raw)
    assert assert_contiguous(frames(events)) == REDACTED
    assert terminal(events).data["migrations"] == 1
    [resumed] = second.requests
    assert resumed.body["resume"]["text"] == "".join(script[:cut])  # the original text
    assert second.resume_mismatches == []


# -- stop sequences where output guardrails redact or block (the stop-sequence oracle) -----------
# A backend applies stop sequences to the raw text: with `stop: ["4111 1111"]` it stopped before
# the redacted card number, so the released text's end and `finish_reason` told the client that
# the number starts so. Where an output guardrail redacts or blocks, the stop sequences are
# matched on the released text instead (streaming/released_stops.py) and never reach the engine.

COMPLETIONS = "/api/v2/text/completions-detection"


async def fms_outcome(orch: Orchestrator, output: Any, stops: list[str]) -> tuple[Any, ...]:
    """What an FMS stream tells its client: frames' text and finish reason, the terminal."""
    body = generation_body(output=output, params={"stop_sequences": stops, "max_new_tokens": 200})
    events = await orch.stream(body)
    got = frames(events)
    end = terminal(events)
    return (
        assert_contiguous(got),
        got[-1].get("finish_reason"),
        end.name,
        end.data["finish_reason"],
        end.data["processed_index"],
    )


@pytest.mark.parametrize("guess", ["4111 1111", "555-123", "jo@ex"])
async def test_a_stop_guessing_redacted_text_tells_the_fms_client_nothing(
    pii_engine, guess
) -> None:
    """Repro of the oracle: the right guess ended the stream `STOP_SEQUENCE` right before the
    redacted entity, a wrong one did not. Now both give the whole redacted answer."""
    async with Orchestrator(config(pii_engine)) as orch:
        right = await fms_outcome(orch, REDACT, [guess])
        wrong = await fms_outcome(orch, REDACT, ["9999 9999"])
        raw = await raw_post(
            orch, STREAMING, generation_body(output=REDACT, params={"stop_sequences": [guess]})
        )
    assert right == wrong == (REDACTED, "EOS_TOKEN", "completed", "EOS_TOKEN", len(REDACTED))
    no_entity(raw)
    assert [r.body["stop_sequences"] for r in pii_engine.requests] == [[], [], []]


async def test_a_stop_guessing_blocked_text_tells_the_fms_client_nothing(pii_engine) -> None:
    """`block` leaks through stops too: a backend stop before the flagged e-mail ended the
    stream `completed` where a wrong guess got the refusal. Now both get the refusal."""
    block = {"pii": {"on_detection": "block"}}
    async with Orchestrator(config(pii_engine)) as orch:
        outcomes = []
        for stops in (["jo@ex"], ["zz@ex"]):
            body = generation_body(output=block, params={"stop_sequences": stops})
            events = await orch.stream(body)
            outcomes.append(
                (
                    "".join(f["generated_text"] for f in frames(events)),
                    [e.name for e in events if e.name],
                    terminal(events).data.get("incomplete_details"),
                )
            )
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1][-3:] == ["refusal.delta", "refusal.done", "incomplete"]
    assert outcomes[0][2] == {"reason": "content_filter"}


async def test_a_stop_guessing_redacted_text_tells_chat_and_completions_clients_nothing(
    pii_engine,
) -> None:
    """Chat Completions says `stop` for both ends: the oracle there is where the text ends."""
    async with Orchestrator(config(pii_engine)) as orch:
        client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0)
        extra = {"detectors": {"output": REDACT}}
        ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
        stream = await client.chat.completions.create(
            **ask, stream=True, stop=["555-123"], extra_body=extra
        )
        chunks = [c async for c in stream]
        unary = await client.chat.completions.create(**ask, stop="4111 1111", extra_body=extra)
        completion = await raw_chunks(
            orch,
            {"model": MODEL, "prompt": "hi", "stream": True, "stop": ["jo@ex"], "max_tokens": 200,
             "detectors": {"output": REDACT}},
            path=COMPLETIONS,
        )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REDACTED
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert unary.choices[0].message.content == REDACTED
    assert unary.choices[0].finish_reason == "stop"
    text = "".join(c["choices"][0]["text"] for c in completion[:-1] if c.get("choices"))
    assert text == REDACTED
    assert [r.body.get("stop") or r.body.get("stop_sequences") for r in pii_engine.requests] == [
        [],
        [],
        [],
    ]


@pytest.mark.parametrize(
    ("stop", "released"),
    [
        ("call", "Write to [email] today. Or "),  # in text no guardrail changed
        ("Card", "Write to [email] today. Or call [phone], please. "),
    ],
)
async def test_a_stop_in_released_text_ends_the_stream_as_the_backend_stop_does(
    pii_engine, stop, released
) -> None:
    """The same text, frames' finish reason and terminal as the engine's own stop without
    guardrails (the entities replaced), and a truthful token count: what the engine generated."""
    async with Orchestrator(config(pii_engine)) as orch:
        plain_text, *plain = await fms_outcome(orch, None, [stop])
        guarded_text, *guarded = await fms_outcome(orch, REDACT, [stop])
        events = await orch.stream(
            generation_body(output=REDACT, params={"stop_sequences": [stop]})
        )
    assert pii_engine.requests[0].body["stop_sequences"] == [stop]
    assert pii_engine.requests[1].body["stop_sequences"] == []
    assert plain_text.replace("jo@example.com", "[email]").replace("555-123-4567", "[phone]") == (
        guarded_text
    )
    assert guarded_text == released
    assert plain[:3] == guarded[:3] == ["STOP_SEQUENCE", "completed", "STOP_SEQUENCE"]
    assert guarded[3] == len(released)
    end = terminal(events)
    assert len(tokens(released)) <= end.data["generated_token_count"] <= len(tokens(ANSWER))


async def test_a_stop_in_a_replacement_matches_the_released_text() -> None:
    """The client stops on what it receives: `[phone]` is in no text the engine wrote."""
    engine = FakeEngine(script=tokens(ANSWER))
    await engine.start()
    try:
        async with Orchestrator(config(engine)) as orch:
            text, *rest = await fms_outcome(orch, REDACT, ["[phone]"])
    finally:
        await engine.close()
    assert (text, *rest) == (
        "Write to [email] today. Or call ",
        "STOP_SEQUENCE",
        "completed",
        "STOP_SEQUENCE",
        len("Write to [email] today. Or call "),
    )


async def test_a_stop_split_between_two_frames_matches_and_its_start_is_held() -> None:
    """The engine holds after `today. Or call` until the client has the first frame (the
    detectors release `Write to [email] today.`): the stop sequence `today. Or call [ph` starts
    in that frame and ends in a later one. Its possible start (`today.`) is held back from the
    first frame, and the answer ends right before it."""
    script = tokens(ANSWER)
    held = len(tokens("Write to jo@example.com today. Or call"))
    engine = FakeEngine(script=script, hold_after=held)
    await engine.start()
    seen: list[str] = []

    def on_event(events: list[Any]) -> None:
        got = frames(events)
        if got and not engine.release.is_set():
            seen.extend(f["generated_text"] for f in got)
            engine.release.set()

    try:
        async with Orchestrator(config(engine)) as orch:
            body = generation_body(output=REDACT, params={"stop_sequences": ["today. Or call [ph"]})
            events = await orch.stream(body, on_event=on_event)
    finally:
        await engine.close()
    assert "".join(seen) == "Write to [email] "  # "today." held: it may start the stop
    got = frames(events)
    assert assert_contiguous(got) == "Write to [email] "
    assert got[-1]["finish_reason"] == "STOP_SEQUENCE"
    assert terminal(events).name == "completed"
    assert engine.requests[0].tokens_sent > held  # the rest came after the first frame


@pytest.mark.parametrize("engine_ends", [False, True])
async def test_a_whole_document_annotator_judges_the_text_before_a_stop(engine_ends) -> None:
    """A stop matched here ends the answer where the client's text ends: an annotating
    whole-document detector judges that text (its detections on the final frame), never text
    past the cut. The engine either stalls after the stop (the cut ends it) or has ended."""
    script = tokens(ANSWER)
    # stalled where the detectors have released the sentence that holds the stop
    sent = "Write to jo@example.com today. Or call 555-123-4567, please. Card 41"
    stall = None if engine_ends else Fault("stall", after_tokens=len(tokens(sent)))
    engine = FakeEngine(script=script, fail=stall)
    dets = FakeDetectorServer()
    dets.add("doc", DetectorBehaviour(words={"today": 1.0, "works": 1.0}))
    await engine.start()
    await dets.start()
    cfg = config(engine)
    cfg["detectors"]["doc"] = remote(dets.url, "whole_doc_chunker")
    try:
        async with Orchestrator(cfg) as orch:
            body = generation_body(
                output={**REDACT, "doc": {}}, params={"stop_sequences": [", please"]}
            )
            events = await orch.stream(body)
    finally:
        await engine.close()
        await dets.close()
    got = frames(events)
    released = "Write to [email] today. Or call [phone]"
    assert assert_contiguous(got) == released
    assert got[-1]["finish_reason"] == "STOP_SEQUENCE"
    assert terminal(events).name == "completed"
    start = released.index("today")
    found = [d for f in got for d in f["token_classification_results"].get("output", [])]
    assert sorted(found, key=lambda d: d["start"]) == [
        tcr(9, 16, "[email]", "email"),
        {"start": start, "end": start + 5, "word": "today", "entity": "flagged",
         "entity_group": "test", "detector_id": "doc", "score": 1.0},
        tcr(32, 39, "[phone]", "phone"),
    ]  # fmt: skip


async def test_content_endpoint_redacts_many_findings_off_the_event_loop(
    engine, monkeypatch
) -> None:
    """Redacting 80,000 phone numbers (1 MiB of them) took 0.5 s of CPU, on the event loop:
    with many findings the redaction runs in the bulk executor, as the reply's encoding does."""
    from orchestrator.handlers import content_detection

    threads: list[threading.Thread] = []

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread())
        return redact_text(*args)

    monkeypatch.setattr(content_detection, "redact_text", recording)
    text = "Call 555-123-4567 now. " * 300
    async with Orchestrator(config(engine, max_chars=500)) as orch:
        status, body = await orch.post(
            CONTENT, {"content": text, "detectors": {"pii": {}}, "redact": True}
        )
        few, small = await orch.post(
            CONTENT, {"content": "Call 555-123-4567 now.", "detectors": {"pii": {}}, "redact": True}
        )
    assert status == 200 and few == 200, (body, small)
    assert body["redacted_content"] == "Call [phone] now. " * 299 + "Call [phone] now. "
    assert len(body["detections"]) == 300
    assert small["redacted_content"] == "Call [phone] now."
    assert threads[0] is not threading.main_thread()  # 300 findings: off the loop
    assert threads[1] is threading.main_thread()  # one: not worth a thread hop


async def test_redacted_input_is_reported_and_echoed_redacted_when_output_is_blocked_first(
    pii_engine,
) -> None:
    """Repro: while an input guardrail redacted, the Responses object echoed `user` (an end
    user's e-mail address is a common one) raw in every event: like `metadata`, it is never
    judged, so it is not echoed then (nor `safety_identifier`). And with the first sentence
    of the answer blocked, the input's redactions are still said (on an empty frame before
    the refusal) and the echoed `instructions` are the redacted ones."""
    both = {"input": REDACT, "output": {"pii": {"on_detection": "block"}}}
    request = {
        "model": MODEL,
        "instructions": "Reply to jo@example.com.",
        "input": "Hi",
        "user": "jo@example.com",
        "detectors": both,
    }
    chat = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Reply to jo@example.com."},
            {"role": "user", "content": "Hi"},
        ],
        "detectors": both,
    }
    async with Orchestrator(config(pii_engine)) as orch:
        events = await raw_events(orch, request)
        unary = await raw_post(orch, "/v1/responses", request)
        chunks = await raw_chunks(orch, {**chat, "stream": True}, path="/v1/chat/completions")
        chat_unary = await raw_post(orch, "/v1/chat/completions", chat)
    no_entity(json.dumps(events))
    no_entity(unary)
    note = {**annotation(9, 23, "[email]", "email"), "field": "instructions", "message_index": None}
    final = events[-1]
    assert final["type"] == "response.incomplete"
    for obj in [e["response"] for e in events if "response" in e] + [json.loads(unary)]:
        assert obj["instructions"] == "Reply to [email]."
        assert obj["user"] is None
    assert final["response"]["guardrails"]["input"] == [note]
    assert json.loads(unary)["guardrails"]["input"] == [note]
    expected_input = [{"message_index": 0, "results": [tcr(9, 23, "[email]", "email")]}]
    said = [c["detections"]["input"] for c in chunks[:-1] if "input" in c.get("detections", {})]
    assert said == [expected_input]  # once, on the chunk before the refusal
    assert chunks[-2]["choices"][0]["finish_reason"] == "content_filter"
    completion = json.loads(chat_unary)
    assert completion["detections"]["input"] == expected_input
    # the input was redacted, not refused: only the output's warning
    assert [w["type"] for w in completion["warnings"]] == ["UNSUITABLE_OUTPUT"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_refusal_of_many_detections_is_rendered_off_the_event_loop(
    engine, monkeypatch, path
) -> None:
    """Repro: an input refusal's events were rendered on the event loop whatever they held: at
    the default max_input_chars (100,000) a prompt of e-mail addresses is 14,000 detections,
    0.25 s of the loop on Chat Completions and 0.7 s on Responses (its refusal's annotations,
    then its terminal object listing them again). Past 256 findings in a stream, an event
    that carries findings and the terminal are rendered in the bulk executor."""
    threads: list[tuple[str, bool]] = []
    for writer in (ChatChunkWriter, ResponsesWriter):
        real = writer.render

        def recording(self: Any, event: Any, real: Any = real) -> bytes:
            on_loop = threading.current_thread() is threading.main_thread()
            threads.append((type(event).__name__, on_loop))
            return real(self, event)

        monkeypatch.setattr(writer, "render", recording)
    block = {"input": {"pii": {"on_detection": "block"}}}
    many = " ".join(f"a{i}@example.com" for i in range(300))
    key = "messages" if path == "/v1/chat/completions" else "input"
    async with Orchestrator(config(engine)) as orch:
        for text in (many, "Mail jo@example.com"):
            body = {"model": MODEL, key: [{"role": "user", "content": text}], "detectors": block}
            await raw_post(orch, path, {**body, "stream": True})
    assert engine.requests == []
    assert threads == [
        ("Refusal", False),
        ("Terminal", False),
        ("Refusal", True),
        ("Terminal", True),
    ]


async def test_a_unary_refusal_of_many_detections_is_folded_off_the_event_loop(
    engine, monkeypatch
) -> None:
    """The unary Responses object builds the same events as the stream (ResponsesFold): past
    256 findings they are folded in the bulk executor too."""
    threads: list[tuple[str, bool]] = []
    real = ResponsesFold.add

    def recording(self: Any, event: Any) -> None:
        threads.append(
            (type(event).__name__, threading.current_thread() is threading.main_thread())
        )
        real(self, event)

    monkeypatch.setattr(ResponsesFold, "add", recording)
    many = " ".join(f"a{i}@example.com" for i in range(300))
    block = {"input": {"pii": {"on_detection": "block"}}}
    async with Orchestrator(config(engine)) as orch:
        reply = json.loads(
            await raw_post(
                orch, "/v1/responses", {"model": MODEL, "input": many, "detectors": block}
            )
        )
    assert reply["incomplete_details"] == {"reason": "content_filter"}
    assert len(reply["guardrails"]["input"]) > 256
    assert threads == [("Refusal", False), ("Terminal", False)]


async def test_redacted_input_is_reported_when_time_runs_out_before_any_frame(
    engine, monkeypatch
) -> None:
    """Repro: the input's redactions rode on the first frame only; when request_timeout_s ran
    out while an output detector still held the first sentence (no frame yet), the Responses
    object of `response.incomplete` echoed the raw `instructions` and `guardrails.input` was
    empty. An empty frame carries them before the terminal."""
    clock = manual_deadline_clock(monkeypatch)
    gate = asyncio.Event()  # never set: the output detector holds every sentence
    dets = FakeDetectorServer()
    dets.add("held", DetectorBehaviour(gate=gate))
    await dets.start()
    cfg = config(engine)
    cfg["server"]["request_timeout_s"] = 60
    cfg["detectors"]["held"] = remote(dets.url)
    request = {
        "model": MODEL,
        "instructions": "Reply to jo@example.com.",
        "input": "Hi",
        "detectors": {"input": REDACT, "output": {"held": {}}},
    }
    try:
        async with Orchestrator(cfg) as orch:
            reply = asyncio.create_task(
                raw_post(orch, "/v1/responses", {**request, "stream": True})
            )
            await until(lambda: dets.calls and clock.armed, what="the first sentence held")
            clock.advance(61)  # past request_timeout_s
            raw = await reply
    finally:
        gate.set()
        await dets.close()
    no_entity(raw)
    final = sse_events(raw)[-1]
    assert final.name == "response.incomplete"
    obj = final.data["response"]
    assert obj["incomplete_details"] == {"reason": "max_output_tokens"}
    assert obj["instructions"] == "Reply to [email]."
    assert obj["guardrails"]["input"] == [
        {**annotation(9, 23, "[email]", "email"), "field": "instructions", "message_index": None}
    ]
