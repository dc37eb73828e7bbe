"""OpenAI Chat Completions with guardrails (DESIGN 4.8), driven by the official `openai` SDK (sync
and async) and by a plain HTTP client on the FMS alias: the real orchestrator on 127.0.0.1, a fake
native engine and fake remote detectors on their own sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.openai_support import CHAT_ALIAS, fake_detectors, raw_chunks, sdk, sync_sdk
from tests.orchestrator_support import (
    MODEL,
    SCRIPT,
    Orchestrator,
    frames,
    generation_body,
    native_config,
    remote,
    terminal,
)
from tests.wait_support import within

TEXT = "I am great. What about you?"
ALIAS = CHAT_ALIAS
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = await fake_detectors()
    yield server
    await server.close()


def config(engine: FakeEngine, dets: FakeDetectorServer, **model: Any) -> dict[str, Any]:
    detectors = {n: remote(dets.url) for n in ("clean", "great", "you", "email", "dies_later")}
    detectors["great_block"] = remote(dets.url, on_detection="block")
    detectors["great_block"]["url"] = dets.url
    cfg = native_config(engine.url, detectors=detectors, model=model or None)
    return cfg


def tcr(start: int, end: int, word: str, entity: str, detector_id: str, score: float) -> dict:
    return {
        "start": start,
        "end": end,
        "word": word,
        "entity": entity,
        "entity_group": "test",
        "detector_id": detector_id,
        "score": score,
    }


# -- the SDK as the client ---------------------------------------------------------------------


async def test_async_sdk_streams_judged_text_with_detections(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        stream = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,
            stream=True,
            extra_body={"detectors": {"output": {"great": {}}}},
        )
        chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == TEXT
    # one content chunk per released frame: the two sentences
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert contents == ["I am great.", " What about you?"]
    first = next(c for c in chunks if c.choices[0].delta.content == "I am great.")
    extra = first.model_extra or {}
    assert extra["detections"] == {
        "output": [{"choice_index": 0, "results": [tcr(5, 10, "great", "positive", "great", 0.9)]}]
    }
    assert extra["warnings"] == [
        {"type": "UNSUITABLE_OUTPUT", "message": "Unsuitable output detected."}
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    # the engine got the conversation, under the chat template
    assert engine.requests[0].body["messages"] == USER


async def test_sync_sdk_unary_completion(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        client = sync_sdk(orch)
        completion = await asyncio.to_thread(
            client.chat.completions.create,
            model=MODEL,
            messages=USER,
            extra_body={"detectors": {"output": {"you": {}}}},
        )
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.message.content == TEXT and choice.message.refusal is None
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len("Hi there")
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == len("Hi there") + 8
    extra = completion.model_extra or {}
    assert extra["detections"]["output"][0]["results"] == [
        tcr(23, 26, "you", "pronoun", "you", 0.8)
    ]


async def test_sync_sdk_streaming(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        client = sync_sdk(orch)

        def run() -> list[Any]:
            return list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))

        chunks = await asyncio.to_thread(run)
    # no output detectors: every engine item is its own chunk
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == SCRIPT
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_block_ends_with_content_filter_and_no_flagged_text(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        stream = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,
            stream=True,
            extra_body={"detectors": {"output": {"you": {"on_detection": "block"}}}},
        )
        chunks = [c async for c in stream]
        unary = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,
            extra_body={"detectors": {"output": {"you": {"on_detection": "block"}}}},
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "I am great."  # the clean first sentence, never the flagged second
    last = chunks[-1]
    assert last.choices[0].finish_reason == "content_filter"
    assert last.choices[0].delta.refusal and "`you`" in last.choices[0].delta.refusal
    # spans and labels of what was withheld, never its words
    assert (last.model_extra or {})["detections"]["output"][0]["results"] == [
        tcr(23, 26, "", "pronoun", "you", 0.8)
    ]
    assert [c.choices[0].finish_reason for c in chunks].count("content_filter") == 1
    assert unary.choices[0].finish_reason == "content_filter"
    assert unary.choices[0].message.content is None
    assert unary.choices[0].message.refusal


async def test_input_hit_never_calls_the_engine(engine, dets) -> None:
    messages = [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Earlier message with email."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Here is my email: a@b.c."},
    ]
    async with Orchestrator(config(engine, dets)) as orch:
        stream = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            extra_body={"detectors": {"input": {"email": {}}}},
        )
        chunks = [c async for c in stream]
    assert engine.requests == []
    assert len(chunks) == 1
    only = chunks[0]
    assert only.choices[0].delta.role == "assistant"
    assert only.choices[0].delta.refusal
    assert only.choices[0].finish_reason == "content_filter"
    extra = only.model_extra or {}
    # every message is judged on its own; spans are relative to the message
    assert extra["detections"] == {
        "input": [
            {"message_index": 1, "results": [tcr(21, 26, "email", "EmailAddress", "email", 0.95)]},
            {"message_index": 3, "results": [tcr(11, 16, "email", "EmailAddress", "email", 0.95)]},
        ]
    }
    assert extra["warnings"][0]["type"] == "UNSUITABLE_INPUT"


async def test_detector_failure_mid_stream_makes_the_sdk_raise(engine, dets) -> None:
    engine.hold_after = 6  # " What about" completes the first sentence; the rest waits
    async with Orchestrator(config(engine, dets)) as orch:
        stream = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,
            stream=True,
            extra_body={"detectors": {"output": {"dies_later": {}}}},
        )
        seen: list[str] = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                seen.append(chunk.choices[0].delta.content or "")
                if "".join(seen):
                    engine.release.set()
    assert "".join(seen) == "I am great."
    assert "dies_later" in info.value.message
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "detector_error"


async def test_include_usage_and_done_exactly_once(engine, dets) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "stream": True,
        "stream_options": {"include_usage": True},
        "detectors": {"output": {"clean": {}}},
    }
    async with Orchestrator(config(engine, dets)) as orch:
        chunks = await raw_chunks(orch, body)
        via_v1 = await raw_chunks(orch, body, "/v1/chat/completions")
    assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": len("Hi there"),
        "completion_tokens": 8,
        "total_tokens": len("Hi there") + 8,
    }
    role, *content, finish = chunks[:-2]
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [c["choices"][0]["delta"]["content"] for c in content] == [
        "I am great.",
        " What about you?",
    ]
    # judged frames say so even when nothing was found
    assert all(c["detections"] == {"output": [{"choice_index": 0, "results": []}]} for c in content)
    assert all("warnings" not in c for c in content)
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert len(via_v1) == len(chunks)


async def test_alias_error_after_start_is_an_error_object_then_done(engine, dets) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "stream": True,
        "detectors": {"output": {"dies_later": {}}},
    }
    engine.hold_after = 6
    async with Orchestrator(config(engine, dets)) as orch:
        chunks = await raw_chunks(orch, body, on_content=engine.release)
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    error = chunks[-2]["error"]
    assert error["type"] == "detector_error" and error["code"] == 502
    assert "dies_later" in error["message"]
    assert not any(
        c != "[DONE]" and "choices" in c and c["choices"][0].get("finish_reason") for c in chunks
    )


async def test_length_finish_reason(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        done = await sdk(orch).chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].message.content == "".join(SCRIPT[:3])


# -- enforced guardrails -------------------------------------------------------------------------


async def test_enforced_guardrails_run_for_every_endpoint_and_cannot_be_weakened(
    engine, dets
) -> None:
    enforced = {"guardrails": {"output": {"great": {}}, "input": {"clean": {}}}}
    async with Orchestrator(config(engine, dets, **enforced)) as orch:
        # a client that names nothing
        plain = await sdk(orch).chat.completions.create(model=MODEL, messages=USER)
        # a client that names the enforced detector with a threshold above its score
        weakened = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,
            extra_body={"detectors": {"output": {"great": {"threshold": 0.99}}}},
        )
        fms = await orch.stream(generation_body())
        status, unary = await orch.post(
            "/api/v1/task/classification-with-text-generation",
            generation_body(output={"great": {"threshold": 0.99}}),
        )
    expected = [tcr(5, 10, "great", "positive", "great", 0.9)]
    for completion in (plain, weakened):
        assert (completion.model_extra or {})["detections"]["output"][0]["results"] == expected
    assert [d for f in frames(fms) for d in f["token_classification_results"]["output"]] == (
        expected
    )
    assert terminal(fms).name == "completed"
    assert status == 200 and unary["token_classification_results"]["output"] == expected
    # the enforced input detector judged every request's input
    assert [c[0] for c in dets.calls].count("clean") == 4


async def test_enforced_block_cannot_be_downgraded_to_annotate(engine, dets) -> None:
    enforced = {"guardrails": {"output": {"you": {"on_detection": "block"}}}}
    async with Orchestrator(config(engine, dets, **enforced)) as orch:
        done = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,
            extra_body={"detectors": {"output": {"you": {"on_detection": "annotate"}}}},
        )
    assert done.choices[0].finish_reason == "content_filter"
    assert done.choices[0].message.content is None


# -- bad input: OpenAI error bodies before any byte ----------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": USER}, 404, None),
        ({"model": MODEL, "messages": USER, "n": 2}, 422, "n"),
        ({"model": MODEL, "messages": []}, 422, "messages"),
        ({"model": MODEL, "messages": USER, "detectors": {"output": {"nope": {}}}}, 404, None),
        ({"model": MODEL, "messages": "hello"}, 422, "messages"),
        ({"model": MODEL, "messages": USER, "temperature": "hot"}, 422, "temperature"),
        ({"model": MODEL, "messages": USER, "max_tokens": 0}, 422, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_tokens": 1_000_000}, 422, "max_tokens"),
        ({"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 422, None),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            422,
            None,
        ),
        ({"model": MODEL, "messages": [{"role": "system", "content": "x"}]}, 422, "messages"),
        ({"model": MODEL, "messages": USER, "detector": {"output": {"x": {}}}}, 422, "detector"),
    ],
)
async def test_bad_requests_get_openai_error_bodies(engine, dets, body, status, param) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        for stream in (False, True):
            got, reply = await orch.post(ALIAS, {**body, "stream": stream})
            assert got == status, reply
            assert set(reply) == {"error"}
            err = reply["error"]
            assert err["code"] == status
            assert err["type"] == ("not_found" if status == 404 else "invalid_request")
            assert err["message"]
            if param is not None:
                assert err["param"] == param
    assert engine.requests == []


async def test_a_non_text_part_gets_a_one_line_422(engine, dets) -> None:
    """Not pydantic's dump of both union branches (`messages.0.content.str: ...;
    messages.0.content.list[TextPart].0.type: ...`): one line naming the part."""
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    content = [{"type": "text", "text": "What is this?"}, image]
    async with Orchestrator(config(engine, dets)) as orch:
        got, reply = await orch.post(
            ALIAS, {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        )
    assert (got, reply) == (
        422,
        {
            "error": {
                "message": "messages.0.content: part 1 has type `image_url`: only text parts "
                "are accepted (images and audio cannot be judged by text detectors)",
                "type": "invalid_request",
                "param": "messages.0.content",
                "code": 422,
            }
        },
    )


async def test_sdk_raises_typed_errors(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        client = sdk(orch)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="nope", messages=USER)
        with pytest.raises(openai.UnprocessableEntityError):
            await client.chat.completions.create(model=MODEL, messages=USER, n=2)
    assert missing.value.body == {
        "message": "model `nope` not found (available: fake-model)",
        "type": "not_found",
        "param": None,
        "code": 404,
    }


async def test_oversize_body_is_413_openai_body(engine, dets) -> None:
    cfg = config(engine, dets)
    cfg["server"]["max_request_bytes"] = 2048
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
    async with Orchestrator(cfg) as orch:
        status, reply = await orch.post("/v1/chat/completions", big)
    assert status == 413
    assert reply["error"]["type"] == "invalid_request" and reply["error"]["code"] == 413


async def test_models_list(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        page = await sdk(orch).models.list()
    assert [m.id for m in page.data] == [MODEL]
    assert page.data[0].object == "model" and page.data[0].owned_by == "guardstream"


# -- keep-alive ----------------------------------------------------------------------------------


@pytest.mark.parametrize("surface", ["fms", "chat"])
async def test_keepalive_comments_while_text_is_held_back(engine, dets, surface) -> None:
    """A detector holds the first sentence back until a keep-alive comment was seen."""
    gate = asyncio.Event()
    dets.add("held", DetectorBehaviour(gate=gate))
    cfg = config(engine, dets)
    cfg["detectors"]["held"] = remote(dets.url)
    cfg["server"]["sse_keepalive_s"] = 0.05  # the interval is injected; nothing waits on it
    if surface == "fms":
        path = "/api/v1/task/server-streaming-classification-with-text-generation"
        body: dict[str, Any] = generation_body(output={"held": {}})
    else:
        path = "/v1/chat/completions"
        body = {
            "model": MODEL,
            "messages": USER,
            "stream": True,
            "detectors": {"output": {"held": {}}},
        }
    async with Orchestrator(cfg) as orch:
        assert orch.session is not None
        async with orch.session.post(orch.url + path, json=body) as r:
            assert r.status == 200
            lines: list[bytes] = []
            async with within(30):
                while (line := await r.content.readline()) != b": keep-alive\n":
                    lines.append(line)
                gate.set()
                rest = await r.content.read()
    assert not any(line.startswith(b"data:") for line in lines)  # nothing judged yet
    assert TEXT.split(".")[0].encode() in rest


# -- the FMS alias with a plain HTTP client -------------------------------------------------------


async def test_alias_block_and_input_hit_with_a_plain_client(engine, dets) -> None:
    block = {
        "model": MODEL,
        "messages": USER,
        "stream": True,
        "detectors": {"output": {"you": {"on_detection": "block"}}},
    }
    hit = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "my email"}],
        "stream": True,
        "detectors": {"input": {"email": {}}},
    }
    async with Orchestrator(config(engine, dets)) as orch:
        blocked = await raw_chunks(orch, block)
        refused = await raw_chunks(orch, hit)
        status, unary = await orch.post(ALIAS, {**hit, "stream": False})
    assert blocked[-1] == "[DONE]" and blocked.count("[DONE]") == 1
    *chunks, last = blocked[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "I am great."
    assert last["choices"][0]["finish_reason"] == "content_filter"
    assert last["choices"][0]["delta"]["refusal"].startswith("The response was withheld")
    assert "you?" not in json.dumps(blocked)
    assert len(engine.requests) == 1  # the input hit never reached the engine
    assert refused[-1] == "[DONE]" and len(refused) == 2
    only = refused[0]
    assert only["choices"][0]["delta"]["role"] == "assistant"
    assert only["choices"][0]["finish_reason"] == "content_filter"
    assert only["detections"]["input"] == [
        {"message_index": 0, "results": [tcr(3, 8, "email", "EmailAddress", "email", 0.95)]}
    ]
    assert status == 200
    assert unary["choices"][0]["message"]["content"] is None
    assert unary["choices"][0]["finish_reason"] == "content_filter"
    assert unary["detections"]["input"] == only["detections"]["input"]


# -- options a native engine cannot honour: 422, never a silent drop (issue 20 item 10) ---------

_TAIL = (
    " (model `fake-model`; only an `openai` backend with `api: chat` receives fields guardstream "
    "does not interpret)"
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "response_format",
            {"type": "json_object"},
            "response_format: structured output cannot be honoured by this model's backend" + _TAIL,
        ),
        (
            "logprobs",
            True,
            "logprobs: log probabilities are not returned: their tokens would carry text the "
            "output guardrails withhold or redact",
        ),
        (
            "logit_bias",
            {"50256": -100},
            "logit_bias: logit biases cannot be applied by this model's backend" + _TAIL,
        ),
        (
            "modalities",
            ["text", "audio"],
            "modalities: only text output is supported: only text can be guarded",
        ),
        ("store", True, "store: completions are not stored (this service is stateless)" + _TAIL),
        ("frobnicate", 1, "frobnicate: this model's backend cannot honour it" + _TAIL),
    ],
)
async def test_options_a_native_backend_cannot_honour_are_422(
    engine, dets, field: str, value: Any, message: str
) -> None:
    """The repro: each of these got 200 and was silently dropped on a native engine. Now a 422
    with the exact OpenAI error body, before any byte and without calling the model, streamed or
    not, on both paths; the SDK raises UnprocessableEntityError with that body."""
    async with Orchestrator(config(engine, dets)) as orch:
        for path in ("/v1/chat/completions", ALIAS):
            for stream in (False, True):
                body = {"model": MODEL, "messages": USER, "stream": stream, field: value}
                got, reply = await orch.post(path, body)
                assert (got, reply) == (
                    422,
                    {
                        "error": {
                            "message": message,
                            "type": "invalid_request",
                            "param": field,
                            "code": 422,
                        }
                    },
                )
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await sdk(orch).chat.completions.create(
                model=MODEL, messages=USER, extra_body={field: value}
            )
        assert info.value.body == {
            "message": message,
            "type": "invalid_request",
            "param": field,
            "code": 422,
        }
    assert engine.requests == []


async def test_options_that_ask_for_nothing_pass_on_a_native_backend(engine, dets) -> None:
    """What SDKs and proxies send as defaults asks for nothing: accepted, and labels (`user`,
    `metadata`) are accepted whatever their value."""
    inert = {
        "response_format": {"type": "text"},
        "logprobs": False,
        "top_logprobs": 0,
        "logit_bias": {},
        "modalities": ["text"],
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "store": False,
        "user": "u-1",
        "metadata": {"k": "v"},
    }
    async with Orchestrator(config(engine, dets)) as orch:
        done = await sdk(orch).chat.completions.create(model=MODEL, messages=USER, extra_body=inert)
    assert done.choices[0].message.content == TEXT


def test_a_misspelt_detectors_field_is_refused_whatever_the_backend() -> None:
    """Issue 41: `detector` for `detectors` (as `extra_body` makes easy) was forwarded to an
    `openai` chat backend, and no detector the client asked for ran. It is refused in the
    request model itself, before any backend is chosen, naming the field it meant."""
    from pydantic import ValidationError

    from orchestrator.api.openai_chat import ChatCompletionRequest

    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": USER, "detector": {"output": {"pii": {}}}}
        )
    assert "detector: unknown field (did you mean `detectors`?)" in str(caught.value)
    # OpenAI's own fields still pass through
    ChatCompletionRequest.model_validate({"model": MODEL, "messages": USER, "user": "u-1"})


@pytest.mark.parametrize(
    ("surface", "step"),
    [
        ("chat", "openai_chat.chat_ask"),
        ("responses", "openai_responses.responses_ask"),
        ("chat", "body.validate"),
        ("responses", "body.validate"),
    ],
)
async def test_a_large_request_is_worked_on_off_the_event_loop(
    engine: FakeEngine,
    dets: FakeDetectorServer,
    monkeypatch: pytest.MonkeyPatch,
    surface: str,
    step: str,
) -> None:
    """Python work proportional to the body runs in the bulk executor past the bulk size, a
    small request's inline (a thread hop costs more than the work): validating it (the request
    models' own validators are work per item: a misspelt-field hint per unknown key was 0.9 s
    for a 1 MiB body of them on the loop) and turning it into its ask (every message, every
    tool call's arguments decoded and walked)."""
    import importlib
    import threading

    module_name, name = step.split(".")
    module = importlib.import_module(f"orchestrator.handlers.{module_name}")
    real = getattr(module, name)
    threads: list[threading.Thread] = []

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(module, name, recording)
    path = "/v1/chat/completions" if surface == "chat" else "/v1/responses"
    key = "messages" if surface == "chat" else "input"
    async with Orchestrator(config(engine, dets)) as orch:
        for text in ("Hi there " * 1000, "Hi there"):
            status, reply = await orch.post(
                path, {"model": MODEL, key: [{"role": "user", "content": text}]}
            )
            assert status == 200, reply
    assert threads[0] is not threading.main_thread()  # 9,000 characters: off the loop
    assert threads[1] is threading.main_thread()
