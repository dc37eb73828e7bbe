"""Stream events and their wire encodings (SSE for the task endpoint, NDJSON for stream-content)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..api.errors import ErrorBody, ErrorType
from ..api.responses import (
    ClassifiedFrame,
    IncompleteDetails,
    RefusalDelta,
    RefusalDone,
    StreamError,
    TerminalSummary,
    Wire,
)

# finish_reason -> (terminal event, incomplete reason)
_BY_FINISH: dict[str | None, tuple[str, str | None]] = {
    "EOS_TOKEN": ("completed", None),
    "STOP_SEQUENCE": ("completed", None),
    "MAX_TOKENS": ("incomplete", "max_output_tokens"),
    "TIME_LIMIT": ("incomplete", "time_limit"),
}


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """A frame (`name` None: an SSE message without an `event:` line) or a named event.
    `terminal` marks the one event after which nothing follows."""

    name: str | None
    payload: Wire | ErrorBody
    terminal: bool = False

    def data(self) -> dict[str, Any]:
        return self.payload.dump()

    def sse(self) -> bytes:
        head = f"event: {self.name}\n" if self.name else ""
        return f"{head}data: {json.dumps(self.data(), ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def frame_event(frame: ClassifiedFrame) -> StreamEvent:
    return StreamEvent(None, frame)


def finish_event(summary: TerminalSummary) -> StreamEvent:
    """`completed` or `incomplete`, from how generation finished."""
    name, reason = _BY_FINISH.get(summary.finish_reason, ("completed", None))
    if reason is not None:
        summary = summary.model_copy(
            update={"incomplete_details": IncompleteDetails(reason=reason)}
        )  # type: ignore[arg-type]
    return StreamEvent(name, summary, terminal=True)


def incomplete_event(summary: TerminalSummary, reason: str) -> StreamEvent:
    update = {"incomplete_details": IncompleteDetails(reason=reason)}  # type: ignore[arg-type]
    return StreamEvent("incomplete", summary.model_copy(update=update), terminal=True)


def refusal_events(message: str, done: RefusalDone) -> list[StreamEvent]:
    return [
        StreamEvent("refusal.delta", RefusalDelta(delta=message)),
        StreamEvent("refusal.done", done),
    ]


def failure_event(
    summary: TerminalSummary, frames_sent: int, code: int, error_type: ErrorType | str, message: str
) -> StreamEvent:
    """`failed` once a frame went out (the counters say how far it got), else `error`."""
    if frames_sent:
        err = StreamError(code=code, type=str(error_type), message=message)
        return StreamEvent("failed", summary.model_copy(update={"error": err}), terminal=True)
    return StreamEvent(
        "error",
        ErrorBody(code=code, details=message, type=ErrorType(str(error_type))),
        terminal=True,
    )


def ndjson(payload: Wire | dict[str, Any]) -> bytes:
    data = payload if isinstance(payload, dict) else payload.dump()
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
