"""What one request may ask for is bounded before any work starts (DESIGN 4: "No request can
make the service run unbounded work"), on every surface alike.

Stop sequences: an `openai` backend's stream is read as text and its stop sequences are enforced
by the orchestrator itself (servicekit/text_gate.py), on its event loop. On 321ae20 the OpenAI
surfaces took any number of stop sequences of any length (FMS: 16 of any length): a 1 MB body of
1,000 stop sequences of 1,000 characters cost the gate 33 ms of loop time per token (measured,
2 busy cores), so one request of 2,048 tokens froze every stream of the service for over a
minute. The engine's own bounds (16 sequences of at most 256 characters) now hold on every
surface, for every backend, before the first byte.

The real orchestrator on 127.0.0.1 in front of the fake OpenAI server (`type: openai`, which
advertises no bounds), driven by the official `openai` SDK and raw HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from orchestrator.app import COMPLETIONS_DETECTION_PATH, UNARY_PATH
from tests.fakes.openai_server import FakeOpenAI
from tests.openai_support import sdk
from tests.orchestrator_support import MODEL, Orchestrator, native_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

ASK = [{"role": "user", "content": "Hi"}]
# the engine's bounds (generation/protocol.py), on every surface
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
TOO_MANY = [f"stop{i}" for i in range(MAX_STOP_SEQUENCES + 1)]
TOO_LONG = ["x" * (MAX_STOP_LENGTH + 1)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def orch(openai_upstream: FakeOpenAI) -> AsyncIterator[Orchestrator]:
    config = native_config(openai_upstream.url)
    config["models"][MODEL]["backends"] = [
        {
            "type": "openai",
            "url": openai_upstream.url,
            "model": "fake-model",
            "api": "chat",
            "forward_fields": ["top_k", "min_p"],
        }
    ]
    async with Orchestrator(config) as o:
        yield o


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unary"])
@pytest.mark.parametrize(
    ("stop", "why"),
    [
        (TOO_MANY, f"List should have at most {MAX_STOP_SEQUENCES} items after validation"),
        (TOO_LONG, f"String should have at most {MAX_STOP_LENGTH} characters"),
    ],
    ids=["too-many", "too-long"],
)
async def test_stop_sequences_beyond_the_bounds_are_422_before_any_work(
    orch: Orchestrator, openai_upstream: FakeOpenAI, stream: bool, stop: list[str], why: str
) -> None:
    before = len(openai_upstream.requests)
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        await sdk(orch).chat.completions.create(model=MODEL, messages=ASK, stop=stop, stream=stream)
    body: Any = caught.value.body
    assert body["type"] == "invalid_request" and body["param"].startswith("stop"), body
    assert why in body["message"]
    status, reply = await orch.post(
        COMPLETIONS_DETECTION_PATH, {"model": MODEL, "prompt": "Hi", "stop": stop, "stream": stream}
    )
    assert status == 422, reply
    assert why in reply["details"]
    assert len(openai_upstream.requests) == before


async def test_fms_stop_sequences_are_bounded_alike(orch: Orchestrator) -> None:
    status, body = await orch.post(
        UNARY_PATH,
        {"model_id": MODEL, "inputs": "Hi", "text_gen_parameters": {"stop_sequences": TOO_LONG}},
    )
    assert status == 422, body
    assert body["type"] == "invalid_request"
    assert f"at most {MAX_STOP_LENGTH} characters" in body["details"]


async def test_stop_sequences_at_the_bounds_are_served(
    orch: Orchestrator, openai_upstream: FakeOpenAI
) -> None:
    stop = ["y" * MAX_STOP_LENGTH] * MAX_STOP_SEQUENCES
    done = await sdk(orch).chat.completions.create(model=MODEL, messages=ASK, stop=stop)
    assert done.choices[0].finish_reason == "stop"
    assert openai_upstream.requests[-1]["stop"] == stop


@pytest.mark.parametrize(
    ("field", "value"), [("logprobs", True), ("top_logprobs", 2)], ids=["logprobs", "top"]
)
async def test_log_probabilities_are_refused_even_where_fields_are_forwarded(
    orch: Orchestrator, openai_upstream: FakeOpenAI, field: str, value: Any
) -> None:
    """A token's log probability entry carries the token's text: text the output guardrails
    may withhold or redact. On 321ae20 an `openai` chat backend received `logprobs: true` and
    the answer came back without them, silently (DESIGN 4.8: never silently dropped); no backend
    can return them through the guardrails, so they are refused like `n` > 1."""
    before = len(openai_upstream.requests)
    for stream in (False, True):
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await sdk(orch).chat.completions.create(
                model=MODEL, messages=ASK, stream=stream, **{field: value}
            )
        body: Any = caught.value.body
        assert body["param"] == field, body
        assert body["message"].startswith(f"{field}: log probabilities are not returned"), body
    assert len(openai_upstream.requests) == before
    # the values that ask for nothing (SDKs and proxies send them) still pass
    done = await sdk(orch).chat.completions.create(
        model=MODEL, messages=ASK, logprobs=False, top_logprobs=0
    )
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # renders the judged messages any way it likes: reversed text past an input guardrail
        ("chat_template", "{% for m in messages %}{{ m.content[::-1] }}{% endfor %}"),
        ("continue_final_message", True),  # whose turn it is
        ("guided_regex", "(a|aa)*b"),  # the server compiles a client's regex
    ],
    ids=["chat_template", "continue_final_message", "guided_regex"],
)
async def test_a_servers_own_field_is_refused_unless_its_backends_list_it(
    orch: Orchestrator, openai_upstream: FakeOpenAI, field: str, value: Any
) -> None:
    """On 321ae20 an `openai` chat backend received any field a client sent (vLLM's
    `chat_template` among them); now only OpenAI's own fields and the server's fields the
    backends list (`forward_fields`) are forwarded, anything else is 422 before any work."""
    before = len(openai_upstream.requests)
    for stream in (False, True):
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await sdk(orch).chat.completions.create(
                model=MODEL, messages=ASK, stream=stream, extra_body={field: value}
            )
        body: Any = caught.value.body
        assert (body["type"], body["param"]) == ("invalid_request", field), body
        assert body["message"].startswith(
            f"{field}: not an OpenAI Chat Completions field, and model `{MODEL}`'s backends "
            "do not forward it"
        ), body
    assert len(openai_upstream.requests) == before


async def test_openai_fields_and_the_listed_server_fields_reach_the_backend(
    orch: Orchestrator, openai_upstream: FakeOpenAI
) -> None:
    done = await sdk(orch).chat.completions.create(
        model=MODEL, messages=ASK, presence_penalty=0.5, extra_body={"top_k": 5, "min_p": 0.1}
    )
    assert done.choices[0].finish_reason == "stop"
    sent = openai_upstream.requests[-1]
    assert (sent["presence_penalty"], sent["top_k"], sent["min_p"]) == (0.5, 5, 0.1)


async def test_a_detectors_request_params_are_bounded(
    orch: Orchestrator, openai_upstream: FakeOpenAI
) -> None:
    """A request's params for a detector are sent with each of the stream's calls to it (one
    per chunk): 1 MB of them would be multiplied by the answer's chunks. Over 64 KiB they are a
    422 on every surface, before any work."""
    big = {"labels": ["x" * 1000] * 70}  # 70,000-odd bytes of JSON
    before = len(openai_upstream.requests)
    status, body = await orch.post(
        UNARY_PATH,
        {
            "model_id": MODEL,
            "inputs": "Hi",
            "guardrail_config": {"output": {"models": {"pii": big}}},
        },
    )
    assert status == 422, body
    assert body["type"] == "invalid_request"
    assert "detector params of 70" in body["details"] and "exceed 65536" in body["details"]
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        await sdk(orch).chat.completions.create(
            model=MODEL, messages=ASK, extra_body={"detectors": {"output": {"pii": big}}}
        )
    message = caught.value.body["message"]  # type: ignore[index]
    assert "detector params of 70" in message and "exceed 65536" in message
    assert len(openai_upstream.requests) == before
