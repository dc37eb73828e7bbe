"""CLI: `serve`, `check-config`, `stream` (DESIGN section 2)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

# Imports live in the subcommands: the config pulls in NLTK (about 2 s), which the terminal
# client does not need.


def _check_config(args: argparse.Namespace) -> int:
    """Every error of the file in one pass. The detector service's file (no `models:`, or
    `--detectors`) is the same format without models."""
    from .config import ConfigError, is_detector_service_config, parse_config, read_yaml

    try:
        data = read_yaml(args.path)
        service = args.detectors or is_detector_service_config(data)
        config = parse_config(data, require_models=not service)
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        print(f"{args.path}: {len(exc.errors)} error(s)", file=sys.stderr)
        return 1
    if service:
        builtins = sum(1 for d in config.detectors.values() if d.builtin is not None)
        print(f"{args.path}: OK (detector service config: {builtins} built-in detector(s))")
        return 0
    from .capacity import judge_session_warnings

    for warning in judge_session_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"{args.path}: OK ({len(config.models)} model(s), {len(config.detectors)} detector(s), "
        f"{len(config.chunkers)} chunker(s))"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from detectors.runtime import one_blas_thread_per_process

    from .capacity import judge_session_warnings
    from .config import ConfigError, load_config
    from .logs import configure_logging
    from .server import run_event_loop
    from .workers import run_server

    # In-process model detectors load torch and tokenizers into this process (and into its
    # workers, which inherit the environment), and these must be set before: OpenMP threads that
    # sleep when idle, as in the engine (spinning ones take the cores the event loop needs on a
    # small machine: generation/__init__.py), and no tokenizers thread pool to warn about when a
    # managed engine or a worker is forked. Until the orchestrator stopped importing
    # `generation` (DESIGN 1), that import set them by accident.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the detectors' numpy products on one OpenBLAS thread: many detector threads run at once
    one_blas_thread_per_process()
    configure_logging(args.log_format, args.log_level.upper())
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    if not config.models:
        logging.getLogger("guardstream").warning(
            "no models configured: only the detection endpoints will serve"
        )
    for warning in judge_session_warnings(config):
        logging.getLogger("guardstream").warning("%s", warning)
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    try:
        # SIGTERM (what Kubernetes and docker send) and SIGINT both drain: see run_server
        return run_event_loop(
            run_server(
                config,
                host,
                port,
                device=args.device,
                log_format=args.log_format,
                log_level=args.log_level.upper(),
                ready_hint=(lambda bound: try_it(config, bound)) if args.hint else None,
            )
        )
    except ConfigError as exc:  # found at start-up: API keys, TLS files
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    except OSError as exc:  # the port is taken, the host is not ours
        print(f"cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def try_it(config: Any, port: int) -> str:
    """Commands to paste once the service is ready (`serve --hint`, which `make run` uses), built
    from the running config: its first model, output detectors it has (`pii` and `hap` when
    there), a bounded answer so a small model ends cleanly, and, when keys are on, the
    Authorization header read from the key variable in the shell (the key is never printed)."""
    model = next(iter(config.models), "MODEL")
    judging = sorted(d for d, c in config.detectors.items() if c.type == "text_contents")
    preferred = [d for d in ("pii", "hap") if d in judging]
    chosen = preferred or judging[:2]
    body = json.dumps(
        {
            "model_id": model,
            "inputs": "Tell me about cats in one sentence.",
            "guardrail_config": {"output": {"models": {d: {} for d in chosen}}},
            "text_gen_parameters": {"max_new_tokens": 60},
        }
    )
    url = f"http://127.0.0.1:{port}"
    env = config.server.api_keys_env
    # the first key of the variable, expanded by the user's shell: `${VAR%%,*}`
    key = f"${{{env}%%,*}}" if env else None
    auth = [f'    -H "authorization: Bearer {key}" \\'] if key else []
    client_env = f"GUARDSTREAM_API_KEY={key} " if key else ""
    flags = "".join(f"--output-detector {d} " for d in chosen)
    lines = [
        "",
        "guardstream is ready. In another terminal, try:",
        "",
        f"  curl -N {url}/api/v1/task/server-streaming-classification-with-text-generation \\",
        *auth,
        "    -H 'content-type: application/json' \\",
        f"    -d '{body}'",
        "",
        f"  or: {client_env}{sys.executable} -m orchestrator stream --url {url} --max-new-tokens 60 "
        f"{flags}'Tell me about cats in one sentence.'",
        "",
    ]
    if env:
        lines[3:3] = [f"  (API keys are on: the commands read one from ${env} in your shell)", ""]
    return "\n".join(lines)


def _stream(args: argparse.Namespace) -> int:
    from .terminal_client import run_terminal_client

    return asyncio.run(run_terminal_client(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator", description="guardstream orchestrator"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service")
    serve.add_argument("--config", required=True)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="for in-process detectors"
    )
    serve.add_argument(
        "--log-format",
        default="json",
        choices=["json", "text"],
        help="json: one object per line, for log collectors (default); text: for people",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--hint",
        action="store_true",
        help="print example commands once the service is ready (make run uses it)",
    )
    serve.set_defaults(func=_serve)

    check = sub.add_parser(
        "check-config", help="validate a config, every error in one pass; exit 1 on error"
    )
    check.add_argument("path")
    check.add_argument(
        "--detectors",
        action="store_true",
        help="the file is the detector service's (no models needed); "
        "a file without a models section is taken for one",
    )
    check.set_defaults(func=_check_config)

    stream = sub.add_parser("stream", help="stream a generation in the terminal")
    stream.add_argument("prompt")
    stream.add_argument("--url", default="http://127.0.0.1:8033")
    stream.add_argument(
        "--model", default=None, help="model_id (default: the server's first model)"
    )
    stream.add_argument("--input-detector", action="append", default=[], metavar="ID")
    stream.add_argument("--output-detector", action="append", default=[], metavar="ID")
    stream.add_argument("--max-new-tokens", type=int, default=None)
    stream.add_argument(
        "--api",
        choices=("fms", "chat"),
        default="fms",
        help="fms: the FMS streaming endpoint; chat: OpenAI /v1/chat/completions",
    )
    stream.add_argument("--api-key", default=None)
    stream.add_argument("--no-color", action="store_true")
    stream.set_defaults(func=_stream)

    args = parser.parse_args(argv)
    if args.command != "serve":  # serve configures its own (structured) logging
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
            stream=sys.stderr,
        )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
