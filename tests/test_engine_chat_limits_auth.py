"""The engine's chat input (`messages`), its advertised limits (`GET /v1/models`) and Bearer auth
(`--api-keys-env`), on a real tiny-random server (pytest-aiohttp) and the real CLI."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from generation import models
from generation.__main__ import main
from generation.server import create_app
from tests.engine_support import generate

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about cats."},
    {"role": "assistant", "content": "Cats purr."},
    {"role": "user", "content": "And dogs?"},
]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nTell me about cats.<|im_end|>\n"
    "<|im_start|>assistant\nCats purr.<|im_end|>\n"
    "<|im_start|>user\nAnd dogs?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture
async def client(aiohttp_client: Any, tiny_model: models.LoadedModel) -> Any:
    return await aiohttp_client(create_app(tiny_model))


@pytest.fixture
async def keyed(aiohttp_client: Any, tiny_model: models.LoadedModel) -> Any:
    return await aiohttp_client(create_app(tiny_model, api_keys=["key-one", "key-two"]))


def template_ids(model: models.LoadedModel, text: str) -> list[int]:
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


async def error_of(client: Any, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    resp = await client.post(path, json=body, **kwargs)
    return resp.status, await resp.json()


# ----- messages ---------------------------------------------------------------------------------


async def test_messages_use_the_chat_template(client: Any, tiny_model: models.LoadedModel) -> None:
    expected = template_ids(tiny_model, RENDERED)
    resp = await client.post("/v1/tokenize", json={"messages": CONVERSATION})
    assert resp.status == 200
    assert await resp.json() == {"token_ids": expected, "count": len(expected)}

    stream = await generate(client, "", {"messages": CONVERSATION, "max_new_tokens": 6})
    assert stream.completed and stream.finish_reason == "MAX_TOKENS"
    assert stream.prompt_token_ids == expected
    assert stream.items[0]["input_token_count"] == len(expected)
    # the same prompt as token ids generates the same tokens: the template was the only step
    by_ids = await generate(client, "", {"input_ids": expected, "max_new_tokens": 6})
    assert by_ids.token_ids == stream.token_ids and by_ids.text == stream.text


async def test_one_user_message_equals_a_chat_prompt(client: Any) -> None:
    by_chat = await generate(client, "", {"prompt": "Hi there", "chat": True, "max_new_tokens": 4})
    by_messages = await generate(
        client, "", {"messages": [{"role": "user", "content": "Hi there"}], "max_new_tokens": 4}
    )
    assert by_messages.prompt_token_ids == by_chat.prompt_token_ids
    assert by_messages.token_ids == by_chat.token_ids


async def test_messages_resume_like_any_prompt(client: Any) -> None:
    """A migrated chat request resumes as input_ids + resume, like every other prompt."""
    whole = await generate(client, "", {"messages": CONVERSATION, "max_new_tokens": 10})
    resumed = await generate(
        client,
        "",
        {
            "input_ids": whole.prompt_token_ids,
            "resume": {"token_ids": whole.token_ids[:4], "text": whole.delivered_text(4)},
            "max_new_tokens": 10,
        },
    )
    assert whole.delivered_text(4) + resumed.text == whole.text
    assert resumed.token_ids == whole.token_ids[4:]


_MSG = {"role": "user", "content": "x"}
BAD_MESSAGES: list[tuple[str, dict[str, Any], str]] = [
    ("tool role without its call", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0: tool_call_id: a `tool` message, and only one, names its call"),
    ("tool_call_id on a user message", {"messages": [{**_MSG, "tool_call_id": "c"}]}, "messages.0: tool_call_id: a `tool` message, and only one, names its call"),
    ("tool_calls on a user message", {"messages": [{**_MSG, "tool_calls": []}]}, "messages.0: tool_calls: only an assistant message carries tool calls"),
    ("developer role", {"messages": [{"role": "developer", "content": "x"}]}, "messages.0.role: Input should be 'system', 'user', 'assistant' or 'tool'"),
    ("no messages", {"messages": []}, "messages: List should have at least 1 item after validation, not 0"),
    ("too many messages", {"messages": [_MSG] * 1025}, "messages: List should have at most 1024 items after validation, not 1025"),
    ("content parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "messages.0.content: Input should be a valid string"),
    ("no content", {"messages": [{"role": "user"}]}, "messages.0: content is required (null only for an assistant turn of calls)"),
    ("null content without calls", {"messages": [{"role": "assistant", "content": None}]}, "messages.0: content is required (null only for an assistant turn of calls)"),
    ("tools with a prompt", {"prompt": "a", "tools": [{"type": "function"}]}, "body: tools go through the chat template: send messages (or input_ids)"),
    ("no tools", {"messages": [_MSG], "tools": []}, "tools: List should have at least 1 item after validation, not 0"),
    ("extra message field", {"messages": [{**_MSG, "weight": 1}]}, "messages.0.weight: Extra inputs are not permitted"),
    ("not a list", {"messages": "hi"}, "messages: Input should be a valid list"),
    ("prompt and messages", {"prompt": "a", "messages": [_MSG]}, "body: exactly one of prompt, input_ids and messages is required"),
    ("input_ids and messages", {"input_ids": [1], "messages": [_MSG]}, "body: exactly one of prompt, input_ids and messages is required"),
    ("no input", {}, "body: exactly one of prompt, input_ids and messages is required"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "details"), [c[1:] for c in BAD_MESSAGES], ids=[c[0] for c in BAD_MESSAGES]
)
async def test_bad_messages(client: Any, body: dict[str, Any], details: str) -> None:
    assert await error_of(client, "/v1/generate", body) == (
        422,
        {"code": 422, "details": details, "type": "invalid_request"},
    )


async def test_bad_tokenize_bodies(client: Any) -> None:
    for body in ({}, {"prompt": "a", "messages": [_MSG]}):
        assert await error_of(client, "/v1/tokenize", body) == (
            422,
            {
                "code": 422,
                "details": "body: exactly one of prompt and messages is required",
                "type": "invalid_request",
            },
        )


async def test_model_without_chat_template(
    aiohttp_client: Any, tiny_model: models.LoadedModel
) -> None:
    plain = dataclasses.replace(tiny_model, has_chat_template=False)
    client = await aiohttp_client(create_app(plain))
    for path in ("/v1/generate", "/v1/tokenize"):
        assert await error_of(client, path, {"messages": [_MSG]}) == (
            422,
            {
                "code": 422,
                "details": "messages: this model has no chat template",
                "type": "invalid_request",
            },
        )
    models_body = await (await client.get("/v1/models")).json()
    assert models_body["data"][0]["chat_template"] is False


# ----- advertised limits --------------------------------------------------------------------------


async def test_models_advertises_context_and_ranges(client: Any) -> None:
    resp = await client.get("/v1/models")
    assert resp.status == 200
    assert await resp.json() == {
        "object": "list",
        "data": [
            {
                "id": "tiny-random",
                "object": "model",
                "owned_by": "guardstream",
                "max_model_len": 512,
                "max_context": 512,
                "chat_template": True,
                "tools": False,
                "tool_call_format": None,
                "dtype": "float64",
                "batch_invariant": False,
                "parameters": {
                    "max_new_tokens": {"minimum": 1, "maximum": 1_000_000},
                    "min_new_tokens": {"minimum": 0, "maximum": 1_000_000},
                    "max_time": {"minimum": 0.0, "maximum": 86400.0},
                    "decoding_method": {"enum": ["greedy", "sampling"]},
                    "temperature": {"minimum": 0.0, "maximum": 100.0},
                    "top_k": {"minimum": 0},
                    "top_p": {"exclusiveMinimum": 0.0, "maximum": 1.0},
                    "seed": {"minimum": 0, "maximum": 2**63 - 1},
                    "repetition_penalty": {"exclusiveMinimum": 0.0, "maximum": 100.0},
                    "stop_sequences": {"maxItems": 16, "items": {"minLength": 1, "maxLength": 256}},
                    "messages": {
                        "minItems": 1,
                        "maxItems": 1024,
                        "roles": ["system", "user", "assistant", "tool"],
                    },
                    "tools": {"minItems": 1, "maxItems": 128},
                },
            }
        ],
    }


LIMIT_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("temperature 150", {"prompt": "a", "decoding": {"temperature": 150}}, "decoding.temperature: Input should be less than or equal to 100"),
    ("300-char stop", {"prompt": "a", "stop_sequences": ["s" * 300]}, "stop_sequences.0: String should have at most 256 characters"),
    ("17 stops", {"prompt": "a", "stop_sequences": ["s"] * 17}, "stop_sequences: List should have at most 16 items after validation, not 17"),
    ("max_time 1e6", {"prompt": "a", "max_time": 1e6}, "max_time: Input should be less than or equal to 86400"),
    ("prompt of 2001 tokens", {"prompt": "a " * 2000}, "the prompt has 2001 tokens (+0 resumed): it must be shorter than the model's context of 512 tokens"),
    ("prompt + budget over the context", {"input_ids": [5] * 500, "max_new_tokens": 20}, "max_new_tokens is 20 but the prompt has 500 tokens: together they exceed the model's context of 512 tokens (at most 12 new tokens fit)"),
    ("default budget over the context", {"input_ids": [5] * 400}, "max_new_tokens is 128 but the prompt has 400 tokens: together they exceed the model's context of 512 tokens (at most 112 new tokens fit)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "details"), [c[1:] for c in LIMIT_ERRORS], ids=[c[0] for c in LIMIT_ERRORS]
)
async def test_limits_are_422_before_any_byte(
    client: Any, body: dict[str, Any], details: str
) -> None:
    assert await error_of(client, "/v1/generate", body) == (
        422,
        {"code": 422, "details": details, "type": "invalid_request"},
    )


async def test_messages_over_the_context(client: Any, tiny_model: models.LoadedModel) -> None:
    long = [{"role": "user", "content": "a " * 600}]
    count = len(template_ids(tiny_model, f"<|im_start|>user\n{'a ' * 600}<|im_end|>\n"))
    count += len(template_ids(tiny_model, "<|im_start|>assistant\n"))
    tokenized = await (await client.post("/v1/tokenize", json={"messages": long})).json()
    assert tokenized["count"] == count > 512
    assert await error_of(client, "/v1/generate", {"messages": long}) == (
        422,
        {
            "code": 422,
            "details": f"the prompt has {count} tokens (+0 resumed): it must be shorter than "
            "the model's context of 512 tokens",
            "type": "invalid_request",
        },
    )


async def test_budget_that_exactly_fills_the_context(client: Any) -> None:
    stream = await generate(client, "", {"input_ids": [5] * 500, "max_new_tokens": 12})
    assert stream.completed and stream.finish_reason == "MAX_TOKENS"
    assert len(stream.token_ids) == 12


# ----- auth -------------------------------------------------------------------------------------

UNAUTHORIZED = {"code": 401, "details": "missing or invalid API key", "type": "unauthorized"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer key-one-and-more"},
        {"Authorization": "Basic key-one"},
        {"Authorization": "key-one"},
        {"Authorization": "Bearer "},
    ],
    ids=["none", "wrong key", "longer key", "basic scheme", "no scheme", "empty bearer"],
)
async def test_without_a_valid_key_every_route_is_401(keyed: Any, headers: dict[str, str]) -> None:
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/generate"),
        ("POST", "/v1/tokenize"),
        ("GET", "/no-such-route"),  # 401, not 404: no key, no map of the routes
        ("POST", "/admin/faults"),  # not enabled here: guarded like any unknown path
    ):
        resp = await keyed.request(method, path, json={"prompt": "a"}, headers=headers)
        assert resp.status == 401, (method, path)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert await resp.json() == UNAUTHORIZED


async def test_with_a_valid_key(keyed: Any) -> None:
    for key in ("key-one", "key-two"):
        auth = {"Authorization": f"Bearer {key}"}
        resp = await keyed.get("/v1/models", headers=auth)
        assert resp.status == 200
        resp = await keyed.post("/v1/tokenize", json={"prompt": "Hi"}, headers=auth)
        assert resp.status == 200
        resp = await keyed.post(
            "/v1/generate", json={"prompt": "Hi", "max_new_tokens": 3}, headers=auth
        )
        assert resp.status == 200
        lines = [json.loads(line) for line in (await resp.read()).splitlines()]
        assert lines[-1] == {"complete_final": True}
    # the scheme is case-insensitive (RFC 7235)
    resp = await keyed.get("/v1/models", headers={"Authorization": "bearer key-two"})
    assert resp.status == 200
    resp = await keyed.get("/no-such-route", headers={"Authorization": "Bearer key-one"})
    assert resp.status == 404


async def test_probes_and_scrapes_need_no_key(keyed: Any) -> None:
    assert (await keyed.get("/health")).status == 200
    assert (await keyed.get("/metrics")).status == 200


async def test_fault_route_of_a_test_engine_is_open(
    aiohttp_client: Any, tiny_model: models.LoadedModel
) -> None:
    client = await aiohttp_client(create_app(tiny_model, fault_injection=True, api_keys=["k"]))
    resp = await client.post("/admin/faults", json={"mode": "error", "after_tokens": 1})
    assert resp.status == 200 and await resp.json() == {"armed": 1}
    assert (await client.post("/v1/generate", json={"prompt": "a"})).status == 401


def test_create_app_refuses_an_empty_key_list(tiny_model: models.LoadedModel) -> None:
    with pytest.raises(ValueError, match="api_keys is empty"):
        create_app(tiny_model, api_keys=[])


@pytest.mark.parametrize(
    ("env", "message"),
    [({}, "is not set"), ({"GS_TEST_ENGINE_KEYS": ""}, "holds no key")],
    ids=["unset", "empty"],
)
def test_serve_refuses_to_start_without_keys(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    message: str,
) -> None:
    monkeypatch.delenv("GS_TEST_ENGINE_KEYS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # fails before loading any model: the spec does not even have to exist
    code = main(["serve", "--model", "/nonexistent", "--api-keys-env", "GS_TEST_ENGINE_KEYS"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: --api-keys-env: environment variable GS_TEST_ENGINE_KEYS {message}\n"
    )


@pytest.mark.parametrize(
    "flag, value", [("--prefill-chunk-tokens", "0"), ("--max-batch-size", "-1")]
)
def test_serve_refuses_sizes_below_one(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """Before loading any model: a zero chunk would never prefill anything."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "/nonexistent", flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {flag} must be at least 1, not {value}\n")
