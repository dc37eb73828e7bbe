"""The typed events of one guarded generation (DESIGN section 1, "One pipeline, many writers").

The pipeline yields these; each API surface is only a writer that renders them in its own wire
format (FMS SSE, chat-completion chunks, Responses events, a unary object), so the surfaces
cannot disagree on what was judged, blocked or cut off. They hold `Finding`s, not wire models:
a writer projects them into its own shape. A `Terminal`'s error is the API's one `Failure`
(api/errors.py), which each surface renders itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..api.errors import Failure
from .findings import Finding

TerminalKind = Literal["completed", "incomplete", "failed", "error"]
IncompleteReason = Literal["max_output_tokens", "time_limit", "content_filter"]


@dataclass(slots=True)
class Frame:
    """Released text `[start, end)` of the generated stream, judged by every gating detector,
    with the detections on it (stream-relative). `final` marks the last frame, which carries the
    finish reason and token count."""

    start: int
    end: int
    text: str
    detections: list[Finding] = field(default_factory=list)
    final: bool = False
    finish_reason: str | None = None
    generated_token_count: int | None = None
    input_token_count: int | None = None
    seed: int | None = None
    judged: bool = False  # output detectors ran on it (False: forwarded as generated)
    # the first frame of a request whose input was redacted (DESIGN 4.6a): those detections,
    # spans relative to the text the client sent, each `redacted` with its replacement
    input_detections: list[Finding] | None = None
    # Another event follows at once (the pipeline already has it): a streaming writer may hold
    # this frame's bytes and send them with the next event's, one write for a burst of frames.
    more: bool = False
    # where a detector redacts: the frame's end in the generated text (`end` is in the text the
    # client receives); the pipeline's hold-back metric measures from there
    source_end: int | None = None


@dataclass(slots=True)
class ToolCall:
    """A tool call the model made (`api: chat` backends), whole: released once every output
    detector that applies to tool calls judged its arguments (streaming/tool_calls.py), with
    the arguments as the client receives them (redacted where a detector redacts) and the
    detections on them (spans relative to `arguments`, naming the call)."""

    index: int
    id: str | None
    name: str | None
    arguments: str
    detections: list[Finding] = field(default_factory=list)
    judged: bool = False  # output detectors applied to it


@dataclass(slots=True)
class Refusal:
    """A guardrail stopped the request. `direction` "input": input detectors flagged the prompt
    and the model was never called (spans relative to the judged input); "output": a blocking
    detector flagged generated text, which is never released (spans stream-relative)."""

    direction: Literal["input", "output"]
    message: str
    detections: list[Finding]
    input_token_count: int | None = None
    seed: int | None = None


@dataclass(slots=True)
class Terminal:
    """Exactly one per stream, always last. `kind` is the FMS terminal event name; `reason` is
    set for `incomplete`; `error` for `failed` (after a frame) and `error` (before any)."""

    kind: TerminalKind
    finish_reason: str | None = None
    generated_token_count: int = 0
    input_token_count: int | None = None
    processed_index: int = 0
    migrations: int = 0
    reason: IncompleteReason | None = None
    error: Failure | None = None


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Nothing was yielded for `sse_keepalive_s`: streaming writers send a comment so idle
    proxies do not cut the stream; others ignore it."""


Event = Frame | ToolCall | Refusal | Terminal | KeepAlive
# What a surface's writer renders: keep-alives are the serving loop's (handlers/serving.py)
Rendered = Frame | ToolCall | Refusal | Terminal
KEEP_ALIVE = KeepAlive()

# finish_reason -> (terminal kind, incomplete reason)
TERMINAL_BY_FINISH: dict[str | None, tuple[TerminalKind, IncompleteReason | None]] = {
    "EOS_TOKEN": ("completed", None),
    "STOP_SEQUENCE": ("completed", None),
    "MAX_TOKENS": ("incomplete", "max_output_tokens"),
    "TIME_LIMIT": ("incomplete", "time_limit"),
}


def cut_short(finish_reason: str | None) -> bool:
    """The model did not end the text itself: any reason but its EOS (a token or time budget,
    a stop sequence, one the pipeline imposed, none). The same request with a smaller budget
    or another stop cuts it anywhere, so its tail is judged as the beginning of an entity
    wherever it could be one (DESIGN 4.6a: no tail oracle); an answer the model ended is what
    it wrote, released as judged."""
    return finish_reason != "EOS_TOKEN"
