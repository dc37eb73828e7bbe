"""Running the app: listening socket, TLS, signals, graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from .app import create_app
from .clients.tls import server_ssl_context
from .config import Config
from .state import STATE

log = logging.getLogger("guardstream")


async def start_server(
    config: Config, host: str, port: int, *, device: str = "auto"
) -> tuple[web.AppRunner, int]:
    """Starts the service and returns its runner and bound port (port 0 picks a free one)."""
    app = create_app(config, device=device)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels the
    # engine request and every detector call of that stream (DESIGN 4.7).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=config.server.drain_timeout_s,
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=server_ssl_context(config.server.tls))
    await site.start()
    bound = port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        bound = server.sockets[0].getsockname()[1]
    return runner, bound


async def drain(runner: web.AppRunner, timeout_s: float) -> None:
    """Stops taking new streams, lets running ones finish within `timeout_s`, ends the rest
    with a `failed` event of type `server_shutdown`, then stops everything."""
    state = runner.app[STATE]
    state.draining = True
    if state.active_streams:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), timeout_s)
    for stream in list(state.streams):
        stream.shut_down()
    if state.active_streams:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), 5)
    await runner.cleanup()


async def run_server(config: Config, host: str, port: int, *, device: str = "auto") -> int:
    runner, bound = await start_server(config, host, port, device=device)
    scheme = "https" if config.server.tls else "http"
    log.info("guardstream listening on %s://%s:%d", scheme, host, bound)
    print(f"guardstream listening on {scheme}://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining streams for up to %.0f s", config.server.drain_timeout_s)
    await drain(runner, config.server.drain_timeout_s)
    return 0
