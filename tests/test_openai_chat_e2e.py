"""Chat Completions end to end with real parts (DESIGN 4.8, 7): the official `openai` SDK against
the orchestrator on 127.0.0.1, in front of real engine processes (`tiny-random`, `smollm2-135m`)
and of an OpenAI-compatible upstream (`type: openai, api: chat`: the fake chat server speaking
vLLM's streaming protocol). The engine applies the chat template; a SIGKILLed replica mid-stream
and a dropped upstream connection are invisible to the SDK; the engines' limits are 422s with
each surface's error body on every surface, before any byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from generation import models
from orchestrator.app import CHAT_PATH, STREAMING_PATH, UNARY_PATH
from tests.e2e_support import (
    MODEL,
    all_healthy,
    engine_answer,
    engine_call,
    kill_the_serving_replica,
    migrations,
    stall_every_replica,
)
from tests.engine_support import skip_without_smollm2
from tests.fakes.openai_server import FakeOpenAI, OpenAIFault
from tests.openai_support import sdk
from tests.orchestrator_support import Orchestrator, generation_body

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The quick brown fox"},
]
UPSTREAM = "upstream-chat"
SMOLLM2 = "smollm2"


@pytest.fixture
def orch(e2e_orch: Orchestrator) -> Orchestrator:
    """The session's end-to-end deployment (conftest)."""
    return e2e_orch


async def sdk_stream(orch: Orchestrator, on_chunk: Any = None, **kwargs: Any) -> list[Any]:
    """Every chunk of a streamed completion; `on_chunk(chunks so far)` after each one."""
    stream = await sdk(orch).chat.completions.create(stream=True, **kwargs)
    chunks: list[Any] = []
    async for chunk in stream:
        chunks.append(chunk)
        if on_chunk is not None:
            await on_chunk(chunks)
    return chunks


def finishes(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def pieces(chunks: list[Any]) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


async def token_count(orch: Orchestrator, model: str, body: dict[str, Any]) -> int:
    return json.loads(await engine_call(orch, model, "/v1/tokenize", body))["count"]


FINISH = {"EOS_TOKEN": "stop", "STOP_SEQUENCE": "stop", "MAX_TOKENS": "length"}


# -- a. tiny-random: the chat template, and a SIGKILL mid-stream --------------------------------


async def test_chat_template_is_applied_and_real_detectors_judge(orch: Orchestrator) -> None:
    await all_healthy(orch)
    chunks = await sdk_stream(
        orch,
        model=MODEL,
        messages=CONVERSATION,
        temperature=0,
        max_tokens=20,
        stream_options={"include_usage": True},
        extra_body={"detectors": {"output": {"pii": {}, "hap": {}}}},
    )
    templated = await token_count(orch, MODEL, {"messages": CONVERSATION})
    plain = await token_count(orch, MODEL, {"prompt": CONVERSATION[-1]["content"]})
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == templated
    assert templated > plain  # role markers and the system message went in
    engine = await engine_answer(orch, MODEL, {"messages": CONVERSATION, "max_new_tokens": 20})
    expected, finish = engine["text"], engine["finish_reason"]
    assert expected and "".join(pieces(chunks)) == expected
    assert finishes(chunks) == [FINISH[finish]]
    assert usage.completion_tokens == engine["generated_token_count"]
    # every content chunk was judged by the real detectors (the extension says so, found or not)
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            output = (chunk.model_extra or {})["detections"]["output"]
            assert [o["choice_index"] for o in output] == [0]
    # the unary completion is the same greedy answer
    unary = await sdk(orch).chat.completions.create(
        model=MODEL,
        messages=CONVERSATION,
        temperature=0,
        max_tokens=20,  # type: ignore[arg-type]
    )
    assert unary.choices[0].message.content == expected
    assert unary.choices[0].finish_reason == FINISH[finish]
    assert unary.usage is not None and unary.usage.prompt_tokens == templated


async def test_sigkill_of_the_serving_replica_mid_stream_is_seamless_for_the_sdk(
    orch: Orchestrator,
) -> None:
    await all_healthy(orch)
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": CONVERSATION,
        "temperature": 0,
        "max_tokens": 40,
        "stream_options": {"include_usage": True},
    }
    expected = await sdk_stream(orch, **request)
    assert expected[-1].usage.completion_tokens >= 12  # long enough to cut in the middle
    before = await migrations(orch, MODEL)

    # every replica stalls after 8 tokens, so the kill lands mid-stream whichever serves
    await stall_every_replica(orch)
    killed: list[int] = []

    async def kill_after_three_pieces(chunks: list[Any]) -> None:
        if killed or len(pieces(chunks)) < 3:
            return
        killed.append(await kill_the_serving_replica(orch))

    got = await sdk_stream(orch, kill_after_three_pieces, **request)
    assert killed
    assert "".join(pieces(got)) == "".join(pieces(expected))
    assert finishes(got) == finishes(expected) and len(finishes(got)) == 1
    # the finish chunk is the last choice chunk; only the usage chunk follows it
    assert got[-2].choices[0].finish_reason and got[-1].choices == []
    # guardstream's extension on the finish chunk says the stream moved (absent without a move)
    assert (got[-2].model_extra or {}).get("migrations") == 1
    assert "migrations" not in (expected[-2].model_extra or {})
    assert got[-1].usage == expected[-1].usage
    assert len({c.id for c in got}) == 1
    assert await migrations(orch, MODEL) == before + 1


