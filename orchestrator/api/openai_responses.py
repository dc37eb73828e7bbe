"""Wire shapes of the OpenAI Responses surface (DESIGN 4.9): the request, the response object and
every streaming event, with guardstream's extensions (`detectors` in requests; the
`guardrail_detection` annotation and the `guardrails` lists in responses).

The service is stateless and guards text only. What cannot be honoured is refused with a clear
message instead of being silently dropped: stored state (`previous_response_id`, `store: true`,
`background`, `conversation`, stored `prompt` templates) and hosted tools (anything but
`function` tools) are 400 (`check_stateless`, before schema validation); other features it
cannot deliver (structured output formats, logprobs, reasoning effort, non-text input) are 422.
Function tools, `function_call` and `function_call_output` items go to an `openai` backend with
`api: chat` as Chat Completions tools and messages (`chat_tools`, `ResponsesRequest.chat`);
the calls the model makes are judged like text (DESIGN 4.8, 4.9). Fields that only label or
route a request (`metadata`, `user`, `safety_identifier`, `prompt_cache_key`, `service_tier`,
`truncation`, ...) are accepted; unknown fields are 422.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from .errors import Failure, invalid
from .fms_requests import FAIL_FAST
from .input_pieces import InputPiece, arguments_pieces
from .json_numbers import json_integer, json_number
from .openai_chat import ChatDetectors, OpenAIErrorBody

ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "refusal")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- request ------------------------------------------------------------------------------------

# Fields of stored state or tools: 400 whenever they ask for something (DESIGN 4.9).
_STATELESS: dict[str, str] = {
    "previous_response_id": "responses are not stored (this service is stateless); send the "
    "whole conversation in `input`",
    "store": "responses are not stored (this service is stateless); leave `store` out or send "
    "`store: false`",
    "background": "background mode needs stored responses; this service is stateless",
    "conversation": "conversations are not stored (this service is stateless); send the whole "
    "conversation in `input`",
    "prompt": "stored prompt templates are not supported; send the text in `instructions` and "
    "`input`",
}
HOSTED_TOOLS_WHY = (
    "only `function` tools are supported: a hosted tool runs where its results cannot be guarded"
)


def check_stateless(data: Any) -> None:
    """400 for a body that asks for stored state or tools; `false`, `null` and `[]` ask for
    nothing and pass (SDKs and proxies send them as defaults)."""
    if not isinstance(data, dict):
        return
    for name, why in _STATELESS.items():
        value = data.get(name)
        if value is None or value is False or value == []:
            continue
        raise invalid(f"{name}: {why}", 400)
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise invalid(f"tools: tool {i} has type `{kind}`: {HOSTED_TOOLS_WHY}", 400)


class InputText(Strict):
    """A text part. `output_text` parts of an earlier response sent back as conversation keep
    their `annotations` and `logprobs`, which are ignored."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputRefusal(Strict):
    """An assistant's refusal sent back as conversation (a blocked or refused earlier turn)."""

    type: Literal["refusal"]
    refusal: str


# A plain union (the `type` literals are disjoint anyway): a discriminator mapping two tags to
# one schema made OpenAPI tools (schemathesis) derive a wrong per-tag enum and call valid
# bodies invalid
ContentPart = InputText | InputRefusal


class InputMessage(Strict):
    """One message item. `id`, `status` and `phase` are accepted so that output items of an
    earlier response can be sent back unchanged."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], FAIL_FAST]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in _TEXT_PARTS:
                    raise ValueError(
                        f"content part type `{kind}` is not supported: only text can be guarded"
                    )
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class ResponsesStreamOptions(Strict):
    include_obfuscation: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"] = "text"


class TextConfig(Strict):
    """Only plain text: a JSON schema could not be enforced on guarded, possibly cut output."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    """Accepted only when it asks for nothing: the served models do not reason."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


class FunctionCallItem(Strict):
    """A call the model made in an earlier turn, sent back as conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def chat_call(self) -> dict[str, Any]:
        """The call as a Chat Completions assistant message holds it."""
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class FunctionCallOutputItem(Strict):
    """A tool's result for `call_id`: judged by the input detectors like every message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else "message"
    return kind if kind in ("function_call", "function_call_output") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def chat_tool(self) -> dict[str, Any]:
        """The tool as Chat Completions declares it."""
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


def _input_kind(v: Any) -> str | None:
    if isinstance(v, str):
        return "text"
    return "messages" if isinstance(v, list) else None


