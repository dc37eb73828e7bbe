"""Tool calls of the native engine (DESIGN 7; issue 38 item 1): a chat template that takes tools
renders them (and a conversation's calls and results); the model's `<tool_call>` JSON leaves the
text and goes out as `data.tool_calls`, whole; a template without tool support is a 422 and
`GET /v1/models` says which. The model's answer is scripted (the `script` fault): a tiny random
model writes no call by chance. Real engine servers on 127.0.0.1."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generation import models
from generation.server import create_app
from generation.tool_calls import (
    HERMES,
    ToolCallParser,
    template_messages,
    tool_call_format,
    visible_prefix,
)
from tests.engine_processes import ThreadedServer
from tests.engine_support import check_every_split, generate, run
from tests.tool_model_support import HERMES_TEMPLATE, scripted_ids

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "Let me check. " + CALL_TEXT
DEEP = '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "</tool_call>"
SURROGATE = '<tool_call>{"name": "f", "arguments": {"city": "Par\\ud800is"}}</tool_call>'


# -- the parser -----------------------------------------------------------------------------------


def parse_all(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[Any]]:
    text, calls = [], []
    for piece in pieces:
        t, c = parser.feed(piece)
        text.append(t)
        calls.extend(c)
    text.append(parser.finish())
    return "".join(text), calls


def test_text_before_a_call_flows_and_the_call_leaves_whole() -> None:
    parser = ToolCallParser([1, 2, 3])
    assert parser.feed("Let me check. <tool") == ("Let me check. ", [])
    assert parser.feed('_call>\n{"name": "get_weather", ') == ("", [])
    text, [call] = parser.feed('"arguments": {"city": "Par\u00eds"}}\n</tool_call> ok')
    assert text == " ok"
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Par\u00eds"}')
    assert call.id.startswith("call_") and len(call.id) == 5 + 24
    assert parser.finish() == ""


def test_ids_name_the_prompt_and_the_call() -> None:
    def ids(prompt: list[int], text: str) -> list[str]:
        return [c.id for c in parse_all(ToolCallParser(prompt), [text])[1]]

    two = CALL_TEXT + CALL_TEXT
    assert ids([1], two) == ids([1], two)  # every replica names a call alike
    assert len(set(ids([1], two))) == 2  # two calls of one answer differ
    assert ids([1], CALL_TEXT) != ids([2], CALL_TEXT)  # so does the same call on a later turn


@pytest.mark.parametrize(
    ("text", "visible"),
    [
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>"),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
        ('a <tool_call>{"name": "f"', 'a <tool_call>{"name": "f"'),  # never closed
        ("a <tool_ca", "a <tool_ca"),
        ("1 < 2 <tool> </tool_call>", "1 < 2 <tool> </tool_call>"),
        # nested past what Python's json parses (RecursionError): text, not a failed stream
        (DEEP, DEEP),
        # strings that are no Unicode text (a lone surrogate's escape): no wire can carry them
        (SURROGATE, SURROGATE),
        (SURROGATE.replace('"f"', '"\\udfff"'), SURROGATE.replace('"f"', '"\\udfff"')),
    ],
    ids=[
        "not-json",
        "no-name",
        "never-closed",
        "a-tag-begun",
        "other-tags",
        "too-deep",
        "lone-surrogate-argument",
        "lone-surrogate-name",
    ],
)
def test_what_is_not_a_call_is_the_text_the_model_wrote(text: str, visible: str) -> None:
    assert parse_all(ToolCallParser([]), [text]) == (visible, [])


def test_arguments_given_as_a_string_or_as_parameters() -> None:
    body = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_all(ToolCallParser([]), [body])[1][0].arguments == '{"a": 1}'
    body = '<tool_call>{"name": "f", "parameters": {"a": [1, 2]}}</tool_call>'
    assert parse_all(ToolCallParser([]), [body])[1][0].arguments == '{"a": [1, 2]}'


ANSWERS = st.lists(
    st.sampled_from(
        ["Hi ", "<", "<tool_call>", "</tool_call>", CALL_TEXT, '{"name": "f"}', "x", " 1 < 2", "\n"]
    ),
    max_size=8,
).map("".join)


@settings(max_examples=150, derandomize=True)
@given(text=ANSWERS, cuts=st.lists(st.integers(0, 200), max_size=8), skip=st.integers(0, 12))
def test_what_is_released_depends_on_the_text_not_its_deltas(
    text: str, cuts: list[int], skip: int
) -> None:
    """Split anywhere, the same text and calls; what is out at any point is what a resumed
    parser computes from the text so far (`visible_prefix`); `skip` drops exactly that many."""
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    whole = parse_all(ToolCallParser([7]), [text])
    assert parse_all(ToolCallParser([7]), pieces) == whole
    parser, out = ToolCallParser([7]), ""
    for i, piece in enumerate(pieces):
        out += parser.feed(piece)[0]
        assert out == visible_prefix("".join(pieces[: i + 1]))
    skipped = parse_all(ToolCallParser([7], skip=skip), pieces)
    assert skipped == (whole[0][skip:], whole[1])


def test_the_template_says_whether_it_takes_tools() -> None:
    assert tool_call_format(HERMES_TEMPLATE) == HERMES
    assert tool_call_format({"default": "{{ messages }}", "tool_use": HERMES_TEMPLATE}) == HERMES
    assert tool_call_format(models.load("tiny-random").tokenizer.chat_template) is None
    assert tool_call_format(None) is None
    # takes tools, but calls in a format the engine cannot parse (Llama 3.1's bare JSON)
    assert tool_call_format("{% if tools %}{{ tools | tojson }}{% endif %}") is None


def test_arguments_sent_back_reach_the_template_as_objects() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    [turn] = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert turn["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    odd = {**call, "function": {"name": "f", "arguments": "[1]"}}
    assert template_messages([{"role": "assistant", "tool_calls": [odd]}])[0]["tool_calls"] == [odd]


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture
async def tools_client(aiohttp_client: Any, tool_model: models.LoadedModel) -> Any:
    return await aiohttp_client(create_app(tool_model, fault_injection=True))


@pytest.fixture
async def plain_client(aiohttp_client: Any, tiny_model: models.LoadedModel) -> Any:
    return await aiohttp_client(create_app(tiny_model))


async def script(client: Any, ids: list[int], after_tokens: int = 0) -> None:
    body = {"mode": "script", "token_ids": ids, "after_tokens": after_tokens}
    resp = await client.post("/admin/faults", json=body)
    assert resp.status == 200, await resp.text()


async def test_models_say_whether_the_template_takes_tools(
    tools_client: Any, plain_client: Any
) -> None:
    [entry] = (await (await tools_client.get("/v1/models")).json())["data"]
    assert (entry["tools"], entry["tool_call_format"]) == (True, "hermes")
    assert entry["parameters"]["messages"]["roles"] == ["system", "user", "assistant", "tool"]
    assert entry["parameters"]["tools"] == {"minItems": 1, "maxItems": 128}
    [entry] = (await (await plain_client.get("/v1/models")).json())["data"]
    assert (entry["tools"], entry["tool_call_format"]) == (False, None)


TOOL_TURNS = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": ASK, "tools": TOOLS},
        {"messages": TOOL_TURNS},
        {"messages": TOOL_TURNS, "tools": TOOLS},
    ],
    ids=["tools", "a conversation with calls", "both"],
)
async def test_tools_and_calls_go_through_the_template(
    tools_client: Any, tool_model: models.LoadedModel, body: dict[str, Any]
) -> None:
    resp = await tools_client.post("/v1/tokenize", json=body)
    assert resp.status == 200, await resp.text()
    got = tool_model.tokenizer.decode((await resp.json())["token_ids"])
    expected = tool_model.tokenizer.apply_chat_template(
        template_messages([{**m, "content": m["content"] or ""} for m in body["messages"]]),
        tools=body.get("tools"),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert got == expected
    if "tools" in body:
        assert json.dumps(TOOLS[0]["function"]["description"]) in got
    if len(body["messages"]) > 1:
        assert '"arguments": {"city": "Paris"}' in got  # an object, not a JSON string
        assert "<tool_response>\nsunny\n</tool_response>" in got


async def test_arguments_sent_back_nested_too_deep_for_json_reach_the_template_as_a_string(
    tools_client: Any, tool_model: models.LoadedModel
) -> None:
    """A client's earlier call whose arguments nest past what Python's json takes: rendered as
    the string it is. It was an uncaught RecursionError, a 500 that the orchestrator takes for
    a failed replica: one request could quarantine every replica of the model in turn."""
    deep = "[" * 5000
    turns = [{**m} for m in TOOL_TURNS]
    turns[1] = {**turns[1], "tool_calls": [{**turns[1]["tool_calls"][0]}]}
    turns[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": deep}
    resp = await tools_client.post("/v1/tokenize", json={"messages": turns})
    assert resp.status == 200, await resp.text()
    reply = await resp.json()
    assert json.dumps(deep) in tool_model.tokenizer.decode(reply["token_ids"])  # as tojson has it
    # rendered, it is too long for the tiny model: the client's 422, never a replica's 500
    resp = await tools_client.post("/v1/generate", json={"messages": turns, "max_new_tokens": 1})
    assert (resp.status, await resp.json()) == (
        422,
        {
            "code": 422,
            "details": f"the prompt has {reply['count']} tokens (+0 resumed): it must be "
            f"shorter than the model's context of {tool_model.max_context} tokens",
            "type": "invalid_request",
        },
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": ASK, "tools": TOOLS}, "tools"),
        ({"messages": TOOL_TURNS}, "messages"),
    ],
)
async def test_a_template_without_tools_is_a_422_that_says_so(
    plain_client: Any, body: dict[str, Any], field: str
) -> None:
    for path in ("/v1/generate", "/v1/tokenize"):
        resp = await plain_client.post(path, json=body)
        assert resp.status == 422
        assert await resp.json() == {
            "code": 422,
            "details": f"{field}: model tiny-random's chat template has no tool support",
            "type": "invalid_request",
        }


async def test_tools_need_the_template(tools_client: Any) -> None:
    resp = await tools_client.post("/v1/generate", json={"prompt": "hi", "tools": TOOLS})
    assert resp.status == 422
    assert "tools go through the chat template" in (await resp.json())["details"]


async def test_a_scripted_call_leaves_the_text_as_a_tool_call(
    tools_client: Any, tool_model: models.LoadedModel
) -> None:
    ids = scripted_ids(tool_model, ANSWER)
    await script(tools_client, ids)
    stream = await generate(tools_client, "", {"messages": ASK, "tools": TOOLS})
    assert stream.completed and stream.finish_reason == "EOS_TOKEN"
    assert stream.token_ids == ids
    assert stream.text == "Let me check. "
    [call] = stream.tool_calls
    assert (call["index"], call["name"], call["arguments"]) == (
        0,
        "get_weather",
        '{"city": "Paris"}',
    )
    assert call["id"].startswith("call_")


async def test_a_call_whose_arguments_are_no_unicode_text_is_the_text_the_model_wrote(
    tools_client: Any, tool_model: models.LoadedModel
) -> None:
    """A model that writes a lone surrogate's escape in a call: the stream completes with that
    text (it failed with an in-band 500: the call's arguments could not be encoded)."""
    answer = "Let me check. " + SURROGATE
    await script(tools_client, scripted_ids(tool_model, answer))
    stream = await generate(tools_client, "", {"messages": ASK, "tools": TOOLS})
    assert stream.completed and stream.finish_reason == "EOS_TOKEN"
    assert (stream.text, stream.tool_calls) == (answer, [])


async def test_without_tools_the_same_answer_is_text(
    tools_client: Any, tool_model: models.LoadedModel
) -> None:
    await script(tools_client, scripted_ids(tool_model, ANSWER))
    stream = await generate(tools_client, "", {"messages": ASK})
    assert (stream.text, stream.tool_calls) == (ANSWER, [])


@settings(max_examples=4, deadline=None, derandomize=True)
@given(before=st.sampled_from(["", "Sure. "]), after=st.integers(1, 6))
def test_a_resume_anywhere_sends_the_calls_again_and_the_rest_exactly(
    tool_model: models.LoadedModel, before: str, after: int
) -> None:
    """The answer (text, a call) is forced, the model then generates `after` more tokens; a
    resume at every later token gives the same text after the client's and every call again."""
    forced = scripted_ids(tool_model, before + CALL_TEXT, eos=False)
    body = {"messages": ASK, "tools": TOOLS, "max_new_tokens": len(forced) + after}
    with ThreadedServer(lambda: create_app(tool_model)) as server:
        full = run(check_every_split(server.url, body, forced=forced))
    assert [c["name"] for c in full.tool_calls] == ["get_weather"]
    assert full.text.startswith(before)
