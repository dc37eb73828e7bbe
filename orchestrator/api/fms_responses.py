"""Response bodies, frames and terminal events (DESIGN sections 4.3 to 4.6). Null fields are
omitted on the wire: serialise with `dump()`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .errors import ErrorBody


class Wire(BaseModel):
    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class TokenClassificationResult(Wire):
    """A detection as a client sees it; spans relative to the whole text (never to a chunk)."""

    start: int
    end: int
    word: str
    entity: str
    entity_group: str
    detector_id: str
    score: float
    # DESIGN 4.6a: the span was replaced; `word` is the replacement the client received
    redacted: bool | None = None
    # DESIGN 4.8: a detection on a tool call's arguments (the span is relative to them)
    tool_call_index: int | None = None
    tool_call_id: str | None = None


class TokenClassificationResults(Wire):
    input: list[TokenClassificationResult] | None = None
    output: list[TokenClassificationResult] | None = None


class FrameWarning(Wire):
    id: Literal["UNSUITABLE_INPUT", "UNSUITABLE_OUTPUT"]
    message: str


UNSUITABLE_INPUT = FrameWarning(
    id="UNSUITABLE_INPUT",
    message="Unsuitable input detected. Please check the detected entities on your input.",
)
UNSUITABLE_OUTPUT = FrameWarning(
    id="UNSUITABLE_OUTPUT",
    message="Unsuitable output detected.",
)

FinishReason = Literal[
    "EOS_TOKEN", "STOP_SEQUENCE", "MAX_TOKENS", "TIME_LIMIT", "CANCELLED", "ERROR"
]


class ClassifiedFrame(Wire):
    """One SSE data message of the streaming task endpoint."""

    generated_text: str | None = None
    token_classification_results: TokenClassificationResults = Field(
        default_factory=TokenClassificationResults
    )
    start_index: int | None = None
    processed_index: int | None = None
    finish_reason: FinishReason | None = None
    generated_token_count: int | None = None
    input_token_count: int | None = None
    seed: int | None = None
    warnings: list[FrameWarning] | None = None


class IncompleteDetails(Wire):
    reason: Literal["max_output_tokens", "time_limit", "content_filter"]


class StreamError(Wire):
    code: int
    type: str
    message: str


class TerminalSummary(Wire):
    """Data of `completed`, `incomplete` and `failed`."""

    finish_reason: FinishReason | None = None
    generated_token_count: int = 0
    input_token_count: int | None = None
    processed_index: int = 0
    migrations: int = 0
    incomplete_details: IncompleteDetails | None = None
    error: StreamError | None = None


class RefusalDelta(Wire):
    delta: str


class RefusalDone(Wire):
    refusal: str
    detections: list[TokenClassificationResult]


class ClassifiedGeneratedTextResult(Wire):
    """Body of the unary task endpoint: the whole stream folded into one object."""

    generated_text: str | None = None
    token_classification_results: TokenClassificationResults = Field(
        default_factory=TokenClassificationResults
    )
    finish_reason: FinishReason | None = None
    generated_token_count: int | None = None
    input_token_count: int | None = None
    seed: int | None = None
    warnings: list[FrameWarning] | None = None
    status: Literal["completed", "incomplete"] = "completed"
    incomplete_details: IncompleteDetails | None = None
    refusal: RefusalDone | None = None
    migrations: int = 0


class ContentDetection(Wire):
    """A detection from the content endpoints; spans relative to the whole content."""

    start: int
    end: int
    text: str
    detection: str
    detection_type: str
    detector_id: str
    score: float
    evidence: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    redacted: bool | None = None  # with `redact: true`: `text` is the replacement


class ContentDetectionResponse(Wire):
    """With `redact: true`, `redacted_content` is the content with every detection replaced, and
    the spans are relative to it."""

    detections: list[ContentDetection]
    redacted_content: str | None = None


class StreamContentResult(Wire):
    """One NDJSON line of the stream-content reply."""

    detections: list[ContentDetection]
    start_index: int
    processed_index: int


class HealthResponse(Wire):
    status: Literal["ok"] = "ok"
    version: str


class ComponentStatus(Wire):
    status: Literal["HEALTHY", "UNHEALTHY", "UNKNOWN"]
    details: dict[str, Any] | None = None


class InfoResponse(Wire):
    """GET /info. `DEGRADED`: ready (200), but a replica or a detector that no enforced
    guardrail uses is unhealthy. Without a key (auth on) only `status`: ids map the deployment."""

    status: Literal["HEALTHY", "DEGRADED", "UNHEALTHY", "UNKNOWN"]
    models: dict[str, list[dict[str, Any]]] | None = None
    detectors: dict[str, ComponentStatus] | None = None
    chunkers: dict[str, ComponentStatus] | None = None


__all__ = ["ErrorBody"]
