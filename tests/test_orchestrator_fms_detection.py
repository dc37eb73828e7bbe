"""The FMS orchestrator's detection endpoints beyond `content` (issue 40): chat, context and
generated detection, and generation-detection, with its request and response shapes and its
validation texts (fms-guardrails-orchestrator v0.18.3: `src/models.rs`, the handlers, and the
bodies its own tests assert), over real HTTP: the orchestrator on 127.0.0.1, a fake detector
service speaking the detector API's chat, context/doc and generation kinds, a fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, prompt_text
from tests.orchestrator_support import MODEL, Orchestrator, native_config, remote

CHAT = "/api/v2/text/detection/chat"
CONTEXT = "/api/v2/text/detection/context"
GENERATED = "/api/v2/text/detection/generated"
GENERATION = "/api/v2/text/generation-detection"
MESSAGES = [
    {"role": "user", "content": "What is his cellphone?"},
    {"role": "assistant", "content": "It's +1 (123) 123-4567. Mail jo@example.com."},
]
PROMPT = "In 2014, what was the average height of men who were born in 1996?"
ANSWER = "The average height of men who were born in 1996 was 171cm (or 5'7.5'') in 2014."


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add(
        "pii_chat", DetectorBehaviour(words={"cellphone": 0.97, "What": 0.3}, detection="is_pii")
    )
    server.add("fact_check", DetectorBehaviour(words={"height": 0.91}, detection="is_accurate"))
    server.add(
        "relevance", DetectorBehaviour(words={"171cm": 0.89, "born": 0.2}, detection="is_relevant")
    )
    server.add("broken", DetectorBehaviour(fail_status=500))
    await server.start()
    yield server
    await server.close()


def config(engine: FakeEngine, dets: FakeDetectorServer, **model: Any) -> dict[str, Any]:
    kinds = {
        "pii_chat": "text_chat",
        "fact_check": "text_context_doc",
        "relevance": "text_generation",
        "broken": "text_generation",
    }
    detectors: dict[str, Any] = {
        d: {**remote(dets.url, "whole_doc_chunker"), "type": kind} for d, kind in kinds.items()
    }
    detectors["pii"] = {"builtin": "regex", "chunker_id": "sentence"}
    return native_config(engine.url, detectors=detectors, model=model or None)


@pytest.fixture
async def orch(engine: FakeEngine, dets: FakeDetectorServer) -> AsyncIterator[Orchestrator]:
    engine.script = [ANSWER[:20], ANSWER[20:]]
    async with Orchestrator(config(engine, dets)) as o:
        yield o


def detection(detector_id: str, detection: str, score: float, **extra: Any) -> dict[str, Any]:
    return {
        "detection_type": "test",
        "detection": detection,
        "detector_id": detector_id,
        "score": score,
        **extra,
    }


async def test_chat_detection_calls_a_chat_detector_with_the_whole_conversation(
    orch: Orchestrator, dets: FakeDetectorServer
) -> None:
    status, reply = await orch.post(CHAT, {"detectors": {"pii_chat": {}}, "messages": MESSAGES})
    assert status == 200, reply
    # "What" scored 0.3, below the default threshold (0.5); the configured id, not the reply's
    assert reply == {"detections": [detection("pii_chat", "is_pii", 0.97)]}
    [(path, headers, body)] = dets.kind_calls
    assert path == "/api/v1/text/chat"
    assert headers["detector-id"] == headers["x-model-name"] == "pii_chat"
    assert body == {"messages": MESSAGES, "tools": [], "detector_params": {}}


async def test_chat_detection_sends_tools_and_params_and_applies_the_request_threshold(
    orch: Orchestrator, dets: FakeDetectorServer
) -> None:
    tools = [{"type": "function", "function": {"name": "example", "parameters": {"id": "a"}}}]
    request = {
        "detectors": {"pii_chat": {"threshold": 0.2, "style": "strict"}},
        "messages": MESSAGES,
        "tools": tools,
    }
    status, reply = await orch.post(CHAT, request)
    assert status == 200, reply
    assert reply == {
        "detections": [
            detection("pii_chat", "is_pii", 0.97),
            detection("pii_chat", "is_pii", 0.3),
        ]
    }
    [(_, _, body)] = dets.kind_calls
    assert body["tools"] == tools
    assert body["detector_params"] == {"style": "strict"}  # the threshold is the orchestrator's


async def test_a_builtin_text_detector_judges_each_message(orch: Orchestrator) -> None:
    status, reply = await orch.post(CHAT, {"detectors": {"pii": {}}, "messages": MESSAGES})
    assert status == 200, reply
    assert reply == {
        "detections": [
            {
                "detection_type": "pii",
                "detection": "phone",
                "detector_id": "pii",
                "score": 1.0,
                "metadata": {
                    "message_index": 1,
                    "start": 5,
                    "end": 22,
                    "text": "+1 (123) 123-4567",
                },
            },
            {
                "detection_type": "pii",
                "detection": "email",
                "detector_id": "pii",
                "score": 1.0,
                "metadata": {"message_index": 1, "start": 29, "end": 43, "text": "jo@example.com"},
            },
        ]
    }


async def test_context_detection(orch: Orchestrator, dets: FakeDetectorServer) -> None:
    request = {
        "detectors": {"fact_check": {}},
        "content": "The average human height has increased in the past century.",
        "context_type": "url",
        "context": ["https://ourworldindata.org/human-height"],
    }
    status, reply = await orch.post(CONTEXT, request)
    assert status == 200, reply
    assert reply == {"detections": [detection("fact_check", "is_accurate", 0.91)]}
    [(path, _, body)] = dets.kind_calls
    assert path == "/api/v1/text/context/doc"
    assert body == {
        "content": request["content"],
        "context_type": "url",
        "context": request["context"],
        "detector_params": {},
    }


async def test_generated_detection(orch: Orchestrator, dets: FakeDetectorServer) -> None:
    request = {"prompt": PROMPT, "generated_text": ANSWER, "detectors": {"relevance": {}}}
    status, reply = await orch.post(GENERATED, request)
    assert status == 200, reply
    assert reply == {"detections": [detection("relevance", "is_relevant", 0.89)]}
    [(path, _, body)] = dets.kind_calls
    assert path == "/api/v1/text/generation"
    assert body == {"prompt": PROMPT, "generated_text": ANSWER, "detector_params": {}}


async def test_generation_detection_generates_then_judges(
    orch: Orchestrator, engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    request = {"model_id": MODEL, "prompt": PROMPT, "detectors": {"relevance": {}}}
    status, reply = await orch.post(GENERATION, request)
    assert status == 200, reply
    assert reply == {
        "generated_text": ANSWER,
        "detections": [detection("relevance", "is_relevant", 0.89)],
        "input_token_count": len(PROMPT),  # the fake engine: one token per character
    }
    assert [prompt_text(r.body) for r in engine.requests] == [PROMPT]
    [(_, _, body)] = dets.kind_calls
    assert body == {"prompt": PROMPT, "generated_text": ANSWER, "detector_params": {}}


async def test_generation_detection_keeps_the_models_enforced_guardrails(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    """A prompt the model's enforced input guardrail refuses never reaches the model, and no
    detector is asked about text that was not generated."""
    cfg = config(engine, dets, guardrails={"input": {"pii": {"on_detection": "block"}}})
    async with Orchestrator(cfg) as orch:
        request = {
            "model_id": MODEL,
            "prompt": "Mail jo@example.com the answer.",
            "detectors": {"relevance": {}},
        }
        status, reply = await orch.post(GENERATION, request)
    assert status == 200, reply
    assert reply["generated_text"] == "" and reply["detections"] == []
    assert [w["id"] for w in reply["warnings"]] == ["UNSUITABLE_INPUT"]
    assert engine.requests == [] and dets.kind_calls == []


BAD: list[tuple[str, dict[str, Any], int, str]] = [
    (CHAT, {"detectors": {}, "messages": MESSAGES}, 422, "`detectors` is required"),
    (CHAT, {"detectors": {"pii_chat": {}}, "messages": []}, 422, "`messages` is required"),
    (
        CHAT,
        {"detectors": {"pii_chat": {}}, "messages": [{"role": "user"}]},
        422,
        "Message content cannot be empty",
    ),
    (
        CHAT,
        {
            "detectors": {"pii_chat": {}},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        422,
        "Only content of type text is allowed",
    ),
    (CHAT, {"detectors": {"pii_chat": {}}}, 422, "missing field `messages`"),
    (
        CHAT,
        {"detectors": {"pii_chat": {}}, "messages": MESSAGES, "extra_args": 1},
        422,
        "unknown field `extra_args`, expected one of `detectors`, `messages`, `tools`",
    ),
    (
        CHAT,
        {"detectors": {"pii_chat": {"threshold": "high"}}, "messages": MESSAGES},
        422,
        "`threshold` parameter specified for model `pii_chat` must be a number",
    ),
    (
        CHAT,
        {"detectors": {"non_existing_detector": {}}, "messages": MESSAGES},
        404,
        "detector `non_existing_detector` not found",
    ),
    (
        CHAT,
        {"detectors": {"relevance": {}}, "messages": MESSAGES},
        422,
        "detector `relevance` is not supported by this endpoint",
    ),
    (
        CONTEXT,
        {"detectors": {"fact_check": {}}, "content": "", "context_type": "docs", "context": ["x"]},
        422,
        "`content` is required",
    ),
    (
        CONTEXT,
        {"detectors": {"fact_check": {}}, "content": "x", "context_type": "docs", "context": []},
        422,
        "`context` is required",
    ),
    (
        CONTEXT,
        {"detectors": {"pii": {}}, "content": "x", "context_type": "docs", "context": ["y"]},
        422,
        "detector `pii` is not supported by this endpoint",
    ),
    (
        GENERATED,
        {"prompt": "", "generated_text": "x", "detectors": {"relevance": {}}},
        422,
        "`prompt` is required",
    ),
    (
        GENERATED,
        {"prompt": "p", "generated_text": "", "detectors": {"relevance": {}}},
        422,
        "`generated_text` is required",
    ),
    (
        GENERATED,
        {"prompt": "p", "generated_text": "x", "detectors": {}},
        422,
        "`detectors` is required",
    ),
    (
        GENERATED,
        {"prompt": "p", "generated_text": "x", "detectors": {"fact_check": {}}},
        422,
        "detector `fact_check` is not supported by this endpoint",
    ),
    (
        GENERATION,
        {"model_id": "", "prompt": "p", "detectors": {"relevance": {}}},
        422,
        "`model_id` is required",
    ),
    (
        GENERATION,
        {"model_id": MODEL, "prompt": "p", "detectors": {"pii_chat": {}}},
        422,
        "detector `pii_chat` is not supported by this endpoint",
    ),
    (GENERATION, {"model_id": MODEL, "prompt": "p"}, 422, "missing field `detectors`"),
]


@pytest.mark.parametrize(("path", "body", "status", "details"), BAD)
async def test_validation_errors_are_the_fms_orchestrators(
    orch: Orchestrator,
    engine: FakeEngine,
    dets: FakeDetectorServer,
    path: str,
    body: dict[str, Any],
    status: int,
    details: str,
) -> None:
    got, reply = await orch.post(path, body)
    assert (got, reply["code"], reply["details"]) == (status, status, details), reply
    assert reply["type"] == ("not_found" if status == 404 else "invalid_request")
    assert dets.kind_calls == [] and engine.requests == []  # checked before any call


async def test_a_context_type_outside_docs_and_url_is_refused(orch: Orchestrator) -> None:
    request = {
        "detectors": {"fact_check": {}},
        "content": "x",
        "context_type": "thoughts",
        "context": ["y"],
    }
    status, reply = await orch.post(CONTEXT, request)
    assert status == 422 and reply["details"].startswith("context_type: "), reply


async def test_a_failing_detector_is_a_detector_error_that_quotes_nothing(
    orch: Orchestrator,
) -> None:
    request = {"prompt": "p", "generated_text": "x", "detectors": {"broken": {}}}
    status, reply = await orch.post(GENERATED, request)
    assert status == 502, reply
    assert reply == {
        "code": 502,
        "details": "detector `broken`: HTTP 500",
        "type": "detector_error",
    }


async def test_an_out_of_range_score_from_a_kind_detector_is_a_detector_error(
    orch: Orchestrator, dets: FakeDetectorServer
) -> None:
    dets.detectors["relevance"].reply = [{"detection_type": "t", "detection": "d", "score": 5.0}]
    request = {"prompt": "p", "generated_text": "x", "detectors": {"relevance": {}}}
    status, reply = await orch.post(GENERATED, request)
    assert status == 502, reply
    assert reply["details"] == "detector `relevance`: detection 0: score 5.0 is not in [0, 1]"
