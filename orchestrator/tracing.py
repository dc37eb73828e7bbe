"""OpenTelemetry traces of the orchestrator (README "Tracing"): off unless configured.

Tracing is on when `server.tracing` is set in config.yaml, or when the standard environment asks
for it (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or
`OTEL_TRACES_EXPORTER=otlp|console`); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
keep it off. Off, nothing of OpenTelemetry is imported or created and every hook below is one
`TRACER is None` check (by its caller or at its top): no span, no event, no header.

On, one trace per request (the client's W3C `traceparent` is its parent when it sends one):

- a SERVER span per request: surface, model, HTTP status, request id, and at the end the
  terminal event, finish reason, token and frame counts and migrations; one `frame` event per
  frame the output detectors released, with its hold-back (how long its last character waited
  for the detectors);
- `input_detection` around the input detectors;
- `generate.attempt` per dispatch to a replica (replica, attempt number, resumed and new tokens,
  failure reason) and a `migration` event on the request span between two attempts;
- `detector <id>` per detector call (contents count and characters, detections, duration).

Spans carry counts, ids and error messages, never prompt or generated text. `traceparent` goes
on every call to an engine or a detector service, naming the attempt or detector span, so an
engine or detector service with tracing on parents its own spans there. Spans leave through a
BatchSpanProcessor (a background thread), never on the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from servicekit.tracing import build_provider, env_wants_tracing, server_spans, traces_url

from . import logs

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from .config import TracingConfig

log = logging.getLogger("guardstream.tracing")

DEFAULT_SERVICE_NAME = "guardstream"
# The tracer of this process, or None: tracing is off and every hook is a no-op.
TRACER: Tracer | None = None
_PROVIDER: TracerProvider | None = None
_PROPAGATOR: Any = None
# the span of the request being handled (set by the middleware, copied into every task)
_REQUEST_SPAN: ContextVar[Span | None] = ContextVar("guardstream_request_span", default=None)
# the span an outgoing call belongs to (a generation attempt, a detector call): its context is
# what `traceparent` names. Kept apart from OpenTelemetry's current context because an attempt
# spans the yields of an async generator, where attaching a context is not safe.
_CALL_SPAN: ContextVar[Span | None] = ContextVar("guardstream_call_span", default=None)
# environment variables set for managed engines (they inherit the tracing settings) and their
# previous values, restored by shutdown()
_CHILD_ENV: dict[str, str | None] = {}
_CHILD_ENVIRON: MutableMapping[str, str] = os.environ


# What this module reads of the pipeline's events. Tracing is an observer the pipeline calls
# (`frame_event`, `record_terminal`): it states what it reads (read-only) instead of importing
# the pipeline's types, so `tracing` stays below `streaming/` (clients call it too).
class TracedFailure(Protocol):
    @property
    def type(self) -> Any: ...
    @property
    def code(self) -> int: ...
    @property
    def message(self) -> str: ...


class TracedFrame(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def detections(self) -> Sequence[Any]: ...


class TracedTerminal(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def generated_token_count(self) -> int: ...
    @property
    def processed_index(self) -> int: ...
    @property
    def migrations(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def input_token_count(self) -> int | None: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def error(self) -> TracedFailure | None: ...


def configure(
    settings: TracingConfig | None,
    *,
    exporter: SpanExporter | None = None,
    environ: MutableMapping[str, str] = os.environ,
) -> bool:
    """Turns tracing on for this process when `settings` (config.yaml's `server.tracing`), the
    environment or an explicit `exporter` ask for it; else makes sure it is off. Returns whether
    it is on. Managed engines inherit the settings through `environ` (see engine_env)."""
    global TRACER, _PROVIDER, _PROPAGATOR
    shutdown()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" and exporter is None:
        if settings is not None:
            log.warning("server.tracing is ignored: OTEL_SDK_DISABLED=true")
        return False
    if settings is None and exporter is None and not env_wants_tracing(environ):
        return False
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    endpoint = settings.otlp_endpoint if settings is not None else None
    ratio = settings.sample_ratio if settings is not None else None
    name = _service_name(settings, environ)
    _PROVIDER = build_provider(
        service_name=name,
        endpoint=endpoint,
        sample_ratio=ratio,
        exporter=exporter,
        environ=environ,
    )
    TRACER = _PROVIDER.get_tracer("guardstream.orchestrator")
    _PROPAGATOR = TraceContextTextMapPropagator()
    logs.TRACE_IDS = current_ids
    # managed engines are started with this process's environment: they inherit the settings
    global _CHILD_ENVIRON
    _CHILD_ENVIRON = environ
    for key, value in engine_env(settings, environ).items():
        _CHILD_ENV.setdefault(key, environ.get(key))
        environ[key] = value
    log.info("tracing on: service %s", name)
    return True


def _service_name(settings: TracingConfig | None, environ: Mapping[str, str]) -> str:
    configured = settings.service_name if settings is not None else None
    return configured or environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME


def engine_env(
    settings: TracingConfig | None, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The variables that make a managed engine trace like this orchestrator (the same collector
    and sampling, as `<service name>-engine`) on top of `environ`; {} when tracing is off.
    configure() sets them in this process's environment for the engines the app starts; a
    process that starts engines without the app adds them to those engines' environment."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return {}
    if settings is None and not env_wants_tracing(environ):
        return {}
    wanted = {"OTEL_SERVICE_NAME": f"{_service_name(settings, environ)}-engine"}
    if settings is not None and settings.otlp_endpoint:
        wanted["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = traces_url(settings.otlp_endpoint)
    if not env_wants_tracing(environ):
        wanted["OTEL_TRACES_EXPORTER"] = "otlp"
    if settings is not None and settings.sample_ratio is not None:
        wanted["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        wanted["OTEL_TRACES_SAMPLER_ARG"] = repr(settings.sample_ratio)
    return wanted


def force_flush(timeout_ms: int = 30_000) -> bool:
    """Exports every finished span now (tests call it before asserting)."""
    return _PROVIDER.force_flush(timeout_ms) if _PROVIDER is not None else True


def shutdown() -> None:
    """Flushes and turns tracing off; restores the environment configure() set for children."""
    global TRACER, _PROVIDER, _PROPAGATOR
    provider, _PROVIDER = _PROVIDER, None
    TRACER = None
    _PROPAGATOR = None
    logs.TRACE_IDS = None
    if provider is not None:
        provider.shutdown()
    for key, old in _CHILD_ENV.items():
        if old is None:
            _CHILD_ENVIRON.pop(key, None)
        else:
            _CHILD_ENVIRON[key] = old
    _CHILD_ENV.clear()


# -- helpers the pipeline calls (each only when TRACER is not None) ------------------------------


def current_ids() -> tuple[str, str] | None:
    """The current (trace id, span id) in hex, for log lines; None outside a span."""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def inject(headers: MutableMapping[str, str]) -> None:
    """Puts `traceparent` (and `tracestate`) for the current call on an outgoing request; it
    replaces one a client sent (ours is its descendant)."""
    if _PROPAGATOR is None:
        return
    from opentelemetry import trace

    span = _CALL_SPAN.get()
    context = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(headers, context=context)


def middleware(surfaces: Mapping[str, str], untraced: frozenset[str]) -> Any:
    """The request span: a SERVER span per request (but probes and scrapes), the child of the
    client's `traceparent` when it sent one, current for the whole handling (the access log
    line included), so every task and log line of the request belongs to it."""

    def surface(request: web.Request) -> Mapping[str, Any]:
        return {"guardstream.surface": surfaces.get(request.path, "other")}

    def bind(request: web.Request, span: Span) -> Callable[[], None]:
        token = _REQUEST_SPAN.set(span)

        def done() -> None:
            _REQUEST_SPAN.reset(token)
            request_id = request.get("request_id")  # set by the handler
            if request_id:
                span.set_attribute("guardstream.request_id", request_id)

        return done

    return server_spans(lambda: TRACER, untraced=untraced, attributes=surface, bind=bind)


def request_span(model_id: str) -> Span | None:
    """The current request's span (None when tracing is off or outside a request), labelled
    with the model the request's pipeline runs on."""
    if TRACER is None:
        return None
    span = _REQUEST_SPAN.get()
    if span is not None:
        span.set_attribute("guardstream.model", model_id)
    return span


