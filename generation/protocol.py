"""Wire shapes of the engine API (DESIGN section 7), validated strictly: unknown fields and
wrong types are client errors (422), never guesses."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import annotated_types
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
# A conversation's size is bounded by the body limit (server.CLIENT_MAX_SIZE); the count bound
# keeps a body of thousands of empty messages from making the template loop long.
MAX_MESSAGES = 1024
ChatRole = Literal["system", "user", "assistant", "tool"]
MAX_TOOLS = 128


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


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: Utf8Str
    arguments: Utf8Str  # a JSON string, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (OpenAI's shape), rendered by the chat template."""

    model_config = _STRICT

    id: Utf8Str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message. Plain-text content only (the orchestrator flattens content parts). A
    `tool` message answers the call `tool_call_id` names; an assistant turn may carry the calls
    it made (`tool_calls`, content then may be null). Both need a template with tool support.
    `name` is the speaker's (OpenAI's field): the template renders it where it uses names, and
    ignores it otherwise; a special token's text in it is text (control_tokens.py)."""

    model_config = _STRICT

    role: ChatRole
    content: Utf8Str | None = None
    name: Utf8Str | None = None
    tool_call_id: Utf8Str | None = None
    tool_calls: list[MessageToolCall] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant turn of calls)")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: a `tool` message, and only one, names its call")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        return self

    def uses_tools(self) -> bool:
        return self.role == "tool" or self.tool_calls is not None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (only the fields it has)."""
        return self.model_dump(exclude_none=True) | {"content": self.content or ""}


# A tool as OpenAI's Chat Completions describes it; its JSON schema goes to the template as sent.
Tool = dict[str, Any]


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]


class GenerateRequest(BaseModel):
    """POST /v1/generate. Exactly one of `prompt`, `input_ids` and `messages` (which always goes
    through the chat template with the generation prompt). `max_new_tokens` is the budget of the
    whole generation, resumed tokens included, and must fit in the context with the prompt (a
    larger value is a 422, as vLLM rejects it, rather than silently clamped); `max_time`
    (seconds, 0 = none) ends the stream with TIME_LIMIT."""

    model_config = _STRICT

    prompt: Utf8Str | None = None
    input_ids: list[StrictInt] | None = None
    messages: Messages | None = None
    # rendered through the chat template (`messages` only) and the model's calls parsed out of
    # its text into `data.tool_calls`: the template must take tools (GET /v1/models `tools`)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    chat: bool = False
    resume: Resume | None = None
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    min_new_tokens: int = Field(0, ge=0, le=1_000_000)
    decoding: Decoding = Field(default_factory=Decoding)
    stop_sequences: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    max_time: float = Field(0.0, ge=0.0, le=86_400.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        given = [self.prompt is not None, self.input_ids is not None, self.messages is not None]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, input_ids and messages is required")
        if self.chat and self.input_ids is not None:
            raise ValueError(
                "chat applies the chat template to prompt; it cannot be used with input_ids"
            )
        if self.tools is not None and self.prompt is not None:
            raise ValueError("tools go through the chat template: send messages (or input_ids)")
        return self


class TokenizeRequest(BaseModel):
    """POST /v1/tokenize: `prompt` (with `chat`: as one user message under the template) or
    `messages` (always under the template, with the generation prompt)."""

    model_config = _STRICT

    prompt: Utf8Str | None = None
    messages: Messages | None = None
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    chat: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages is required")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go through the chat template: send messages")
        return self


class FaultRequest(BaseModel):
    """POST /admin/faults (only with --enable-fault-injection)."""

    model_config = _STRICT

    after_tokens: int = Field(0, ge=0)
    mode: Literal["close", "stall", "error", "script"]
    times: int = Field(1, ge=1, le=1_000_000)
    token_ids: list[StrictInt] = Field(default_factory=list)  # `script` only


# ----- what GET /v1/models advertises, read off the schema above (one source of truth) ---------

_BOUND_KEYS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Ge, "ge", "minimum"),
    (annotated_types.Gt, "gt", "exclusiveMinimum"),
    (annotated_types.Le, "le", "maximum"),
    (annotated_types.Lt, "lt", "exclusiveMaximum"),
    (annotated_types.MinLen, "min_length", "minItems"),
    (annotated_types.MaxLen, "max_length", "maxItems"),
)


def _bounds(metadata: Any) -> dict[str, Any]:
    """JSON-Schema keywords (`minimum`, `exclusiveMinimum`, `maxItems`, ...) of pydantic
    constraint metadata."""
    out: dict[str, Any] = {}
    for item in metadata:
        for kind, attr, keyword in _BOUND_KEYS:
            if isinstance(item, kind):
                out[keyword] = getattr(item, attr)
    return out


def _field_bounds(model: type[BaseModel], name: str) -> dict[str, Any]:
    return _bounds(model.model_fields[name].metadata)


def _stop_sequence_bounds() -> dict[str, Any]:
    for item in get_args(StopSequence)[1:]:
        if isinstance(item, StringConstraints):
            return {"minLength": item.min_length, "maxLength": item.max_length}
    return {}


def advertised_parameters() -> dict[str, dict[str, Any]]:
    """The accepted range of every generation parameter, as `GET /v1/models` advertises it, so a
    client (the orchestrator) can reject a request before it dispatches it."""
    messages_bounds: dict[str, Any] = {}
    for item in get_args(Messages)[1:]:  # the Field(...) inside Annotated carries the bounds
        messages_bounds.update(_bounds(getattr(item, "metadata", ())))
    return {
        "max_new_tokens": _field_bounds(GenerateRequest, "max_new_tokens"),
        "min_new_tokens": _field_bounds(GenerateRequest, "min_new_tokens"),
        "max_time": _field_bounds(GenerateRequest, "max_time"),
        "decoding_method": {"enum": list(get_args(Decoding.model_fields["method"].annotation))},
        "temperature": _field_bounds(Decoding, "temperature"),
        "top_k": _field_bounds(Decoding, "top_k"),
        "top_p": _field_bounds(Decoding, "top_p"),
        "seed": _field_bounds(Decoding, "seed"),
        "repetition_penalty": _field_bounds(Decoding, "repetition_penalty"),
        "stop_sequences": {
            **_field_bounds(GenerateRequest, "stop_sequences"),
            "items": _stop_sequence_bounds(),
        },
        "messages": {**messages_bounds, "roles": list(get_args(ChatRole))},
        "tools": _field_bounds(GenerateRequest, "tools"),
    }


# The engine's bounds on waiting work (server.py; `python -m generation serve` flags): generate
# requests held past its slots, and characters (request body bytes) queued for its tokenizer
# thread. Far above an orchestrator's use: it holds at most `server.max_concurrent_streams`
# (1024) streams per worker.
MAX_WAITING_REQUESTS = 4096
MAX_TOKENIZER_CHARS = 64 * 1024 * 1024


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
