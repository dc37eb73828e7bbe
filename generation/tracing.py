"""OpenTelemetry traces of the engine: off unless configured (README "Tracing").

On with `--otlp-endpoint URL` or the standard environment (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_TRACES_EXPORTER=otlp|console`; managed engines get
these from their orchestrator); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it
off. On, every request but probes and scrapes gets a SERVER span, the child of the caller's W3C
`traceparent` (the orchestrator's `generate.attempt` span): prompt, resumed and generated token
counts, finish reason, fault injected. Off, nothing of OpenTelemetry is imported or created and
the app has no tracing middleware. Spans carry counts, never text. (The engine never imports
the orchestrator, so this is its own small setup.)
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

DEFAULT_SERVICE_NAME = "guardstream-engine"
UNTRACED = frozenset({"/health", "/metrics"})
TRACER: Tracer | None = None
_PROVIDER: TracerProvider | None = None
SPAN = web.RequestKey("guardstream_engine_span", object)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def env_wants_tracing(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def configure(otlp_endpoint: str | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Turns tracing on when `otlp_endpoint` (a collector's base URL) or the environment asks
    for it; returns whether it is on. Call before create_app()."""
    global TRACER, _PROVIDER
    shutdown()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if otlp_endpoint is None and not env_wants_tracing(environ):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    name = environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME
    # the sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    names = environ.get("OTEL_TRACES_EXPORTER", "").lower().split(",")
    names = [n.strip() for n in names if n.strip()] or ["otlp"]
    exporters: list[SpanExporter] = []
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters.append(ConsoleSpanExporter())
    if "otlp" in names or otlp_endpoint is not None or not exporters:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = None
        if otlp_endpoint is not None:
            url = otlp_endpoint.rstrip("/")
            url = url if url.endswith("/v1/traces") else url + "/v1/traces"
        exporters.append(OTLPSpanExporter(endpoint=url))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _PROVIDER = provider
    TRACER = provider.get_tracer("guardstream.engine")
    return True


def shutdown() -> None:
    """Exports what is left and turns tracing off (at exit)."""
    global TRACER, _PROVIDER
    provider, _PROVIDER, TRACER = _PROVIDER, None, None
    if provider is not None:
        provider.shutdown()


def middleware() -> Any:
    """The SERVER span of each request, current while it is handled."""
    from opentelemetry.trace import SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        tracer = TRACER
        if tracer is None or request.path in UNTRACED:
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        attributes = {
            "http.request.method": request.method,
            "url.path": request.path,
            "http.route": route,
        }
        request_id = request.headers.get("x-request-id")
        if request_id:
            attributes["guardstream.request_id"] = request_id[:128]
        status = 499  # the client left and the handler was cancelled
        with tracer.start_as_current_span(
            f"{request.method} {route}",
            context=propagator.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            request[SPAN] = span
            try:
                response = await handler(request)
                status = response.status
                return response
            finally:
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
