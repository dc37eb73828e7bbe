"""OpenTelemetry traces of the detector service: off unless configured (README "Tracing").

On with `--otlp-endpoint URL` or the standard environment (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_TRACES_EXPORTER=otlp|console`);
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off. On, every request but
probes, scrapes and the registry gets a SERVER span, the child of the caller's W3C `traceparent`
(the orchestrator's `detector <id>` span): detector id, contents count and characters,
detections. Off, nothing of OpenTelemetry is imported or created and the app has no tracing
middleware. Spans carry counts, never text. The orchestrator builds its own provider with
`build_provider` (it may import detectors; the engine has its own copy).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

DEFAULT_SERVICE_NAME = "guardstream-detectors"
UNTRACED = frozenset({"/health", "/metrics", "/registry"})
TRACER: Tracer | None = None
_PROVIDER: TracerProvider | None = None
SPAN = web.RequestKey("guardstream_detectors_span", object)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def env_wants_tracing(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces (with no `server.tracing`)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
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
    """A TracerProvider exporting through a BatchSpanProcessor: to `exporter` when given (tests:
    the SDK's InMemorySpanExporter), else per OTEL_TRACES_EXPORTER (`otlp`, the default, and/or
    `console`), the OTLP endpoint being `endpoint` or the OTEL_EXPORTER_OTLP_* variables.
    Sampling: parent-based with `sample_ratio`, or the OTEL_TRACES_SAMPLER variables."""
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

            exporters.append(ConsoleSpanExporter())
        if "otlp" in names or endpoint is not None or not exporters:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None))
    for each in exporters:
        provider.add_span_processor(BatchSpanProcessor(each))
    return provider


def configure(otlp_endpoint: str | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Turns tracing on when `otlp_endpoint` (a collector's base URL) or the environment asks
    for it; returns whether it is on. Call before create_app()."""
    global TRACER, _PROVIDER
    shutdown()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if otlp_endpoint is None and not env_wants_tracing(environ):
        return False
    name = environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME
    _PROVIDER = build_provider(service_name=name, endpoint=otlp_endpoint, environ=environ)
    TRACER = _PROVIDER.get_tracer("guardstream.detectors")
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
