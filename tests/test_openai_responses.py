"""The OpenAI Responses API with guardrails and the OpenResponses terminal events (DESIGN 4.9),
driven by the official `openai` SDK (async, and sync in a thread) and by a plain HTTP client
reading the raw SSE: the real orchestrator on 127.0.0.1, a fake native engine and fake remote
detectors on their own sockets; and, for migration, two real tiny-random engine processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from tests.e2e_support import MODEL as TINY
from tests.e2e_support import (
    all_healthy,
    kill_the_serving_replica,
    migrations,
    stall_every_replica,
)
from tests.engine_processes import free_port
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.openai_support import (
    RESPONSES_PATH,
    check_stream,
    fake_detectors,
    raw_events,
    sdk,
    sync_sdk,
    types,
    without_guardrail_annotations,
)
from tests.orchestrator_support import MODEL, SCRIPT, Orchestrator, native_config, remote
from tests.wait_support import within

TEXT = "I am great. What about you?"
PATH = RESPONSES_PATH
DETECTOR_IDS = ("clean", "great", "you", "email", "dies_later", "blocker")

# the event types of a stream that ends normally, with one detection per sentence
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = await fake_detectors(
        ("blocker", DetectorBehaviour(words={"about": 0.9}, detection="secret"))
    )
    yield server
    await server.close()


def config(engine_url: str, dets: FakeDetectorServer, **model: Any) -> dict[str, Any]:
    detectors = {n: remote(dets.url) for n in DETECTOR_IDS}
    return native_config(engine_url, detectors=detectors, model=model or None)


def output_detectors(**detectors: Any) -> dict[str, Any]:
    return {"detectors": {"output": detectors}}


def annotation(start: int, end: int, text: str, detection: str, detector_id: str, score: float):
    return {
        "type": "guardrail_detection",
        "start_index": start,
        "end_index": end,
        "text": text,
        "detector_id": detector_id,
        "detection": detection,
        "detection_type": "test",
        "score": score,
    }


GREAT = annotation(5, 10, "great", "positive", "great", 0.9)
YOU = annotation(23, 26, "you", "pronoun", "you", 0.8)


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "Hi there", **extra}


# -- natural finish: response.completed ----------------------------------------------------------


async def test_sdk_stream_completes_with_annotations_into_the_whole_text(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        stream = await sdk(orch).responses.create(
            model=MODEL,
            input="Hi there",
            stream=True,
            extra_body=output_detectors(great={}, you={}),
        )
        events = [e async for e in stream]
    dumped = [e.to_dict() for e in events]
    check_stream(dumped)
    assert types(events) == [
        *OPENING,
        "response.output_text.delta",
        "response.output_text.annotation.added",
        "response.output_text.delta",
        "response.output_text.annotation.added",
        *CLOSING,
        "response.completed",
    ]
    created, in_progress, item_added, part_added, d1, a1, d2, a2, text_done = dumped[:9]
    rid = created["response"]["id"]
    assert rid.startswith("resp_")
    assert created["response"]["status"] == in_progress["response"]["status"] == "in_progress"
    assert created["response"]["output"] == [] and created["response"]["usage"] is None
    item_id = item_added["item"]["id"]
    assert item_id.startswith("msg_")
    assert item_added["item"] == {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    assert part_added["part"] == {
        "type": "output_text",
        "text": "",
        "annotations": [],
        "logprobs": [],
    }
    # one delta per released frame: the two sentences
    assert [d1["delta"], d2["delta"]] == ["I am great.", " What about you?"]
    assert all(
        (e["item_id"], e["output_index"], e["content_index"]) == (item_id, 0, 0)
        for e in (part_added, d1, a1, d2, a2, text_done)
    )
    # annotations index the whole output text, not the frame
    assert (a1["annotation_index"], a1["annotation"]) == (0, GREAT)
    assert (a2["annotation_index"], a2["annotation"]) == (1, YOU)
    for a in (a1, a2):
        note = a["annotation"]
        assert TEXT[note["start_index"] : note["end_index"]] == note["text"]
    assert text_done["text"] == TEXT
    # the SDK's own object for the annotation keeps every field
    sdk_note = events[7].annotation  # type: ignore[union-attr]
    assert sdk_note is not None and sdk_note.type == "guardrail_detection"
    assert (sdk_note.start_index, sdk_note.end_index, sdk_note.detector_id) == (23, 26, "you")

    final = events[-1].response  # type: ignore[union-attr]
    assert final.id == rid and final.object == "response" and final.model == MODEL
    assert final.status == "completed"
    assert final.error is None and final.incomplete_details is None
    assert final.output_text == TEXT
    message = final.output[0]
    assert message.type == "message" and message.id == item_id and message.status == "completed"
    assert [c.type for c in message.content] == ["output_text"]
    assert [a.to_dict() for a in message.content[0].annotations] == [GREAT, YOU]  # type: ignore[union-attr]
    assert final.usage is not None
    assert final.usage.input_tokens == len("Hi there")
    assert final.usage.output_tokens == len(SCRIPT)
    assert final.usage.total_tokens == len("Hi there") + len(SCRIPT)
    assert final.usage.input_tokens_details.cached_tokens == 0
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    assert (final.model_extra or {})["guardrails"] == {"input": [], "output": [GREAT, YOU]}
    # a normal completion: no error and no refusal events
    assert not [t for t in types(events) if "refusal" in t or t in ("error", "response.failed")]
    # the engine got the conversation, under the chat template
    assert engine.requests[0].body["messages"] == [{"role": "user", "content": "Hi there"}]


async def test_sdk_stream_helper_accumulates_the_final_response(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        async with sdk(orch).responses.stream(
            model=MODEL, input="Hi there", extra_body=output_detectors(you={})
        ) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
    assert types(events) == [
        *OPENING,
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.annotation.added",
        *CLOSING,
        "response.completed",
    ]
    # the helper's running snapshot: each delta event carries the text so far
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [e.snapshot for e in deltas] == ["I am great.", TEXT]  # type: ignore[union-attr]
    assert final.status == "completed" and final.output_text == TEXT
    assert final.output[0].content[0].annotations[0].to_dict() == YOU  # type: ignore[union-attr]


async def test_sync_sdk_streams_and_unary_with_instructions_and_message_items(engine, dets) -> None:
    conversation = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Hello"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi!", "annotations": []}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]},
    ]
    async with Orchestrator(config(engine.url, dets)) as orch:
        client = sync_sdk(orch)

        def run() -> list[Any]:
            stream = client.responses.create(
                model=MODEL, input=conversation, instructions="Be nice.", stream=True
            )
            return list(stream)

        events = await asyncio.to_thread(run)
        unary = await asyncio.to_thread(
            client.responses.create, model=MODEL, input=conversation, instructions="Be nice."
        )
    check_stream([e.to_dict() for e in events])
    # no output detectors: every engine item is its own delta
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == SCRIPT
    assert events[-1].type == "response.completed"
    assert unary.status == "completed" and unary.output_text == TEXT
    assert unary.instructions == "Be nice."
    Response.model_validate(unary.to_dict())
    # instructions first, as a system message; `developer` is the system role for templates
    assert engine.requests[0].body["messages"] == [
        {"role": "system", "content": "Be nice."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Hi there"},
    ]
    assert engine.requests[1].body["messages"] == engine.requests[0].body["messages"]


async def test_unary_is_the_object_the_stream_ends_with(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        streamed = await raw_events(orch, body(**output_detectors(great={})))
        status, unary = await orch.post(PATH, body(**output_detectors(great={})))
    assert status == 200
    final = streamed[-1]["response"]
    for obj in (final, unary):
        Response.model_validate(without_guardrail_annotations(obj))
        assert obj["output"][0]["content"][0]["annotations"] == [GREAT]
    ignore = {"id", "created_at", "completed_at", "output"}
    assert {k: v for k, v in unary.items() if k not in ignore} == {
        k: v for k, v in final.items() if k not in ignore
    }
    assert unary["output"][0]["content"] == final["output"][0]["content"]
    assert unary["status"] == "completed" and unary["object"] == "response"


# -- budgets: response.incomplete with max_output_tokens -----------------------------------------


async def test_low_max_output_tokens_is_incomplete_with_the_partial_text(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        stream = await sdk(orch).responses.create(
            model=MODEL, input="Hi there", max_output_tokens=3, stream=True
        )
        events = [e async for e in stream]
        unary = await sdk(orch).responses.create(model=MODEL, input="Hi there", max_output_tokens=3)
    check_stream([e.to_dict() for e in events])
    assert types(events) == [
        *OPENING,
        *["response.output_text.delta"] * 3,
        *CLOSING,
        "response.incomplete",
    ]
    final = events[-1].response  # type: ignore[union-attr]
    partial = "".join(SCRIPT[:3])
    for response in (final, unary):
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output_text == partial
        assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
        assert response.usage is not None and response.usage.output_tokens == 3
        assert response.max_output_tokens == 3
    assert engine.requests[0].body["max_new_tokens"] == 3


# -- guardrails: refusal events, then response.incomplete with content_filter ---------------------


async def test_block_sends_refusal_then_content_filter_and_never_the_flagged_text(
    engine, dets
) -> None:
    request = body(**output_detectors(blocker={"on_detection": "block"}))
    async with Orchestrator(config(engine.url, dets)) as orch:
        events = await raw_events(orch, request)
        status, unary = await orch.post(PATH, request)
    assert types(events) == [
        *OPENING,
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.content_part.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    # the flagged second sentence, and the flagged word, are in no event
    for event in events:
        wire = json.dumps(event)
        assert "about" not in wire and "What" not in wire
    clean = events[4]
    assert clean["delta"] == "I am great."
    refusal_added, delta, done, refusal_part_done = events[7:11]
    assert refusal_added["content_index"] == 1
    assert refusal_added["part"] == {"type": "refusal", "refusal": ""}
    assert delta["delta"] == done["refusal"] == refusal_part_done["part"]["refusal"]
    assert "`blocker`" in done["refusal"]
    final = events[-1]["response"]
    assert status == 200
    for response in (final, unary):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "content_filter"}
        assert response["error"] is None
        assert response["output"][0]["status"] == "incomplete"
        assert [c["type"] for c in response["output"][0]["content"]] == ["output_text", "refusal"]
        assert response["output"][0]["content"][0]["text"] == "I am great."
        # the detection is reported with its span; its text was withheld with the sentence
        assert response["guardrails"] == {
            "input": [],
            "output": [{**annotation(17, 22, "", "secret", "blocker", 0.9)}],
        }


async def test_input_hit_refuses_and_never_calls_the_engine(engine, dets) -> None:
    conversation = [
        {"role": "user", "content": "Earlier message with email."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Here is my email: a@b.c."},
    ]
    request = {"model": MODEL, "input": conversation, "detectors": {"input": {"email": {}}}}
    async with Orchestrator(config(engine.url, dets)) as orch:
        events = await raw_events(orch, request)
        unary = await sdk(orch).responses.create(
            model=MODEL, input=conversation, extra_body={"detectors": {"input": {"email": {}}}}
        )
    assert engine.requests == []
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[3]["part"]["type"] == "refusal" and events[3]["content_index"] == 0
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "content_filter"}
    assert [c["type"] for c in final["output"][0]["content"]] == ["refusal"]
    # every input item was judged on its own; spans are relative to the item
    expected = {
        "input": [
            {
                **annotation(21, 26, "email", "EmailAddress", "email", 0.95),
                "field": "input",
                "message_index": 0,
            },
            {
                **annotation(11, 16, "email", "EmailAddress", "email", 0.95),
                "field": "input",
                "message_index": 2,
            },
        ],
        "output": [],
    }
    assert final["guardrails"] == expected
    assert final["usage"]["output_tokens"] == 0
    assert unary.status == "incomplete" and unary.output_text == ""
    assert unary.incomplete_details is not None
    assert unary.incomplete_details.reason == "content_filter"
    assert (unary.model_extra or {})["guardrails"] == expected
    refusal = unary.output[0].content[0]  # type: ignore[union-attr]
    assert refusal.type == "refusal" and "`email`" in refusal.refusal


# -- errors: response.failed after response.created, `error` before it ---------------------------


async def test_detector_error_after_text_is_response_failed(engine, dets) -> None:
    # the engine holds after " about" (the first sentence is complete once the next word is)
    # until the client has seen the first sentence; the detector then fails on the second one
    engine.hold_after = 6
    async with Orchestrator(config(engine.url, dets)) as orch:
        stream = await sdk(orch).responses.create(
            model=MODEL, input="Hi there", stream=True, extra_body=output_detectors(dies_later={})
        )
        events = []
        async for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                engine.release.set()
    check_stream([e.to_dict() for e in events])
    assert types(events) == [
        *OPENING,
        "response.output_text.delta",
        *CLOSING,
        "response.failed",
    ]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "failed"
    assert final.output_text == "I am great."
    assert final.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert final.error is not None
    assert final.error.code == "server_error"
    assert final.error.type == "detector_error"  # type: ignore[attr-defined]
    assert final.error.message == "detector `dies_later`: HTTP 503"
    assert final.incomplete_details is None


async def test_engine_error_after_text_is_failed_in_stream_and_unary(dets) -> None:
    engine = FakeEngine(script=list(SCRIPT), fail=Fault("error", after_tokens=3, times=-1))
    await engine.start()
    try:
        async with Orchestrator(config(engine.url, dets)) as orch:
            events = await raw_events(orch, body())
            status, unary = await orch.post(PATH, body())
    finally:
        await engine.close()
    assert types(events) == [
        *OPENING,
        *["response.output_text.delta"] * 3,
        *CLOSING,
        "response.failed",
    ]
    partial = "".join(SCRIPT[:3])
    # unary: text came before the failure, so the reply is the failed object
    assert status == 200
    for response in (events[-1]["response"], unary):
        assert response["status"] == "failed"
        assert response["output"][0]["content"][0]["text"] == partial
        assert response["error"]["code"] == "server_error"
        assert response["error"]["type"] == "generation_unavailable"
        assert response["usage"]["output_tokens"] == 3


async def test_every_replica_unreachable_is_an_error_event_and_no_response(dets) -> None:
    nothing = f"http://127.0.0.1:{free_port()}"  # a port with nothing listening
    async with Orchestrator(config(nothing, dets)) as orch:
        events = await raw_events(orch, body())
        stream = await sdk(orch).responses.create(model=MODEL, input="Hi there", stream=True)
        sdk_events = [e async for e in stream]
        status, unary = await orch.post(PATH, body())
    assert events == [
        {
            "type": "error",
            "sequence_number": 0,
            "code": "generation_unavailable",
            "message": events[0]["message"],
            "param": None,
        }
    ]
    assert events[0]["message"]
    assert types(sdk_events) == ["error"]
    assert sdk_events[0].code == "generation_unavailable"  # type: ignore[union-attr]
    # unary: nothing was sent, so a real HTTP error with the OpenAI body
    assert status == 503
    assert unary["error"]["type"] == "generation_unavailable" and unary["error"]["code"] == 503


# -- bad input: OpenAI error bodies before any byte ----------------------------------------------


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"previous_response_id": "resp_123"}, 400, "previous_response_id"),
        ({"store": True}, 400, "store"),
        # function tools reach an `openai` chat backend (tests/test_openai_tool_calls.py) or a
        # native engine whose template takes them (tests/test_native_tool_calls.py); the fake
        # engine answers as one without tool support; a hosted tool runs where its results
        # cannot be guarded
        ({"tools": [{"type": "function", "name": "f"}]}, 422, None),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"background": True}, 400, "background"),
        ({"conversation": "conv_1"}, 400, "conversation"),
        ({"model": "nope"}, 404, None),
        ({"detectors": {"output": {"nope": {}}}}, 404, None),
        ({"input": 5}, 422, "input"),
        ({"input": []}, 422, "input"),
        ({"input": [{"role": "assistant", "content": "x"}]}, 422, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 422, None),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            422,
            "input.messages.0.function_call_output.call_id",
        ),
        ({"input": [{"type": "computer_call_output", "output": "x"}]}, 422, "input"),
        ({"temperature": "hot"}, 422, "temperature"),
        ({"max_output_tokens": 0}, 422, "max_output_tokens"),
        ({"max_output_tokens": 1_000_000}, 422, "max_output_tokens"),
        ({"text": {"format": {"type": "json_object"}}}, 422, "text.format.type"),
        ({"reasoning": {"effort": "high"}}, 422, "reasoning.effort"),
        ({"top_logprobs": 5}, 422, "top_logprobs"),
        ({"frequency_penalty": 1}, 422, "frequency_penalty"),
        # booleans are booleans: 0.0 or "false" is a 422, never a guess (the negative fuzz
        # found 0.0 accepted as false)
        ({"parallel_tool_calls": 0.0}, 422, "parallel_tool_calls"),
        ({"parallel_tool_calls": "false"}, 422, "parallel_tool_calls"),
        ({"stream_options": {"include_obfuscation": 1}}, 422, "stream_options.include_obfuscation"),
    ],
)
async def test_bad_requests_get_openai_error_bodies(engine, dets, extra, status, param) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        for stream in (False, True):
            got, reply = await orch.post(PATH, {**body(**extra), "stream": stream})
            assert got == status, reply
            assert set(reply) == {"error"}
            err = reply["error"]
            assert err["code"] == status
            assert err["type"] == ("not_found" if status == 404 else "invalid_request")
            assert err["message"]
            if param is not None:
                assert err["param"] == param
    assert engine.requests == []


@pytest.mark.parametrize(
    ("field", "raw", "status"),
    [
        ("temperature", "1e400", 422),
        ("max_output_tokens", "1e400", 422),
        ("temperature", "9" * 400, 422),
        ("temperature", "NaN", 400),
    ],
)
async def test_numbers_beyond_range_are_client_errors(engine, dets, field, raw, status) -> None:
    text = f'{{"model": "{MODEL}", "input": "Hi there", "{field}": {raw}}}'
    async with Orchestrator(config(engine.url, dets)) as orch:
        got, reply = await orch.post(PATH, text, headers={"Content-Type": "application/json"})
    assert got == status, reply
    assert reply["error"]["type"] == "invalid_request"
    assert engine.requests == []


async def test_harmless_openai_fields_are_accepted_and_echoed(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        response = await sdk(orch).responses.create(
            model=MODEL,
            input="Hi there",
            store=False,
            metadata={"ticket": "42"},
            user="u-1",
            parallel_tool_calls=False,
            truncation="disabled",
            text={"format": {"type": "text"}, "verbosity": "low"},
            tools=[],
            temperature=0,
            top_p=0.5,
        )
    assert response.status == "completed" and response.output_text == TEXT
    assert response.metadata == {"ticket": "42"} and response.user == "u-1"
    assert (response.temperature, response.top_p) == (0, 0.5)
    assert response.text is not None and response.text.verbosity == "low"
    sent = engine.requests[0].body
    assert sent["decoding"]["method"] == "greedy" and sent["decoding"]["top_p"] == 0.5


async def test_sdk_raises_typed_errors(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        client = sdk(orch)
        with pytest.raises(openai.BadRequestError) as stateful:
            await client.responses.create(
                model=MODEL, input="Hi there", previous_response_id="resp_1", stream=True
            )
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="Hi there")
    assert stateful.value.body == {
        "message": "previous_response_id: responses are not stored (this service is "
        "stateless); send the whole conversation in `input`",
        "type": "invalid_request",
        "param": "previous_response_id",
        "code": 400,
    }
    assert engine.requests == []


async def test_oversize_body_is_413_openai_body(engine, dets) -> None:
    cfg = config(engine.url, dets)
    cfg["server"]["max_request_bytes"] = 2048
    async with Orchestrator(cfg) as orch:
        status, reply = await orch.post(PATH, body(input="x" * 4096))
    assert status == 413
    assert reply["error"]["type"] == "invalid_request" and reply["error"]["code"] == 413


# -- enforced guardrails -------------------------------------------------------------------------


async def test_enforced_guardrails_run_and_cannot_be_weakened(engine, dets) -> None:
    enforced = {"guardrails": {"output": {"you": {"on_detection": "block"}}}}
    async with Orchestrator(config(engine.url, dets, **enforced)) as orch:
        response = await sdk(orch).responses.create(
            model=MODEL,
            input="Hi there",
            extra_body=output_detectors(you={"on_detection": "annotate", "threshold": 0.99}),
        )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "content_filter"
    assert response.output_text == "I am great."


# -- keep-alive ----------------------------------------------------------------------------------


async def test_keepalive_comments_while_text_is_held_back(engine, dets) -> None:
    """A detector holds the first sentence back until a keep-alive comment was seen: the
    comment starts the HTTP response before any response object exists."""
    gate = asyncio.Event()
    dets.add("held", DetectorBehaviour(gate=gate))
    cfg = config(engine.url, dets)
    cfg["detectors"]["held"] = remote(dets.url)
    cfg["server"]["sse_keepalive_s"] = 0.05  # the interval is injected; nothing waits on it
    request = body(stream=True, **output_detectors(held={}))
    async with Orchestrator(cfg) as orch:
        assert orch.session is not None
        async with orch.session.post(orch.url + PATH, json=request) as r:
            assert r.status == 200
            lines: list[bytes] = []
            async with within(30):
                while (line := await r.content.readline()) != b": keep-alive\n":
                    lines.append(line)
                gate.set()
                rest = (await r.content.read()).decode()
    assert lines == []  # nothing judged yet, not even response.created
    # `rest` starts after the first comment's line: its blank line, then maybe more comments
    blocks = [b for b in map(str.strip, rest.split("\n\n")) if b and not b.startswith(":")]
    events = [json.loads(b.split("\ndata: ", 1)[1]) for b in blocks]
    check_stream(events)
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == TEXT


# -- migration with real engines -----------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="session")
async def test_sigkill_of_the_serving_replica_mid_stream_is_one_seamless_response(
    e2e_orch: Orchestrator,
) -> None:
    orch = e2e_orch  # the session's deployment (conftest): counters compared before and after
    prompt = "The quick brown fox"
    await all_healthy(orch)
    client = sdk(orch)
    first = await client.responses.create(
        model=TINY, input=prompt, temperature=0, max_output_tokens=40
    )
    assert first.usage is not None and first.usage.output_tokens >= 12
    before = await migrations(orch, kind="mid_stream")

    # every replica stalls after 8 tokens, so the kill lands mid-stream whichever serves
    await stall_every_replica(orch)
    stream = await client.responses.create(
        model=TINY, input=prompt, temperature=0, max_output_tokens=40, stream=True
    )
    events = []
    killed = False
    async for event in stream:
        events.append(event)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        if not killed and len(deltas) >= 3:
            await kill_the_serving_replica(orch)
            killed = True
    assert killed
    assert await migrations(orch, kind="mid_stream") == before + 1
    check_stream([e.to_dict() for e in events])
    final = events[-1].response  # type: ignore[union-attr]
    # one terminal event, the same as the uninterrupted run's, with the same text (greedy
    # tiny-random never samples EOS: both runs end response.incomplete at max_output_tokens)
    assert events[-1].type == f"response.{first.status}"
    assert final.status == first.status
    assert final.incomplete_details == first.incomplete_details
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == first.output_text
    assert final.usage is not None and final.usage.output_tokens == first.usage.output_tokens


async def test_openapi_documents_the_responses_endpoint(engine, dets) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        assert orch.session is not None
        async with orch.session.get(orch.url + "/openapi.json") as r:
            doc = await r.json()
    operation = doc["paths"]["/v1/responses"]["post"]
    content = operation["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponseObject"}
    documented = {
        e["properties"]["data"]["contentSchema"]["$ref"].rsplit("/", 1)[1]
        for e in content["text/event-stream"]["schema"]["oneOf"]
    }
    assert "LifecycleEvent" in documented and "ErrorEvent" in documented
    schemas = doc["components"]["schemas"]
    assert schemas["ResponsesRequest"]["properties"]["model"]["enum"] == [MODEL]
    assert operation["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpenAIErrorBody"
    }
