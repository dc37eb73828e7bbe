"""The FMS task endpoints' wire format (DESIGN 4.3): pipeline events as SSE messages, or folded
into the unary `ClassifiedGeneratedTextResult`.

`FmsWriter` is one of the three writers `handlers.serving.serve` drives: it renders events, and
nothing else (the slot, the response, keep-alives and bursts are the serving loop's)."""

from __future__ import annotations

from typing import Any

from ..api.errors import ErrorBody, Failure
from ..api.fms_responses import (
    UNSUITABLE_INPUT,
    UNSUITABLE_OUTPUT,
    ClassifiedFrame,
    ClassifiedGeneratedTextResult,
    FrameWarning,
    IncompleteDetails,
    RefusalDelta,
    RefusalDone,
    StreamError,
    TerminalSummary,
    TokenClassificationResults,
    Wire,
)
from .events import Frame, Refusal, Rendered, Terminal
from .finding_wire import tcr, tcr_model
from .findings import Finding
from .wire_json import SSE_HEADERS, dumps


def sse(name: str | None, data: dict[str, Any]) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + dumps(data) + b"\n\n"


def classified_frame(frame: Frame) -> ClassifiedFrame:
    return ClassifiedFrame(
        generated_text=frame.text,
        token_classification_results=TokenClassificationResults(
            input=[tcr_model(f) for f in frame.input_detections]
            if frame.input_detections
            else None,
            output=[tcr_model(f) for f in frame.detections] if frame.judged else None,
        ),
        start_index=frame.start,
        processed_index=frame.end,
        finish_reason=frame.finish_reason if frame.final else None,  # type: ignore[arg-type]
        generated_token_count=frame.generated_token_count if frame.final else None,
        input_token_count=frame.input_token_count,
        seed=frame.seed,
        warnings=[UNSUITABLE_OUTPUT] if frame.detections else None,
    )


def frame_dict(frame: Frame) -> dict[str, Any]:
    """The frame's wire dict without building pydantic objects (one per frame on the hot path);
    equal to `classified_frame(frame).dump()`, which the tests check."""
    out: dict[str, Any] = {
        "generated_text": frame.text,
        "token_classification_results": {},
        "start_index": frame.start,
        "processed_index": frame.end,
    }
    if frame.input_detections:
        out["token_classification_results"]["input"] = [tcr(f) for f in frame.input_detections]
    if frame.judged:
        out["token_classification_results"]["output"] = [tcr(f) for f in frame.detections]
    if frame.final:
        if frame.finish_reason is not None:
            out["finish_reason"] = frame.finish_reason
        if frame.generated_token_count is not None:
            out["generated_token_count"] = frame.generated_token_count
    if frame.input_token_count is not None:
        out["input_token_count"] = frame.input_token_count
    if frame.seed is not None:
        out["seed"] = frame.seed
    if frame.detections:
        out["warnings"] = [UNSUITABLE_OUTPUT.dump()]
    return out


def input_refusal_frame(refusal: Refusal) -> ClassifiedFrame:
    """An input hit is one frame with the input detections (DESIGN 4.5)."""
    return ClassifiedFrame(
        token_classification_results=TokenClassificationResults(
            input=[tcr_model(f) for f in refusal.detections]
        ),
        start_index=0,
        processed_index=0,
        input_token_count=refusal.input_token_count,
        seed=refusal.seed,
        warnings=[UNSUITABLE_INPUT],
    )


def summary(terminal: Terminal) -> TerminalSummary:
    return TerminalSummary(
        finish_reason=terminal.finish_reason,  # type: ignore[arg-type]
        generated_token_count=terminal.generated_token_count,
        input_token_count=terminal.input_token_count,
        processed_index=terminal.processed_index,
        migrations=terminal.migrations,
        incomplete_details=IncompleteDetails(reason=terminal.reason)
        if terminal.reason is not None
        else None,
        error=StreamError(
            code=terminal.error.code, type=str(terminal.error.type), message=terminal.error.message
        )
        if terminal.error is not None and terminal.kind == "failed"
        else None,
    )