def frame_event(span: Span, frame: TracedFrame, hold_s: float) -> None:
    """One `frame` event per frame the output detectors released (one per judged chunk, never
    per token: a stream without output detectors holds nothing back and records no events):
    its span of text, its detections, and how long its last character was held back."""
    span.add_event(
        "frame",
        {
            "guardstream.frame.start": frame.start,
            "guardstream.frame.end": frame.end,
            "guardstream.frame.detections": len(frame.detections),
            "guardstream.frame.hold_ms": round(hold_s * 1000, 3),
        },
    )


def record_terminal(span: Span, terminal: TracedTerminal, frames: int) -> None:
    """How the stream ended, on the request span; `failed` and `error` mark it as an error."""
    from opentelemetry.trace import StatusCode

    attributes: dict[str, Any] = {
        "guardstream.terminal": terminal.kind,
        "guardstream.frames": frames,
        "guardstream.generated_tokens": terminal.generated_token_count,
        "guardstream.processed_index": terminal.processed_index,
        "guardstream.migrations": terminal.migrations,
    }
    if terminal.finish_reason is not None:
        attributes["guardstream.finish_reason"] = terminal.finish_reason
    if terminal.input_token_count is not None:
        attributes["guardstream.input_tokens"] = terminal.input_token_count
    if terminal.reason is not None:
        attributes["guardstream.incomplete_reason"] = terminal.reason
    if terminal.error is not None:
        attributes["guardstream.error.type"] = str(terminal.error.type)
        attributes["guardstream.error.code"] = terminal.error.code
        span.set_status(StatusCode.ERROR, terminal.error.message[:500])
    span.set_attributes(attributes)


