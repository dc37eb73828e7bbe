"""The FMS orchestrator's streaming-classification integration scenarios, ported as black-box HTTP
tests: the real orchestrator on 127.0.0.1, a fake native engine and fake remote detectors on their
own sockets. Where DESIGN differs from FMS the expectations follow DESIGN: stream-relative spans,
one terminal event per stream, real 4xx for validation errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from orchestrator.app import STREAMING_PATH
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    SCRIPT,
    Orchestrator,
    SseEvent,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    remote,
    terminal,
)

# "I am great. What about you?" in eight tokens; two sentences: [0, 11) and [11, 27).
TEXT = "I am great. What about you?"
UNSUITABLE_OUTPUT = {"id": "UNSUITABLE_OUTPUT", "message": "Unsuitable output detected."}
UNSUITABLE_INPUT = {
    "id": "UNSUITABLE_INPUT",
    "message": "Unsuitable input detected. Please check the detected entities on your input.",
}


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add("clean", DetectorBehaviour())
    server.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    server.add("you", DetectorBehaviour(words={"you": 0.8, "What": 0.7}, detection="pronoun"))
    server.add("broken", DetectorBehaviour(fail_status=500))
    server.add("dies_later", DetectorBehaviour(fail_status=503, fail_on="What"))
    server.add("email", DetectorBehaviour(words={"email": 0.95}, detection="EmailAddress"))
    server.add("miscount", DetectorBehaviour(drop_one=True))
    await server.start()
    yield server
    await server.close()


def config(engine: FakeEngine, dets: FakeDetectorServer, **detectors: dict) -> dict:
    base = {name: remote(dets.url) for name in ("clean", "great", "you", "broken", "email")}
    base["dies_later"] = remote(dets.url)
    base["miscount"] = remote(dets.url)
    base["email_whole"] = remote(dets.url, "whole_doc_chunker")
    base["generation_type"] = remote(dets.url, type="text_generation")
    base.update(detectors)
    return native_config(engine.url, detectors=base)


def release_after_first_frame(engine: FakeEngine) -> Callable[[list[SseEvent]], None]:
    def on_event(events: list[SseEvent]) -> None:
        if frames(events):
            engine.release.set()

    return on_event


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


async def test_no_detectors_forwards_every_token_as_a_frame(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body())
    fs = frames(events)
    assert [f["generated_text"] for f in fs] == SCRIPT
    assert assert_contiguous(fs) == TEXT
    assert fs[-1]["finish_reason"] == "EOS_TOKEN"
    assert fs[-1]["generated_token_count"] == 8
    assert all("finish_reason" not in f for f in fs[:-1])
    assert all(f["input_token_count"] == len("Hi there") for f in fs)
    end = terminal(events)
    assert end.name == "completed"
    assert end.data == {
        "finish_reason": "EOS_TOKEN",
        "generated_token_count": 8,
        "input_token_count": 8,
        "processed_index": 27,
        "migrations": 0,
    }


async def test_input_detection_without_hits_goes_on_to_generation(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body("Hi there", input={"email": {}}))
    assert assert_contiguous(frames(events)) == TEXT
    assert terminal(events).name == "completed"
    assert [c[:2] for c in dets.calls] == [("email", ["Hi there"])]


async def test_input_detection_with_a_hit_refuses_without_calling_the_model(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(
            generation_body("Here is my email: a@b.c. Thanks.", input={"email": {}})
        )
    assert len(events) == 2
    frame = events[0].data
    assert events[0].name is None
    assert frame["token_classification_results"] == {
        "input": [tcr(11, 16, "email", "EmailAddress", "email", 0.95)]
    }
    assert frame["warnings"] == [UNSUITABLE_INPUT]
    assert frame["input_token_count"] == len("Here is my email: a@b.c. Thanks.")
    assert frame["start_index"] == 0 and frame["processed_index"] == 0
    end = terminal(events)
    assert end.name == "incomplete"
    assert end.data["incomplete_details"] == {"reason": "content_filter"}
    assert engine.requests == []  # the model was never called


async def test_two_input_detectors_results_sorted_by_start_then_detector(engine, dets) -> None:
    inputs = "What? I sent you an email. Then you replied."
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(inputs, input={"you": {}, "email": {}}))
    found = events[0].data["token_classification_results"]["input"]
    # sentence-chunked, yet spans are relative to the whole inputs
    assert [(d["start"], d["end"], d["detector_id"]) for d in found] == [
        (0, 4, "you"),
        (13, 16, "you"),
        (20, 25, "email"),
        (32, 35, "you"),
    ]
    assert all(inputs[d["start"] : d["end"]] == d["word"] for d in found)
    assert terminal(events).name == "incomplete"


async def test_input_detector_error_gives_error_event_naming_it(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(input={"broken": {}}))
    assert len(events) == 1
    end = terminal(events)
    assert end.name == "error"
    assert end.data["code"] == 502
    assert end.data["type"] == "detector_error"
    assert "broken" in end.data["details"]
    assert engine.requests == []


async def test_input_detector_reply_count_mismatch_is_an_error(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body("One. Two. Three.", input={"miscount": {}}))
    end = terminal(events)
    assert end.name == "error"
    assert end.data["type"] == "detector_error"
    assert "miscount" in end.data["details"]


async def test_generation_error_before_first_token_is_an_error_event(engine, dets) -> None:
    engine.inject(Fault("error", error_type="generation_error", message="engine broke"))
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"clean": {}}))
    assert len(events) == 1
    end = terminal(events)
    assert end.name == "error"
    assert end.data["type"] == "generation_error"
    # the engine's own words are logged, never quoted to a client (DESIGN 6)
    assert end.data["details"] == "replica native-0 reported an error"


async def test_engine_4xx_that_slips_through_is_invalid_request_not_5xx(engine, dets) -> None:
    """A client mistake only the engine caught is still the client's: 422, never a 502."""
    engine.inject(Fault("http", status=400, message="prompt rejected"))
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"clean": {}}))
    assert len(events) == 1
    end = terminal(events)
    assert end.name == "error"
    assert end.data["code"] == 422 and end.data["type"] == "invalid_request"
    assert end.data["details"] == "replica native-0 rejected the request (HTTP 400)"


