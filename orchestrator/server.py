"""Running the app: listening socket, TLS, signals, graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

from .app import create_app
from .clients.tls import server_ssl_context
from .config import Config
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


# After the drain: how long streams ended with `server_shutdown` get to write their terminal
# event, and then how long aiohttp waits for any other handler before cancelling it.
SHUTDOWN_GRACE_S = 5.0
CLEANUP_GRACE_S = 2.0


async def start_server(
    config: Config, host: str, port: int, *, device: str = "auto"
) -> tuple[web.AppRunner, int]:
    """Starts the service and returns its runner and bound port (port 0 picks a free one)."""
    ssl_context = server_ssl_context(config.server.tls)  # a bad certificate fails before startup
    app = create_app(config, device=device)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels the
    # engine request and every detector call of that stream (DESIGN 4.7).
    # shutdown_timeout: runner.cleanup() runs after drain(), which already gave streams their
    # time; what is left then is only waited on briefly.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=min(config.server.drain_timeout_s, CLEANUP_GRACE_S),
        access_log=None,  # the request-id middleware writes the access line, with the id
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
    except BaseException:
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
        await asyncio.wait_for(state.idle.wait(), grace_s)


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


async def run_server(config: Config, host: str, port: int, *, device: str = "auto") -> int:
    """Serves until SIGTERM or SIGINT, then drains; a second signal cuts the drain short."""
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
    try:
        runner, bound = await start_server(config, host, port, device=device)
        scheme = "https" if config.server.tls else "http"
        log.info("guardstream listening on %s://%s:%d", scheme, host, bound)
        print(f"guardstream listening on {scheme}://{host}:{bound}", flush=True)
        await stop.wait()
        log.info("draining streams for up to %g s", config.server.drain_timeout_s)
        await drain(runner, config.server.drain_timeout_s, force=force)
        log.info("stopped")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0
