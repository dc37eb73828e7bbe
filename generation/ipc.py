"""Frames between the engine's API process and its engine-core process (issue 35).

One frame = a 4-byte big-endian length, then one orjson document (a JSON array whose first item
names the message). Both ends read and write them with an asyncio protocol (`FrameProtocol`:
non-blocking, read by the loop's selector) over one Unix socketpair the API process creates
before it starts the core, so neither event loop ever blocks on the other: a slow reader only
fills the socket's buffer, and then takes every frame waiting there in one go.

Why this and not zmq/msgpack (vLLM's choice) or `multiprocessing.Connection`: orjson is already
the engine's encoder (dataclasses and enums natively, in C: the core's per-step cost is one call
for all rows), a socketpair needs no broker or extra dependency and gives EOF when the peer dies
(the API process's signal that the core is gone, and the core's that its API process is), and
`multiprocessing.Connection` pickles and only offers a blocking `recv` to a loop. (vLLM's
EngineCore sends msgpack over zmq sockets; the shape is the same: one message per step, all
requests' outputs in it.)

Messages (`kind` first):
- API -> core: `["submit", rid, job]`, `["cancel", rid]`, `["stop"]`.
- core -> API: `["hello", facts]` once the engine serves, `["step", [[rid, [event, ...]], ...]]`
  once per worker delivery (every row's events of the step in one frame; an event is an
  `EngineDelta` or `StreamError` as orjson encodes a dataclass), `["bye"]` once the core has
  stopped its engine (every unfinished stream got its error first).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import orjson

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30  # a corrupt length, never a real frame: the peer is treated as gone


def encode(message: Any) -> bytes:
    """One frame. orjson, or json for what orjson refuses (an integer past 64 bits)."""
    try:
        body = orjson.dumps(message)
    except TypeError:
        body = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


class FrameProtocol(asyncio.Protocol):
    """Reads frames off the socket and hands them on by the batch: every complete frame of one
    read in one `on_messages` call. A reader that fell behind (the socket's buffer holds several
    steps) so takes them at once, and can write each stream's tokens of all of them in one go;
    `on_lost` once the peer has closed (or died). Writes go straight to the transport."""

    def __init__(
        self, on_messages: Callable[[list[Any]], None], on_lost: Callable[[], None]
    ) -> None:
        self._on_messages = on_messages
        self._on_lost = on_lost
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.Event()  # the connection is gone (after its last write went out)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        messages = []
        start = 0
        end = len(buffer)
        while end - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME:  # never a real frame: the peer is broken, treat it as gone
                assert self.transport is not None
                self.transport.close()
                return
            if end - start - HEADER.size < size:
                break
            body = start + HEADER.size
            messages.append(orjson.loads(memoryview(buffer)[body : body + size]))
            start = body + size
        del buffer[:start]
        if messages:
            self._on_messages(messages)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self._on_lost()

    def send(self, message: Any) -> None:
        """One frame, unless the socket is closed (the peer is gone: `on_lost` says so)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(message))


async def connect(
    sock: socket.socket,
    on_messages: Callable[[list[Any]], None],
    on_lost: Callable[[], None],
) -> FrameProtocol:
    """Frames over `sock` (one end of the socketpair) on the running loop."""
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_unix_connection(
        lambda: FrameProtocol(on_messages, on_lost), sock=sock
    )
    return protocol
