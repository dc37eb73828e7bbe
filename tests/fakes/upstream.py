"""What the fake engines share: serving an aiohttp app on 127.0.0.1, stopping politely or like
SIGKILL, and handing out armed faults in order."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Protocol, TypeVar

from aiohttp import web


class _Armed(Protocol):
    times: int  # requests it still applies to; -1: all


F = TypeVar("F", bound=_Armed)


def next_fault(faults: Sequence[F]) -> F | None:
    """The first fault with uses left, one use spent."""
    for fault in faults:
        if fault.times != 0:
            if fault.times > 0:
                fault.times -= 1
            return fault
    return None


async def start_site(
    runner: web.AppRunner, port: int = 0, ssl_context: ssl.SSLContext | None = None
) -> str:
    """Serve a set-up runner on 127.0.0.1 (port 0: one the OS picks as it binds, so no other
    process can take it first); its URL, https with `ssl_context`."""
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context, reuse_address=True)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"{'https' if ssl_context else 'http'}://127.0.0.1:{bound}"


class FakeUpstream:
    """Mixed into the fakes' dataclasses; call `_init_upstream()` from `__post_init__`. Handlers
    register the transports of open streams in `_transports` so that `kill()` can reset them."""

    url: str
    _runner: web.AppRunner | None
    _transports: set[asyncio.BaseTransport]

    def _init_upstream(self) -> None:
        self.url = ""
        self._runner = None
        self._transports = set()

    async def _serve(
        self, app: web.Application, port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> int:
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        self.url = await start_site(self._runner, port, ssl_context)
        return int(self.url.rsplit(":", 1)[1])

    async def kill(self) -> None:
        """Like SIGKILL: every open stream is reset and new connections are refused."""
        for t in list(self._transports):
            t.abort()
        await self.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
