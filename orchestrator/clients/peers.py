"""A remote detector or engine is a peer we do not trust with our clients (DESIGN 6).

Every call to one passes `allow_redirects=False` (a 3xx is an answer like any other non-200: a
followed redirect is a GET to wherever the peer points, our own endpoints included, whose answer
would then be judged or shown as the peer's); a body is read up to a bound before anything parses
it; and an error body goes to the operator's log (`log_error_body`), never into a message a client
sees: clients get a fixed message naming the detector or replica and the HTTP status.
"""

from __future__ import annotations

import logging

import aiohttp

log = logging.getLogger("guardstream.peers")

# how much of an error body is read, and logged: enough for any real error message
ERROR_BODY_BYTES = 4096
_READ_BYTES = 64 * 1024


class BodyTooLarge(Exception):
    """A peer's body passed the bound its caller set."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than {limit} bytes")
        self.limit = limit


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as it passes `limit` bytes (a Content-Length
    over it is refused before a byte is read): a peer cannot make us hold more than `limit`."""
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge(limit)
    buf = bytearray()
    while True:
        chunk = await resp.content.read(min(_READ_BYTES, limit + 1 - len(buf)))
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(limit)


async def read_error_body(resp: aiohttp.ClientResponse) -> bytes:
    """The first ERROR_BODY_BYTES of a non-200 body (the rest is never read)."""
    buf = bytearray()
    while len(buf) < ERROR_BODY_BYTES:
        chunk = await resp.content.read(ERROR_BODY_BYTES - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def log_error_body(peer: str, status: int, raw: bytes) -> None:
    """An error body, for the operator: the log is theirs (a client never sees it). `%r` of the
    text keeps a body's newlines and control characters from forging log lines."""
    text = raw[:ERROR_BODY_BYTES].decode("utf-8", "replace")
    log.warning("%s answered HTTP %d: %r", peer, status, text)


def log_inband_error(peer: str, error: object) -> None:
    """An error a peer sent inside a stream (an engine's error item or event), for the operator;
    the client is told that the replica reported an error, not what it said."""
    log.warning("%s reported an error: %r", peer, error)
