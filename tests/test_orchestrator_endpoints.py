"""The other endpoints of DESIGN 4.1, black-box: unary generation, content detection,
stream-content (NDJSON in and out), /health, /info and /openapi.json."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from orchestrator.app import CONTENT_PATH, STREAM_CONTENT_PATH, UNARY_PATH
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    MODEL,
    NDJSON,
    SCRIPT,
    Orchestrator,
    generation_body,
    native_config,
    remote,
)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[FakeEngine, FakeDetectorServer, dict]]:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    dets = FakeDetectorServer()
    dets.add("you", DetectorBehaviour(words={"you": 0.8}, detection="pronoun"))
    dets.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    dets.add("broken", DetectorBehaviour(fail_status=500))
    dets.add("great_para", dets.detectors["great"])
    await dets.start()
    detectors = {
        "you": remote(dets.url),
        "great": remote(dets.url),
        "great_para": remote(dets.url, "paragraph"),
        "broken": remote(dets.url),
        "pii": {"builtin": "regex", "chunker_id": "sentence"},
    }
    yield engine, dets, native_config(engine.url, detectors=detectors)
    await dets.close()
    await engine.close()


async def test_unary_generation_folds_the_stream(setup) -> None:
    cfg = setup[2]
    async with Orchestrator(cfg) as orch:
        status, body = await orch.post(UNARY_PATH, generation_body(output={"you": {}}))
    assert status == 200
    assert body == {
        "generated_text": "I am great. What about you?",
        "token_classification_results": {
            "output": [
                {
                    "start": 23,
                    "end": 26,
                    "word": "you",
                    "entity": "pronoun",
                    "entity_group": "test",
                    "detector_id": "you",
                    "score": 0.8,
                }
            ]
        },
        "finish_reason": "EOS_TOKEN",
        "generated_token_count": 8,
        "input_token_count": 8,
        "warnings": [{"id": "UNSUITABLE_OUTPUT", "message": "Unsuitable output detected."}],
        "status": "completed",
        "migrations": 0,
    }


async def test_unary_generation_errors_are_http_errors(setup) -> None:
    cfg = setup[2]
    async with Orchestrator(cfg) as orch:
        status, body = await orch.post(UNARY_PATH, generation_body(output={"broken": {}}))
        status_404, body_404 = await orch.post(UNARY_PATH, generation_body(model_id="nope"))
    assert status == 502
    assert body["type"] == "detector_error" and "broken" in body["details"]
    assert status_404 == 404 and body_404["type"] == "not_found"


async def test_unary_blocking_returns_the_refusal_without_text(setup) -> None:
    cfg = setup[2]
    async with Orchestrator(cfg) as orch:
        status, body = await orch.post(
            UNARY_PATH, generation_body(output={"great": {"on_detection": "block"}})
        )
    assert status == 200
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "content_filter"}
    assert "great" not in json.dumps(body.get("generated_text"))
    # the refusal says where and what kind, never quotes the withheld text
    assert [(d["word"], d["detector_id"]) for d in body["refusal"]["detections"]] == [("", "great")]
    assert "great." not in json.dumps(body)


async def test_content_detection_spans_are_relative_to_the_whole_content(setup) -> None:
    cfg = setup[2]
    content = "Mail me at jo@example.com. Or call you know who at 555-123-4567."
    async with Orchestrator(cfg) as orch:
        status, body = await orch.post(
            CONTENT_PATH, {"content": content, "detectors": {"pii": {}, "you": {}}}
        )
    assert status == 200
    found = [(d["start"], d["end"], d["text"], d["detector_id"]) for d in body["detections"]]
    assert found == [
        (11, 25, "jo@example.com", "pii"),
        (35, 38, "you", "you"),
        (51, 63, "555-123-4567", "pii"),
    ]
    assert all(content[s:e] == t for s, e, t, _ in found)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"content": "x", "detectors": {}}, 422),
        ({"content": "x"}, 422),
        ({"content": 5, "detectors": {"you": {}}}, 422),
        ({"content": "x", "detectors": {"nope": {}}}, 404),
        ("not json", 415),
        ([1, 2], 422),
    ],
)
async def test_content_detection_rejects_bad_bodies(setup, body, status) -> None:
    cfg = setup[2]
    async with Orchestrator(cfg) as orch:
        got, err = await orch.post(CONTENT_PATH, body)
    assert got == status, err
    assert err["code"] == status
    assert err["type"] == ("not_found" if status == 404 else "invalid_request")


async def test_stream_content_ndjson_in_and_out(setup) -> None:
    cfg = setup[2]
    lines = [
        {"detectors": {"you": {}, "great_para": {}}, "content": "Are you "},
        {"content": "sure? It is great.\n\nAnd you"},
        {"content": " too."},
    ]
    payload = "".join(json.dumps(line) + "\n" for line in lines)
    async with Orchestrator(cfg) as orch:
        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAM_CONTENT_PATH, data=payload, headers={"Content-Type": NDJSON}
        ) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("application/x-ndjson")
            out = [json.loads(x) for x in (await r.text()).splitlines()]
    # "Are you sure? It is great." + "\n\nAnd you too."
    assert [(o["start_index"], o["processed_index"]) for o in out] == [(0, 26), (26, 40)]
    assert [(d["start"], d["end"], d["detector_id"]) for o in out for d in o["detections"]] == [
        (4, 7, "you"),
        (20, 25, "great_para"),
        (32, 35, "you"),
    ]


async def test_stream_content_first_line_errors_are_http_4xx(setup) -> None:
    cfg = setup[2]
    async with Orchestrator(cfg) as orch:
        no_detectors = await orch.post(STREAM_CONTENT_PATH, '{"content": "hi"}\n')
        unknown = await orch.post(
            STREAM_CONTENT_PATH, '{"detectors": {"nope": {}}, "content": "hi"}\n'
        )
        empty = await orch.post(STREAM_CONTENT_PATH, "")
        garbage = await orch.post(STREAM_CONTENT_PATH, "{nope\n")
    assert no_detectors[0] == 422 and "detectors" in no_detectors[1]["details"]
    assert unknown[0] == 404
    assert empty[0] == 422
    assert garbage[0] == 400


async def test_stream_content_bad_later_line_ends_with_an_error_line(setup) -> None:
    cfg = setup[2]
    payload = '{"detectors": {"you": {}}, "content": "Hi you. "}\n{"content": 3}\n'
    async with Orchestrator(cfg) as orch:
        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAM_CONTENT_PATH, data=payload, headers={"Content-Type": NDJSON}
        ) as r:
            assert r.status == 200
            out = [json.loads(x) for x in (await r.text()).splitlines()]
    assert out[-1]["code"] == 422 and out[-1]["type"] == "invalid_request"


async def test_health_info_and_openapi(setup) -> None:
    cfg = setup[2]
    async with Orchestrator(cfg) as orch:
        assert orch.session is not None
        async with orch.session.get(orch.url + "/health") as r:
            assert r.status == 200
            health = await r.json()
        async with orch.session.get(orch.url + "/info") as r:
            info = await r.json()
        async with orch.session.get(orch.url + "/openapi.json") as r:
            assert r.status == 200
            spec = await r.json()
        async with orch.session.get(orch.url + "/nope") as r:
            missing = (r.status, await r.json())
    assert health["status"] == "ok" and health["version"]
    assert set(info["detectors"]) == {"you", "great", "great_para", "broken", "pii"}
    assert set(info["chunkers"]) == {"sentence", "paragraph", "whole_doc_chunker"}
    assert [r["status"] for r in info["models"][MODEL]] == ["HEALTHY"]
    assert spec["openapi"].startswith("3.")
    for path in (UNARY_PATH, CONTENT_PATH, STREAM_CONTENT_PATH, "/health", "/info"):
        assert path in spec["paths"], path
    assert missing == (404, {"code": 404, "details": "no such endpoint", "type": "not_found"})
