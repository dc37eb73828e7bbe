"""The openai backend learns what a server takes instead of assuming vLLM (DESIGN section 7),
against the fakes speaking as `transformers serve` does (`flavour="transformers"`, the shapes checked
against the real server in tests/test_clients_transformers_serve.py): no `return_token_ids`, no token-id
prompts, no `/tokenize`, no chat continuation, no `[DONE]`, usage in the finish chunk, the stop
string sent, vLLM-only sampling fields refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from generation import models
from orchestrator.clients.backend import (
    ChatMessage,
    EngineDelta,
    GenerationError,
    GenerationParams,
    GenerationRequest,
    ModelBackend,
)
from orchestrator.clients.backends import build_model_backends
from orchestrator.clients.openai import OpenAIClient
from orchestrator.config import ModelConfig
from tests.fakes.openai_server import FakeOpenAI, OpenAIFault, count_tokens, start_fakes, templated
from tests.fakes.upstream import FakeUpstream

SCRIPT = ["Once", " upon", " a", " time", "."]
FULL = "".join(SCRIPT)


async def start(servers: list[FakeUpstream], n: int = 1, **kw: Any) -> list[FakeOpenAI]:
    """`n` fake servers speaking as transformers serve does (chat and completions alike)."""
    return await start_fakes(servers, n, script=list(SCRIPT), flavour="transformers", **kw)


def request(prompt: str = "Hi", **params: Any) -> GenerationRequest:
    params.setdefault("max_new_tokens", 20)
    return GenerationRequest(prompt=prompt, params=GenerationParams(**params))


def backend(
    session: aiohttp.ClientSession,
    urls: list[str],
    api: str = "completions",
    registry: CollectorRegistry | None = None,
    **extra: Any,
) -> ModelBackend:
    config = ModelConfig.model_validate(
        {
            "backends": [
                {"type": "openai", "url": u, "model": "fake-model", "api": api, **extra}
                for u in urls
            ],
            "migration": {"quarantine_s": 30},
        }
    )
    registry = registry if registry is not None else CollectorRegistry()
    return build_model_backends({"m": config}, session, registry=registry)["m"]


async def test_completions_learns_the_server_and_streams_text(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """The first request carries `return_token_ids`: the 422 names it, the client sends the same
    request again at once without it and remembers (the second request never carries it).
    Items are text, one token an event; the final one takes the usage's count; the end of the
    body after the finish chunk is a normal end."""
    (s,) = await start(servers)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    for _ in range(2):
        stream = client.generate(request(), None, stall_timeout_s=30, max_time=0)
        items = [i async for i in stream]
        assert [(i.text, i.token_ids, i.token_count) for i in items] == [
            *((t, (), 1) for t in SCRIPT),
            ("", (), 0),
        ]
        assert items[-1].finish_reason == "EOS_TOKEN"
        assert items[-1].input_token_count == count_tokens("Hi")
    assert ["return_token_ids" in r for r in s.requests] == [True, False, False]
    assert client.traits.refused == {"return_token_ids"}
    assert client.traits.token_ids is False


async def test_resume_by_text_without_token_ids(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """A replica dies after two tokens: the other gets the prompt text plus the delivered text
    (a token-id prompt would be refused) and the rest of the budget; the client's text is
    seamless."""
    a, b = await start(servers, 2)
    a.faults.append(OpenAIFault("close", after=2))
    be = backend(session, [a.url, b.url])
    stream = be.stream(request(max_new_tokens=10))
    chunks = [c async for c in stream]
    await stream.aclose()
    assert "".join(c.text for c in chunks) == FULL
    assert stream.migrations == 1 and stream.finish_reason == "EOS_TOKEN"
    resumed = [r for r in b.requests if "return_token_ids" not in r]
    assert resumed[0]["prompt"] == "Hi" + "Once upon"
    assert resumed[0]["max_tokens"] == 8
    assert chunks[-1].generated_token_count == 5


async def test_token_id_prompt_refused_falls_back_to_text(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """A continuation with token ids (begun on a vLLM replica) on a server that takes no
    token-id prompt: the 400 turns the resume into a resume by text, remembered."""
    from orchestrator.clients.backend import Continuation

    (s,) = await start(servers)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    client.traits.refused.add("return_token_ids")
    cont = Continuation(prompt_token_ids=(72, 105), token_ids=(1000, 1001), text="Once upon")
    stream = client.generate(request(max_new_tokens=5), cont, stall_timeout_s=30, max_time=0)
    items = [i async for i in stream]
    assert "".join(i.text for i in items) == " a time."
    assert [r["prompt"] for r in s.requests] == [[72, 105, 1000, 1001], "HiOnce upon"]
    assert s.requests[1]["max_tokens"] == 3
    assert client.traits.token_prompt is False


async def test_stop_string_the_server_sends_is_cut_here(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """transformers serve sends the token that completes a stop string; OpenAI's contract (and
    the native engine's) leaves the stop string out: guardstream cuts it, STOP_SEQUENCE."""
    (s,) = await start(servers)
    client = OpenAIClient("o0", s.url, "fake-model", session)
    stream = client.generate(
        request(stop_sequences=(" a t",)), None, stall_timeout_s=30, max_time=0
    )
    items = [i async for i in stream]
    assert "".join(i.text for i in items) == "Once upon"
    assert items[-1].finish_reason == "STOP_SEQUENCE"