@contextlib.contextmanager
def input_detection(detectors: Iterable[Any]) -> Iterator[Span | None]:
    """The `input_detection` span over these RequestedDetectors (current inside, so detector
    calls are its children); yields None when tracing is off."""
    if TRACER is None:
        yield None
        return
    ids = [d.detector_id for d in detectors]
    with TRACER.start_as_current_span(
        "input_detection", attributes={"guardstream.detectors": ids}
    ) as span:
        yield span


class _CallSpan:
    """A client span that outgoing calls made meanwhile (in this task) name in `traceparent`."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: Token[Span | None] | None = _CALL_SPAN.set(span)

    def _close(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            try:
                _CALL_SPAN.reset(token)
            except ValueError:  # ended from another task (a generator closed by its owner)
                pass
        self.span.end()


class DetectorCall(_CallSpan):
    def end(self, outcome: str, reply: list[list[Any]] | None, seconds: float) -> None:
        from opentelemetry.trace import StatusCode

        span = self.span
        span.set_attribute("guardstream.detector.outcome", outcome)
        span.set_attribute("guardstream.detector.duration_ms", round(seconds * 1000, 3))
        if reply is not None:
            span.set_attribute("guardstream.detector.detections", sum(len(r) for r in reply))
        elif outcome == "error":
            import sys

            exc = sys.exc_info()[1]  # ended in the `finally` of the failed call
            span.set_status(StatusCode.ERROR, str(exc)[:500] if exc is not None else None)
        self._close()


def start_detector_call(detector_id: str, contents: list[str]) -> DetectorCall | None:
    """The span of one detector call (a child of the current span), or None when off."""
    if TRACER is None:
        return None
    from opentelemetry.trace import SpanKind

    span = TRACER.start_span(
        f"detector {detector_id}",
        kind=SpanKind.CLIENT,
        attributes={
            "guardstream.detector.id": detector_id,
            "guardstream.detector.contents": len(contents),
            "guardstream.detector.chars": sum(len(c) for c in contents),
        },
    )
    return DetectorCall(span)


class Attempt(_CallSpan):
    """One dispatch of a generation to a replica (`generate.attempt`)."""

    def __init__(self, span: Span, replica: str, attempt: int, delivered: int) -> None:
        super().__init__(span)
        self.replica = replica
        self.attempt = attempt
        self.delivered = delivered  # tokens delivered before this attempt
        self._migration: dict[str, Any] | None = None
        # the request span, current in the task reading the engine: it gets the migration event
        from opentelemetry import trace

        self._parent = trace.get_current_span()

    def failed(self, message: str, error_type: str, migratable: bool) -> None:
        from opentelemetry.trace import StatusCode

        self.span.set_attributes(
            {
                "guardstream.attempt.failure": message[:500],
                "guardstream.attempt.error_type": error_type,
                "guardstream.attempt.migratable": migratable,
            }
        )
        self.span.set_status(StatusCode.ERROR, message[:500])

    def migrating(self, kind: str, migration: int) -> None:
        """The request moves on to another replica: a `migration` event once this attempt
        has ended."""
        self._migration = {
            "guardstream.migration.number": migration,
            "guardstream.migration.kind": kind,
            "guardstream.migration.from_replica": self.replica,
            "guardstream.migration.after_attempt": self.attempt,
        }

    def end(self, delivered: int) -> None:
        self.span.set_attribute("guardstream.attempt.tokens", delivered - self.delivered)
        self._close()
        if self._migration is not None:
            self._migration["guardstream.migration.delivered_tokens"] = delivered
            self._parent.add_event("migration", self._migration)


def start_attempt(attempt: int, replica: str, delivered: int) -> Attempt | None:
    """The span of one generation attempt (a child of the request span), or None when off."""
    if TRACER is None:
        return None
    from opentelemetry.trace import SpanKind

    span = TRACER.start_span(
        "generate.attempt",
        kind=SpanKind.CLIENT,
        attributes={
            "guardstream.attempt": attempt,
            "guardstream.replica": replica,
            "guardstream.attempt.resumed_tokens": delivered,
        },
    )
    return Attempt(span, replica, attempt, delivered)
