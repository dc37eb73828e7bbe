"""A detection kept by the orchestrator: thresholded, stream-relative, tagged with its detector.
Every surface's wire form of it is in `finding_wire` (this module knows no surface)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkers import Span
from detectors.api import Detection
from detectors.base import text_bounds

from ..clients.detectors import DetectorCallError
from ..clients.judges import UNJUDGED_TYPE
from ..clients.registry import RequestedDetector


@dataclass(frozen=True, slots=True)
class Finding:
    start: int
    end: int
    text: str
    detection: str
    detection_type: str
    detector_id: str
    score: float
    evidence: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    # input findings of a conversation: which piece of the request the span is relative to
    # (the message's index, and "name"/"refusal"/"instructions" for text beside the content)
    message_index: int | None = None
    field: str | None = None
    # the span was replaced (DESIGN 4.6a): `text` is the replacement, the span is where it is
    redacted: bool = False
    # a warning, not a verdict: an `on_error: annotate` judge could not judge this text
    # (clients/judges.py); it never blocks, redacts or refuses
    unjudged: bool = False
    # an output finding on a tool call's arguments (spans relative to its arguments string)
    tool_call_index: int | None = None
    tool_call_id: str | None = None


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """The order clients see (DESIGN 4.3): by start, then detector id (input findings of a
    conversation: by message first, `instructions` before every message; a tool call's: by
    call first)."""
    return sorted(
        findings,
        key=lambda f: (
            -1 if f.message_index is None else f.message_index,
            -1 if f.tool_call_index is None else f.tool_call_index,
            f.field or "",
            f.start,
            f.detector_id,
            f.end,
        ),
    )


def kept_findings(
    detector: RequestedDetector, span: Span, detections: list[Detection]
) -> tuple[Finding, ...]:
    """Detections with `score >= threshold`, shifted from chunk-relative to stream-relative;
    a judge's `unjudged` warning whatever its score (only a judge's: a remote detector cannot
    turn a detection into a warning by its type)."""
    kept: list[Finding] = []
    size = len(span.text)
    # a redacting classifier's verdict is on the chunk: it redacts the chunk (DESIGN 4.6a),
    # whatever span its reply names (a remote service may name the word that decided it)
    whole = text_bounds(span.text) if detector.redacting and detector.judges_chunks else None
    for d in detections:
        if not (0 <= d.start <= d.end <= size):
            raise DetectorCallError(
                detector.detector_id,
                f"detection span [{d.start}, {d.end}) lies outside its content of {size} characters",
            )
        unjudged = d.detection_type == UNJUDGED_TYPE and detector.client.reads_context
        if d.score >= detector.threshold or unjudged:
            start, end = (d.start, d.end) if whole is None or unjudged else whole
            if start == end and detector.redacting and whole is None and not unjudged:
                # a verdict without a place (a remote classifier taken for a span detector):
                # redacting no characters would release what it flagged
                raise DetectorCallError(
                    detector.detector_id,
                    f"detection span [{d.start}, {d.end}) covers no text: a redacting detector "
                    "cannot redact it",
                )
            # the detection's text is its span's (DESIGN 6), never the reply's own `text`: a
            # detector that quoted other text there (a redacted number elsewhere in the chunk)
            # would send the client what a redaction withheld
            text = span.text[start:end]
            kept.append(
                Finding(
                    start=span.start + start,
                    end=span.start + end,
                    text=text,
                    detection=d.detection,
                    detection_type=d.detection_type,
                    detector_id=detector.detector_id,
                    score=d.score,
                    evidence=d.evidence,
                    metadata=d.metadata,
                    unjudged=unjudged,
                )
            )
    return tuple(kept)
