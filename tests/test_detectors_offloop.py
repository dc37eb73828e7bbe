"""Issue 20, item 4: nothing CPU-heavy on the event loop for large inputs. Four concurrent 1 MB
PII-dense /content requests used to stall /health for 3 s: chunking, scanning and the building
of tens of thousands of findings and of the reply all ran on the loop. Past BULK_CHARS they run
in worker threads; below it (a sentence, a prompt) they stay inline. Checked by where the work
runs (thread identities), never by the clock; the figures are bench/loop_lag.py's."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchestrator.app import CONTENT_PATH
from orchestrator.streaming import text_judgement
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import SCRIPT, Orchestrator, generation_body, native_config

SENTENCE = "Mail jo@example.com or call 555-123-4567 today. "


@pytest.fixture
async def orch() -> AsyncIterator[Orchestrator]:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    dets = {"pii": {"builtin": "regex", "chunker_id": "sentence"}}
    async with Orchestrator(native_config(engine.url, detectors=dets)) as o:
        yield o
    await engine.close()


@pytest.fixture
def where(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The threads that chunked texts and built findings, by step."""
    seen: dict[str, list[int]] = {"chunk": [], "findings": []}
    real_chunk, real_findings = text_judgement._chunk_regions, text_judgement._findings

    def chunk(*args: Any) -> Any:
        seen["chunk"].append(threading.get_ident())
        return real_chunk(*args)

    def findings(*args: Any) -> Any:
        seen["findings"].append(threading.get_ident())
        return real_findings(*args)

    monkeypatch.setattr(text_judgement, "_chunk_regions", chunk)
    monkeypatch.setattr(text_judgement, "_findings", findings)
    return seen


async def test_a_large_content_is_chunked_and_judged_off_the_loop_with_exact_results(
    orch: Orchestrator, where: dict[str, list[int]]
) -> None:
    n = text_judgement.BULK_CHARS // len(SENTENCE) + 10
    text = SENTENCE * n
    status, body = await orch.post(CONTENT_PATH, {"content": text, "detectors": {"pii": {}}})
    assert status == 200
    loop_thread = threading.get_ident()
    assert where["chunk"] and loop_thread not in where["chunk"]
    assert where["findings"] and loop_thread not in where["findings"]
    found = body["detections"]
    assert len(found) == 2 * n  # more than 256: the reply is built off the loop too
    want = []
    for i in range(n):
        at = i * len(SENTENCE)
        want.append((at + 5, at + 19, "jo@example.com", "email"))
        want.append((at + 28, at + 40, "555-123-4567", "phone"))
    assert [(d["start"], d["end"], d["text"], d["detection"]) for d in found] == want
    assert found[0] == {
        "start": 5,
        "end": 19,
        "text": "jo@example.com",
        "detection": "email",
        "detection_type": "pii",
        "detector_id": "pii",
        "score": 1.0,
    }


async def test_a_small_content_and_a_prompt_stay_on_the_loop(
    orch: Orchestrator, where: dict[str, list[int]]
) -> None:
    status, body = await orch.post(CONTENT_PATH, {"content": SENTENCE, "detectors": {"pii": {}}})
    assert status == 200 and len(body["detections"]) == 2
    events = await orch.stream(generation_body("Hi there", input={"pii": {}}))
    assert events[-1].name == "completed"
    loop_thread = threading.get_ident()
    assert where["chunk"] == [loop_thread] * 2 and where["findings"] == [loop_thread] * 2


async def test_windows_only_at_cuts_that_are_no_sentence_end(
    orch: Orchestrator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk boundary is looked across only where the cut is not natural for the detector:
    a sentence end splits none of the regex detector's kinds, so neither the content endpoint
    nor an input gets a window there (an input did at every boundary before, issue 33); the
    `max_chars` safety cut inside a run of words gets one on both. Counted, not timed: the
    windows doubled the detector work of bulk text (bench/loop_lag.py)."""
    windows: list[int] = []
    real_seam = text_judgement._seam

    def seam(text: str, start: int, end: int, boundary: int) -> Any:
        windows.append(boundary)
        return real_seam(text, start, end, boundary)

    monkeypatch.setattr(text_judgement, "_seam", seam)
    three = SENTENCE * 3  # three sentences, each far below the sentence chunker's max_chars
    status, body = await orch.post(CONTENT_PATH, {"content": three, "detectors": {"pii": {}}})
    assert status == 200 and len(body["detections"]) == 6
    assert windows == []

    # 600 characters without a sentence end: one safety cut (max_chars 500), at the last
    # whitespace before it; the phone number after the cut is found whole
    run_on = "word " * 99 + "call 555-123-4567 now " + "more " * 20
    status, body = await orch.post(CONTENT_PATH, {"content": run_on, "detectors": {"pii": {}}})
    assert status == 200
    assert [d["text"] for d in body["detections"]] == ["555-123-4567"]
    assert windows == [499]  # before the space after "call"

    windows.clear()
    events = await orch.stream(generation_body(three, input={"pii": {}}))
    assert events[-1].name == "incomplete"  # refused: the input holds PII
    assert events[-1].data["incomplete_details"] == {"reason": "content_filter"}
    assert windows == []

    events = await orch.stream(generation_body(run_on, input={"pii": {}}))
    assert events[-1].name == "incomplete"
    assert windows == [499]


async def test_a_refused_large_input_s_unary_reply_is_built_off_the_loop(
    orch: Orchestrator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused 1 MB input's unary reply holds one detection per e-mail and phone: building
    and encoding it took a second on the loop (found with bench/loop_lag.py --inputs). It is
    built in a worker thread, with every detection in it."""
    from orchestrator.app import UNARY_PATH
    from orchestrator.streaming import fms_writer

    built: list[int] = []
    real_body = fms_writer.UnaryFold.body

    def body(self: fms_writer.UnaryFold) -> dict[str, Any]:
        built.append(threading.get_ident())
        return real_body(self)

    monkeypatch.setattr(fms_writer.UnaryFold, "body", body)
    n = text_judgement.BULK_CHARS // len(SENTENCE) + 10
    request = generation_body(SENTENCE * n, input={"pii": {}})
    status, reply = await orch.post(UNARY_PATH, request)
    assert status == 200
    assert built and threading.get_ident() not in built
    found = reply["token_classification_results"]["input"]
    assert len(found) == 2 * n
    assert (reply["status"], reply["incomplete_details"]) == (
        "incomplete",
        {"reason": "content_filter"},
    )
    assert "generated_text" not in reply  # the model was never called
    tcr = {"entity_group": "pii", "detector_id": "pii", "score": 1.0}
    at = (n - 1) * len(SENTENCE)
    assert [found[0], found[1], found[-1]] == [
        {"start": 5, "end": 19, "word": "jo@example.com", "entity": "email", **tcr},
        {"start": 28, "end": 40, "word": "555-123-4567", "entity": "phone", **tcr},
        {"start": at + 28, "end": at + 40, "word": "555-123-4567", "entity": "phone", **tcr},
    ]
