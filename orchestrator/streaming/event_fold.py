"""What a unary OpenAI-shaped reply (a `chat.completion`, a `text_completion`) gathers from a
stream's events before it renders its one object: the text, the output and input detections, the
refusal and the terminal. The folds differ only in the object they render (`body`)."""

from __future__ import annotations

from ..api.errors import Failure
from .events import Frame, Refusal, Rendered, Terminal, ToolCall
from .findings import Finding


class EventFold:
    """Collects a stream's events; a failure is never said in-band (nothing was sent: the
    serving loop answers it as an HTTP error)."""

    def __init__(self, model: str) -> None:
        self._model = model  # the reply's `model`
        self.texts: list[str] = []
        self.output: list[Finding] = []
        self.input: list[Finding] = []  # a refused input's, or a redacted input's
        self.tool_calls: list[ToolCall] = []  # released, whole (a chat.completion's message)
        self.refusal: Refusal | None = None
        self.terminal: Terminal | None = None

    def in_band(self, failure: Failure) -> bool:
        return False

    def add(self, event: Rendered) -> None:
        if isinstance(event, Frame):
            self.texts.append(event.text)
            self.output.extend(event.detections)
            self.input.extend(event.input_detections or ())
        elif isinstance(event, ToolCall):
            self.tool_calls.append(event)
            self.output.extend(event.detections)
        elif isinstance(event, Refusal):
            self.refusal = event
            (self.input if event.direction == "input" else self.output).extend(event.detections)
        elif isinstance(event, Terminal):
            self.terminal = event

    @property
    def input_refused(self) -> bool:
        return self.refusal is not None and self.refusal.direction == "input"
