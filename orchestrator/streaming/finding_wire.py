"""The wire forms of a `Finding`: one function per shape a surface shows a detection in, so a
field's name, order, omission and type are decided once (issue 33).

- `tcr`: the token classification result (DESIGN 4.3): FMS frames, `refusal.done`, the unary
  task result, and the Chat Completions `detections` extension (4.8);
- `content`: the content endpoints' detection (4.1: content and stream-content);
- `annotation`, `input_annotation`: the Responses `guardrail_detection` annotation (4.9);
- `completion_detection`: the FMS orchestrator's `Detection` of completions-detection;
- `detection_result`: the FMS orchestrator's span-less `DetectionResult` of chat, context and
  generated detection (the span goes into `metadata`).

Every form: `score` is a float (the wire models' type: an integer score reads `1.0` on every
surface), `redacted: true` only on a redacted finding (4.6a); the dict forms leave out what is
None (an input annotation's `message_index: null` stays: the Responses shape sends it).

The plain-dict forms are the definitions: their hot paths (a frame per token, tens of
thousands of detections in one content reply) render them with no pydantic object each; where
a reply is assembled from the API's models, `tcr_model`/`content_model` validate the same dict
into one. tests/test_finding_wire.py checks each form against its wire model filled in field by
field."""

from __future__ import annotations

from typing import Any

from ..api.fms_detection import DetectionResult
from ..api.fms_responses import ContentDetection, TokenClassificationResult
from ..api.openai_responses import GuardrailAnnotation, InputAnnotation
from .findings import Finding


def tcr(f: Finding) -> dict[str, Any]:
    """`{start, end, word, entity, entity_group, detector_id, score, redacted?,
    tool_call_index?, tool_call_id?}`: `word`, `entity`, `entity_group` are the detector's
    `text`, `detection`, `detection_type`; a finding on a tool call's arguments names the call
    (its span is relative to the call's arguments string)."""
    out: dict[str, Any] = {
        "start": f.start,
        "end": f.end,
        "word": f.text,
        "entity": f.detection,
        "entity_group": f.detection_type,
        "detector_id": f.detector_id,
        "score": float(f.score),
    }
    if f.redacted:
        out["redacted"] = True
    if f.tool_call_index is not None:
        out["tool_call_index"] = f.tool_call_index
        if f.tool_call_id is not None:
            out["tool_call_id"] = f.tool_call_id
    return out


def tcr_model(f: Finding) -> TokenClassificationResult:
    return TokenClassificationResult.model_validate(tcr(f))


def content(f: Finding) -> dict[str, Any]:
    """`{start, end, text, detection, detection_type, detector_id, score, evidence?,
    metadata?, redacted?}`."""
    out: dict[str, Any] = {
        "start": f.start,
        "end": f.end,
        "text": f.text,
        "detection": f.detection,
        "detection_type": f.detection_type,
        "detector_id": f.detector_id,
        "score": float(f.score),
    }
    if f.evidence is not None:
        out["evidence"] = f.evidence
    if f.metadata is not None:
        out["metadata"] = f.metadata
    if f.redacted:
        out["redacted"] = True
    return out


def content_model(f: Finding) -> ContentDetection:
    return ContentDetection.model_validate(content(f))


# the FMS orchestrator's `Detection`: its field order, and no evidence or metadata there
FMS_DETECTION_KEYS = (
    "start",
    "end",
    "text",
    "detector_id",
    "detection_type",
    "detection",
    "score",
    "redacted",
)


def completion_detection(f: Finding) -> dict[str, Any]:
    """The content detection as the FMS orchestrator's completions-detection shows it."""
    c = content(f)
    return {k: c[k] for k in FMS_DETECTION_KEYS if k in c}


def detection_result(f: Finding) -> DetectionResult:
    """A text detector's finding where the endpoint's detections have no span: the span (and
    the message it is relative to) in `metadata`, after the detector's own metadata."""
    where: dict[str, Any] = {"start": f.start, "end": f.end, "text": f.text}
    if f.message_index is not None:
        where = {"message_index": f.message_index, **where}
    return DetectionResult(
        detection_type=f.detection_type,
        detection=f.detection,
        detector_id=f.detector_id,
        score=f.score,
        evidence=f.evidence or None,
        metadata={**(f.metadata or {}), **where},
    )


def annotation(f: Finding, *, withheld: bool = False) -> GuardrailAnnotation:
    """`withheld`: the span lies in text a blocking detector stopped, which never leaves the
    service, so neither does its `text`."""
    return GuardrailAnnotation(
        start_index=f.start,
        end_index=f.end,
        text="" if withheld else f.text,
        detector_id=f.detector_id,
        detection=f.detection,
        detection_type=f.detection_type,
        score=f.score,
        redacted=True if f.redacted else None,
        call_id=f.tool_call_id if f.tool_call_index is not None else None,
    )


def input_annotation(f: Finding) -> InputAnnotation:
    """A detection on the request, with the piece it is relative to: `instructions`, or the
    input item `message_index`."""
    return InputAnnotation(
        **annotation(f).model_dump(exclude={"type"}),
        field="instructions" if f.field == "instructions" else "input",
        message_index=f.message_index,
    )
