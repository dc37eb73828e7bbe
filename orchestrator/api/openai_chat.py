"""Wire shapes of the OpenAI Chat Completions surface (DESIGN 4.8), with guardstream's
extensions (`detectors` in requests; `detections` and `warnings` in responses).

The request keeps unknown fields (`extra="allow"`): an `openai` chat backend receives them
untouched, every other backend ignores them. Fields guardstream cannot honour while guarding the
output (several choices, log probabilities, the legacy `functions`, web search) are rejected
with a clear 422 instead of being dropped. `tools`, `tool_choice` and `parallel_tool_calls` are forwarded to an `openai` backend
with `api: chat` (the tool calls it answers with are judged like text, DESIGN 4.8); the native
engine takes `tools` where the model's chat template does (`check_native_tools`); an `openai`
backend with `api: completions` refuses a request that asks for them (`check_extra_honoured`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from ..suggestions import closest
from .errors import Failure
from .fms_requests import FAIL_FAST, MAX_STOP_SEQUENCES, DetectorMap, StopSequence
from .fms_responses import TokenClassificationResult, Wire
from .input_pieces import LABEL_FIELDS, NAME_FIELD, InputPiece, arguments_pieces
from .json_numbers import json_integer, json_number

ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED = {
    "functions": "the legacy function calls are not supported: use `tools`",
    "function_call": "the legacy function calls are not supported: use `tool_choice`",
    "audio": "audio output is not supported: only text can be guarded",
    "prediction": "predicted outputs are not supported",
    # the one hosted tool of Chat Completions (Responses refuses them all: HOSTED_TOOLS_WHY)
    "web_search_options": "web search is not supported: it runs where its results cannot be "
    "guarded (the model would read pages no input guardrail judged)",
}


# The OpenAI Chat Completions request fields guardstream does not interpret itself, which an
# `openai` chat backend receives untouched (DESIGN 4.8: "other OpenAI fields are forwarded").
# A field that is not OpenAI's is a server's own, and is forwarded only where the model's
# backends list it (`backends[].forward_fields`): such fields can change what the model reads
# past the input guardrails (vLLM's `chat_template` renders the judged messages any way it
# likes, `continue_final_message` and `add_generation_prompt` change whose turn it is) or cost
# the server unbounded work (`guided_regex`, `structured_outputs`).
OPENAI_CHAT_FIELDS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "metadata",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "service_tier",
        "store",
        "tool_choice",
        "tools",
        "top_logprobs",
        "user",
        "verbosity",
        "web_search_options",
    }
)


def check_forwardable(extra: dict[str, Any], model: str, forward_fields: frozenset[str]) -> None:
    """422 for a field an `openai` chat backend would receive that is neither OpenAI's nor one
    of `forward_fields` (what every backend of the model lists)."""
    for name in extra:
        if name not in OPENAI_CHAT_FIELDS and name not in forward_fields:
            raise ValueError(
                f"{name}: not an OpenAI Chat Completions field, and model `{model}`'s backends "
                "do not forward it (a server's own fields are forwarded only where "
                "`backends[].forward_fields` lists them)"
            )


TOOLS_WHY = (
    "tool calls are not supported by this model's backend (an `openai` backend with "
    "`api: completions` sends a prompt, without tools)"
)
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
# Extra fields that only label or route a request: accepted whatever the backend.
_LABELS = LABEL_FIELDS
# Extra fields a backend that does not receive them cannot honour, at a value that asks for
# something; the value that asks for nothing (SDKs and proxies send defaults) passes.
_EXTRA_WHY = {
    "response_format": "structured output cannot be honoured by this model's backend",
    "logit_bias": "logit biases cannot be applied by this model's backend",
    "frequency_penalty": "frequency penalties cannot be applied by this model's backend",
    "presence_penalty": "presence penalties cannot be applied by this model's backend",
    "reasoning_effort": "this model's backend does not reason",
    "verbosity": "this model's backend has no verbosity setting",
    "store": "completions are not stored (this service is stateless)",
    "tools": TOOLS_WHY,
    "tool_choice": TOOLS_WHY,
}
_INERT: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "store": (False,),
    "modalities": (["text"],),  # any other value is refused by the request model
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # without tools: nothing to call
    "parallel_tool_calls": (True, False),  # without tools: nothing to call
}


def check_extra_honoured(extra: dict[str, Any], model: str) -> None:
    """422 for a field the model's backend would silently drop (DESIGN 4.8): only an `openai`
    backend with `api: chat` receives the fields guardstream does not interpret; for any other
    a field that asks for something is refused, naming it (OpenAI's `param`)."""
    for name, value in extra.items():
        if name in _LABELS or value is None or value in _INERT.get(name, ()):
            continue
        why = _EXTRA_WHY.get(name, "this model's backend cannot honour it")
        raise ValueError(
            f"{name}: {why} (model `{model}`; only an `openai` backend with `api: chat` "
            "receives fields guardstream does not interpret)"
        )


def check_native_tools(extra: dict[str, Any], model: str) -> None:
    """422 for what the native engine cannot honour about tools: it renders them through the
    model's chat template and parses the calls the model chooses to make, so it cannot force
    a call (`tool_choice` other than `auto` or `none`) nor keep the model to one
    (`parallel_tool_calls: false`). Whether the template takes tools at all is the engine's
    to say (`GET /v1/models`, checked before dispatch)."""
    tools = extra.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise ValueError(
            'tools: a list of `{"type": "function", "function": {"name": ..., ...}}` objects'
        )
    if extra.get("parallel_tool_calls") not in (None, True, False):
        raise ValueError("parallel_tool_calls: a boolean")
    choice = extra.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ValueError(
            f"tool_choice: the native engine cannot force a tool call (model `{model}`; "
            "use `auto` or `none`)"
        )
    if extra.get("parallel_tool_calls") is False and extra.get("tools"):
        raise ValueError(
            "parallel_tool_calls: the native engine cannot keep the model to one call "
            f"(model `{model}`)"
        )


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(Strict):
    name: str
    arguments: str


class ToolCallIn(Strict):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


def tool_call_field(j: int) -> str:
    """The `field` of an assistant message's tool call's arguments among the judged pieces."""
    return f"tool_calls.{j}.function.arguments"


class ChatMessageIn(BaseModel):
    """A message of the conversation; content is text or text parts (images and audio cannot be
    judged by text detectors, so they are refused rather than passed unguarded). A `tool`
    message answers the call `tool_call_id` names; an assistant message may carry the calls
    it made (`tool_calls`)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = None
    name: str | None = Field(None, max_length=256)
    refusal: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[ToolCallIn], FAIL_FAST] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessageIn:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a `tool` message names the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id: only a `tool` message answers a tool call")
        if self.role != "assistant" and self.tool_calls is not None:
            raise ValueError("tool_calls: only an `assistant` message makes tool calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        # one line naming the part, instead of pydantic's dump of both union branches
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    shown = f"type `{kind}`" if isinstance(kind, str) else "no text type"
                    raise ValueError(
                        f"part {i} has {shown}: only text parts are accepted "
                        "(images and audio cannot be judged by text detectors)"
                    )
        elif v is not None and not isinstance(v, str):
            raise ValueError("must be a string or a list of text parts")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def pieces(self, index: int) -> list[InputPiece]:
        """Every text of this message for the input detectors: the content (its parts joined,
        as the engine receives them; a tool's result too: injection through a tool result is
        the classic attack on an agent), `name` and `refusal`, and each tool call's arguments,
        each on its own."""
        out = [InputPiece(self.text(), index, target=index, user_turn=self.role == "user")]
        if self.name:  # it reaches the model (the chat template's): redacted there like content
            out.append(InputPiece(self.name, index, NAME_FIELD, target=index))
        if self.refusal:
            out.append(InputPiece(self.refusal, index, "refusal"))
        for j, call in enumerate(self.tool_calls or ()):
            out += arguments_pieces(call.function.arguments, index, tool_call_field(j), index, j)
            # the call's name and id reach the engine too (the chat template renders them)
            out.append(
                InputPiece(call.function.name, index, f"tool_calls.{j}.function.name", fixed=True)
            )
            out.append(InputPiece(call.id, index, f"tool_calls.{j}.id", fixed=True))
        if self.tool_call_id:
            out.append(InputPiece(self.tool_call_id, index, "tool_call_id", fixed=True))
        return out

    def wire_tool_calls(self) -> tuple[dict[str, Any], ...] | None:
        if self.tool_calls is None:
            return None
        return tuple(c.model_dump(mode="json") for c in self.tool_calls)


def _function_tools(tools: Any) -> None:
    """422 for `tools` that are not all `function` tools with a name, whatever the backend:
    the output guardrails judge a call's `function.arguments`, and a custom tool's call carries
    free text (`custom.input`) that nothing would judge (the Responses surface refuses every
    other kind too: HOSTED_TOOLS_WHY)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ValueError("tools: a list of function tools")
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        function = tool.get("function") if isinstance(tool, dict) else None
        if kind != "function" or not (
            isinstance(function, dict) and isinstance(function.get("name"), str)
        ):
            shown = f"type `{kind}`" if isinstance(kind, str) else "no type"
            raise ValueError(
                f'tools: tool {i} has {shown}: only `{{"type": "function", "function": '
                '{"name": ...}}` tools are supported (the output guardrails judge a function '
                "call's arguments, and no other kind of call)"
            )


class StreamOptions(Strict):
    include_usage: StrictBool = False  # as the schema says: "yes" or 1 is a 422


class ChatDetectors(Strict):
    input: DetectorMap = Field(default_factory=dict)
    output: DetectorMap = Field(default_factory=dict)


# the extension fields guardstream reads in an OpenAI body (everything else is OpenAI's)
GUARDSTREAM_FIELDS = ("detectors",)


class OpenAIGenerationFields(BaseModel):
    """What the OpenAI generation requests guardstream serves (Chat Completions here, the
    Completions twin in openai_completions.py) share: the sampling fields, one choice, and the
    FMS `detectors` extension, whose misspelling is refused (forwarded to an `openai` backend,
    it would leave the client's detectors unrun)."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: StrictBool = False  # "false" or 1 is a 422, never a guess at what was meant
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    # one string or a list, as OpenAI takes it; a list from here on (`_one_or_list`)
    stop: Annotated[list[StopSequence], FAIL_FAST] | None = Field(
        None, max_length=MAX_STOP_SEQUENCES
    )
    n: int | None = Field(None, ge=1)
    detectors: ChatDetectors | None = None

    @field_validator("max_tokens", "n", "seed", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return json_integer(v)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        return json_number(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_guarded_choice(self) -> OpenAIGenerationFields:
        if self.n not in (None, 1):
            raise ValueError("n: only n = 1 is supported (every choice would need its own guard)")
        for name in self.model_extra or {}:
            hint = closest(name, GUARDSTREAM_FIELDS, quote="`")
            if hint:
                raise ValueError(f"{name}: unknown field{hint}")
        return self

    def stop_list(self) -> list[str]:
        return list(self.stop or ())


class ChatCompletionRequest(OpenAIGenerationFields):
    messages: Annotated[list[ChatMessageIn], FAIL_FAST] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _integer(cls, v: Any) -> Any:
        return json_integer(v)

    @model_validator(mode="after")
    def _guardable(self) -> ChatCompletionRequest:
        modalities = (self.model_extra or {}).get("modalities")
        if modalities not in (None, ["text"]):
            raise ValueError("modalities: only text output is supported: only text can be guarded")
        for name, why in _UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value not in (None, [], "none"):
                raise ValueError(f"{name}: {why}")
        for name in ("logprobs", "top_logprobs"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, *_INERT[name]):
                # whatever the backend: each entry carries its token's text, which the output
                # guardrails may withhold or redact (a backend receiving the field would answer
                # them, and they would be dropped: never silently, DESIGN 4.8)
                raise ValueError(
                    f"{name}: log probabilities are not returned: their tokens would carry text "
                    "the output guardrails withhold or redact"
                )
        _function_tools((self.model_extra or {}).get("tools"))
        if not any(m.role == "user" for m in self.messages):
            raise ValueError("messages: at least one message must have the role `user`")
        return self

    def input_pieces(self) -> list[InputPiece]:
        """What input detectors judge: every message, whatever its role (DESIGN 4.8)."""
        return [p for i, m in enumerate(self.messages) for p in m.pieces(i)]

    def forwarded(self) -> dict[str, Any]:
        """Fields guardstream does not interpret, for an `openai` chat backend."""
        return dict(self.model_extra or {})


# -- responses --------------------------------------------------------------------------------


class ChatWarning(Wire):
    type: Literal["UNSUITABLE_INPUT", "UNSUITABLE_OUTPUT"]
    message: str


class OutputDetections(Wire):
    choice_index: int = 0
    results: list[TokenClassificationResult]


class InputDetections(Wire):
    """Detections on one message's content (spans relative to its text parts joined), or, with
    `field`, on its `name`, `refusal` or a tool call's arguments
    (`tool_calls.<j>.function.arguments`)."""

    message_index: int
    field: str | None = None
    results: list[TokenClassificationResult]


class ChatDetections(Wire):
    input: list[InputDetections] | None = None
    output: list[OutputDetections] | None = None


class FunctionCall(Wire):
    name: str | None = None
    arguments: str


class ToolCallOut(Wire):
    """A tool call the model made: whole in a chunk's `delta.tool_calls` (with its `index`), or
    in a unary message's `tool_calls`."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(Wire):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionChunk(Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    detections: ChatDetections | None = None
    warnings: list[ChatWarning] | None = None
    # guardstream's extension on the finish chunk: the times the stream moved to another
    # replica mid-generation (DESIGN 7; the FMS terminal event's `migrations`), when any
    migrations: int | None = None

    def dump(self) -> dict[str, Any]:
        # finish_reason and logprobs stay as explicit nulls (OpenAI sends them); the rest omit
        data = self.model_dump(mode="json", exclude_none=True)
        for choice, raw in zip(data["choices"], self.choices, strict=True):
            choice["finish_reason"] = raw.finish_reason
            choice["logprobs"] = None
        return data


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice] = Field(min_length=1)
    usage: Usage
    detections: ChatDetections | None = None
    warnings: list[ChatWarning] | None = None
    migrations: int | None = None  # as on the finish chunk, when any

    def dump(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=True)
        for choice, raw in zip(data["choices"], self.choices, strict=True):
            choice["message"]["content"] = raw.message.content
            choice["message"]["refusal"] = raw.message.refusal
            choice["logprobs"] = None
        return data


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class OpenAIErrorBody(BaseModel):
    """`{"error": {...}}`: what OpenAI SDKs raise as an API error, before or inside a stream;
    the OpenAI surfaces' rendering of the API's one `Failure`."""

    error: OpenAIErrorDetail

    @classmethod
    def from_failure(cls, failure: Failure, *, param: str | None = None) -> OpenAIErrorBody:
        return cls(
            error=OpenAIErrorDetail(
                message=failure.message, type=failure.type.value, param=param, code=failure.code
            )
        )

    @classmethod
    def for_request(cls, failure: Failure) -> OpenAIErrorBody:
        """An HTTP error response: `param` names the request field the message starts with
        (`messages: ...` -> `messages`), as OpenAI's own errors do."""
        return cls.from_failure(failure, param=error_param(failure.message))

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def error_param(details: str) -> str | None:
    """The request field an error names (`messages: ...` → `messages`), for OpenAI's `param`."""
    head, sep, _ = details.partition(": ")
    if sep and head and " " not in head and len(head) <= 128:
        return head
    return None


class ModelCard(Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "guardstream"


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]
