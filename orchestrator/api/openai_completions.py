"""POST /api/v2/text/completions-detection: the OpenAI Completions request with the FMS field
`detectors: {input, output}` (issue 40), and its replies in the FMS orchestrator's shape
(`text_completion` objects and chunks; `detections` and `warnings` beside `choices`; a detection
is `{start, end, text, detector_id, detection_type, detection, score}`). The chat twin is
/api/v2/chat/completions-detection (openai_chat.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, model_validator

from .openai_chat import OpenAIGenerationFields

COMPLETIONS_DETECTION_PATH = "/api/v2/text/completions-detection"


class CompletionRequest(OpenAIGenerationFields):
    """The fields guardstream interprets; any other is refused (no backend receives fields it
    does not know on this endpoint, and a silently dropped one would change the answer)."""

    prompt: str

    @model_validator(mode="after")
    def _checked(self) -> CompletionRequest:
        # the FMS orchestrator's texts (CompletionsRequest::validate)
        if not self.model:
            raise ValueError("`model` must not be empty")
        if self.detectors is not None and self.detectors.input and not self.prompt:
            raise ValueError("`prompt` must not be empty when input detectors are provided")
        for name, value in (self.model_extra or {}).items():
            if value is not None:
                raise ValueError(
                    f"{name}: not supported on this endpoint (guardstream reads model, prompt, "
                    "stream, stream_options, max_tokens, temperature, top_p, seed, stop, n and "
                    "detectors)"
                )
        return self


class CompletionDetection(BaseModel):
    """A detection on this endpoint (the FMS orchestrator's `Detection`, spans relative to the
    prompt or to the choice's whole text)."""

    start: int
    end: int
    text: str
    detector_id: str
    detection_type: str
    detection: str
    score: float
    redacted: bool | None = None


class InputResults(BaseModel):
    message_index: int
    results: list[CompletionDetection]


class OutputResults(BaseModel):
    choice_index: int
    results: list[CompletionDetection]


class CompletionDetections(BaseModel):
    input: list[InputResults] | None = None
    output: list[OutputResults] | None = None


class CompletionWarning(BaseModel):
    type: Literal["UNSUITABLE_INPUT", "UNSUITABLE_OUTPUT"]
    message: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class Completion(BaseModel):
    """The unary reply, and (with one choice of new text) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    detections: CompletionDetections | None = None
    warnings: list[CompletionWarning] | None = None
