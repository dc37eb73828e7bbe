"""A finding's wire forms (orchestrator/streaming/finding_wire.py) are the API's wire models:
each plain-dict form equals its pydantic model filled in field by field from DESIGN's mapping
(4.3 TCR, 4.1 content detection, the FMS orchestrator's completions `Detection`), key order
included, and every surface renders a detection's score the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from orchestrator.api.fms_responses import ContentDetection, TokenClassificationResult
from orchestrator.api.openai_completions import CompletionDetection
from orchestrator.api.openai_responses import GuardrailAnnotation
from orchestrator.streaming import finding_wire
from orchestrator.streaming.chat_writer import ChatChunkWriter
from orchestrator.streaming.completions_writer import CompletionChunkWriter
from orchestrator.streaming.events import Frame
from orchestrator.streaming.findings import Finding
from orchestrator.streaming.fms_writer import sse_event

json_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=3))
findings = st.builds(
    Finding,
    start=st.integers(0, 100),
    end=st.integers(0, 100),
    text=st.text(max_size=5),
    detection=st.text(max_size=5),
    detection_type=st.text(max_size=5),
    detector_id=st.text(min_size=1, max_size=5),
    # a detector's score is a float; an integer one must still read as the wire models say
    score=st.one_of(st.floats(0, 1), st.integers(0, 1)),
    evidence=st.one_of(st.none(), st.lists(st.dictionaries(st.text(max_size=2), json_values))),
    metadata=st.one_of(st.none(), st.dictionaries(st.text(max_size=2), json_values)),
    message_index=st.one_of(st.none(), st.integers(0, 3)),
    field=st.sampled_from([None, "name", "instructions"]),
    redacted=st.booleans(),
)


# each form's wire model, and DESIGN's mapping of its fields to a Finding's (`redacted` apart)
TCR = {
    "start": "start",
    "end": "end",
    "word": "text",
    "entity": "detection",
    "entity_group": "detection_type",
    "detector_id": "detector_id",
    "score": "score",
}
CONTENT = {
    "start": "start",
    "end": "end",
    "text": "text",
    "detection": "detection",
    "detection_type": "detection_type",
    "detector_id": "detector_id",
    "score": "score",
    "evidence": "evidence",
    "metadata": "metadata",
}
FORMS: dict[str, tuple[Callable[[Finding], dict[str, Any]], type[BaseModel], dict[str, str]]] = {
    "tcr": (finding_wire.tcr, TokenClassificationResult, TCR),
    "content": (finding_wire.content, ContentDetection, CONTENT),
    # the FMS orchestrator's order; no evidence or metadata
    "completion_detection": (
        finding_wire.completion_detection,
        CompletionDetection,
        {k: CONTENT[k] for k in ("start", "end", "text", "detector_id", "detection_type")}
        | {"detection": "detection", "score": "score"},
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
@settings(max_examples=60)
@given(f=findings)
def test_each_form_is_its_wire_model(form: str, f: Finding) -> None:
    render, model, fields = FORMS[form]
    values = {wire: getattr(f, attr) for wire, attr in fields.items()}
    wire = model(**values, redacted=True if f.redacted else None).model_dump(
        mode="json", exclude_none=True
    )
    rendered = render(f)
    assert rendered == wire
    assert list(rendered) == list(wire)  # the model's field order: the bytes follow it
    assert type(rendered["score"]) is float


@settings(max_examples=30)
@given(findings)
def test_the_models_are_the_forms(f: Finding) -> None:
    """Where a reply is assembled from the API's models, the model holds the same form."""
    assert finding_wire.tcr_model(f).dump() == finding_wire.tcr(f)
    assert finding_wire.content_model(f).dump() == finding_wire.content(f)


def test_the_annotations_name_their_piece_and_withhold_blocked_text() -> None:
    f = Finding(3, 8, "[mail]", "email", "pii", "pii", 1.0, message_index=2, redacted=True)
    assert finding_wire.annotation(f).model_dump(mode="json") == {
        "type": "guardrail_detection",
        "start_index": 3,
        "end_index": 8,
        "text": "[mail]",
        "detector_id": "pii",
        "detection": "email",
        "detection_type": "pii",
        "score": 1.0,
        "redacted": True,
    }
    assert finding_wire.annotation(f, withheld=True).text == ""
    note = finding_wire.input_annotation(f).model_dump(mode="json")
    assert (note["field"], note["message_index"]) == ("input", 2)
    on_instructions = Finding(0, 2, "hi", "x", "y", "d", 0.5, field="instructions")
    note = finding_wire.input_annotation(on_instructions).model_dump(mode="json")
    assert (note["field"], note["message_index"], "redacted" in note) == (
        "instructions",
        None,
        False,
    )
    assert isinstance(finding_wire.annotation(on_instructions), GuardrailAnnotation)


def test_detection_result_carries_the_span_in_metadata_after_the_detectors_own() -> None:
    f = Finding(1, 4, "abc", "email", "pii", "pii", 0.5, None, {"start": 99, "k": "v"}, 1)
    assert finding_wire.detection_result(f).model_dump(mode="json", exclude_none=True) == {
        "detection_type": "pii",
        "detection": "email",
        "detector_id": "pii",
        "score": 0.5,
        "metadata": {"start": 1, "k": "v", "message_index": 1, "end": 4, "text": "abc"},
    }


def test_an_integer_score_reads_as_a_float_on_every_surface() -> None:
    """The hot paths render dicts, not models: an integer score would go out as `1` on one
    surface and `1.0` on another (the FMS frame rendered its TCR without the cast)."""
    f = Finding(0, 2, "Hi", "greeting", "form", "mood", 1)  # type: ignore[arg-type]
    frame = Frame(start=0, end=2, text="Hi", detections=[f], judged=True)
    fms = sse_event(frame)
    chat = ChatChunkWriter("m", include_usage=False).render(frame)
    completions = CompletionChunkWriter("m", include_usage=False).render(frame)
    for wire in (fms, chat, completions):
        assert b'"score":1.0' in wire and b'"score":1,' not in wire and b'"score":1}' not in wire