def terminal_payload(terminal: Terminal) -> Wire | ErrorBody:
    if terminal.kind == "error":
        assert terminal.error is not None
        return ErrorBody.from_failure(terminal.error)
    return summary(terminal)


def sse_event(event: Rendered) -> bytes:
    """One pipeline event as SSE bytes."""
    if isinstance(event, Frame):
        return sse(None, frame_dict(event))
    if isinstance(event, Refusal):
        if event.direction == "input":
            return sse(None, input_refusal_frame(event).dump())
        done = RefusalDone(
            refusal=event.message, detections=[tcr_model(f) for f in event.detections]
        )
        return sse("refusal.delta", RefusalDelta(delta=event.message).dump()) + sse(
            "refusal.done", done.dump()
        )
    return sse(event.kind, terminal_payload(event).dump())


class FmsWriter:
    """The streaming task endpoint's writer."""

    # the 200 and the SSE headers go out at once, before the pipeline's first event: every
    # error after that is in-band, the `error` or `failed` terminal event (DESIGN 4.3)
    headers = SSE_HEADERS
    start_at_once = True

    def in_band(self, failure: Failure) -> bool:
        return True  # never asked: the response has started

    def render(self, event: Rendered) -> bytes:
        return sse_event(event)


class UnaryFold:
    """Folds the events of one stream into the unary result; an error ends it as a real HTTP
    error (nothing was sent yet, and the result has no place for one)."""

    def __init__(self) -> None:
        # findings, made wire models in `body` (off the loop: serving.fold_unary)
        self._texts: list[str] = []
        self._inputs: list[Finding] = []  # of a refused input
        self._redacted_inputs: list[Finding] = []
        self._outputs: list[Finding] = []
        self._warnings: dict[str, FrameWarning] = {}
        self.result = ClassifiedGeneratedTextResult()

    def in_band(self, failure: Failure) -> bool:
        return False

    def add(self, event: Rendered) -> None:
        r = self.result
        if isinstance(event, Frame):
            if event.input_detections:
                self._redacted_inputs.extend(event.input_detections)
            if event.text:
                self._texts.append(event.text)
            self._outputs.extend(event.detections)
            if event.detections:
                self._warnings.setdefault(UNSUITABLE_OUTPUT.id, UNSUITABLE_OUTPUT)
            r.input_token_count = event.input_token_count
            r.seed = event.seed
        elif isinstance(event, Refusal):
            if event.direction == "input":
                self._inputs.extend(event.detections)
                self._warnings.setdefault(UNSUITABLE_INPUT.id, UNSUITABLE_INPUT)
                r.input_token_count = event.input_token_count
                r.seed = event.seed
            else:
                r.refusal = RefusalDone(
                    refusal=event.message, detections=[tcr_model(f) for f in event.detections]
                )
        elif isinstance(event, Terminal):
            r.finish_reason = event.finish_reason  # type: ignore[assignment]
            r.generated_token_count = event.generated_token_count
            r.input_token_count = event.input_token_count
            r.migrations = event.migrations
            r.incomplete_details = (
                IncompleteDetails(reason=event.reason) if event.reason is not None else None
            )
            r.status = "incomplete" if event.kind == "incomplete" else "completed"

    def body(self) -> dict[str, Any]:
        r = self.result
        r.generated_text = "".join(self._texts) if self._texts or not self._inputs else None
        inputs = [tcr_model(f) for f in self._inputs + self._redacted_inputs]
        r.token_classification_results = TokenClassificationResults(
            input=inputs or None,
            output=[tcr_model(f) for f in self._outputs] if self._outputs or self._texts else None,
        )
        r.warnings = list(self._warnings.values()) or None
        return r.dump()