ConversationInput = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], FAIL_FAST, Tag("messages")],
    Discriminator(
        _input_kind,
        custom_error_type="input_type",
        custom_error_message="must be a string or a list of message items",
    ),
]
MetaKey = Annotated[str, Field(max_length=64)]
MetaValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(Strict):
    model: str
    input: ConversationInput
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool = False  # "false", 0 or 0.0 are a 422, never a guess
    stream_options: ResponsesStreamOptions | None = None
    detectors: ChatDetectors | None = None
    # accepted and echoed; they label or route a request and change nothing in generation
    metadata: Annotated[dict[MetaKey, MetaValue], FAIL_FAST] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: int | None = Field(None, ge=0)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[str], FAIL_FAST] | None = Field(None, max_length=0)
    top_logprobs: int | None = Field(None, ge=0, le=0)
    # checked by check_stateless first (400); here only their harmless values remain
    store: Literal[False] | None = None
    background: Literal[False] | None = None
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None
    tools: Annotated[list[FunctionTool], FAIL_FAST] | None = None

    @field_validator("max_output_tokens", "max_tool_calls", "top_logprobs", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return json_integer(v)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        return json_number(v)

    @field_validator("input", mode="before")
    @classmethod
    def _message_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, item in enumerate(v):
                kind = item.get("type", "message") if isinstance(item, dict) else "message"
                if kind not in ("message", "function_call", "function_call_output"):
                    raise ValueError(
                        f"item {i}: item type `{kind}` is not supported: only message items "
                        "with text and function calls and their outputs can be guarded"
                    )
        return v

    @model_validator(mode="after")
    def _has_user_message(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not any(
            isinstance(m, InputMessage) and m.role == "user" for m in self.input
        ):
            raise ValueError("input: at least one message must have the role `user`")
        return self

    def chat_tools(self) -> dict[str, Any]:
        """`tools`, `tool_choice` and `parallel_tool_calls` as a Chat Completions request
        says them (what an `openai` chat backend receives; any other backend refuses them)."""
        out: dict[str, Any] = {}
        if self.tools:
            out["tools"] = [t.chat_tool() for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            out["tool_choice"] = choice
        if self.parallel_tool_calls is not None and self.tools:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        return out

    def input_pieces(self) -> list[InputPiece]:
        """What input detectors judge: `instructions` and every input item, each on its own
        (DESIGN 4.9): a message's text, a function call's arguments, a function's output;
        `message_index` is the item's index in `input` (0 for a string), `target` the message
        of the conversation (`chat`) it is in."""
        out: list[InputPiece] = []
        if self.instructions:
            out.append(InputPiece(self.instructions, None, "instructions", target=0))
        if isinstance(self.input, str):
            out.append(InputPiece(self.input, 0, target=len(out)))
            return out
        for i, (item, (target, call)) in enumerate(zip(self.input, self._places(), strict=True)):
            if isinstance(item, FunctionCallItem):
                out += arguments_pieces(item.arguments, i, "arguments", target, call)
                # the name and id reach the engine too (the chat template renders them)
                out.append(InputPiece(item.name, i, "name", fixed=True))
                out.append(InputPiece(item.call_id, i, "call_id", fixed=True))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(InputPiece(item.output, i, "output", target))
                out.append(InputPiece(item.call_id, i, "call_id", fixed=True))
            else:
                user = item.role == "user"
                out.append(InputPiece(item.text(), i, target=target, user_turn=user))
        return out

    def _places(self) -> list[tuple[int, int | None]]:
        """Where each input item is in the conversation (`chat`): the message, and for a
        function call its index among that assistant message's calls (consecutive calls are
        one assistant turn, as Chat Completions says them)."""
        at = 0 if not self.instructions else 1
        out: list[tuple[int, int | None]] = []
        calls = 0  # of the assistant turn being gathered
        assert isinstance(self.input, list)
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                if calls == 0:
                    at += 1
                out.append((at - 1, calls))
                calls += 1
                continue
            calls = 0
            out.append((at, None))
            at += 1
        return out

    def chat(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The whole conversation as Chat Completions messages: (role, text, tool fields);
        `instructions` first, as a system message; consecutive function calls are one
        assistant turn; a function's output is a `tool` message."""
        out: list[tuple[str, str, dict[str, Any]]] = []
        if self.instructions:
            out.append(("system", self.instructions, {}))
        if isinstance(self.input, str):
            out.append(("user", self.input, {}))
            return out
        for item, (target, call) in zip(self.input, self._places(), strict=True):
            if isinstance(item, FunctionCallItem):
                if call == 0:
                    out.append(("assistant", "", {"tool_calls": []}))
                out[target][2]["tool_calls"].append(item.chat_call())
            elif isinstance(item, FunctionCallOutputItem):
                out.append(("tool", item.output, {"tool_call_id": item.call_id}))
            else:
                out.append((item.role, item.text(), {}))
        return out

    def conversation_messages(self) -> list[tuple[str, str]]:
        """(role, text) of the whole conversation: `instructions` first, as a system message."""
        return [(role, text) for role, text, _ in self.chat()]


# -- the response object ------------------------------------------------------------------------


class GuardrailAnnotation(BaseModel):
    """A detection on the output text (or, in `guardrails.input`, on one piece of the request):
    `[start_index, end_index)` in code points into the whole text."""

    type: Literal["guardrail_detection"] = "guardrail_detection"
    start_index: int
    end_index: int
    text: str
    detector_id: str
    detection: str
    detection_type: str
    score: float
    # DESIGN 4.6a: the span was replaced and `text` is the replacement (omitted otherwise)
    redacted: bool | None = None
    # a detection on a function call's arguments: the call (the span is relative to its
    # `arguments`; omitted otherwise)
    call_id: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unredacted(self, handler: Any) -> Any:
        data = handler(self)
        for key in ("redacted", "call_id"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class InputAnnotation(GuardrailAnnotation):
    """A detection on the request (`guardrails.input`): spans relative to `instructions`
    (`field: "instructions"`) or to the text of input item `message_index` (0 for a string
    `input`)."""

    field: Literal["input", "instructions"] = "input"
    message_index: int | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[GuardrailAnnotation] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputRefusal(BaseModel):
    type: Literal["refusal"] = "refusal"
    refusal: str = ""


OutputContent = Annotated[OutputText | OutputRefusal, Field(discriminator="type")]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputContent] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    """A call the model made: released whole, once judged (DESIGN 4.9)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallOut, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    """`code` is one of OpenAI's response error codes (`server_error`, or `invalid_prompt` for
    the client's own mistake); `type` is guardstream's error type, naming what failed."""

    code: Literal["server_error", "invalid_prompt"]
    message: str
    type: str
    param: str | None = None

    @classmethod
    def from_failure(cls, failure: Failure) -> ResponseErrorInfo:
        return cls(
            code="invalid_prompt" if failure.code < 500 else "server_error",
            message=failure.message,
            type=failure.type.value,
        )


class IncompleteInfo(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class Guardrails(BaseModel):
    """Every detection of the request: `input` on `instructions` and the input items, `output`
    on the generated text (including what a blocking detector withheld)."""

    input: list[InputAnnotation] = Field(default_factory=list)
    output: list[GuardrailAnnotation] = Field(default_factory=list)


class TextConfigOut(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] = "medium"


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteInfo | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "none"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: Literal["auto", "disabled"] = "disabled"
    text: TextConfigOut = Field(default_factory=TextConfigOut)
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: None = None
    background: bool = False
    store: bool = False
    user: str | None = None
    safety_identifier: str | None = None
    usage: ResponseUsage | None = None
    guardrails: Guardrails = Field(default_factory=Guardrails)

    def dump(self) -> dict[str, Any]:
        # nulls stay: OpenAI sends `error: null`, `incomplete_details: null`, ...
        return self.model_dump(mode="json")


# -- streaming events ---------------------------------------------------------------------------


class LifecycleEvent(BaseModel):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class FunctionCallArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputContent


class OutputTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class AnnotationAddedEvent(BaseModel):
    type: Literal["response.output_text.annotation.added"] = "response.output_text.annotation.added"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    annotation_index: int
    annotation: GuardrailAnnotation


class RefusalDeltaEvent(BaseModel):
    type: Literal["response.refusal.delta"] = "response.refusal.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class RefusalDoneEvent(BaseModel):
    type: Literal["response.refusal.done"] = "response.refusal.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    refusal: str


class ErrorEvent(BaseModel):
    """An error before any response object exists; `code` is guardstream's error type."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str
    message: str
    param: str | None = None

    @classmethod
    def from_failure(cls, failure: Failure, sequence_number: int) -> ErrorEvent:
        return cls(
            sequence_number=sequence_number, code=failure.type.value, message=failure.message
        )


StreamEvent = Annotated[
    LifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | AnnotationAddedEvent
    | RefusalDeltaEvent
    | RefusalDoneEvent
    | FunctionCallArgumentsDeltaEvent
    | FunctionCallArgumentsDoneEvent
    | ErrorEvent,
    Field(discriminator="type"),
]
STREAM_EVENT_MODELS: tuple[type[BaseModel], ...] = (
    LifecycleEvent,
    OutputItemEvent,
    ContentPartEvent,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    AnnotationAddedEvent,
    RefusalDeltaEvent,
    RefusalDoneEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    ErrorEvent,
)
# what /openapi.json documents for POST /v1/responses
OPENAPI_MODELS: tuple[type[BaseModel], ...] = (
    ResponsesRequest,
    ResponseObject,
    *STREAM_EVENT_MODELS,
    OpenAIErrorBody,
)
