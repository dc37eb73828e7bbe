"""The command-line flags the engine and the detector service share, added and applied one way:
`--otlp-endpoint` (where traces go; the standard OTEL_* variables turn tracing on too) and
`--log-level`. The orchestrator has neither: its tracing is configured in config.yaml and its
logs are structured (`--log-format`), DESIGN section 2.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from .tracing import ServiceTracing

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_service_flags(parser: argparse.ArgumentParser, *, tracing: bool = True) -> None:
    """`--log-level`, and `--otlp-endpoint` unless `tracing` is False (a command that serves
    nothing, such as the engine's `prepare`)."""
    if tracing:
        parser.add_argument(
            "--otlp-endpoint",
            default=None,
            metavar="URL",
            help="send OpenTelemetry traces to this OTLP/HTTP collector (http://host:4318); "
            "the standard OTEL_* variables turn tracing on too (README: Tracing)",
        )
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")


@contextmanager
def service_flags(args: argparse.Namespace, tracing: ServiceTracing | None) -> Iterator[None]:
    """Applies the flags `add_service_flags` added: the log level at once, and `tracing` (off
    unless `--otlp-endpoint` or the environment asks) for the block; leaving the block exports
    the last spans, however it is left. None: a command without tracing."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if tracing is None:
        yield
        return
    tracing.configure(args.otlp_endpoint)
    try:
        yield
    finally:
        tracing.shutdown()
