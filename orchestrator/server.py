"""One process serving the app: listening socket, TLS, signals, graceful drain.

`serve_process` is what `python -m orchestrator serve` runs with `server.workers: 1`, and what
each worker of a supervisor runs (workers.py: the supervisor of `server.workers` > 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web

from .app import create_app
from .capacity import fit_to_process_limits
from .clients.tls import server_ssl_context
from .config import Config
from .handlers.health import DETECTOR_HEALTH
from .http_protocol import GuardedAppRunner
from .reload import reload_config
from .reload_channel import SupervisorLink
from .state import STATE, AppState

log = logging.getLogger("guardstream")

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` on uvloop where it is installed (Linux, macOS): its event loop, transports
    and timers are implemented in C, which cuts the orchestrator's CPU per streamed token (a
    wake-up per token at real generation speeds); else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def freeze_startup_heap() -> int:
    """Moves every object alive after start-up (modules, compiled patterns, the sentence
    model, pydantic's validators: ~150k objects) out of the collector's reach, and returns how
    many. Python's full collections otherwise walk them all, while the event loop stands still:
    measured at 256 streams (bench/orchestrator.py), each full collection took ~145 ms and made
    the p99 added latency 160-250 ms; frozen, they take ~35 ms (the streams' own objects) and
    the p99 is 38-67 ms. Garbage made at start-up is collected first; what is frozen is never
    freed, which is what objects that live as long as the process need. Each `server.workers`
    worker is a process of its own and freezes its own heap."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def freeze_after_warm_up(warmed: asyncio.Event) -> None:
    """In-process detectors load their models in the warm-up that /info waits for, after
    start-up: once it is over, what they loaded is frozen too. No collection first: traffic may
    already flow, and the garbage frozen with them is a one-off."""
    await warmed.wait()
    gc.freeze()
    log.info("heap frozen after the detectors' warm-up: %d objects", gc.get_freeze_count())


# After the drain: how long streams ended with `server_shutdown` get to write their terminal
# event, and then how long aiohttp waits for any other handler before cancelling it.
SHUTDOWN_GRACE_S = 5.0
CLEANUP_GRACE_S = 2.0


async def start_server(
    config: Config,
    host: str,
    port: int,
    *,
    device: str = "auto",
    reuse_port: bool = False,
    workers: int = 1,
) -> tuple[web.AppRunner, int]:
    """Starts the service and returns its runner and bound port (port 0 picks a free one);
    `reuse_port`: share the port with other workers (SO_REUSEPORT), `workers` of them."""
    ssl_context = server_ssl_context(config.server.tls)  # a bad certificate fails before startup
    # The port is bound before start-up, which starts managed engines (seconds to minutes): a
    # busy port fails at once, not after the engines have loaded. Workers share a port their
    # supervisor reserved, so they bind with SO_REUSEPORT as they listen.
    sock = None if reuse_port else bind_socket(host, port)
    try:
        app = create_app(config, device=device, workers=workers)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the
        # engine request and every detector call of that stream (DESIGN 4.7).
        # shutdown_timeout: runner.cleanup() runs after drain(), which already gave streams their
        # time; what is left then is only waited on briefly.
        # GuardedAppRunner: parser errors in the API's error body, header_timeout_s (http_protocol)
        runner = GuardedAppRunner(
            app,
            header_timeout_s=config.server.header_timeout_s,
            handler_cancellation=True,
            shutdown_timeout=min(config.server.drain_timeout_s, CLEANUP_GRACE_S),
            access_log=None,  # the request-id middleware writes the access line, with the id
        )
        await runner.setup()
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    try:
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(
                runner, sock, ssl_context=ssl_context, backlog=config.server.listen_backlog
            )
        else:
            site = web.TCPSite(
                runner,
                host,
                port,
                ssl_context=ssl_context,
                reuse_port=True,
                backlog=config.server.listen_backlog,
            )
        await site.start()
    except BaseException:
        if sock is not None:
            sock.close()
        await runner.cleanup()  # stops managed engines started by setup()
        raise
    bound = port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        bound = server.sockets[0].getsockname()[1]
    return runner, bound


async def _wait_idle(state: AppState, timeout_s: float, force: asyncio.Event | None) -> None:
    """Until no stream runs, `timeout_s` passed, or `force` is set (a second signal)."""
    if not state.active_streams:
        return
    waiters = [asyncio.ensure_future(state.idle.wait())]
    if force is not None:
        waiters.append(asyncio.ensure_future(force.wait()))
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def _shut_down_streams(state: AppState, grace_s: float) -> None:
    """Ends every running stream with a `server_shutdown` terminal event and waits (up to
    `grace_s`) until they have written it."""
    for stream in list(state.streams):
        stream.shut_down()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await state.idle.wait()


async def drain(
    runner: web.AppRunner, timeout_s: float, *, force: asyncio.Event | None = None
) -> None:
    """Stops taking new streams (they get 503 while the socket stays open, so a load balancer
    that has not noticed yet gets a retryable answer rather than a refused connection), lets
    running ones finish within `timeout_s`, ends the rest with a `failed` (or `error`) event of
    type `server_shutdown`, then stops everything."""
    state = runner.app[STATE]
    state.draining = True
    if state.active_streams:
        log.info("draining %d stream(s) for up to %g s", state.active_streams, timeout_s)
        await _wait_idle(state, timeout_s, force)
    if state.active_streams:
        log.warning("ending %d stream(s) with server_shutdown", state.active_streams)
        await _shut_down_streams(state, SHUTDOWN_GRACE_S)
    await runner.cleanup()


async def _print_when_warm(warmed: asyncio.Event, text: str) -> None:
    """Prints `text` once in-process detectors are warm (models and engines are up by then)."""
    await warmed.wait()
    print(text, flush=True)


async def serve_process(
    config: Config,
    host: str,
    port: int,
    *,
    device: str = "auto",
    worker: bool = False,
    workers: int = 1,
    control_fd: int | None = None,
    ready_hint: Callable[[int], str] | None = None,
) -> int:
    """One process serving the app; a worker (one of `workers`) shares the port and tells its
    supervisor on stdout when it listens; `control_fd` is its end of the reload channel
    (reload_channel.py)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    force = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: ending every stream now", sig.name)
            force.set()
        else:
            log.info("%s: shutting down", sig.name)
            stop.set()

    # Installed before start-up (managed engines can take minutes): a signal then means "stop
    # once started", never a hard kill that leaves engine processes behind.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    started: list[AppState] = []
    reloads: set[asyncio.Task[None]] = set()
    link: SupervisorLink | None = None
    channel: asyncio.Task[None] | None = None

    def on_hangup() -> None:
        if not started:  # the default action would kill a process still starting
            log.warning("SIGHUP during start-up: ignored (the config just read is in use)")
            return
        task = asyncio.ensure_future(_reload_logged(started[0]))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        config = fit_to_process_limits(config)  # open files: see orchestrator/capacity.py
        runner, bound = await start_server(
            config, host, port, device=device, reuse_port=worker, workers=workers
        )
        log.info("start-up heap frozen: %d objects", freeze_startup_heap())
        refreeze = asyncio.ensure_future(freeze_after_warm_up(runner.app[DETECTOR_HEALTH].warmed))
        scheme = "https" if config.server.tls else "http"
        if worker:
            state = runner.app[STATE]
            if control_fd is not None:
                link = await SupervisorLink.open(control_fd)
                state.reload_others = link.reload_others
                channel = asyncio.ensure_future(link.serve(functools.partial(reload_config, state)))
            log.info("worker %d listening on %s://%s:%d", os.getpid(), scheme, host, bound)
            print(json.dumps({"ready": os.getpid(), "port": bound}), flush=True)
        else:
            log.info("guardstream listening on %s://%s:%d", scheme, host, bound)
            print(f"guardstream listening on {scheme}://{host}:{bound}", flush=True)
        hint = None
        if ready_hint is not None:
            warmed = runner.app[DETECTOR_HEALTH].warmed
            hint = asyncio.ensure_future(_print_when_warm(warmed, ready_hint(bound)))
        started.append(runner.app[STATE])
        await stop.wait()
        refreeze.cancel()
        if hint is not None:
            hint.cancel()
        log.info("draining streams for up to %g s", config.server.drain_timeout_s)
        await drain(runner, config.server.drain_timeout_s, force=force)
        log.info("stopped")
    finally:
        if link is not None:
            link.close()
        if channel is not None:
            channel.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return 0


async def _reload_logged(state: AppState) -> None:
    """SIGHUP: the config reloaded (orchestrator/reload.py); every error is logged, and a bad
    file changes nothing."""
    log.info("SIGHUP: reloading the config")
    errors = await reload_config(state)
    for line in errors:
        log.error("config not reloaded: %s", line)


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (OSError when the port is taken)."""
    info = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(info[0], info[1], info[2])
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if info[0] == socket.AF_INET6:
            # "::" serves IPv4 too, as TCPSite did
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(info[4])
    except BaseException:
        sock.close()
        raise
    return sock
