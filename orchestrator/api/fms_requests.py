"""Request bodies of the orchestrator API (DESIGN section 4.2): unknown fields are 422."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    FailFast,
    Field,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from .json_numbers import json_integer, json_number

JsonInt = Annotated[int, BeforeValidator(json_integer)]


class _FailFast(FailFast):
    """pydantic's FailFast, hashable: `X | Annotated[list[Y], ...]` hashes the metadata."""

    def __hash__(self) -> int:
        return hash(FailFast)


# Every collection of a request stops validating at its first invalid item: pydantic otherwise
# collects one error per item, and a 1 MiB body of invalid items (`messages: [1, 1, ...]`) held
# the event loop for seconds and took gigabytes to describe. The 422 names the first one.
FAIL_FAST = _FailFast()

# A request's stop sequences, bounded as the engine bounds them (generation/protocol.py) on every
# surface and for every backend: an `openai` backend's stream has them enforced by the
# orchestrator itself (servicekit/text_gate.py), whose work per token grows with their number
# times their length; unbounded, one request's 1,000 sequences of 1,000 characters held the event
# loop 33 ms a token.
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


OnDetection = Literal["annotate", "block", "redact"]
# the longest replacement: a template is the operator's or the client's, and every flagged span
# of a stream becomes one copy of it
MAX_REDACT_WITH = 256
# A request's params for one detector, as JSON: they are sent with every call the stream makes
# to that detector (one per chunk), so a request body's worth of params would be multiplied by
# the chunks of its answer. Real params (thresholds, labels, a few patterns or topics) are a few
# hundred bytes.
MAX_DETECTOR_PARAMS_BYTES = 65_536


class DetectorParams(BaseModel):
    """One detector's entry in a request. `threshold`, `on_detection` and `redact_with` are the
    orchestrator's; every other key is forwarded to the detector as `detector_params`."""

    model_config = ConfigDict(extra="allow")

    threshold: float | None = Field(None, ge=0, le=1)
    on_detection: OnDetection | None = None
    # redact: what replaces each flagged span, a fixed string or a template with {entity}
    redact_with: StrictStr | None = Field(None, max_length=MAX_REDACT_WITH)

    @field_validator("threshold", mode="before")
    @classmethod
    def _numeric_threshold(cls, v: Any) -> Any:
        # "0.5" or true must not slip through pydantic's lax coercion: a threshold is a number.
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ValueError("threshold must be a number")
        try:
            v = json_number(v)  # NaN would silently drop every detection
        except ValueError:
            raise ValueError("threshold must be a finite number") from None
        if v is not None and not 0 <= v <= 1:
            # scores are in [0, 1]: 5 would silently turn the detector off, -1 flag everything
            raise ValueError(f"threshold must be between 0 and 1, got {v}")
        return v

    @model_validator(mode="after")
    def _bounded(self) -> DetectorParams:
        if self.model_extra:
            # json, not orjson: an integer past 64 bits is valid JSON (orjson refuses it)
            size = len(json.dumps(self.model_extra, separators=(",", ":")).encode())
            if size > MAX_DETECTOR_PARAMS_BYTES:
                raise ValueError(
                    f"detector params of {size} bytes exceed {MAX_DETECTOR_PARAMS_BYTES} (they "
                    "are sent with every call to the detector)"
                )
        return self

    def detector_params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


DetectorMap = Annotated[dict[str, DetectorParams], FAIL_FAST]


class InputGuardrail(Strict):
    models: DetectorMap = Field(default_factory=dict)
    masks: Annotated[list[tuple[JsonInt, JsonInt]], FAIL_FAST] | None = None

    @field_validator("masks")
    @classmethod
    def _ordered_masks(cls, v: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        for start, end in v or []:
            if start < 0 or end < start:
                raise ValueError(f"mask [{start}, {end}] must satisfy 0 <= start <= end")
        return v


class OutputGuardrail(Strict):
    models: DetectorMap = Field(default_factory=dict)


class GuardrailConfig(Strict):
    input: InputGuardrail | None = None
    output: OutputGuardrail | None = None


class TextGenParameters(Strict):
    max_new_tokens: int | None = Field(None, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    decoding_method: Literal["GREEDY", "SAMPLING"] = "GREEDY"
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    repetition_penalty: float = Field(1.0, gt=0)
    stop_sequences: Annotated[list[StopSequence], FAIL_FAST] = Field(
        default_factory=list, max_length=MAX_STOP_SEQUENCES
    )
    max_time: float = Field(0.0, ge=0)

    # (validators on the fields rather than annotated types: those would hide the bounds from
    # the JSON schema of the optional fields)
    @field_validator("max_new_tokens", "min_new_tokens", "top_k", "seed", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return json_integer(v)

    @field_validator("temperature", "top_p", "repetition_penalty", "max_time", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("must be a finite number")
        return json_number(v)

    @model_validator(mode="after")
    def _min_below_max(self) -> TextGenParameters:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        return self


class GuardrailsHttpRequest(Strict):
    """Body of both task endpoints."""

    model_id: str
    inputs: str
    guardrail_config: GuardrailConfig = Field(default_factory=GuardrailConfig)
    text_gen_parameters: TextGenParameters = Field(default_factory=TextGenParameters)


class ContentDetectionRequest(Strict):
    """POST /api/v2/text/detection/content. `redact: true` also returns the content with every
    detection replaced by its detector's `redact_with` (DESIGN 4.6a)."""

    content: str
    detectors: DetectorMap = Field(min_length=1)
    redact: StrictBool = False


class StreamContentLine(Strict):
    """One NDJSON line of POST /api/v2/text/detection/stream-content; detectors on the first."""

    content: str
    detectors: DetectorMap | None = None
