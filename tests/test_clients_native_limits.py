"""The orchestrator's native client side of the engine's chat input, advertised limits and keys:
`messages` on the wire, Bearer keys (`api_key_env`, generated keys for managed engines), an
engine's 4xx as `invalid_request` (never a 502, never migrated), and
`ReplicatedModelBackend.validate` against real tiny-random engines (pytest-aiohttp servers, and
one managed engine process)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from generation import models
from generation.server import create_app
from orchestrator.api.errors import ApiError, ErrorType
from orchestrator.clients.advertised_limits import (
    AdvertisedLimits,
    EngineLimits,
    ParamRange,
    merge_limits,
)
from orchestrator.clients.backend import (
    ChatMessage,
    Continuation,
    GenerationError,
    GenerationParams,
    GenerationRequest,
)
from orchestrator.clients.backends import ReplicatedModelBackend, build_model_backends
from orchestrator.clients.managed import ENGINE_API_KEYS_ENV
from orchestrator.clients.native import NativeClient, native_body
from orchestrator.config import ConfigError, ModelConfig
from tests.engine_processes import free_port
from tests.fakes.engine import FakeEngine, Fault
from tests.fakes.openai_server import FakeOpenAI

KEY_ENV = "GS_TEST_NATIVE_KEY"
KEY = "native-secret"
CHAT = (
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Tell me about cats."),
)
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me about cats.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@dataclasses.dataclass
class Served:
    url: str
    calls: Counter[tuple[str, str]]  # (method, path) -> requests seen, keyed or not


@pytest.fixture
def serve(aiohttp_server: Any, tiny_model: models.LoadedModel) -> Any:
    """Start a real tiny-random engine app on 127.0.0.1; counts the requests it receives."""

    async def start(loaded: models.LoadedModel = tiny_model, **kwargs: Any) -> Served:
        app = create_app(loaded, **kwargs)
        calls: Counter[tuple[str, str]] = Counter()

        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            calls[(request.method, request.path)] += 1
            return await handler(request)

        app.middlewares.insert(0, count)
        server = await aiohttp_server(app)
        return Served(str(server.make_url("")).rstrip("/"), calls)

    return start


def backend(
    session: aiohttp.ClientSession, *backends: dict[str, Any], limit: int = 3
) -> ReplicatedModelBackend:
    config = ModelConfig.model_validate(
        {"backends": list(backends), "migration": {"limit": limit, "stall_timeout_s": 30}}
    )
    b = build_model_backends({"tiny": config}, session, registry=CollectorRegistry())["tiny"]
    assert isinstance(b, ReplicatedModelBackend)
    return b


def native(url: str, key_env: str | None = KEY_ENV) -> dict[str, Any]:
    return {"type": "native", "url": url, "api_key_env": key_env}


def req(
    prompt: str = "Hello",
    messages: tuple[ChatMessage, ...] | None = None,
    extra: dict[str, Any] | None = None,
    **params: Any,
) -> GenerationRequest:
    return GenerationRequest(
        prompt, GenerationParams(**params), messages=messages, extra=extra or {}
    )


async def invalid(b: ReplicatedModelBackend, request: GenerationRequest) -> str:
    """The details of the 422 that validate raises."""
    with pytest.raises(ApiError) as info:
        await b.validate(request)
    assert (info.value.code, info.value.error_type) == (422, ErrorType.INVALID_REQUEST)
    return info.value.details


async def drain(b: ReplicatedModelBackend, request: GenerationRequest) -> str:
    stream = b.stream(request)
    async with stream:
        return "".join([chunk.text async for chunk in stream])


@pytest.fixture(autouse=True)
def engine_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


# ----- the wire ---------------------------------------------------------------------------------


def test_native_body_sends_messages_and_resumes_by_ids() -> None:
    request = req(messages=CHAT, max_new_tokens=5)
    assert native_body(request, None, 0) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about cats."},
        ],
        "max_new_tokens": 5,
        "min_new_tokens": 0,
        "decoding": {
            "method": "greedy",
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
        },
        "stop_sequences": [],
    }
    resumed = native_body(request, Continuation((1, 2, 3), (7,), "x"), 0)
    assert "messages" not in resumed and "prompt" not in resumed
    assert resumed["input_ids"] == [1, 2, 3]
    assert resumed["resume"] == {"token_ids": [7], "text": "x"}


async def test_client_sends_messages_and_its_key(session: aiohttp.ClientSession) -> None:
    fake = FakeEngine(script=["Hi", "!"])
    await fake.start()
    try:
        client = NativeClient("r0", fake.url, session, api_key=KEY)
        stream = client.generate(req(messages=CHAT), None, stall_timeout_s=10, max_time=0)
        assert "".join([item.text async for item in stream]) == "Hi!"
        (recorded,) = fake.requests
        assert recorded.headers["Authorization"] == f"Bearer {KEY}"
        assert recorded.body["messages"] == [m.wire() for m in CHAT]
        assert "prompt" not in recorded.body and "chat" not in recorded.body
    finally:
        await fake.close()


async def test_tokenize_messages_on_a_keyed_engine(
    session: aiohttp.ClientSession, serve: Any, tiny_model: models.LoadedModel
) -> None:
    engine = await serve(api_keys=[KEY])
    client = NativeClient("r0", engine.url, session, api_key=KEY)
    expected = len(tiny_model.tokenizer(RENDERED, add_special_tokens=False)["input_ids"])
    assert await client.tokenize("", False, CHAT) == expected
    one_turn = RENDERED.removeprefix("<|im_start|>system\nBe brief.<|im_end|>\n")
    one = len(tiny_model.tokenizer(one_turn, add_special_tokens=False)["input_ids"])
    assert await client.tokenize("Tell me about cats.", True) == one < expected
    limits = await client.advertised(5)
    assert limits is not None and limits.max_model_len == 512 and limits.chat_template is True


@pytest.mark.parametrize("status", [400, 413, 422])
async def test_engine_rejection_is_invalid_request(
    session: aiohttp.ClientSession, status: int
) -> None:
    fake = FakeEngine(fail=Fault("http", status=status, message="prompt too long"))
    await fake.start()
    try:
        client = NativeClient("r0", fake.url, session)
        with pytest.raises(GenerationError) as info:
            async for _ in client.generate(req(), None, stall_timeout_s=10, max_time=0):
                pass
        err = info.value
        assert (err.error_type, err.code, err.migratable) == ("invalid_request", 422, False)
        # the engine's body is logged, never quoted to a client (DESIGN 6)
        assert err.message == f"replica r0 rejected the request (HTTP {status})"
    finally:
        await fake.close()


@pytest.mark.parametrize(
    ("status", "hint"),
    [(401, " (check the backend's api_key_env)"), (403, " (check the backend's api_key_env)"),
     (404, "")],
)  # fmt: skip
async def test_deployment_4xx_is_a_generation_error(
    session: aiohttp.ClientSession, status: int, hint: str
) -> None:
    fake = FakeEngine(fail=Fault("http", status=status, message="nope"))
    await fake.start()
    try:
        client = NativeClient("r0", fake.url, session)
        with pytest.raises(GenerationError) as info:
            async for _ in client.generate(req(), None, stall_timeout_s=10, max_time=0):
                pass
        err = info.value
        assert (err.error_type, err.code, err.migratable) == ("generation_error", 502, False)
        assert err.message == f"replica r0 rejected the request (HTTP {status}){hint}"
    finally:
        await fake.close()


# ----- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "state"), [(None, "is not set"), (" ", "holds no key")])
def test_native_key_env_must_hold_a_key(
    session: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    value: str | None,
    state: str,
) -> None:
    if value is None:
        monkeypatch.delenv(KEY_ENV)
    else:
        monkeypatch.setenv(KEY_ENV, value)
    with pytest.raises(ConfigError) as info:
        backend(session, native("http://127.0.0.1:1", None), native("http://127.0.0.1:2"))
    assert info.value.errors == [
        f"models.tiny.backends.1.api_key_env: environment variable {KEY_ENV} {state}"
    ]


async def test_keyed_engine_with_its_key(session: aiohttp.ClientSession, serve: Any) -> None:
    engine = await serve(api_keys=["other", KEY])
    b = backend(session, native(engine.url))
    await b.validate(req())
    assert await drain(b, req(max_new_tokens=4)) != ""
    assert engine.calls[("POST", "/v1/generate")] == 1


async def test_wrong_key_is_a_generation_error_and_not_migrated(
    session: aiohttp.ClientSession, serve: Any
) -> None:
    engines = [await serve(api_keys=["right"]) for _ in range(2)]
    b = backend(session, *(native(e.url) for e in engines))
    await b.validate(req(temperature=150.0))  # nothing advertised to this key: not checked here
    with pytest.raises(GenerationError) as info:
        await drain(b, req())
    err = info.value
    assert (err.error_type, err.code) == ("generation_error", 502)
    assert "HTTP 401" in err.message and "check the backend's api_key_env" in err.message
    assert sum(e.calls[("POST", "/v1/generate")] for e in engines) == 1


# ----- an engine's own 4xx at dispatch ----------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (req(temperature=150.0), "decoding.temperature: Input should be less than or equal to 100"),
        (
            req("a " * 2000),
            "the prompt has 2001 tokens (+0 resumed): it must be shorter than the model's "
            "context of 512 tokens",
        ),
    ],
    ids=["temperature", "prompt too long"],
)
async def test_engine_4xx_at_dispatch_is_invalid_request_not_migrated(
    session: aiohttp.ClientSession,
    serve: Any,
    request_: GenerationRequest,
    details: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = [await serve(api_keys=[KEY]) for _ in range(2)]
    b = backend(session, *(native(e.url) for e in engines))
    stream = b.stream(request_)
    with pytest.raises(GenerationError) as info:
        async with stream:
            async for _ in stream:
                pass
    err = info.value
    assert (err.error_type, err.code, err.migratable) == ("invalid_request", 422, False)
    # the engine's explanation is the operator's (the log), not quoted to a client (DESIGN 6)
    assert err.message.endswith("rejected the request (HTTP 422)")
    logged = [a for r in caplog.records for a in r.args or () if isinstance(a, str)]
    assert any(details in a for a in logged)
    assert stream.migrations == 0
    assert sum(e.calls[("POST", "/v1/generate")] for e in engines) == 1
    assert [r["failures"] for r in b.info()] == [0, 0]


# ----- validate ---------------------------------------------------------------------------------

MAX_SEED = 2**63 - 1
PARAM_ERRORS: list[tuple[str, GenerationRequest, str]] = [
    ("temperature 150", req(temperature=150.0), "temperature is 150; it must be between 0 and 100"),
    ("temperature -0.5", req(temperature=-0.5), "temperature is -0.5; it must be between 0 and 100"),
    ("top_p 0", req(top_p=0.0), "top_p is 0; it must be greater than 0 and at most 1"),
    ("top_p 1.5", req(top_p=1.5), "top_p is 1.5; it must be greater than 0 and at most 1"),
    ("top_k -1", req(top_k=-1), "top_k is -1; it must be at least 0"),
    ("repetition_penalty 0", req(repetition_penalty=0.0), "repetition_penalty is 0; it must be greater than 0 and at most 100"),
    ("seed -1", req(seed=-1), f"seed is -1; it must be between 0 and {MAX_SEED}"),
    ("seed 2**63", req(seed=2**63), f"seed is {2**63}; it must be between 0 and {MAX_SEED}"),
    ("max_time 1e6", req(max_time=1e6), "max_time is 1000000; it must be between 0 and 86400"),
    ("max_time -0.5", req(max_time=-0.5), "max_time is -0.5; it must be between 0 and 86400"),
    ("max_new_tokens 2e6", req(max_new_tokens=2_000_000), "max_new_tokens is 2000000; it must be between 1 and 1000000"),
    ("300-char stop", req(stop_sequences=("ok", "s" * 300)), "stop_sequences[1] is 300 characters long; at most 256 are accepted"),
    ("17 stops", req(stop_sequences=("s",) * 17), "stop_sequences has 17 entries; at most 16 are accepted"),
    ("empty stop", req(stop_sequences=("",)), "stop_sequences[0] must be at least 1 character long"),
    ("tool role", req(messages=(ChatMessage("user", "hi"), ChatMessage("tool", "x", "c"))), "messages: model tiny-random's chat template has no tool support"),
    ("tools", req(messages=(ChatMessage("user", "hi"),), extra={"tools": [{"type": "function"}]}), "tools: model tiny-random's chat template has no tool support"),
    ("odd role", req(messages=(ChatMessage("user", "hi"), ChatMessage("critic", "x"))), "messages[1].role `critic` is not accepted (use assistant, system, tool, user)"),
    ("1025 messages", req(messages=(ChatMessage("user", "hi"),) * 1025), "messages has 1025 entries; at most 1024 are accepted"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("request_", "details"), [c[1:] for c in PARAM_ERRORS], ids=[c[0] for c in PARAM_ERRORS]
)
async def test_validate_parameters_against_the_advertised_ranges(
    session: aiohttp.ClientSession, serve: Any, request_: GenerationRequest, details: str
) -> None:
    engine = await serve(api_keys=[KEY])
    b = backend(session, native(engine.url))
    assert await invalid(b, request_) == f"model `tiny`: {details}"
    assert engine.calls[("POST", "/v1/tokenize")] == 0


async def test_validate_prompt_length_against_the_context(
    session: aiohttp.ClientSession, serve: Any, tiny_model: models.LoadedModel
) -> None:
    engines = [await serve(api_keys=[KEY]) for _ in range(2)]
    b = backend(session, *(native(e.url) for e in engines))

    def tokens() -> int:
        return sum(e.calls[("POST", "/v1/tokenize")] for e in engines)

    # short: its bytes and the template allowance fit the context, nothing is tokenized
    await b.validate(req("Hello", max_new_tokens=20))
    await b.validate(req(messages=CHAT, max_new_tokens=20))
    assert tokens() == 0
    # long enough to need counting, and it fits
    await b.validate(req("a " * 150, max_new_tokens=20))
    assert tokens() == 1
    # prompt alone over the context
    details = await invalid(b, req("a " * 2000))
    assert details == (
        "model `tiny`: the prompt has 2001 tokens: it must be shorter than the model's context "
        "of 512 tokens"
    )
    # prompt + budget over the context
    prompt = "a " * 299
    n = len(tiny_model.tokenizer(prompt)["input_ids"])
    details = await invalid(b, req(prompt, max_new_tokens=300))
    assert details == (
        f"model `tiny`: the prompt has {n} tokens and max_new_tokens is 300: {n + 300} tokens "
        f"exceed the model's context of 512 tokens (at most {512 - n} new tokens fit)"
    )
    await b.validate(req(prompt, max_new_tokens=512 - n))
    # a budget the client did not set shrinks to what fits (vLLM's unset max_tokens)...
    fitted = await b.validate(req(prompt, max_new_tokens=300, budget_is_default=True))
    assert fitted.params.max_new_tokens == 512 - n and fitted.prompt == prompt
    # ...but never below min_new_tokens, and a prompt that fills the context is still refused
    assert (
        await invalid(
            b, req(prompt, max_new_tokens=300, min_new_tokens=300, budget_is_default=True)
        )
        == details
    )
    assert (await invalid(b, req("a " * 2000, budget_is_default=True))).startswith(
        "model `tiny`: the prompt has 2001 tokens: it must be shorter"
    )
    # a request that fits is returned as it came
    same = req("a " * 150, max_new_tokens=20, budget_is_default=True)
    assert await b.validate(same) is same
    # messages go through the template when counted
    long_chat = (ChatMessage("system", "Be brief."), ChatMessage("user", "a " * 400))
    rendered = (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{'a ' * 400}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    m = len(tiny_model.tokenizer(rendered, add_special_tokens=False)["input_ids"])
    details = await invalid(b, req(messages=long_chat, max_new_tokens=200))
    assert details == (
        f"model `tiny`: the prompt has {m} tokens and max_new_tokens is 200: {m + 200} tokens "
        f"exceed the model's context of 512 tokens (at most {512 - m} new tokens fit)"
    )
    # each replica's /v1/models was read once, however many requests were validated
    assert [e.calls[("GET", "/v1/models")] for e in engines] == [1, 1]


async def test_validate_uses_the_smallest_context(
    session: aiohttp.ClientSession, serve: Any, tiny_model: models.LoadedModel
) -> None:
    small = dataclasses.replace(tiny_model, max_context=256)
    engines = [await serve(api_keys=[KEY]), await serve(small, api_keys=[KEY])]
    b = backend(session, *(native(e.url) for e in engines))
    prompt = "a " * 199
    n = len(tiny_model.tokenizer(prompt)["input_ids"])
    details = await invalid(b, req(prompt, max_new_tokens=100))
    assert details == (
        f"model `tiny`: the prompt has {n} tokens and max_new_tokens is 100: {n + 100} tokens "
        f"exceed the model's context of 256 tokens (at most {256 - n} new tokens fit)"
    )


async def test_validate_without_a_chat_template(
    session: aiohttp.ClientSession, serve: Any, tiny_model: models.LoadedModel
) -> None:
    plain = dataclasses.replace(tiny_model, has_chat_template=False)
    engine = await serve(plain, api_keys=[KEY])
    b = backend(session, native(engine.url))
    assert await invalid(b, req(messages=CHAT)) == (
        "model `tiny`: messages: the model has no chat template"
    )
    chat = GenerationRequest("Hi", GenerationParams(), chat=True)
    assert await invalid(b, chat) == "model `tiny`: chat: the model has no chat template"


async def test_validate_skips_dead_and_silent_replicas(
    session: aiohttp.ClientSession, serve: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    fake = FakeEngine()  # answers /v1/models without a context: advertises nothing
    await fake.start()
    try:
        b = backend(session, native(dead), native(fake.url))
        await b.validate(req(temperature=150.0))  # nobody advertises: nothing to check here
        engine = await serve(api_keys=[KEY])
        b = backend(session, native(dead), native(fake.url), native(engine.url))
        details = await invalid(b, req(temperature=150.0))
        assert details == "model `tiny`: temperature is 150; it must be between 0 and 100"
    finally:
        await fake.close()


async def test_a_failed_fetch_is_retried_only_after_retry_s(
    session: aiohttp.ClientSession, serve: Any
) -> None:
    engine = await serve(api_keys=["right"])  # our key is wrong: every /v1/models is a 401
    b = backend(session, native(engine.url))
    now = [100.0]
    b.limits = AdvertisedLimits(retry_s=10, clock=lambda: now[0])
    await b.validate(req(temperature=150.0))
    await b.validate(req(temperature=150.0))
    assert engine.calls[("GET", "/v1/models")] == 1
    now[0] += 10
    await b.validate(req(temperature=150.0))
    assert engine.calls[("GET", "/v1/models")] == 2


async def test_validate_does_not_consult_openai_backends(session: aiohttp.ClientSession) -> None:
    vllm = FakeOpenAI()
    await vllm.start()
    try:
        b = backend(session, {"type": "openai", "url": vllm.url, "model": "fake-model"})
        await b.validate(req("a " * 5000, temperature=150.0, max_new_tokens=100_000))
        assert vllm.requests == [] and vllm.tokenize_requests == []
    finally:
        await vllm.close()


def test_merge_limits_is_what_every_replica_accepts() -> None:
    a = EngineLimits(
        model="a",
        max_model_len=512,
        ranges={"temperature": ParamRange(minimum=0, maximum=100), "top_k": ParamRange(minimum=0)},
        max_stop_sequences=16,
        max_stop_length=256,
        roles=frozenset({"system", "user", "assistant"}),
        chat_template=True,
    )
    b = EngineLimits(
        model="b",
        max_model_len=4096,
        ranges={"temperature": ParamRange(exclusive_minimum=0, maximum=2)},
        max_stop_sequences=4,
        roles=frozenset({"user", "assistant"}),
        chat_template=False,
    )
    merged = merge_limits([a, b])
    assert merged.max_model_len == 512
    assert merged.ranges["temperature"] == ParamRange(minimum=0, exclusive_minimum=0, maximum=2)
    assert merged.ranges["temperature"].describe() == "greater than 0 and at most 2"
    assert merged.ranges["top_k"] == ParamRange(minimum=0)
    assert (merged.max_stop_sequences, merged.max_stop_length) == (4, 256)
    assert merged.roles == frozenset({"user", "assistant"})
    assert merged.chat_template is False


def test_engine_limits_parse_tolerates_what_it_does_not_know() -> None:
    assert EngineLimits.parse({"data": [{"id": "fake"}]}) is None
    assert EngineLimits.parse([]) is None
    assert EngineLimits.parse({"data": [{"max_model_len": True}]}) is None
    parsed = EngineLimits.parse(
        {"data": [{"id": "m", "max_model_len": 100, "parameters": {"temperature": "hot"}}]}
    )
    assert parsed == EngineLimits(
        model="m", max_model_len=100, ranges={"temperature": ParamRange()}
    )


# ----- a managed engine and its generated key ---------------------------------------------------


def command_line(pid: int | None) -> list[bytes]:
    """What `ps` shows of a process."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