@pytest.mark.parametrize(
    ("params", "name", "field"),
    [
        ({"min_new_tokens": 2}, "min_new_tokens", "min_tokens"),
        ({"decoding_method": "SAMPLING", "top_k": 5}, "top_k", "top_k"),
        ({"repetition_penalty": 1.2}, "repetition_penalty", "repetition_penalty"),
    ],
)
async def test_a_refused_sampling_field_is_the_clients_422(
    session: aiohttp.ClientSession,
    servers: list[FakeUpstream],
    params: dict[str, Any],
    name: str,
    field: str,
) -> None:
    """Never silently dropped: the server's refusal becomes an invalid_request 422, the next
    request is refused without calling the server, and validate() refuses it up front."""
    (s,) = await start(servers)
    be = backend(session, [s.url])
    client = be.replicas[0].client
    assert isinstance(client, OpenAIClient)
    message = (
        f"replica openai-0 cannot honour `{name}` (its server refuses `{field}`); "
        "leave it unset for this model"
    )
    for _ in range(2):
        stream = client.generate(request(**params), None, stall_timeout_s=30, max_time=0)
        with pytest.raises(GenerationError) as info:
            [i async for i in stream]
        assert (info.value.code, info.value.error_type, info.value.message) == (
            422,
            "invalid_request",
            message,
        )
        assert not info.value.migratable
    # one request: its 422 named both `return_token_ids` and the sampling field; none after
    assert len(s.requests) == 1
    from orchestrator.api.errors import ApiError

    with pytest.raises(ApiError) as up_front:
        await be.validate(request(**params))
    assert up_front.value.details == (
        f"{name}: model `m` cannot honour it (the server of its replica openai-0 refuses it)"
    )
    await be.validate(request())  # without it: fine


