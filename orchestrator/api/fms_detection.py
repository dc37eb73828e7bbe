"""The FMS orchestrator's detection endpoints beyond `content` (issue 40): chat, context and
generated detection, and generation-detection, with the FMS orchestrator's own request and
response shapes and validation messages (`fms-guardrails-orchestrator` v0.18.3, `src/models.rs`):
a client written against it gets the same `code` and `details` here.

Its validation order and texts are kept: unknown and missing fields as serde words them
(``unknown field `x`, expected one of ...``, ``missing field `x` ``), then ``"`x` is required"``
for an empty required value, then a non-numeric threshold, then the detectors' kinds (the
handlers: 404 ``detector `x` not found``, 422 ``detector `x` is not supported by this
endpoint``). Detections on these endpoints have no span: `{detection_type, detection,
detector_id, score, evidence?, metadata?}`."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .fms_requests import FAIL_FAST, DetectorMap, TextGenParameters


class FmsBody(BaseModel):
    """A request body checked as the FMS orchestrator checks it (serde's `deny_unknown_fields`
    and missing-field messages first, then `validate()`'s)."""

    model_config = ConfigDict(extra="forbid")
    REQUIRED: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _serde(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = list(cls.model_fields)
        for key in data:
            if key not in cls.model_fields:
                expected = ", ".join(f"`{f}`" for f in fields)
                raise ValueError(f"unknown field `{key}`, expected one of {expected}")
        for name in cls.REQUIRED:
            if name not in data:
                raise ValueError(f"missing field `{name}`")
        detectors = data.get("detectors")
        if isinstance(detectors, dict):
            for detector_id, params in detectors.items():
                threshold = params.get("threshold") if isinstance(params, dict) else None
                if threshold is not None and (
                    isinstance(threshold, bool) or not isinstance(threshold, int | float)
                ):
                    # checked after validate()'s emptiness checks there; the emptiness of these
                    # values is checked below, so only a non-empty body reaches this text
                    cls._required(data)
                    raise ValueError(
                        f"`threshold` parameter specified for model `{detector_id}` must be a "
                        "number"
                    )
        return data

    @classmethod
    def _required(cls, data: dict[str, Any]) -> None:
        """``"`x` is required"`` for the first required value that is empty, in FMS's order."""
        for name in cls.REQUIRED:
            if name in data and not data[name]:
                raise ValueError(f"`{name}` is required")

    @model_validator(mode="after")
    def _not_empty(self) -> FmsBody:
        self._required(self.model_dump(include=set(self.REQUIRED)))
        return self


class ContentPart(BaseModel):
    """A part of a message's content; only text can be judged."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, Any] | None = None
    refusal: str | None = None


class ChatMessage(BaseModel):
    """A conversation message as the FMS orchestrator reads it (OpenAI's; unknown keys
    ignored, as there)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "developer", "assistant", "system", "tool"]
    content: str | Annotated[list[ContentPart], FAIL_FAST] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """What a text detector judges of it: the content, its text parts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content or [])

    def wire(self) -> dict[str, Any]:
        """The message as a chat detector receives it (unset fields left out)."""
        return self.model_dump(exclude_none=True)


class ChatDetectionRequest(FmsBody):
    """POST /api/v2/text/detection/chat."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("detectors", "messages")

    detectors: DetectorMap
    messages: Annotated[list[ChatMessage], FAIL_FAST]
    tools: Annotated[list[dict[str, Any]], FAIL_FAST] = Field(default_factory=list)

    @model_validator(mode="after")
    def _messages(self) -> ChatDetectionRequest:
        for m in self.messages:
            if m.content is None and m.tool_calls is None:
                raise ValueError("Message content cannot be empty")
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                raise ValueError("Only content of type text is allowed")
        return self


class ContextDetectionRequest(FmsBody):
    """POST /api/v2/text/detection/context."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("detectors", "content", "context_type", "context")

    detectors: DetectorMap
    content: str
    context_type: Literal["docs", "url"]
    context: Annotated[list[str], FAIL_FAST]


class GeneratedDetectionRequest(FmsBody):
    """POST /api/v2/text/detection/generated."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("prompt", "generated_text", "detectors")

    prompt: str
    generated_text: str
    detectors: DetectorMap


class GenerationDetectionRequest(FmsBody):
    """POST /api/v2/text/generation-detection: generate, then judge (prompt, generated text)."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("model_id", "prompt", "detectors")

    model_id: str
    prompt: str
    detectors: DetectorMap
    text_gen_parameters: TextGenParameters | None = None


class DetectionResult(BaseModel):
    """One detection on these endpoints (FMS `DetectionResult`: no span). Built-in text
    detectors, which find spans, put them in `metadata` (`start`, `end`, `text`, and the
    conversation's `message_index`)."""

    detection_type: str
    detection: str
    detector_id: str
    score: float
    evidence: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class DetectionsResponse(BaseModel):
    """The reply of chat, context and generated detection."""

    detections: list[DetectionResult]


class GenerationDetectionResponse(BaseModel):
    """The reply of generation-detection (FMS field order); `warnings` when an enforced input
    guardrail refused the prompt (the model was not called) or the output was cut."""

    generated_text: str
    detections: list[DetectionResult]
    input_token_count: int
    warnings: list[dict[str, str]] | None = None
