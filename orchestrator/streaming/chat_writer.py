"""The Chat Completions wire format (DESIGN 4.8): pipeline events as `chat.completion.chunk`
SSE messages ending in exactly one `[DONE]`, or folded into one `chat.completion`.

Every stream has exactly one `finish_reason` or one in-band error object, and `[DONE]` last. A
block never shows flagged text: the refusal rides on the finishing chunk.

`ChatChunkWriter` is one of the three writers `handlers.serving.serve` drives: it renders events,
and nothing else. Taking the stream slot, starting the response, keep-alives and sending a
burst of frames in one write are the serving loop's, once for every surface.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from ..api.errors import Failure
from ..api.fms_responses import UNSUITABLE_INPUT, UNSUITABLE_OUTPUT
from ..api.openai_chat import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDetections,
    ChatWarning,
    Choice,
    ChunkChoice,
    Delta,
    FunctionCall,
    InputDetections,
    OpenAIErrorBody,
    OutputDetections,
    ToolCallOut,
    Usage,
)
from .event_fold import EventFold
from .events import Frame, Refusal, Rendered, Terminal, ToolCall
from .finding_wire import tcr, tcr_model
from .findings import Finding, sort_findings
from .wire_json import SSE_HEADERS, dumps

DONE = b"data: [DONE]\n\n"
INPUT_WARNING = ChatWarning(type="UNSUITABLE_INPUT", message=UNSUITABLE_INPUT.message)
OUTPUT_WARNING = ChatWarning(type="UNSUITABLE_OUTPUT", message=UNSUITABLE_OUTPUT.message)


# what follows a frame chunk's content in `ChatCompletionChunk.dump()` order
_FRAME_TAIL = b'},"finish_reason":null,"logprobs":null}]'
_WARNINGS_TAIL = b',"warnings":[' + orjson.dumps(OUTPUT_WARNING.dump()) + b"]"


def finish_reason(terminal: Terminal, *, tool_calls: bool = False) -> str:
    """`tool_calls` where the model ended its turn with tool calls that were released."""
    if terminal.reason == "content_filter":
        return "content_filter"
    if terminal.kind == "incomplete":
        return "length"  # a token or time budget ran out
    return "tool_calls" if tool_calls else "stop"


def tool_call_out(call: ToolCall, *, indexed: bool) -> ToolCallOut:
    """A released call on the wire: whole, in one chunk (`indexed`) or in the unary message."""
    return ToolCallOut(
        index=call.index if indexed else None,
        id=call.id,
        function=FunctionCall(name=call.name, arguments=call.arguments),
    )


def usage(terminal: Terminal) -> Usage:
    prompt = terminal.input_token_count or 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=terminal.generated_token_count,
        total_tokens=prompt + terminal.generated_token_count,
    )


def _output(findings: list[Finding]) -> ChatDetections:
    return ChatDetections(
        output=[OutputDetections(choice_index=0, results=[tcr_model(f) for f in findings])]
    )


def _input(findings: list[Finding]) -> ChatDetections:
    """One entry per judged piece (a message's content, its name or refusal), in message order;
    spans relative to that piece."""
    groups: dict[tuple[int, str | None], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.message_index or 0, f.field), []).append(f)
    return ChatDetections(
        input=[
            InputDetections(
                message_index=index,
                field=field,  # type: ignore[arg-type]
                results=[tcr_model(f) for f in group],
            )
            for (index, field), group in groups.items()
        ]
    )


class ChatChunkWriter:
    """Renders one stream's events as SSE bytes.

    A frame's chunk is rendered from bytes prepared once per stream (no pydantic object per
    frame: without output detectors that is one per token), equal to what `_chunk` renders."""

    headers = SSE_HEADERS
    start_at_once = False  # an error before the first chunk is a real HTTP error

    def __init__(self, model: str, *, include_usage: bool) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._include_usage = include_usage
        self._role_sent = False
        self._finished = False
        self._tool_calls = False  # a tool call was released
        self._head = (
            b'data: {"id":'
            + dumps(self.id)
            + b',"object":"chat.completion.chunk","created":'
            + str(self.created).encode()
            + b',"model":'
            + dumps(model)
            + b',"choices":[{"index":0,"delta":{"content":'
        )

    def _chunk(
        self,
        delta: Delta,
        *,
        finish: str | None = None,
        detections: ChatDetections | None = None,
        warnings: list[ChatWarning] | None = None,
        migrations: int | None = None,
    ) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish)],  # type: ignore[arg-type]
            detections=detections,
            warnings=warnings,
            migrations=migrations,
        )
        return b"data: " + dumps(chunk.dump()) + b"\n\n"

    def _role(self) -> bytes:
        if self._role_sent:
            return b""
        self._role_sent = True
        return self._chunk(Delta(role="assistant", content=""))

    def in_band(self, failure: Failure) -> bool:
        """Any error before the first byte is an HTTP error: OpenAI SDKs raise it as one."""
        return False

    def _frame(self, frame: Frame) -> bytes:
        """`_chunk(Delta(content=text), detections=..., warnings=...)` without pydantic."""
        tail = _FRAME_TAIL
        if frame.judged:
            results = b",".join(dumps(tcr(f)) for f in frame.detections)
            tail += b',"detections":{"output":[{"choice_index":0,"results":[' + results + b"]}]}"
        if frame.detections:
            tail += _WARNINGS_TAIL
        return self._head + dumps(frame.text) + tail + b"}\n\n"

    def render(self, event: Rendered) -> bytes:
        if isinstance(event, Frame):
            if event.input_detections:  # the input was redacted: said once, on this chunk
                output = _output(event.detections).output if event.judged else None
                return self._role() + self._chunk(
                    Delta(content=event.text),
                    detections=ChatDetections(
                        input=_input(event.input_detections).input, output=output
                    ),
                    warnings=[OUTPUT_WARNING] if event.detections else None,
                )
            if not event.text and not event.detections:
                return b""
            return self._role() + self._frame(event)
        if isinstance(event, ToolCall):
            self._tool_calls = True
            return self._role() + self._chunk(
                Delta(tool_calls=[tool_call_out(event, indexed=True)]),
                detections=_output(event.detections) if event.judged else None,
                warnings=[OUTPUT_WARNING] if event.detections else None,
            )
        if isinstance(event, Refusal):
            self._finished = True
            if event.direction == "input":
                self._role_sent = True
                return self._chunk(
                    Delta(role="assistant", refusal=event.message),
                    finish="content_filter",
                    detections=_input(event.detections),
                    warnings=[INPUT_WARNING],
                )
            return self._role() + self._chunk(
                Delta(refusal=event.message),
                finish="content_filter",
                detections=_output(event.detections),
                warnings=[OUTPUT_WARNING],
            )
        return self._terminal(event)

    def _terminal(self, terminal: Terminal) -> bytes:
        if terminal.error is not None:
            error = OpenAIErrorBody.from_failure(terminal.error).dump()
            return b"data: " + dumps(error) + b"\n\n" + DONE
        out = b""
        if not self._finished:
            out += self._role() + self._chunk(
                Delta(),
                finish=finish_reason(terminal, tool_calls=self._tool_calls),
                migrations=terminal.migrations or None,
            )
        if self._include_usage:
            chunk = ChatCompletionChunk(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage(terminal),
            )
            out += b"data: " + dumps(chunk.dump()) + b"\n\n"
        return out + DONE


class ChatCompletionFold(EventFold):
    """The unary `chat.completion`; an error anywhere is a real HTTP error (nothing was sent)."""

    def body(self) -> dict[str, Any]:
        terminal = self.terminal
        assert terminal is not None
        refusal = self.refusal.message if self.refusal is not None else None
        detections = None
        if self.input or self.output:
            detections = ChatDetections(
                input=_input(sort_findings(self.input)).input if self.input else None,
                output=_output(self.output).output if self.output else None,
            )
        calls = self.tool_calls if refusal is None else []
        text = "".join(self.texts)
        only_calls = bool(calls) and not text  # OpenAI's `content: null` beside tool calls
        # an input refusal's warning (a redacted input that an output block followed is none)
        warnings = [INPUT_WARNING] if self.input_refused and self.input else []
        if self.output:
            warnings.append(OUTPUT_WARNING)
        completion = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self._model,
            choices=[
                Choice(
                    message=AssistantMessage(
                        content=None if refusal is not None or only_calls else text,
                        refusal=refusal,
                        tool_calls=[tool_call_out(c, indexed=False) for c in calls] or None,
                    ),
                    finish_reason=finish_reason(terminal, tool_calls=bool(calls)),  # type: ignore[arg-type]
                )
            ],
            usage=usage(terminal),
            detections=detections,
            warnings=warnings or None,
            migrations=terminal.migrations or None,
        )
        return completion.dump()
