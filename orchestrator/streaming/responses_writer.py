"""The Responses wire format (DESIGN 4.9): pipeline events as OpenResponses SSE events (`event:
<type>` and `data: <json>` with a `sequence_number` counting from 0), ending in exactly one
terminal event, or folded into one response object.

The response object is created lazily, on the first pipeline event that is not an error: an
error before it is the `error` event (no response ever existed), an error after it is
`response.failed`. Released text goes into one `output_text` part of one assistant message; a
block or an input hit adds a `refusal` part (text released before a block keeps its own
`output_text` part; flagged text is never in one). Every `*.added` has its `*.done` before the
terminal event, so the object a client accumulates equals the one the terminal event carries.

A tool call (`ToolCall`, after the answer's text) is a `function_call` output item of its own,
after the message (which is done by then): `output_item.added`, its arguments in one
`function_call_arguments.delta` (released whole, once judged) and `.done`, `output_item.done`;
its detections are in `guardrails.output`, naming the call (`call_id`).

`ResponsesWriter` is one of the three writers `handlers.serving.serve` drives: it renders events,
and nothing else (the slot, the response, keep-alives and bursts are the serving loop's).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel

from ..api.errors import Failure
from ..api.openai_responses import (
    AnnotationAddedEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallOut,
    FunctionChoice,
    Guardrails,
    IncompleteInfo,
    LifecycleEvent,
    OutputItemEvent,
    OutputMessage,
    OutputRefusal,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    RefusalDeltaEvent,
    RefusalDoneEvent,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    TextConfigOut,
)
from .events import Frame, Refusal, Rendered, Terminal, ToolCall
from .finding_wire import annotation, input_annotation
from .findings import Finding
from .wire_json import SSE_HEADERS, dumps

OUTPUT_INDEX = 0  # one output item: the assistant message


def redacted_piece(text: str, findings: list[Finding]) -> str:
    """`text` with each redacted finding's span (relative to `text`) replaced by its
    replacement (`Finding.text`); overlapping spans are merged and take the first one's
    replacement, so no flagged character is left whatever the overlaps."""
    spans = sorted((f.start, f.end, f.text) for f in findings if f.redacted)
    out: list[str] = []
    at = 0
    for start, end, replacement in spans:
        if start < at:  # overlaps the previous span: extend it
            at = max(at, end)
            continue
        out.append(text[at:start])
        out.append(replacement)
        at = end
    out.append(text[at:])
    return "".join(out)


def sse(event: BaseModel) -> bytes:
    data = event.model_dump(mode="json")
    return b"event: " + data["type"].encode() + b"\ndata: " + dumps(data) + b"\n\n"


class ResponsesWriter:
    """One response's state and its events. `events()` turns a pipeline event into the wire
    events it causes (and updates the object); `render()` is the same as SSE bytes;
    `response()` is the object as it stands."""

    headers = SSE_HEADERS
    start_at_once = False  # a client mistake found before the first byte is an HTTP error

    def __init__(self, body: ResponsesRequest) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.created = False  # response.created was emitted
        self.finished = False  # the terminal event was emitted
        self._body = body
        self._seq = 0
        self._status: ResponseStatus = "in_progress"
        self._item: OutputMessage | None = None
        self._item_done = False  # the message's output_item.done was emitted
        self._calls: list[FunctionCallOut] = []  # output items after the message
        self._text: OutputText | None = None  # the open output_text part
        self._guardrails = Guardrails()
        self._usage: ResponseUsage | None = None
        self._error: ResponseErrorInfo | None = None
        self._incomplete: IncompleteInfo | None = None
        self._completed_at: int | None = None
        self.text_seen = False  # some output text or a refusal exists
        # what the object echoes of the request: `instructions` as the engine got them
        # (redacted, DESIGN 4.6a), and the labels (`metadata`, `user`, `safety_identifier`)
        # unless an input guardrail redacts: they are never judged (they do not reach the
        # engine), and an end user's e-mail address is a common `user`
        self._instructions = body.instructions
        self.withhold_labels = False

    # -- the object -----------------------------------------------------------------------------

    def response(self) -> ResponseObject:
        b = self._body
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            completed_at=self._completed_at,
            status=self._status,
            model=b.model,
            output=([] if self._item is None else [self._item.model_copy(deep=True)])
            + [c.model_copy() for c in self._calls],
            error=self._error,
            incomplete_details=self._incomplete,
            instructions=self._instructions,
            max_output_tokens=b.max_output_tokens,
            temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p,
            parallel_tool_calls=bool(b.parallel_tool_calls),
            tool_choice=_tool_choice(b),
            tools=list(b.tools or ()),
            truncation=b.truncation or "disabled",
            text=TextConfigOut(verbosity=(b.text.verbosity if b.text else None) or "medium"),
            metadata={} if self.withhold_labels else b.metadata or {},
            user=None if self.withhold_labels else b.user,
            safety_identifier=None if self.withhold_labels else b.safety_identifier,
            usage=self._usage,
            guardrails=self._guardrails.model_copy(deep=True),
        )

    # -- rendering ------------------------------------------------------------------------------

    def in_band(self, failure: Failure) -> bool:
        """Before the first byte, the client's own mistake is an HTTP error; a server-side one
        is the `error` event (OpenResponses: no response object was created)."""
        return failure.code >= 500

    def render(self, event: Rendered) -> bytes:
        return b"".join(sse(e) for e in self.events(event))

    def events(self, event: Rendered) -> list[BaseModel]:
        if self.finished:
            return []
        out: list[BaseModel] = []
        if isinstance(event, Terminal) and event.error is not None and not self.created:
            self.finished = True
            return [ErrorEvent.from_failure(event.error, self._next())]
        if not self.created:
            self.created = True
            if isinstance(event, Frame) and event.input_detections and self._instructions:
                self._instructions = redacted_piece(
                    self._instructions,
                    [f for f in event.input_detections if f.field == "instructions"],
                )
            for kind in ("response.created", "response.in_progress"):
                out.append(
                    LifecycleEvent(
                        type=kind, sequence_number=self._next(), response=self.response()
                    )
                )
        if isinstance(event, Frame):
            self._frame(event, out)
        elif isinstance(event, ToolCall):
            self._tool_call(event, out)
        elif isinstance(event, Refusal):
            self._refusal(event, out)
        else:
            self._terminal(event, out)
        return out

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _where(self) -> dict[str, Any]:
        assert self._item is not None
        return {
            "sequence_number": self._next(),
            "item_id": self.item_id,
            "output_index": OUTPUT_INDEX,
            "content_index": len(self._item.content) - 1,
        }

    def _open_item(self, out: list[BaseModel]) -> OutputMessage:
        if self._item is None:
            self._item = OutputMessage(id=self.item_id, status="in_progress")
            out.append(
                OutputItemEvent(
                    type="response.output_item.added",
                    sequence_number=self._next(),
                    output_index=OUTPUT_INDEX,
                    item=self._item.model_copy(deep=True),
                )
            )
        return self._item

    def _open_text(self, out: list[BaseModel]) -> OutputText:
        item = self._open_item(out)
        if self._text is None:
            self._text = OutputText()
            item.content.append(self._text)
            out.append(
                ContentPartEvent(
                    type="response.content_part.added", **self._where(), part=OutputText()
                )
            )
        return self._text

    def _close_text(self, out: list[BaseModel]) -> None:
        part = self._text
        if part is None:
            return
        out.append(OutputTextDoneEvent(**self._where(), text=part.text))
        out.append(
            ContentPartEvent(
                type="response.content_part.done", **self._where(), part=part.model_copy(deep=True)
            )
        )
        self._text = None

    def _close_item(self, status: str, out: list[BaseModel]) -> None:
        self._close_text(out)
        if self._item is None or self._item_done:
            return
        self._item_done = True
        self._item.status = status  # type: ignore[assignment]
        out.append(
            OutputItemEvent(
                type="response.output_item.done",
                sequence_number=self._next(),
                output_index=OUTPUT_INDEX,
                item=self._item.model_copy(deep=True),
            )
        )

    def _frame(self, frame: Frame, out: list[BaseModel]) -> None:
        if frame.input_detections:  # the input was redacted (DESIGN 4.6a)
            self._guardrails.input.extend(input_annotation(f) for f in frame.input_detections)
        if not frame.text and not frame.detections:
            return
        part = self._open_text(out)
        if frame.text:
            self.text_seen = True
            part.text += frame.text
            out.append(OutputTextDeltaEvent(**self._where(), delta=frame.text))
        for finding in frame.detections:
            note = annotation(finding)
            part.annotations.append(note)
            self._guardrails.output.append(note)
            out.append(
                AnnotationAddedEvent(
                    **self._where(),
                    annotation_index=len(part.annotations) - 1,
                    annotation=note.model_copy(),
                )
            )

    def _tool_call(self, call: ToolCall, out: list[BaseModel]) -> None:
        """A whole, judged call: its own output item after the message (closed first)."""
        self._close_item("completed", out)
        self.text_seen = True
        index = len(self._calls) + (0 if self._item is None else 1)
        item = FunctionCallOut(
            id=f"fc_{uuid.uuid4().hex}",
            call_id=call.id or f"call_{uuid.uuid4().hex}",
            name=call.name or "",
            status="in_progress",
        )
        where = {"item_id": item.id, "output_index": index}
        out.append(self._item_event("response.output_item.added", index, item))
        self._calls.append(item)
        out.append(
            FunctionCallArgumentsDeltaEvent(
                sequence_number=self._next(), **where, delta=call.arguments
            )
        )
        out.append(
            FunctionCallArgumentsDoneEvent(
                sequence_number=self._next(), **where, arguments=call.arguments
            )
        )
        item.arguments, item.status = call.arguments, "completed"
        out.append(self._item_event("response.output_item.done", index, item))
        self._guardrails.output.extend(
            annotation(f).model_copy(update={"call_id": item.call_id}) for f in call.detections
        )

    def _item_event(self, kind: str, index: int, item: FunctionCallOut) -> OutputItemEvent:
        return OutputItemEvent(
            type=kind,  # type: ignore[arg-type]
            sequence_number=self._next(),
            output_index=index,
            item=item.model_copy(),
        )

    def _refusal(self, refusal: Refusal, out: list[BaseModel]) -> None:
        self.text_seen = True
        if refusal.direction == "input":
            self._guardrails.input.extend(input_annotation(f) for f in refusal.detections)
        else:
            self._guardrails.output.extend(annotation(f, withheld=True) for f in refusal.detections)
        item = self._open_item(out)
        self._close_text(out)
        part = OutputRefusal()
        item.content.append(part)
        out.append(
            ContentPartEvent(
                type="response.content_part.added", **self._where(), part=OutputRefusal()
            )
        )
        part.refusal = refusal.message
        out.append(RefusalDeltaEvent(**self._where(), delta=refusal.message))
        out.append(RefusalDoneEvent(**self._where(), refusal=refusal.message))
        out.append(
            ContentPartEvent(
                type="response.content_part.done", **self._where(), part=part.model_copy()
            )
        )

    def _terminal(self, terminal: Terminal, out: list[BaseModel]) -> None:
        self.finished = True
        prompt = terminal.input_token_count or 0
        self._usage = ResponseUsage(
            input_tokens=prompt,
            output_tokens=terminal.generated_token_count,
            total_tokens=prompt + terminal.generated_token_count,
        )
        if terminal.error is not None:
            self._status = "failed"
            self._error = ResponseErrorInfo.from_failure(terminal.error)
            self._close_item("incomplete", out)
            kind = "response.failed"
        elif terminal.kind == "completed":
            self._status = "completed"
            self._completed_at = int(time.time())
            if self._item is None and not self._calls:  # an empty answer is still a message
                self._open_text(out)
            self._close_item("completed", out)
            kind = "response.completed"
        else:
            self._status = "incomplete"
            reason = (
                "content_filter" if terminal.reason == "content_filter" else "max_output_tokens"
            )
            self._incomplete = IncompleteInfo(reason=reason)
            if self._item is None and not self._calls:
                self._open_text(out)
            self._close_item("incomplete", out)
            kind = "response.incomplete"
        out.append(
            LifecycleEvent(type=kind, sequence_number=self._next(), response=self.response())
        )


def _tool_choice(body: ResponsesRequest) -> str | FunctionChoice:
    """The request's, else what it means: `auto` where tools were offered."""
    if body.tool_choice is not None:
        return body.tool_choice
    return "auto" if body.tools else "none"


class ResponsesFold:
    """The unary reply: the object the stream would have ended with. An error before any output
    is a real HTTP error (nothing was sent); after some, the object says `failed`."""

    def __init__(self, body: ResponsesRequest) -> None:
        self._writer = ResponsesWriter(body)

    @property
    def writer(self) -> ResponsesWriter:
        return self._writer

    def in_band(self, failure: Failure) -> bool:
        """An object that holds output says `failed`; before any, nothing to say it in."""
        return self._writer.text_seen

    def add(self, event: Rendered) -> None:
        self._writer.events(event)

    def body(self) -> dict[str, Any]:
        return self._writer.response().dump()