async def test_generation_error_mid_stream_is_failed_after_frames(engine, dets) -> None:
    engine.inject(Fault("error", after_tokens=7, error_type="generation_error", message="boom"))
    # the engine waits after "I am great. What about" (the chunker knows the first sentence ended
    # once the next word is whole) until the first sentence's frame has reached the client: it is judged before the failure arrives
    engine.hold_after = 6
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(
            generation_body(output={"clean": {}}), on_event=release_after_first_frame(engine)
        )
    assert [f["generated_text"] for f in frames(events)] == ["I am great."]
    end = terminal(events)
    assert end.name == "failed"
    assert end.data["error"]["type"] == "generation_error"
    assert end.data["error"]["message"] == "replica native-0 reported an error"
    assert end.data["processed_index"] == 11


@pytest.mark.parametrize(
    ("body", "details"),
    [
        ({"model_id": "fake-model", "inputs": "x", "colour": "red"}, "colour"),
        ({"model_id": "fake-model"}, "inputs"),
        (
            {"model_id": "fake-model", "inputs": "x", "text_gen_parameters": {"topk": 3}},
            "topk",
        ),
        (
            {
                "model_id": "fake-model",
                "inputs": "x",
                "guardrail_config": {"output": {"models": {"clean": {"threshold": "high"}}}},
            },
            "threshold",
        ),
    ],
)
async def test_invalid_bodies_are_422_before_streaming(engine, dets, body, details) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        status, err = await orch.post(STREAMING_PATH, body)
    assert status == 422
    assert err["code"] == 422 and err["type"] == "invalid_request"
    assert details in err["details"]
    assert engine.requests == []


def _with_threshold(value: object) -> dict:
    return {
        "model_id": "fake-model",
        "inputs": "x",
        "guardrail_config": {"output": {"models": {"clean": {"threshold": value}}}},
    }


@pytest.mark.parametrize(
    ("body", "details"),
    [
        (
            {"model_id": "fake-model", "inputs": "x", "parameters": {"max_new_tokens": 3}},
            "parameters: unknown field (did you mean `text_gen_parameters`?)",
        ),
        (
            {"model_id": "fake-model", "inputs": "x", "text_gen_parameters": {"max_tokens": 3}},
            "text_gen_parameters.max_tokens: unknown field (did you mean `max_new_tokens`?)",
        ),
        (
            {"model_id": "fake-model", "inputs": "x", "colour": "red"},
            "colour: unknown field (expected one of: guardrail_config, inputs, model_id, "
            "text_gen_parameters)",
        ),
        (
            _with_threshold(5),
            "guardrail_config.output.models.clean.threshold: "
            "threshold must be between 0 and 1, got 5",
        ),
        (
            _with_threshold(-1),
            "guardrail_config.output.models.clean.threshold: "
            "threshold must be between 0 and 1, got -1",
        ),
    ],
)
async def test_bad_bodies_get_exact_helpful_422s(engine, dets, body, details) -> None:
    """A guessed field gets a hint; a threshold outside [0, 1] (5 silently turned a detector
    off) is refused naming the field."""
    async with Orchestrator(config(engine, dets)) as orch:
        status, err = await orch.post(STREAMING_PATH, body)
    assert (status, err) == (422, {"code": 422, "details": details, "type": "invalid_request"})
    assert engine.requests == []


