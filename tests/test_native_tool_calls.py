"""Tool calls with the native engine behind the orchestrator (issue 38 items 1 and 7): the
official `openai` SDK's tool loop, streamed and unary, Chat Completions and Responses, against
guardstream in front of a real engine whose chat template takes tools (tiny-random with a
Hermes template, tests/tool_model_support.py). The model's answers are scripted with the
engine's `script` fault: a tiny random model writes no call by chance. A model whose template has
no tool support is a 422 before any byte that says so (tiny-random; smollm2-135m, whose shipped
template has none); a replica killed after a call resumes on another one exactly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
import pytest_asyncio
import requests

from generation import models
from generation.server import create_app
from orchestrator.clients.backend import (
    Continuation,
    GenerationError,
    GenerationParams,
    GenerationRequest,
    ToolCallDelta,
)
from orchestrator.clients.native import native_body, parse_data
from tests.engine_processes import ThreadedServer
from tests.openai_support import finishes, reassembled, sdk
from tests.orchestrator_support import MODEL, Orchestrator, native_config
from tests.tool_model_support import scripted_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an e-mail.",
            "parameters": {"type": "object", "properties": {"to": {"type": "string"}}},
        },
    }
]
RESPONSE_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ASK = [{"role": "user", "content": "Mail Jo."}]
ARGUMENTS = {"to": "jo@example.com", "subject": "Hi"}
CALL_TEXT = (
    '<tool_call>\n{"name": "send_email", "arguments": ' + json.dumps(ARGUMENTS) + "}\n</tool_call>"
)
FINAL = "Sent it."
DETECTORS = {
    "pii_redact": {"builtin": "regex", "chunker_id": "sentence", "on_detection": "redact"},
    "pii_block": {"builtin": "regex", "chunker_id": "sentence", "on_detection": "block"},
}


def engine(loaded: models.LoadedModel) -> ThreadedServer:
    return ThreadedServer(lambda: create_app(loaded, fault_injection=True))


@pytest.fixture(scope="module")
def tool_engine(tool_model: models.LoadedModel) -> Iterator[ThreadedServer]:
    with engine(tool_model) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def orch(tool_engine: ThreadedServer) -> AsyncIterator[Orchestrator]:
    async with Orchestrator(native_config(tool_engine.url, detectors=DETECTORS)) as o:
        yield o


def script(server: ThreadedServer, ids: list[int], after_tokens: int = 0) -> None:
    """The next stream on `server` answers `ids` (then is cut after `after_tokens`)."""
    body = {"mode": "script", "token_ids": ids, "after_tokens": after_tokens}
    requests.post(server.url + "/admin/faults", json=body, timeout=30).raise_for_status()


def text_of(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def answered(call_id: str, arguments: str) -> list[dict[str, Any]]:
    """The conversation after the call, as the SDK's user sends it back with the tool's result."""
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "send_email", "arguments": arguments},
            }
        ],
    }
    return [*ASK, turn, {"role": "tool", "tool_call_id": call_id, "content": "sent"}]


async def test_the_sdk_tool_loop_streamed(
    orch: Orchestrator, tool_engine: ThreadedServer, tool_model: models.LoadedModel
) -> None:
    client = sdk(orch)
    script(tool_engine, scripted_ids(tool_model, "Sure. " + CALL_TEXT))
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, stream=True
    )
    chunks = [c async for c in stream]
    [call] = reassembled(chunks)
    assert (call["name"], json.loads(call["arguments"])) == ("send_email", ARGUMENTS)
    assert call["id"].startswith("call_")
    assert text_of(chunks) == "Sure. "
    assert finishes(chunks) == ["tool_calls"]
    script(tool_engine, scripted_ids(tool_model, FINAL))
    stream = await client.chat.completions.create(
        model=MODEL, messages=answered(call["id"], call["arguments"]), tools=TOOLS, stream=True
    )
    chunks = [c async for c in stream]
    assert (text_of(chunks), reassembled(chunks), finishes(chunks)) == (FINAL, [], ["stop"])


async def test_the_sdk_tool_loop_unary(
    orch: Orchestrator, tool_engine: ThreadedServer, tool_model: models.LoadedModel
) -> None:
    client = sdk(orch)
    script(tool_engine, scripted_ids(tool_model, CALL_TEXT))
    done = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    [call] = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("send_email", ARGUMENTS)
    script(tool_engine, scripted_ids(tool_model, FINAL))
    done = await client.chat.completions.create(
        model=MODEL, messages=answered(call.id, call.function.arguments), tools=TOOLS
    )
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (FINAL, "stop")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unary"])
async def test_the_sdk_responses_tool_loop(
    orch: Orchestrator, tool_engine: ThreadedServer, tool_model: models.LoadedModel, stream: bool
) -> None:
    client = sdk(orch)
    script(tool_engine, scripted_ids(tool_model, CALL_TEXT))
    if stream:
        events = [
            e
            async for e in await client.responses.create(
                model=MODEL, input="Mail Jo.", tools=RESPONSE_TOOLS, stream=True
            )
        ]
        assert events[-1].type == "response.completed"
        first = events[-1].response
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert json.loads(done.arguments) == ARGUMENTS
    else:
        first = await client.responses.create(model=MODEL, input="Mail Jo.", tools=RESPONSE_TOOLS)
    [call] = [o for o in first.output if o.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("send_email", ARGUMENTS)
    script(tool_engine, scripted_ids(tool_model, FINAL))
    final = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Mail Jo."},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sent"},
        ],
        tools=RESPONSE_TOOLS,
    )
    assert final.output_text == FINAL


async def test_an_email_in_an_argument_is_redacted_or_the_call_withheld(
    orch: Orchestrator, tool_engine: ThreadedServer, tool_model: models.LoadedModel
) -> None:
    client = sdk(orch)
    script(tool_engine, scripted_ids(tool_model, CALL_TEXT))
    done = await client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        extra_body={"detectors": {"output": {"pii_redact": {}}}},
    )
    [call] = done.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {**ARGUMENTS, "to": "[email]"}
    script(tool_engine, scripted_ids(tool_model, CALL_TEXT))
    done = await client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        extra_body={"detectors": {"output": {"pii_block": {}}}},
    )
    assert done.choices[0].finish_reason == "content_filter"
    assert not done.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "the native engine cannot force a tool call"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "send_email"}}},
            "tool_choice",
            "the native engine cannot force a tool call",
        ),
        (
            {"parallel_tool_calls": False},
            "parallel_tool_calls",
            "the native engine cannot keep the model to one call",
        ),
    ],
)
async def test_what_the_engine_cannot_honour_is_a_422(
    orch: Orchestrator, extra: dict[str, Any], param: str, message: str
) -> None:
    status, reply = await orch.post(
        "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS, **extra}
    )
    assert (status, reply["error"]["param"]) == (422, param)
    assert message in reply["error"]["message"]


async def test_tool_choice_none_leaves_the_answer_as_text(
    orch: Orchestrator, tool_engine: ThreadedServer, tool_model: models.LoadedModel
) -> None:
    script(tool_engine, scripted_ids(tool_model, CALL_TEXT))
    done = await sdk(orch).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (CALL_TEXT, "stop")


def without_tools(model: str) -> str:
    return f"{{}}: model `{MODEL}`: model {model}'s chat template has no tool support"


@pytest.mark.parametrize("spec", ["tiny-random", "smollm2-135m"])
async def test_a_template_without_tool_support_is_a_422_before_any_byte(
    request: pytest.FixtureRequest, spec: str
) -> None:
    """tiny-random's template and smollm2-135m's shipped one render role and content only:
    `tools` and a conversation with calls are refused, naming the model, by the orchestrator
    (from the engine's `GET /v1/models`), before the model runs."""
    loaded: models.LoadedModel = request.getfixturevalue(
        "tiny_model" if spec == "tiny-random" else "smollm2_model"
    )
    with engine(loaded) as server:
        async with Orchestrator(native_config(server.url)) as o:
            client = sdk(o)
            with pytest.raises(openai.UnprocessableEntityError) as caught:
                await client.chat.completions.create(
                    model=MODEL, messages=ASK, tools=TOOLS, stream=True
                )
            assert caught.value.body["message"] == without_tools(loaded.name).format("tools")
            with pytest.raises(openai.UnprocessableEntityError) as caught:
                await client.chat.completions.create(
                    model=MODEL, messages=answered("call_1", json.dumps(ARGUMENTS))
                )
            assert caught.value.body["message"] == without_tools(loaded.name).format("messages")
            health = await asyncio.to_thread(requests.get, server.url + "/health", timeout=30)
    assert health.json()["tokens_generated"] == 0


async def test_a_replica_killed_after_a_call_resumes_exactly(
    tool_model: models.LoadedModel,
) -> None:
    """The serving replica is cut right after the item that carried the call (and the text
    before it): the orchestrator drops the held call, the next replica replays the tokens and
    sends the call again whole; the client sees what an uninterrupted run gives, once."""
    forced = scripted_ids(tool_model, "Sure. " + CALL_TEXT, eos=False)
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": len(forced) + 3, "temperature": 0}
    with engine(tool_model) as first, engine(tool_model) as second:
        cfg = native_config(first.url)
        cfg["models"][MODEL]["backends"].append({"type": "native", "url": second.url})
        cfg["models"][MODEL]["migration"]["limit"] = 1
        async with Orchestrator(cfg) as o:
            # replicas take turns: the reference (the same answer, uninterrupted) on the
            # first, the stream cut after its first item on the second, resumed on the first
            script(first, forced)
            reference = [
                c
                async for c in await sdk(o).chat.completions.create(
                    model=MODEL, stream=True, **body
                )
            ]
            script(second, forced, after_tokens=1)
            chunks = [
                c
                async for c in await sdk(o).chat.completions.create(
                    model=MODEL, stream=True, **body
                )
            ]
    assert (chunks[-1].model_extra or {})["migrations"] == 1
    assert (reference[-1].model_extra or {}).get("migrations", 0) == 0
    assert reassembled(chunks) == reassembled(reference)
    assert [c["name"] for c in reassembled(chunks)] == ["send_email"]
    assert text_of(chunks) == text_of(reference)
    assert text_of(chunks).startswith("Sure. ")
    assert finishes(chunks) == finishes(reference)


# -- the wire -------------------------------------------------------------------------------------


def test_the_native_client_reads_tool_calls_beside_the_text() -> None:
    call = {"index": 0, "id": "call_1", "name": "send_email", "arguments": '{"to": "x"}'}
    item = parse_data("r", {"token_ids": [1, 2], "text": "Sure. ", "tool_calls": [call]})
    assert (item.text, item.tool_calls) == (
        "Sure. ",
        (ToolCallDelta(0, "call_1", "send_email", '{"to": "x"}'),),
    )
    assert parse_data("r", {"token_ids": [1], "text": "a"}).tool_calls == ()


@pytest.mark.parametrize(
    "raw",
    [
        {"index": 0},
        [{"index": -1, "id": "c", "name": "f", "arguments": "{}"}],
        [{"index": True, "id": "c", "name": "f", "arguments": "{}"}],
        [{"index": 0, "id": None, "name": "f", "arguments": "{}"}],
        [{"index": 0, "id": "c", "name": "f", "arguments": {}}],
        ["call"],
    ],
)
def test_a_malformed_tool_call_fails_the_replica(raw: Any) -> None:
    with pytest.raises(GenerationError) as caught:
        parse_data("r", {"token_ids": [1], "text": "", "tool_calls": raw})
    assert caught.value.migratable
    assert caught.value.message == "replica r sent a malformed tool_calls"


def test_the_engine_gets_the_tools_unless_tool_choice_is_none() -> None:
    params = GenerationParams()
    tools_only = GenerationRequest("", params, extra={"tools": TOOLS})
    assert native_body(tools_only, None, 0)["tools"] == TOOLS
    resumed = native_body(tools_only, Continuation((1,), (2,), "a"), 0)
    assert (resumed["tools"], resumed["resume"]) == (TOOLS, {"token_ids": [2], "text": "a"})
    declined = GenerationRequest("", params, extra={"tools": TOOLS, "tool_choice": "none"})
    assert "tools" not in native_body(declined, None, 0)


async def test_arguments_sent_back_nested_past_json_are_the_clients_422_not_a_failed_replica(
    orch: Orchestrator, tool_engine: ThreadedServer, tool_model: models.LoadedModel
) -> None:
    """An earlier call's arguments nested past what Python's json takes: the engine renders
    them as the string they are (too long for tiny-random here: the client's 422). Its
    RecursionError was an engine 500, which the orchestrator takes for a failed replica: one
    request quarantined every replica of the model in turn."""
    assert orch.session is not None
    body = {"model": MODEL, "messages": answered("c", "[" * 5000), "tools": TOOLS}
    async with orch.session.post(orch.url + "/v1/chat/completions", json=body) as r:
        status, reply = r.status, await r.json()
    assert status == 422
    assert reply["error"]["type"] == "invalid_request"
    assert reply["error"]["message"].startswith("messages: model `fake-model`: the prompt has ")
    assert "must be shorter than the model's context of 512 tokens" in reply["error"]["message"]
    # the replica was not taken for a failed one: the next request is served at once
    script(tool_engine, scripted_ids(tool_model, FINAL))
    done = await sdk(orch).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (FINAL, "stop")