# -- d. the engines' limits, on every surface, before any byte ----------------------------------


def fms_error(status: int, body: Any) -> str:
    assert status == 422, body
    assert set(body) == {"code", "details", "type"}
    assert body["code"] == 422 and body["type"] == "invalid_request"
    return body["details"]


def chat_error(status: int, body: Any, param: str | None = None) -> str:
    assert status == 422, body
    assert set(body) == {"error"}
    error = body["error"]
    assert error == {
        "message": error["message"],
        "type": "invalid_request",
        "param": param,
        "code": 422,
    }
    return error["message"]


LONG = "The quick brown fox jumps over the lazy dog. " * 80  # ~800 tokens; the context is 512


async def test_temperature_beyond_the_engines_range_is_422_on_fms(orch: Orchestrator) -> None:
    await all_healthy(orch)
    params = {"decoding_method": "SAMPLING", "temperature": 150, "max_new_tokens": 8}
    body = generation_body("Hello", params=params, model_id=MODEL)
    for path in (STREAMING_PATH, UNARY_PATH):
        details = fms_error(*await orch.post(path, body))
        assert details == (
            f"text_gen_parameters.temperature: model `{MODEL}`: "
            "text_gen_parameters.temperature is 150; it must be between 0 and 100"
        )


async def test_a_prompt_longer_than_the_context_is_422_on_every_surface(
    orch: Orchestrator,
) -> None:
    await all_healthy(orch)
    count = await token_count(orch, MODEL, {"prompt": LONG})
    assert count > 512
    body = generation_body(LONG, params={"max_new_tokens": 8}, model_id=MODEL)
    expected = (
        f"inputs: model `{MODEL}`: the prompt has {count} tokens: it must be shorter than the "
        "model's context of 512 tokens"
    )
    for path in (STREAMING_PATH, UNARY_PATH):
        assert fms_error(*await orch.post(path, body)) == expected
    messages = [{"role": "user", "content": LONG}]
    templated = await token_count(orch, MODEL, {"messages": messages})
    for stream in (True, False):
        chat = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream}
        assert chat_error(*await orch.post(CHAT_PATH, chat), "messages") == (
            f"messages: model `{MODEL}`: the prompt has {templated} tokens: it must be shorter "
            "than the model's context of 512 tokens"
        )
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,  # type: ignore[arg-type]
        )
    assert info.value.status_code == 422
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "invalid_request"
    # the Responses surface: the same check, before any event
    for stream in (True, False):
        responses = {"model": MODEL, "input": LONG, "max_output_tokens": 8, "stream": stream}
        status, reply = await orch.post("/v1/responses", responses)
        assert status == 422, reply
        assert reply["error"]["type"] == "invalid_request"
        assert reply["error"]["param"] == "input", reply
        assert (
            "it must be shorter than the model's context of 512 tokens" in reply["error"]["message"]
        )


