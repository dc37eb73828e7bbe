"""Connection bounds the engine and the detector service share (the orchestrator has its own,
with its error body: orchestrator/http_protocol.py, `server.header_timeout_s`).

Both are deployed on 0.0.0.0 (deploy/), and aiohttp bounds neither phase of a request that
comes before any handler or auth check: a connection that never completes its request head is
held for aiohttp's keep-alive timeout (3630 s by default), and a body that stalls after its
head is read for as long as the client likes. A client holding thousands of such connections
holds as many sockets and handlers, before a key is ever checked. Here:

- `header_timeout_s` becomes aiohttp's keep-alive timeout, which closes a connection still
  waiting for a complete request head that long after it opened or after its previous response;
- `read_body` reads a request's body within `body_timeout_s` of the handler asking for it, or
  raises `BodyTimeout`: each service answers it with its own 408 body, sent by `close_after`.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from aiohttp import web

HEADER_TIMEOUT_S = 75.0  # the orchestrator's `server.header_timeout_s` default
BODY_TIMEOUT_S = 60.0  # a 4 MiB body at 1 Mbit/s takes ~34 s


class BodyTimeout(Exception):
    """The request body did not arrive within `body_timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:g} s")
        self.timeout_s = timeout_s


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """`--header-timeout-s` and `--body-timeout-s` of a serving command."""
    parser.add_argument(
        "--header-timeout-s",
        type=_positive,
        default=HEADER_TIMEOUT_S,
        help="close a connection whose request head is not complete this long after it opened "
        "or after its previous response",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=_positive,
        default=BODY_TIMEOUT_S,
        help="answer 408 to a request whose body has not arrived this long after its head",
    )


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {value}")
    return number


def runner_options(header_timeout_s: float) -> dict[str, Any]:
    """`web.AppRunner` keyword arguments that bound the wait for a request head."""
    return {"keepalive_timeout": header_timeout_s}


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """`request.read()` within `timeout_s`, else BodyTimeout (answer it with `close_after`). Over `client_max_size` it raises aiohttp's HTTPRequestEntityTooLarge, as
    `read()` does."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None


async def close_after(request: web.Request, response: web.StreamResponse) -> None:
    """Sends `response` and closes the connection at once: the body was refused unread (too
    large, stalled, not in its encoding), so aiohttp's lingering read of the rest (up to 10 s)
    would only hold the connection open for bytes that are thrown away."""
    response.force_close()
    if not response.prepared:
        await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the transport flushes the reply before it closes
