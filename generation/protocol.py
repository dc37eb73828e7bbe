"""Wire shapes of the engine API (DESIGN section 7), validated strictly: unknown fields and
wrong types are client errors (422), never guesses."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    model_validator,
)

_STRICT = ConfigDict(extra="forbid", strict=True)


def _utf8(value: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"); no tokenizer or UTF-8 writer accepts them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from None
    return value


Utf8Str = Annotated[str, AfterValidator(_utf8)]
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_SEED = 2**63 - 1


class Decoding(BaseModel):
    """`method` is case-insensitive (`GREEDY` from an orchestrator config works too)."""

    model_config = _STRICT

    method: Literal["greedy", "sampling"] = "greedy"
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _lower_method(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("method"), str):
            data = {**data, "method": data["method"].lower()}
        return data


class Resume(BaseModel):
    """Tokens (and their text) another replica already delivered; see DESIGN section 7."""

    model_config = _STRICT

    token_ids: list[StrictInt] = Field(default_factory=list)
    text: Utf8Str = ""


StopSequence = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_utf8)
]


class GenerateRequest(BaseModel):
    """POST /v1/generate. `max_new_tokens` is the budget of the whole generation, resumed tokens
    included; `max_time` (seconds, 0 = none) ends the stream with TIME_LIMIT."""

    model_config = _STRICT

    prompt: Utf8Str | None = None
    input_ids: list[StrictInt] | None = None
    chat: bool = False
    resume: Resume | None = None
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    min_new_tokens: int = Field(0, ge=0, le=1_000_000)
    decoding: Decoding = Field(default_factory=Decoding)
    stop_sequences: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    max_time: float = Field(0.0, ge=0.0, le=86_400.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("exactly one of prompt and input_ids is required")
        if self.chat and self.prompt is None:
            raise ValueError(
                "chat applies the chat template to prompt; it cannot be used with input_ids"
            )
        return self


class TokenizeRequest(BaseModel):
    """POST /v1/tokenize."""

    model_config = _STRICT

    prompt: Utf8Str
    chat: bool = False


class FaultRequest(BaseModel):
    """POST /admin/faults (only with --enable-fault-injection)."""

    model_config = _STRICT

    after_tokens: int = Field(0, ge=0)
    mode: Literal["close", "stall", "error"]
    times: int = Field(1, ge=1, le=1_000_000)


def error_body(status: int, details: str, type_: str = "invalid_request") -> dict[str, Any]:
    """The HTTP error shape shared with the orchestrator (DESIGN section 4)."""
    return {"code": status, "details": details, "type": type_}


def describe_validation_error(errors: list[dict[str, Any]]) -> str:
    """pydantic errors as one line: `decoding.top_p: Input should be ...; foo: Extra inputs ...`."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {message}")
    return "; ".join(parts)