async def test_an_unset_budget_shrinks_to_what_the_context_leaves(orch: Orchestrator) -> None:
    """As vLLM does for an unset max_tokens: a prompt too long for the model's default budget
    (256) gets the rest of the context, on every surface; a budget the client set is still its
    own, and too much of it is a 422. Greedy tiny-random never emits EOS, so every answer fills
    the context exactly."""
    await all_healthy(orch)
    prompt = "The quick brown fox jumps over the lazy dog. " * 35
    messages = [{"role": "user", "content": prompt}]
    templated = await token_count(orch, MODEL, {"messages": messages})
    assert templated < 512 < templated + 256
    status, reply = await orch.post(UNARY_PATH, generation_body(prompt, model_id=MODEL))
    assert status == 200, reply
    assert reply["finish_reason"] == "MAX_TOKENS"
    assert reply["input_token_count"] + reply["generated_token_count"] == 512
    completion = await sdk(orch).chat.completions.create(
        model=MODEL, messages=messages, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        templated,
        512 - templated,
    )
    chunks = [
        c
        async for c in await sdk(orch).chat.completions.create(
            model=MODEL, messages=messages, temperature=0, stream=True
        )
    ]
    assert "".join(pieces(chunks)) == completion.choices[0].message.content
    explicit = {"model": MODEL, "messages": messages, "max_tokens": 256, "temperature": 0}
    assert chat_error(*await orch.post(CHAT_PATH, explicit), "max_tokens") == (
        f"max_tokens: model `{MODEL}`: the prompt has {templated} tokens and max_tokens is 256: "
        f"{templated + 256} tokens exceed the model's context of 512 tokens "
        f"(at most {512 - templated} new tokens fit)"
    )


async def test_a_stop_sequence_longer_than_the_engines_limit_is_422(orch: Orchestrator) -> None:
    """The engine's bound (256 characters) is every surface's own, for every backend (an
    `openai` backend's stop sequences are enforced by the orchestrator itself:
    tests/test_request_bounds.py), so the request is refused before the engine is asked."""
    await all_healthy(orch)
    stop = "x" * 300
    why = ".0: String should have at most 256 characters"
    body = generation_body("Hello", params={"stop_sequences": [stop], "max_new_tokens": 8})
    body["model_id"] = MODEL
    for path in (STREAMING_PATH, UNARY_PATH):
        assert fms_error(*await orch.post(path, body)) == f"text_gen_parameters.stop_sequences{why}"
    for stream in (True, False):
        chat = {"model": MODEL, "messages": CONVERSATION, "stop": stop, "stream": stream}
        assert chat_error(*await orch.post(CHAT_PATH, chat), "stop.0") == f"stop{why}"


# -- c. an OpenAI-compatible upstream behind `type: openai, api: chat` ----------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def upstreams() -> AsyncIterator[list[FakeOpenAI]]:
    made = [FakeOpenAI(model="fake-chat"), FakeOpenAI(model="fake-chat")]
    for s in made:
        await s.start()
    yield made
    for s in made:
        await s.close()


def upstream_config(servers: list[FakeOpenAI], quarantine_s: float = 600) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "models": {
            UPSTREAM: {
                "backends": [
                    {"type": "openai", "url": s.url, "model": "fake-chat", "api": "chat"}
                    for s in servers
                ],
                # 600: a failed replica stays out for the rest of the test
                "migration": {"limit": 3, "stall_timeout_s": 10, "quarantine_s": quarantine_s},
            }
        },
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {"pii": {"builtin": "regex", "chunker_id": "sentence"}},
    }


UPSTREAM_QUESTION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where did the cat sit?"},
]