async def test_unknown_detector_is_404_naming_it(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        status, err = await orch.post(STREAMING_PATH, generation_body(output={"nope": {}}))
        status_in, err_in = await orch.post(STREAMING_PATH, generation_body(input={"nope": {}}))
    assert (status, err) == (
        404,
        {
            "code": 404,
            "details": "detector `nope` not found (available: broken, clean, dies_later, email, "
            "email_whole, generation_type, great, miscount, you)",
            "type": "not_found",
        },
    )
    assert (status_in, err_in) == (status, err)


async def test_wrong_detector_type_is_422(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        status, err = await orch.post(
            STREAMING_PATH, generation_body(output={"generation_type": {}})
        )
    assert status == 422
    assert err["type"] == "invalid_request"
    assert "generation_type" in err["details"]


async def test_unknown_model_is_404(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        status, err = await orch.post(STREAMING_PATH, generation_body(model_id="gpt-9"))
    assert status == 404
    assert err == {
        "code": 404,
        "details": "model `gpt-9` not found (available: fake-model)",
        "type": "not_found",
    }


async def test_output_detection_one_detector_without_detections(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"clean": {}}))
    fs = frames(events)
    assert [(f["start_index"], f["processed_index"], f["generated_text"]) for f in fs] == [
        (0, 11, "I am great."),
        (11, 27, " What about you?"),
    ]
    assert all(f["token_classification_results"] == {"output": []} for f in fs)
    assert all("warnings" not in f for f in fs)
    assert fs[-1]["finish_reason"] == "EOS_TOKEN"
    assert terminal(events).name == "completed"
    # chunks that are ready together may share one call: the detector API takes a list
    assert [text for c in dets.calls for text in c[1]] == ["I am great.", " What about you?"]


async def test_output_detection_one_detector_with_detections(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"you": {}}))
    fs = frames(events)
    assert fs[0]["token_classification_results"] == {"output": []}
    assert "warnings" not in fs[0]
    # stream-relative: "What" is at 12 in the stream (1 in its chunk), "you" at 23
    assert fs[1]["token_classification_results"] == {
        "output": [
            tcr(12, 16, "What", "pronoun", "you", 0.7),
            tcr(23, 26, "you", "pronoun", "you", 0.8),
        ]
    }
    assert fs[1]["warnings"] == [UNSUITABLE_OUTPUT]
    assert terminal(events).name == "completed"


async def test_output_detection_two_detectors_sorted(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"you": {}, "great": {}}))
    fs = frames(events)
    assert assert_contiguous(fs) == TEXT
    assert [
        (d["start"], d["detector_id"])
        for f in fs
        for d in f["token_classification_results"]["output"]
    ] == [(5, "great"), (12, "you"), (23, "you")]
    assert fs[0]["warnings"] == [UNSUITABLE_OUTPUT]
    assert terminal(events).name == "completed"


async def test_output_detector_error_mid_stream_delivers_earlier_frames_then_failed(
    engine, dets
) -> None:
    # the engine waits after "I am great. What about" (the chunker knows the first sentence ended
    # once the next word is whole) until the first sentence's frame has reached the client: the two sentences reach the detector in separate calls
    engine.hold_after = 6
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(
            generation_body(output={"dies_later": {}}), on_event=release_after_first_frame(engine)
        )
    assert [f["generated_text"] for f in frames(events)] == ["I am great."]
    end = terminal(events)
    assert end.name == "failed"
    assert end.data["error"]["code"] == 502
    assert end.data["error"]["type"] == "detector_error"
    assert "dies_later" in end.data["error"]["message"]
    assert end.data["processed_index"] == 11
    assert end.data["finish_reason"] == "ERROR"


async def test_output_detector_error_before_any_frame_is_error(engine, dets) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"broken": {}, "clean": {}}))
    assert len(events) == 1
    end = terminal(events)
    assert end.name == "error"
    assert end.data["type"] == "detector_error"
    assert "broken" in end.data["details"]
