"""OpenTelemetry traces of the engine: off unless configured (README "Tracing").

On with `--otlp-endpoint URL` or the standard environment (servicekit.tracing; managed engines
get it from their orchestrator). On, every request but probes and scrapes gets a SERVER span, the
child of the caller's W3C `traceparent` (the orchestrator's `generate.attempt` span): prompt,
resumed and generated token counts, finish reason, fault injected. Off, nothing of OpenTelemetry
is imported or created and the app has no tracing middleware. Spans carry counts, never text.
The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
"""

from __future__ import annotations

from servicekit.tracing import ServiceTracing

TRACING = ServiceTracing(
    default_service_name="guardstream-engine",
    tracer_name="guardstream.engine",
    untraced=frozenset({"/health", "/metrics"}),
)