async def test_an_upstream_connection_drop_migrates_by_continuing_the_message(
    upstreams: list[FakeOpenAI],
) -> None:
    first, second = upstreams
    first.faults.append(OpenAIFault("close", after=3))
    async with Orchestrator(upstream_config(upstreams)) as orch:
        await all_healthy(orch, UPSTREAM)  # both healthy: round-robin starts at the first
        chunks = await sdk_stream(
            orch,
            model=UPSTREAM,
            messages=UPSTREAM_QUESTION,
            temperature=0,
            max_tokens=20,
            stream_options={"include_usage": True},
        )
        assert await migrations(orch, UPSTREAM) == 1
    assert pieces(chunks) == first.script  # one seamless answer, piece by piece
    assert "".join(pieces(chunks)) == first.answer() == "The cat sat on the mat."
    assert finishes(chunks) == ["stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert len(first.requests) == 1 and len(second.requests) == 1
    resumed = second.requests[0]
    assert resumed["messages"] == [
        *UPSTREAM_QUESTION,
        {"role": "assistant", "content": "The cat sat"},
    ]
    assert resumed["continue_final_message"] is True
    assert resumed["add_generation_prompt"] is False
    assert resumed["max_tokens"] == 17  # the budget left after three tokens
    assert resumed["temperature"] == 0.0
    assert second.resume_mismatches == []
    assert first.requests[0]["messages"] == UPSTREAM_QUESTION
    assert "continue_final_message" not in first.requests[0]


async def test_in_band_errors_on_every_upstream_after_text_make_the_sdk_raise(
    upstreams: list[FakeOpenAI],
) -> None:
    """Text reached the client before every replica failed: an in-stream error object."""
    for s in upstreams:
        s.faults.append(OpenAIFault("error", after=2, times=-1))
    async with Orchestrator(upstream_config(upstreams)) as orch:
        await all_healthy(orch, UPSTREAM)
        seen: list[Any] = []

        async def keep(chunks: list[Any]) -> None:
            seen[:] = chunks

        with pytest.raises(openai.APIError) as info:
            await sdk_stream(orch, keep, model=UPSTREAM, messages=UPSTREAM_QUESTION)
    error = info.value
    assert not isinstance(error, openai.APIStatusError)  # the stream itself started with a 200
    assert error.body == {
        "message": error.message,
        "type": "generation_unavailable",
        "param": None,
        "code": 503,
    }
    # the original error (the first replica's), surfaced once no replica is left
    assert (
        error.message
        == "replica openai-0 reported an error (not migrated: no other healthy replica)"
    )
    # the first replica's two pieces and the second's two after it, then the error
    assert "".join(pieces(seen)) == "The cat sat on"
    assert finishes(seen) == []
    assert [len(s.requests) for s in upstreams] == [1, 1]


async def test_in_band_errors_on_every_upstream_before_text_are_an_http_error(
    upstreams: list[FakeOpenAI],
) -> None:
    """Every replica failed before any text: nothing was sent, so a real HTTP 503. Failed
    replicas are not quarantined here: each request makes 1 + `limit` attempts."""
    for s in upstreams:
        s.faults.append(OpenAIFault("error", after=0, times=-1))
    async with Orchestrator(upstream_config(upstreams, quarantine_s=0)) as orch:
        await all_healthy(orch, UPSTREAM)
        for attempt, stream in enumerate((True, False), start=1):
            with pytest.raises(openai.InternalServerError) as info:
                await sdk(orch).chat.completions.create(
                    model=UPSTREAM,
                    messages=UPSTREAM_QUESTION,  # type: ignore[arg-type]
                    stream=stream,
                )
            assert info.value.status_code == 503
            assert info.value.body == {
                "message": "replica openai-0 reported an error (not migrated: migration limit 3 "
                "reached)",
                "type": "generation_unavailable",
                "param": None,
                "code": 503,
            }
            # alternating: openai-0, openai-1, openai-0, openai-1
            assert [len(s.requests) for s in upstreams] == [2 * attempt, 2 * attempt]


# -- b. the real default model, once -------------------------------------------------------------


async def test_smollm2_answers_through_its_chat_template() -> None:
    skip_without_smollm2()
    await asyncio.to_thread(models.prepare, "smollm2-135m")  # the cache `make run` fills
    config = {
        "server": {"host": "127.0.0.1", "port": 0},
        "models": {
            SMOLLM2: {
                "backends": [
                    {
                        "type": "managed",
                        "model": "smollm2-135m",
                        "device": "cpu",
                        "replicas": 1,
                        "start_timeout_s": 240,
                    }
                ],
            }
        },
        "chunkers": {},
        "detectors": {},
    }
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async with Orchestrator(config) as orch:
        await all_healthy(orch, SMOLLM2)
        completion = await sdk(orch).chat.completions.create(
            model=SMOLLM2,
            messages=messages,
            temperature=0,
            max_tokens=8,  # type: ignore[arg-type]
        )
        templated = await token_count(orch, SMOLLM2, {"messages": messages})
        plain = await token_count(orch, SMOLLM2, {"prompt": messages[0]["content"]})
    answer = completion.choices[0].message.content
    assert answer and "Paris" in answer, answer
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == templated > plain + 10  # + its default system prompt
    assert 1 <= completion.usage.completion_tokens <= 8
