"""POST /api/v2/text/completions-detection (issue 40): the OpenAI Completions request with
`detectors: {input, output}` over the guarded pipeline, in the FMS orchestrator's reply shape
(`text_completion`; `detections` and `warnings` beside `choices`), streamed and unary, over
real HTTP with a fake native engine and fake remote detectors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchestrator.api.errors import ErrorType, Failure
from orchestrator.streaming.completions_writer import CompletionChunkWriter
from orchestrator.streaming.events import Frame, Terminal
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, prompt_text
from tests.orchestrator_support import MODEL, Orchestrator, native_config, remote

PATH = "/api/v2/text/completions-detection"
SCRIPT = ["Sure", "!", " Let", " me", " help", " with", " <something>", "."]
TEXT = "".join(SCRIPT)
INPUT_WARNING = {
    "type": "UNSUITABLE_INPUT",
    "message": "Unsuitable input detected. Please check the detected entities on your input and "
    "try again with the unsuitable input removed.",
}
OUTPUT_WARNING = {"type": "UNSUITABLE_OUTPUT", "message": "Unsuitable output detected."}


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    angle = DetectorBehaviour(
        words={"<something>": 1.0}, detection="has_angle_brackets", detection_type="angle"
    )
    server.add("angle", angle)
    server.add("broken", DetectorBehaviour(fail_status=500, fail_on="help"))
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def orch(dets: FakeDetectorServer) -> AsyncIterator[tuple[FakeEngine, Orchestrator]]:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    cfg = native_config(
        engine.url,
        detectors={"angle": remote(dets.url), "broken": remote(dets.url)},
    )
    try:
        async with Orchestrator(cfg) as o:
            yield engine, o
    finally:
        await engine.close()


def angle(start: int, end: int = 0) -> dict[str, Any]:
    return {
        "start": start,
        "end": end or start + len("<something>"),
        "text": "<something>",
        "detector_id": "angle",
        "detection_type": "angle",
        "detection": "has_angle_brackets",
        "score": 1.0,
    }


async def raw_stream(orch: Orchestrator, body: dict[str, Any]) -> list[Any]:
    """Every SSE message of a streamed reply: `data:` JSON, `[DONE]`, or ("error", JSON)."""
    assert orch.session is not None
    async with orch.session.post(orch.url + PATH, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    out: list[Any] = []
    for message in text.split("\n\n"):
        if not message:
            continue
        if message.startswith("event: error\ndata: "):
            out.append(("error", json.loads(message.split("data: ", 1)[1])))
        else:
            assert message.startswith("data: "), message
            data = message.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_unary_output_detections(orch: tuple[FakeEngine, Orchestrator]) -> None:
    engine, o = orch
    body = {
        "model": MODEL,
        "prompt": "Hi there! Can you help me?",
        "max_tokens": 20,
        "detectors": {"output": {"angle": {}}},
    }
    status, reply = await o.post(PATH, body)
    assert status == 200, reply
    assert reply["id"].startswith("cmpl-") and isinstance(reply["created"], int)
    del reply["id"], reply["created"]
    assert reply == {
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": len(body["prompt"]),
            "total_tokens": len(body["prompt"]) + len(SCRIPT),
            "completion_tokens": len(SCRIPT),
        },
        "detections": {"output": [{"choice_index": 0, "results": [angle(TEXT.index("<"))]}]},
        "warnings": [OUTPUT_WARNING],
    }
    # the prompt as it is: no chat template
    [request] = engine.requests
    assert prompt_text(request.body) == body["prompt"] and "messages" not in request.body


async def test_unary_input_detections_never_call_the_model(
    orch: tuple[FakeEngine, Orchestrator],
) -> None:
    engine, o = orch
    prompt = "Hi there! Can you help me with <something>?"
    body = {"model": MODEL, "prompt": prompt, "detectors": {"input": {"angle": {}}}}
    status, reply = await o.post(PATH, body)
    assert status == 200, reply
    assert reply["choices"] == []
    # as the FMS orchestrator: the prompt's count (the engine's tokenizer), nothing generated
    assert reply["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": 0,
        "completion_tokens": 0,
    }
    assert reply["detections"] == {"input": [{"message_index": 0, "results": [angle(31)]}]}
    assert reply["warnings"] == [INPUT_WARNING]
    assert engine.requests == []


async def test_streamed_chunks_carry_each_frame_and_its_detections(
    orch: tuple[FakeEngine, Orchestrator],
) -> None:
    _, o = orch
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "detectors": {"output": {"angle": {}}},
        "stream_options": {"include_usage": True},
    }
    messages = await raw_stream(o, body)
    assert messages[-1] == "[DONE]" and messages.count("[DONE]") == 1
    chunks = messages[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == TEXT
    # sentence chunker: "Sure!" then " Let me help with <something>." each judged
    framed = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert [c["choices"][0]["text"] for c in framed] == ["Sure!", TEXT[len("Sure!") :]]
    assert framed[0]["detections"] == {"output": [{"choice_index": 0, "results": []}]}
    assert "warnings" not in framed[0]
    assert framed[1]["detections"] == {
        "output": [{"choice_index": 0, "results": [angle(TEXT.index("<"))]}]
    }
    assert framed[1]["warnings"] == [OUTPUT_WARNING]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes == [None, None, "stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(SCRIPT)


async def test_a_streamed_input_hit_is_one_chunk_then_done(
    orch: tuple[FakeEngine, Orchestrator],
) -> None:
    engine, o = orch
    body = {
        "model": MODEL,
        "prompt": "Help with <something>",
        "detectors": {"input": {"angle": {}}},
    }
    messages = await raw_stream(o, body)
    assert len(messages) == 2 and messages[1] == "[DONE]"
    [chunk] = messages[:1]
    assert chunk["choices"] == [] and chunk["warnings"] == [INPUT_WARNING]
    assert chunk["detections"] == {"input": [{"message_index": 0, "results": [angle(10)]}]}
    assert engine.requests == []


async def test_a_detector_failing_before_any_chunk_is_an_http_error(
    orch: tuple[FakeEngine, Orchestrator], dets: FakeDetectorServer
) -> None:
    _, o = orch
    dets.detectors["broken"].fail_on = "Sure"  # the first sentence: nothing was sent yet
    body = {"model": MODEL, "prompt": "Hi", "detectors": {"output": {"broken": {}}}}
    for stream in (False, True):
        status, reply = await o.post(PATH, {**body, "stream": stream})
        assert (status, reply) == (
            502,
            {"code": 502, "details": "detector `broken`: HTTP 500", "type": "detector_error"},
        )


def test_an_error_after_the_first_chunk_is_an_error_event_then_done() -> None:
    """As the FMS orchestrator streams it: `event: error` with the error body, `[DONE]` last."""
    writer = CompletionChunkWriter(MODEL, include_usage=True)
    first = writer.render(Frame(text="Sure!", start=0, end=5))
    assert first.startswith(b"data: {") and b'"text":"Sure!"' in first
    failure = Failure(502, ErrorType.DETECTOR_ERROR, "detector `broken`: HTTP 500")
    last = writer.render(Terminal(kind="failed", processed_index=5, error=failure))
    assert last == (
        b'event: error\ndata: {"code":502,"details":"detector `broken`: HTTP 500",'
        b'"type":"detector_error"}\n\ndata: [DONE]\n\n'
    )


@pytest.mark.parametrize(
    ("body", "status", "details"),
    [
        ({"model": "", "prompt": "Hi"}, 422, "`model` must not be empty"),
        (
            {"model": MODEL, "prompt": "", "detectors": {"input": {"angle": {}}}},
            422,
            "`prompt` must not be empty when input detectors are provided",
        ),
        (
            {"model": MODEL, "prompt": "Hi", "detectors": {"output": {"nope": {}}}},
            404,
            "detector `nope` not found (available: angle, broken)",
        ),
        (
            {"model": MODEL, "prompt": "Hi", "detector": {"output": {}}},
            422,
            "detector: unknown field (did you mean `detectors`?)",
        ),
        (
            {"model": MODEL, "prompt": "Hi", "echo": True},
            422,
            "echo: not supported on this endpoint (guardstream reads model, prompt, stream, "
            "stream_options, max_tokens, temperature, top_p, seed, stop, n and detectors)",
        ),
    ],
)
async def test_bad_requests_are_fms_errors_before_any_byte(
    orch: tuple[FakeEngine, Orchestrator], body: dict[str, Any], status: int, details: str
) -> None:
    engine, o = orch
    for stream in (False, True):
        got, reply = await o.post(PATH, {**body, "stream": stream})
        assert (got, reply["code"], reply["details"]) == (status, status, details), reply
    assert engine.requests == []