async def test_a_refused_model_default_is_dropped_not_the_clients_422(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """The operator's decoding_defaults (repetition_penalty 1.1 in the shipped config) set a
    field transformers serve refuses: the request goes again without it, and later ones never
    send it; a client that sets the same field itself still gets the 422."""
    (s,) = await start(servers)
    be = backend(session, [s.url])
    client = be.replicas[0].client
    assert isinstance(client, OpenAIClient)
    defaulted = request(repetition_penalty=1.1, defaulted=frozenset({"repetition_penalty"}))
    for _ in range(2):
        stream = client.generate(defaulted, None, stall_timeout_s=30, max_time=0)
        assert "".join([i.text async for i in stream]) == FULL
    sent = list(s.requests)
    assert [("repetition_penalty" in b, "return_token_ids" in b) for b in sent] == [
        (True, True),  # refused both by name
        (False, False),
        (False, False),
    ]
    await be.validate(defaulted)  # no 422 up front either
    with pytest.raises(GenerationError) as info:
        stream = client.generate(
            request(repetition_penalty=1.1), None, stall_timeout_s=30, max_time=0
        )
        [i async for i in stream]
    assert info.value.code == 422


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model_id": "m", **labels}) or 0.0


async def read_all(stream: Any) -> tuple[list[EngineDelta], GenerationError | None]:
    """Every chunk the stream gave, and the error it ended with (None: it finished)."""
    chunks: list[EngineDelta] = []
    try:
        async for c in stream:
            chunks.append(c)
    except GenerationError as exc:
        return chunks, exc
    finally:
        await stream.aclose()
    return chunks, None


@pytest.mark.parametrize(
    "params",
    [{}, {"decoding_method": "SAMPLING", "temperature": 0.7, "seed": 7}],
    ids=["greedy", "seeded"],
)
async def test_chat_server_without_continuation_replays_a_deterministic_answer(
    session: aiohttp.ClientSession, servers: list[FakeUpstream], params: dict[str, Any]
) -> None:
    """`api: chat` on a server that refuses `continue_final_message` (transformers serve): after
    text was delivered, a greedy or seeded answer is regenerated on the other replica from the
    request as it came; the regenerated prefix is checked against the delivered text and
    swallowed, and the stream goes on after it: the pipeline sees one seamless answer whose
    counts are the server's own. The refusal is learnt once: a later resume replays at once."""
    a, b = await start(servers, 2)
    a.faults.append(OpenAIFault("close", after=2))
    registry = CollectorRegistry()
    be = backend(session, [a.url, b.url], api="chat", registry=registry)
    stream = be.stream(request(max_new_tokens=10, **params))
    chunks, error = await read_all(stream)
    assert error is None
    assert [c.text for c in chunks] == [*SCRIPT, ""]
    assert [c.generated_token_count for c in chunks] == [1, 2, 3, 4, 5, 5]
    hi = count_tokens(templated([{"role": "user", "content": "Hi"}]))
    assert chunks[-1].input_token_count == hi  # the plain prompt: nothing of it was resumed
    assert stream.migrations == 1 and stream.finish_reason == "EOS_TOKEN"
    assert b.requests[0]["continue_final_message"] is True  # refused: 422
    assert b.requests[1] == a.requests[0]  # the request as it came, whole budget
    assert sample(registry, "guardstream_migrations_total", kind="mid_stream") == 1
    assert sample(registry, "guardstream_migration_replays_total", outcome="matched") == 1

    a.faults.append(OpenAIFault("close", after=3))
    be.replicas[0].quarantined_until = 0.0  # the next stream starts on `a` again
    stream = be.stream(request(max_new_tokens=10, **params))
    chunks, error = await read_all(stream)
    assert error is None and "".join(c.text for c in chunks) == FULL
    assert chunks[-1].generated_token_count == 5
    assert len(b.requests) == 3 and b.requests[2] == a.requests[1]  # no second refusal
    assert sample(registry, "guardstream_migration_replays_total", outcome="matched") == 2


async def test_chat_server_without_continuation_restarts_when_nothing_was_delivered(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """Before the first token, and also when the replica's tokens were all held back (a stop
    sequence's possible start): nothing reached the pipeline, so the request starts from scratch
    on the other replica, and the tokens counted for the held text are discarded with it (the
    count is the answer's, not the answer's plus the lost ones)."""
    a, b = await start(servers, 2)
    a.faults.append(OpenAIFault("close", after=2))  # after "Once", " upon": both held
    registry = CollectorRegistry()
    be = backend(session, [a.url, b.url], api="chat", registry=registry)
    stream = be.stream(request(max_new_tokens=10, stop_sequences=("Once upon a tim!",)))
    chunks, error = await read_all(stream)
    assert error is None
    assert "".join(c.text for c in chunks) == FULL
    assert chunks[-1].generated_token_count == 5 and stream.generated_token_count == 5
    assert stream.migrations == 1 and b.requests == [a.requests[0]]
    assert sample(registry, "guardstream_migrations_total", kind="before_first_token") == 1
    assert sample(registry, "guardstream_migration_replays_total", outcome="matched") == 0


async def test_chat_replay_that_differs_ends_with_the_original_error(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """The regenerated answer differs from the delivered text (a replica that is not
    deterministic): nothing of it reaches the pipeline, and the stream ends as a migration that
    could not be made ends (DESIGN 7: the original error, and why it was not migrated)."""
    (a,) = await start(servers)
    (b,) = await start_fakes(
        servers, script=["Once", " more", " a", " time", "."], flavour="transformers"
    )
    a.faults.append(OpenAIFault("close", after=2))
    registry = CollectorRegistry()
    be = backend(session, [a.url, b.url], api="chat", registry=registry)
    chunks, error = await read_all(be.stream(request(max_new_tokens=10)))
    assert [c.text for c in chunks] == ["Once", " upon"]
    assert error is not None
    assert (error.code, error.error_type, error.migratable) == (
        503,
        "generation_unavailable",
        False,
    )
    assert error.message == (
        "replica openai-0: connection failed: connection lost mid-stream (not migrated: the answer "
        "regenerated on replica openai-1 differs from the 9 delivered characters at character 5)"
    )
    assert sample(registry, "guardstream_migration_replays_total", outcome="mismatched") == 1
    assert sample(registry, "guardstream_generation_unmigratable_total", reason="replay_mismatch")
    assert len(b.requests) == 2  # the refused resume, the replay


async def test_chat_server_without_continuation_cannot_resume_unseeded_sampling(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    """Sampling without a seed cannot be regenerated: after text was delivered, a replica that
    cannot continue a partial answer ends the stream with the original error (as a migration
    that could not be made); once the refusal is known, without sending the resume at all."""
    a, b = await start(servers, 2)
    registry = CollectorRegistry()
    be = backend(session, [a.url, b.url], api="chat", registry=registry)
    why = (
        "(not migrated: replica openai-1 cannot continue a partial answer (its server refuses "
        "`continue_final_message`) and sampling without a seed cannot be regenerated)"
    )
    for sent in (1, 1):
        a.faults.append(OpenAIFault("close", after=2))
        req = request(max_new_tokens=10, decoding_method="SAMPLING", temperature=0.7)
        chunks, error = await read_all(be.stream(req))
        assert [c.text for c in chunks] == ["Once", " upon"]
        assert error is not None and (error.code, error.error_type) == (
            503,
            "generation_unavailable",
        )
        assert (
            error.message
            == f"replica openai-0: connection failed: connection lost mid-stream {why}"
        )
        assert len(b.requests) == sent  # the resume refused once, never sent again
        be.replicas[0].quarantined_until = 0.0  # the next stream starts on `a` again
    assert sample(registry, "guardstream_generation_unmigratable_total", reason="cannot_continue")
    # each stream decided to migrate (and counted it) before the new replica turned out unable
    assert sample(registry, "guardstream_migrations_total", kind="mid_stream") == 2
    assert sample(registry, "guardstream_migration_replays_total", outcome="matched") == 0


async def test_chat_usage_in_the_finish_chunk_and_no_done(
    session: aiohttp.ClientSession, servers: list[FakeUpstream]
) -> None:
    (s,) = await start(servers)
    client = OpenAIClient("c0", s.url, "fake-model", session, api="chat")
    stream = client.generate(
        request(stop_sequences=("time",)), None, stall_timeout_s=30, max_time=0
    )
    items = [i async for i in stream]
    assert "".join(i.text for i in items) == "Once upon a "
    assert items[-1].finish_reason == "STOP_SEQUENCE"
    assert sum(i.token_count or 0 for i in items) == 4  # the server's count: 4 pieces sent


async def test_chat_request_on_completions_uses_the_tokenizer_folder(
    session: aiohttp.ClientSession, servers: list[FakeUpstream], tiny_model: models.LoadedModel
) -> None:
    """No /tokenize: with the backend's `tokenizer` folder the conversation is templated here
    (the model's own template) and sent as text; counted with its tokenizer. Without one: a
    clear 502 naming the setting."""
    folder: Path = models.prepare("tiny-random")
    (s,) = await start(servers)
    conversation = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"))
    req = GenerationRequest(
        prompt="Hi", params=GenerationParams(max_new_tokens=5), chat=True, messages=conversation
    )
    client = OpenAIClient("o0", s.url, "fake-model", session, tokenizer=str(folder))
    items = [i async for i in client.generate(req, None, stall_timeout_s=30, max_time=0)]
    assert "".join(i.text for i in items) == FULL
    templated = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert s.requests[-1]["prompt"] == templated + "<|im_start|>assistant\n"
    wire = [m.wire() for m in conversation]  # rendered as transformers renders it
    assert s.requests[-1]["prompt"] == tiny_model.tokenizer.apply_chat_template(
        wire, add_generation_prompt=True, tokenize=False
    )
    expected = tiny_model.tokenizer.apply_chat_template(
        [m.wire() for m in conversation], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert await client.tokenize("Hi", True, conversation) == len(expected)

    bare = OpenAIClient("o1", s.url, "fake-model", session)
    with pytest.raises(GenerationError) as info:
        [i async for i in bare.generate(req, None, stall_timeout_s=30, max_time=0)]
    assert info.value.code == 502 and "`tokenizer`" in info.value.message


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("error", "replica o0 reported an error"),  # `{"error": "<message>"}`, then the end
        ("eof", "replica o0: stream ended without [DONE]"),  # the end before a finish reason
        ("close", "replica o0: connection failed"),
    ],
)
async def test_failures_before_the_finish_are_migratable(
    session: aiohttp.ClientSession, servers: list[FakeUpstream], mode: str, message: str
) -> None:
    """Without `[DONE]` the end of the body is a normal end only after the finish chunk; an
    in-band error (transformers serve's is a bare string) or an earlier end is a failure."""
    (s,) = await start(servers)
    s.faults.append(OpenAIFault(mode, after=2))
    client = OpenAIClient("o0", s.url, "fake-model", session)
    got: list[str] = []
    with pytest.raises(GenerationError) as info:
        async for item in client.generate(request(), None, stall_timeout_s=30, max_time=0):
            got.append(item.text)
    assert info.value.migratable and info.value.code == 503
    assert info.value.message.startswith(message)
    assert got == SCRIPT[:2]
