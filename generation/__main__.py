"""`python -m generation serve|prepare`: one engine replica, or materialise a model and exit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from aiohttp.web import BaseRequest, StreamResponse
from aiohttp.web_log import AccessLogger

from servicekit.auth import ApiKeysError, api_keys_from_env
from servicekit.cli import add_service_flags, service_flags
from servicekit.connections import add_connection_flags, runner_options

from .protocol import MAX_TOKENIZER_CHARS, MAX_WAITING_REQUESTS

LISTENING_PREFIX = "guardstream-engine listening on "
#: The listening socket's accept queue (the kernel caps it at net.core.somaxconn). aiohttp's
#: default, 128, is less than a burst of new streams: 256 clients connecting at once while the
#: event loop is busy overflowed it, the kernel dropped the extra SYNs, and those clients retried
#: after 1 s (a 256-stream burst's TTFT max was ~1.05 s against a p90 of ~0.2 s, bench/engine_host.py).
LISTEN_BACKLOG = 4096


class ProbeQuietAccessLogger(AccessLogger):
    """The access log without health probes and metric scrapes, which the orchestrator and
    Prometheus send every few seconds and would otherwise drown the log."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if request.path in ("/health", "/metrics"):
            return
        super().log(request, response, time)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m generation", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one engine replica")
    serve.add_argument(
        "--model", default="smollm2-135m", help="smollm2-135m, tiny-random, or a folder"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8090, help="0 picks a free port (printed)")
    serve.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    serve.add_argument(
        "--dtype", default="auto", help="auto (fp32 CPU, bf16 CUDA, fp64 tiny-random), float32, ..."
    )
    serve.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every row's logits bitwise independent of its batch (exact migration in bf16; "
        "slower, see README)",
    )
    serve.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="rows of the running batch (default: 64 on a CPU; on CUDA 256, or fewer when the "
        "KV cache sized by --gpu-memory-fraction holds fewer)",
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=MAX_WAITING_REQUESTS,
        help=f"generate requests held past the engine's slots (--max-batch-size) "
        f"(default {MAX_WAITING_REQUESTS}; more get 429 with Retry-After, before any token)",
    )
    serve.add_argument(
        "--max-tokenizer-chars",
        type=int,
        default=MAX_TOKENIZER_CHARS,
        help=f"characters (request body bytes) queued for the tokenizer thread's chat templates "
        f"and tokenization (default {MAX_TOKENIZER_CHARS}; more get 429 with Retry-After; one "
        "request on an idle tokenizer is always taken)",
    )
    serve.add_argument(
        "--max-judge-sessions",
        type=int,
        default=None,
        help="judge sessions held at once (default 256; more get 429)",
    )
    serve.add_argument(
        "--max-judge-tokens",
        type=int,
        default=None,
        help="tokens the judge sessions' KV rows hold together with the packed pass (default on "
        "a CPU: a quarter of the memory available at start; more get 429)",
    )
    serve.add_argument(
        "--static-judge",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="judge passes over a static pool of session slots, replayed from CUDA graphs "
        "(default: on for CUDA, the pool built at the first session's open; on a CPU judge "
        "passes run packed and eager); --static-judge builds the pool at start, before the "
        "decode cache; the pool's slots are the judge sessions held at once",
    )
    serve.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.8,
        help="CUDA: share of the GPU memory free after loading the model that the KV cache "
        "takes; rows and tokens per row are derived from it (GET /health: kv_cache)",
    )
    serve.add_argument(
        "--static-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps over static buffers (default: on for CUDA, where they are replayed "
        "from CUDA graphs; on a CPU they run eagerly and the slot cache is the default)",
    )
    serve.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each static decode step before the previous step's tokens are processed "
        "(default: on; eager steps, a CPU's default, are always synchronous)",
    )
    serve.add_argument(
        "--compile",
        action="store_true",
        help="run the static decode step through torch.compile (Inductor) before its CUDA "
        "graphs are captured: fewer, fused kernels per step; implies --static-decode (on a CPU "
        "too, with bucketed shapes); each bucket compiles at start (tens of seconds on a CPU)",
    )
    serve.add_argument(
        "--prefill-buckets",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pad each prefill up to a bucket of rows and width (default: on for CUDA), so a "
        "server sees few prefill shapes",
    )
    serve.add_argument(
        "--static-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill new rows straight into the static decode cache's slots through a static "
        "pass, replayed from CUDA graphs on CUDA (default: with the static decode step)",
    )
    serve.add_argument(
        "--warm-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every prefill bucket once at start, so the first requests pay no first-use "
        "cost for their shapes (default: on for CUDA with --prefill-buckets)",
    )
    serve.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="prefill longer contexts this many tokens per pass, between decode steps "
        "(default: 256 on a CPU, 2048 on CUDA)",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU intra-op threads (default: torch's; 1 for tiny-random)",
    )
    serve.add_argument(
        "--api-keys-env",
        default=None,
        metavar="NAME",
        help="require `Authorization: Bearer <key>` (except on /health and /metrics); the "
        "accepted keys are read, comma-separated, from the environment variable NAME",
    )
    serve.add_argument(
        "--enable-fault-injection", action="store_true", help="adds POST /admin/faults"
    )
    serve.add_argument(
        "--api-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve HTTP from this process and run the engine (the worker) in a child process "
        "that sends each step's tokens for all streams in one message, so per-stream delivery "
        "never holds the worker's GIL (default: on; the child dies with this process); "
        "--no-api-process: one process, for debugging",
    )
    # the engine-core child of --api-process (engine_core.py): its socketpairs' ends and the Unix
    # socket its own app listens on; --core-command (a JSON argv) replaces the child's command
    serve.add_argument("--core-fd", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--core-steps-fd", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--core-socket", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--core-command", default=None, help=argparse.SUPPRESS)
    add_connection_flags(serve)
    add_service_flags(serve)
    prepare = sub.add_parser("prepare", help="build or convert a model into the cache, then exit")
    prepare.add_argument("model")
    add_service_flags(prepare, tracing=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the core child of --api-process runs with the same flags
    if args.command == "serve":
        for flag in ("max_batch_size", "prefill_chunk_tokens"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                parser.error(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
        if not 0 < args.gpu_memory_fraction <= 1:
            parser.error(f"--gpu-memory-fraction must be in (0, 1], not {args.gpu_memory_fraction}")
    from .tracing import TRACING

    with service_flags(args, TRACING if args.command == "serve" else None):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The command, its flags applied (tracing on for `serve` when asked)."""
    from .models import ModelSpecError, prepare

    if args.command == "prepare":
        try:
            path = prepare(args.model)
        except ModelSpecError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.model} ready at {path}", flush=True)
        return 0
    try:
        keys = api_keys_from_env(args.api_keys_env, "--api-keys-env")
    except ApiKeysError as exc:  # before loading the model: fail fast
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.core_fd is not None:
            return asyncio.run(_serve_core(args))
        if args.api_process:
            return asyncio.run(_serve_api(args, keys))
        return asyncio.run(_serve(args, keys))
    except ModelSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


async def _load_app(args: argparse.Namespace, api_keys: list[str] | None) -> Any:
    """The engine's own app (`create_app`) over the model of `args`."""
    from .models import load
    from .server import create_app

    loop = asyncio.get_running_loop()
    loaded = await loop.run_in_executor(
        None, load, args.model, args.device, args.dtype, args.batch_invariant
    )
    logging.getLogger("guardstream.engine").info(
        "loaded %s on %s (%s%s) in %.1f s",
        loaded.name,
        loaded.device,
        loaded.dtype,
        f", batch-invariant ({loaded.invariant_kernels} kernels)" if loaded.batch_invariant else "",
        loaded.load_seconds,
    )
    app = create_app(
        loaded,
        fault_injection=args.enable_fault_injection,
        max_batch_size=args.max_batch_size,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        static_decode=args.static_decode,
        overlap=args.overlap,
        compile_step=args.compile,
        prefill_buckets=args.prefill_buckets,
        warm_prefill=args.warm_prefill,
        static_prefill=args.static_prefill,
        gpu_memory_fraction=args.gpu_memory_fraction,
        threads=args.threads if args.threads is not None else loaded.threads,
        api_keys=api_keys,
        max_judge_sessions=args.max_judge_sessions,
        max_judge_tokens=args.max_judge_tokens,
        static_judge=args.static_judge,
        body_timeout_s=args.body_timeout_s,
        max_waiting_requests=args.max_waiting_requests,
        max_tokenizer_chars=args.max_tokenizer_chars,
    )
    return app


async def _serve_core(args: argparse.Namespace) -> int:
    """The engine-core child of `--api-process`: no keys (its socket is private to the API
    process, which checks them), no faults (armed where the streams are)."""
    from .engine_core import run_core

    args.enable_fault_injection = False
    app = await _load_app(args, None)
    return await run_core(app, args.core_fd, args.core_socket, args.core_steps_fd)


async def _serve(args: argparse.Namespace, api_keys: list[str] | None) -> int:
    from .server import freeze_startup_heap

    app = await _load_app(args, api_keys)
    return await _listen(args, app, freeze_startup_heap)


async def _serve_api(args: argparse.Namespace, api_keys: list[str] | None) -> int:
    """`--api-process`: start the engine core (a child running this command with the same
    flags, or `--core-command`), then serve HTTP here. Exits 1 if the core dies."""
    from .core_client import CoreClient, CoreStartError  # no torch: the core starts first

    command = (
        json.loads(args.core_command)
        if args.core_command
        else [sys.executable, "-m", "generation", *args.argv]
    )
    lost = asyncio.Event()
    with tempfile.TemporaryDirectory(prefix="guardstream-core-") as folder:  # mode 0700
        core = CoreClient(command, os.path.join(folder, "core.sock"), on_lost=lost.set)
        # the core loads torch, the model and its engine while this process loads its own
        # modules (torch and transformers too: ~2-3 s on a CPU), not after them
        imported = asyncio.ensure_future(asyncio.to_thread(_import_api_modules))
        try:
            facts = await core.start()
        except CoreStartError as exc:
            await imported
            print(f"error: {exc}", file=sys.stderr)
            return exc.returncode or 1
        try:
            await imported
            from .models import load_frontend
            from .server import create_api_app, freeze_startup_heap

            loaded = await asyncio.to_thread(load_frontend, facts)
            app = create_api_app(
                core,
                loaded,
                facts["tool_format"],
                fault_injection=args.enable_fault_injection,
                api_keys=api_keys,
                body_timeout_s=args.body_timeout_s,
                max_waiting_requests=args.max_waiting_requests,
                max_tokenizer_chars=args.max_tokenizer_chars,
            )
            status = await _listen(args, app, freeze_startup_heap, lost)
        finally:
            await core.stop()
    return 1 if lost.is_set() else status


def _import_api_modules() -> None:
    """What the API process serves with (server.py and what it imports), on a thread."""
    from . import models, server  # noqa: F401


async def _listen(
    args: argparse.Namespace,
    app: Any,
    freeze: Callable[[], int],
    lost: asyncio.Event | None = None,
) -> int:
    """Serve `app` on --host/--port until SIGINT/SIGTERM (or `lost`: the engine core died)."""
    from aiohttp import web

    loop = asyncio.get_running_loop()
    # handler_cancellation: a client disconnect cancels its handler at once (and so its request).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=10.0,
        access_log_class=ProbeQuietAccessLogger,
        # a connection that never completes its request head is closed (servicekit.connections)
        **runner_options(args.header_timeout_s),
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=LISTEN_BACKLOG)
    try:
        await site.start()
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 2
    port = runner.addresses[0][1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    freeze()  # after the engine's start-up (the model, its buffers)
    print(f"{LISTENING_PREFIX}http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waits = [loop.create_task(stop.wait())]
    if lost is not None:
        waits.append(loop.create_task(lost.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
