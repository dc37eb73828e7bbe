"""The completions-detection wire format (issue 40): pipeline events as `text_completion` SSE
chunks ending in `data: [DONE]`, or folded into one `text_completion`, in the FMS
orchestrator's shape. An input hit is one chunk with no choices, the input detections and the
UNSUITABLE_INPUT warning (the model is never called); each released frame is one chunk with
its text and, when output detectors judged it, its detections; an error after the first byte
is `event: error` with the error body, then `[DONE]`. A writer only renders: the serving loop
(handlers/serving.py) does the rest."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..api.errors import ErrorBody, Failure
from ..api.fms_responses import UNSUITABLE_OUTPUT
from .chat_writer import finish_reason, usage
from .event_fold import EventFold
from .events import Frame, Refusal, Rendered, Terminal
from .finding_wire import completion_detection
from .findings import Finding, sort_findings
from .wire_json import SSE_HEADERS, dumps

DONE = b"data: [DONE]\n\n"
# the FMS orchestrator's text for this endpoint (its `UNSUITABLE_INPUT_MESSAGE`)
INPUT_WARNING = {
    "type": "UNSUITABLE_INPUT",
    "message": "Unsuitable input detected. Please check the detected entities on your input and "
    "try again with the unsuitable input removed.",
}
OUTPUT_WARNING = {"type": "UNSUITABLE_OUTPUT", "message": UNSUITABLE_OUTPUT.message}


def _input(findings: list[Finding]) -> dict[str, Any]:
    return {"input": [{"message_index": 0, "results": [completion_detection(f) for f in findings]}]}


def _output(findings: list[Finding]) -> dict[str, Any]:
    return {"output": [{"choice_index": 0, "results": [completion_detection(f) for f in findings]}]}


class CompletionChunkWriter:
    headers = SSE_HEADERS
    start_at_once = False  # an error before the first chunk is a real HTTP error

    def __init__(self, model: str, *, include_usage: bool) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._include_usage = include_usage
        self._finished = False
        self._input_refused = False  # its chunk carried the usage already

    def in_band(self, failure: Failure) -> bool:
        return False

    def _chunk(
        self,
        choices: list[dict[str, Any]],
        *,
        detections: dict[str, Any] | None = None,
        warnings: list[dict[str, str]] | None = None,
        usage: dict[str, int] | None = None,
    ) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        if detections is not None:
            chunk["detections"] = detections
        if warnings:
            chunk["warnings"] = warnings
        return b"data: " + dumps(chunk) + b"\n\n"

    @staticmethod
    def _choice(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def render(self, event: Rendered) -> bytes:
        if isinstance(event, Frame):
            if not event.text and not event.detections and not event.input_detections:
                return b""
            detections: dict[str, Any] = {}
            if event.input_detections:  # the prompt was redacted: said once, here
                detections.update(_input(event.input_detections))
            if event.judged:
                detections.update(_output(event.detections))
            return self._chunk(
                [self._choice(event.text)],
                detections=detections or None,
                warnings=[OUTPUT_WARNING] if event.detections else None,
            )
        if isinstance(event, Refusal):
            self._finished = True
            if event.direction == "input":
                self._input_refused = True
                prompt = event.input_token_count or 0
                return self._chunk(
                    [],
                    usage={"prompt_tokens": prompt, "total_tokens": 0, "completion_tokens": 0},
                    detections=_input(event.detections),
                    warnings=[INPUT_WARNING],
                )
            return self._chunk(
                [self._choice("", "content_filter")],
                detections=_output(event.detections),
                warnings=[OUTPUT_WARNING],
            )
        return self._terminal(event)

    def _terminal(self, terminal: Terminal) -> bytes:
        if terminal.error is not None:
            error = ErrorBody.from_failure(terminal.error).dump()
            return b"event: error\ndata: " + dumps(error) + b"\n\n" + DONE
        out = b""
        if not self._finished:
            out += self._chunk([self._choice("", finish_reason(terminal))])
        if self._include_usage and not self._input_refused:
            out += self._chunk([], usage=usage(terminal).dump())
        return out + DONE


class CompletionFold(EventFold):
    """The unary `text_completion`; an error anywhere is a real HTTP error."""

    def body(self) -> dict[str, Any]:
        terminal = self.terminal
        assert terminal is not None
        detections: dict[str, Any] = {}
        if self.input:
            detections.update(_input(sort_findings(self.input)))
        if self.output:
            detections.update(_output(self.output))
        refused = self.input_refused
        warnings = [INPUT_WARNING] if refused else []
        if self.output:
            warnings.append(OUTPUT_WARNING)
        if refused:  # as the FMS orchestrator: no choices, the prompt's count
            assert self.refusal is not None
            choices: list[dict[str, Any]] = []
            counts = {
                "prompt_tokens": self.refusal.input_token_count or 0,
                "total_tokens": 0,
                "completion_tokens": 0,
            }
        else:
            choices = [
                {
                    "index": 0,
                    "text": "".join(self.texts),
                    "logprobs": None,
                    "finish_reason": finish_reason(terminal),
                }
            ]
            counts = usage(terminal).dump()
        out: dict[str, Any] = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self._model,
            "choices": choices,
            "usage": counts,
        }
        if detections:
            out["detections"] = detections
        if warnings:
            out["warnings"] = warnings
        return out
