"""`python -m detectors serve --config PATH [--host H] [--port P] [--device D]`: the detector
service for every `builtin:` entry of the config's `detectors:` section. With the config's
`server.api_keys_env` naming an environment variable (comma-separated keys), every request but
`GET /health` needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys

from servicekit.cli import add_service_flags, service_flags
from servicekit.connections import add_connection_flags

from .runtime import check_device, one_blas_thread_per_process
from .service import (
    ConfigError,
    Limits,
    api_keys_from_config,
    detectors_from_config,
    load_config,
    serve,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m detectors", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the config's built-in detectors over HTTP")
    s.add_argument("--config", required=True, help="config.yaml (its detectors: section)")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed)")
    s.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    defaults = Limits()
    s.add_argument("--max-contents", type=int, default=defaults.max_contents)
    s.add_argument("--max-content-chars", type=int, default=defaults.max_content_chars)
    s.add_argument("--max-total-chars", type=int, default=defaults.max_total_chars)
    s.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    s.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=defaults.max_concurrent_requests,
        help="contents requests in progress at once; beyond, 503 with Retry-After",
    )
    s.add_argument(
        "--no-warmup", action="store_true", help="load models on first use, not at start"
    )
    add_connection_flags(s)
    add_service_flags(s)
    return parser


def _quiet_transformers() -> None:
    """No weight-loading progress bars in a service log."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # transformers missing or changed: cosmetic only
        pass


async def _serve(args: argparse.Namespace, config: dict) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def ready(host: str, port: int, ids: list[str]) -> None:
        # the models, torch and transformers live as long as the process: frozen, Python's
        # full collections stop walking them with the GIL held (see the orchestrator's
        # `freeze_startup_heap`)
        gc.collect()
        gc.freeze()
        print(
            f"detectors: serving {', '.join(ids) or 'no detectors'} on http://{host}:{port}",
            flush=True,
        )

    limits = Limits(
        max_contents=args.max_contents,
        max_content_chars=args.max_content_chars,
        max_total_chars=args.max_total_chars,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_concurrent_requests=args.max_concurrent_requests,
    )
    await serve(
        config,
        host=args.host,
        port=args.port,
        device=args.device,
        limits=limits,
        warmup=not args.no_warmup,
        ready=ready,
        stop=stop,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    one_blas_thread_per_process()  # before the models load numpy
    from .tracing import TRACING

    with service_flags(args, TRACING):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """`serve`, its flags applied (tracing on when asked)."""
    try:
        check_device(args.device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        errors: list[str] = []
        for check in (
            lambda: api_keys_from_config(config),  # server.api_keys_env names a set variable
            lambda: detectors_from_config(config, device=args.device),
        ):
            try:
                check()
            except ConfigError as exc:  # every error listed, in one pass
                errors.extend(exc.errors)
        if errors:
            raise ConfigError(errors)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        return 1
    _quiet_transformers()
    asyncio.run(_serve(args, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
