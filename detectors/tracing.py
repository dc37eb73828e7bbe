"""OpenTelemetry traces of the detector service: off unless configured (README "Tracing").

On with `--otlp-endpoint URL` or the standard environment (servicekit.tracing). On, every request
but probes, scrapes and the registry gets a SERVER span, the child of the caller's W3C
`traceparent` (the orchestrator's `detector <id>` span): detector id, contents count and
characters, detections. Off, nothing of OpenTelemetry is imported or created and the app has no
tracing middleware. Spans carry counts, never text.
"""

from __future__ import annotations

from servicekit.tracing import ServiceTracing

TRACING = ServiceTracing(
    default_service_name="guardstream-detectors",
    tracer_name="guardstream.detectors",
    untraced=frozenset({"/health", "/metrics", "/registry"}),
)
