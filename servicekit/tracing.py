"""OpenTelemetry for every service: off unless configured (README "Tracing").

Tracing is on when a service is given a collector, or when the standard environment asks for it
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_TRACES_EXPORTER=
otlp|console`); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off. Off, nothing
of OpenTelemetry is imported. On, `server_spans` gives every request but probes and scrapes a
SERVER span, the child of the caller's W3C `traceparent`. Spans carry counts, never text.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the request's SERVER span, for annotate() and event()
SPAN = web.RequestKey("guardstream_server_span", object)


def one_line(span: Any) -> str:
    """A finished span as compact JSON on one line (the console exporter's format)."""
    return span.to_json(indent=None) + "\n"


def sdk_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """`OTEL_SDK_DISABLED=true`: nothing traces, whatever else is configured."""
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def env_wants_tracing(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces (with no explicit setting)."""
    if sdk_disabled(environ):
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def traces_url(endpoint: str) -> str:
    """A collector's base URL (`http://collector:4318`) as its OTLP/HTTP traces URL."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def build_provider(
    *,
    service_name: str,
    endpoint: str | None = None,
    sample_ratio: float | None = None,
    exporter: SpanExporter | None = None,
    environ: Mapping[str, str] = os.environ,
) -> TracerProvider:
    """A TracerProvider exporting through a BatchSpanProcessor (a background thread, never the
    event loop): to `exporter` when given (tests: the SDK's InMemorySpanExporter), else per
    OTEL_TRACES_EXPORTER (`otlp`, the default, and/or `console`), the OTLP endpoint being
    `endpoint` or the OTEL_EXPORTER_OTLP_* variables. Sampling: parent-based with
    `sample_ratio`, or the OTEL_TRACES_SAMPLER variables (default: parent-based, always on)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    sampler = None if sample_ratio is None else ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}), sampler=sampler
    )
    exporters: list[SpanExporter] = []
    if exporter is not None:
        exporters.append(exporter)
    else:
        names = environ.get("OTEL_TRACES_EXPORTER", "").lower().split(",")
        names = [n.strip() for n in names if n.strip()] or ["otlp"]
        if "console" in names:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            # one span, one line: an engine's stdout is relayed line by line into the
            # orchestrator's JSON log, and the exporter's default indented JSON became a
            # dozen records per span there (issue 41)
            exporters.append(ConsoleSpanExporter(out=sys.stdout, formatter=one_line))
        if "otlp" in names or endpoint is not None or not exporters:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None))
    for each in exporters:
        provider.add_span_processor(BatchSpanProcessor(each))
    return provider


class ServiceTracing:
    """The tracing of one service process (the engine, the detector service): off until
    `configure()` turns it on; `tracer` is None while off, which is all a hook checks."""

    def __init__(self, *, default_service_name: str, tracer_name: str, untraced: frozenset[str]):
        self.default_service_name = default_service_name
        self.tracer_name = tracer_name
        self.untraced = untraced
        self.tracer: Tracer | None = None
        self._provider: TracerProvider | None = None

    def configure(
        self, otlp_endpoint: str | None = None, environ: Mapping[str, str] = os.environ
    ) -> bool:
        """Turns tracing on when `otlp_endpoint` (a collector's base URL, `--otlp-endpoint`)
        or the environment asks for it, named by OTEL_SERVICE_NAME or the default; returns
        whether it is on. Call before the app is created (it adds the middleware only then)."""
        self.shutdown()
        if sdk_disabled(environ):
            return False
        if otlp_endpoint is None and not env_wants_tracing(environ):
            return False
        name = environ.get("OTEL_SERVICE_NAME", "").strip() or self.default_service_name
        self._provider = build_provider(service_name=name, endpoint=otlp_endpoint, environ=environ)
        self.tracer = self._provider.get_tracer(self.tracer_name)
        return True

    def shutdown(self) -> None:
        """Exports what is left and turns tracing off (at exit)."""
        provider, self._provider, self.tracer = self._provider, None, None
        if provider is not None:
            provider.shutdown()

    def middleware(self) -> Any:
        """The SERVER span of each request, with the caller's `x-request-id`."""
        return server_spans(
            lambda: self.tracer, untraced=self.untraced, attributes=header_request_id
        )


def _no_attributes(request: web.Request) -> Mapping[str, Any]:
    return {}


def header_request_id(request: web.Request) -> Mapping[str, Any]:
    """The caller's `x-request-id` as a span attribute (what the engine and detectors record)."""
    request_id = request.headers.get("x-request-id")
    return {"guardstream.request_id": request_id[:128]} if request_id else {}


def server_spans(
    tracer: Callable[[], Tracer | None],
    *,
    untraced: frozenset[str],
    attributes: Callable[[web.Request], Mapping[str, Any]] = _no_attributes,
    bind: Callable[[web.Request, Span], Callable[[], None] | None] | None = None,
) -> Any:
    """The middleware of the SERVER span of each request (but `untraced` paths), current while
    it is handled, the child of the caller's `traceparent`. `tracer()` is asked per request
    (None: tracing is off, the request passes untouched); `attributes(request)` adds a service's
    own attributes at the start; `bind(request, span)` may keep the span where the service's code
    finds it and return what to do when the request ends. Status 499 (nginx's "client closed
    request") when the handler was cancelled; a 5xx marks the span as an error."""
    from opentelemetry.trace import SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        current = tracer()
        if current is None or request.path in untraced:
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        attrs = {
            "http.request.method": request.method,
            "url.path": request.path,
            "http.route": route,
            **attributes(request),
        }
        status = 499  # the client left and the handler was cancelled
        with current.start_as_current_span(
            f"{request.method} {route}",
            context=propagator.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes=attrs,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            request[SPAN] = span
            done = bind(request, span) if bind is not None else None
            try:
                response = await handler(request)
                status = response.status
                return response
            finally:
                if done is not None:
                    done()
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)

    return traced


def annotate(request: web.Request, attributes: Mapping[str, Any]) -> None:
    """Attributes on the request's span (nothing when tracing is off)."""
    span: Span | None = request.get(SPAN)  # type: ignore[assignment]
    if span is not None:
        span.set_attributes(attributes)


def event(request: web.Request, name: str, attributes: Mapping[str, Any]) -> None:
    """An event on the request's span (nothing when tracing is off)."""
    span: Span | None = request.get(SPAN)  # type: ignore[assignment]
    if span is not None:
        span.add_event(name, attributes)
