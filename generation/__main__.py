"""`python -m generation serve|prepare`: one engine replica, or materialise a model and exit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from aiohttp.web import BaseRequest, StreamResponse
from aiohttp.web_log import AccessLogger

from servicekit.auth import ApiKeysError, api_keys_from_env
from servicekit.cli import add_service_flags, service_flags

LISTENING_PREFIX = "guardstream-engine listening on "


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
        "--max-judge-sessions",
        type=int,
        default=None,
        help="judge sessions held at once (default 256; more get 429)",
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
    add_service_flags(serve)
    prepare = sub.add_parser("prepare", help="build or convert a model into the cache, then exit")
    prepare.add_argument("model")
    add_service_flags(prepare, tracing=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
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
        return asyncio.run(_serve(args, keys))
    except ModelSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


async def _serve(args: argparse.Namespace, api_keys: list[str] | None) -> int:
    from aiohttp import web

    from .models import load
    from .server import create_app, freeze_startup_heap

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
        gpu_memory_fraction=args.gpu_memory_fraction,
        threads=args.threads if args.threads is not None else loaded.threads,
        api_keys=api_keys,
        max_judge_sessions=args.max_judge_sessions,
    )
    # handler_cancellation: a client disconnect cancels its handler at once (and so its request).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=10.0,
        access_log_class=ProbeQuietAccessLogger,
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 2
    port = runner.addresses[0][1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    freeze_startup_heap()  # after the engine's start-up (the model, its buffers)
    print(f"{LISTENING_PREFIX}http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