async def test_managed_engine_gets_a_generated_key(session: aiohttp.ClientSession) -> None:
    b = build_model_backends(
        {
            "tiny": ModelConfig.model_validate(
                {
                    "backends": [
                        {
                            "type": "managed",
                            "model": "tiny-random",
                            "device": "cpu",
                            "start_timeout_s": 120,
                        }
                    ]
                }
            )
        },
        session,
        registry=CollectorRegistry(),
        health_interval_s=0.5,
    )["tiny"]
    assert isinstance(b, ReplicatedModelBackend)
    await b.start()
    try:
        (process,) = b.processes
        key = process.api_key
        assert len(key) >= 32
        cmdline = command_line(process.pid)
        assert b"--api-keys-env" in cmdline and ENGINE_API_KEYS_ENV.encode() in cmdline
        assert not any(key.encode() in arg for arg in cmdline)  # not visible in `ps`
        # the engine requires the key, and the orchestrator's client has it
        async with session.post(process.url + "/v1/tokenize", json={"prompt": "Hi"}) as r:
            assert r.status == 401
        headers = {"Authorization": f"Bearer {key}"}
        async with session.post(
            process.url + "/v1/tokenize", json={"prompt": "Hi"}, headers=headers
        ) as r:
            assert r.status == 200
        assert await b.tokenize("", False, CHAT) > 0
        request = req(messages=CHAT, max_new_tokens=6)
        await b.validate(request)
        stream = b.stream(request)
        async with stream:
            chunks = [chunk async for chunk in stream]
        assert chunks[-1].finish_reason == "MAX_TOKENS"
        assert chunks[-1].generated_token_count == 6
        assert await invalid(b, req(temperature=150.0)) == (
            "model `tiny`: temperature is 150; it must be between 0 and 100"
        )
    finally:
        await b.close()
