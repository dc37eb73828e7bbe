"""OpenTelemetry traces of the engine: off unless configured (README "Tracing").

On with `--otlp-endpoint URL` or the standard environment (servicekit.tracing; managed engines
get it from their orchestrator). On, every request but probes and scrapes gets a SERVER span, the
child of the caller's W3C `traceparent` (the orchestrator's `generate.attempt` span): prompt,
resumed and generated token counts, finish reason, fault injected. Off, nothing of OpenTelemetry
is imported or created and the app has no tracing middleware. Spans carry counts, never text.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from servicekit.tracing import (
    annotate,
    event,
    header_request_id,
    server_spans,
    service_provider,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

__all__ = ["TRACER", "annotate", "configure", "event", "middleware", "shutdown"]

DEFAULT_SERVICE_NAME = "guardstream-engine"
UNTRACED = frozenset({"/health", "/metrics"})
TRACER: Tracer | None = None
_PROVIDER: TracerProvider | None = None


def configure(otlp_endpoint: str | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Turns tracing on when `otlp_endpoint` (a collector's base URL) or the environment asks
    for it; returns whether it is on. Call before create_app()."""
    global TRACER, _PROVIDER
    shutdown()
    _PROVIDER = service_provider(DEFAULT_SERVICE_NAME, otlp_endpoint, environ)
    TRACER = _PROVIDER.get_tracer("guardstream.engine") if _PROVIDER is not None else None
    return TRACER is not None


def shutdown() -> None:
    """Exports what is left and turns tracing off (at exit)."""
    global TRACER, _PROVIDER
    provider, _PROVIDER, TRACER = _PROVIDER, None, None
    if provider is not None:
        provider.shutdown()


def middleware() -> Any:
    """The SERVER span of each request, current while it is handled."""
    return server_spans(lambda: TRACER, untraced=UNTRACED, attributes=header_request_id)
