"""Frames between the engine's API process and its engine-core process (issue 35).

One frame = a 4-byte big-endian length, then one orjson document (a JSON array whose first item
names the message). The API process reads and writes them with an asyncio protocol
(`FrameProtocol`: non-blocking, read by the loop's selector) over Unix socketpairs it creates
before it starts the core, so its event loop never blocks on the core: a slow reader only fills
the socket's buffer, and then takes every frame waiting there in one go. A reader that falls
`HIGH_WATER` bytes behind pauses an asyncio writer (`pause_writing`, `on_pause`); the core's own
frames go out through `StepWriter` instead (below), whose blocking sends are the backpressure.

Why this and not zmq/msgpack (vLLM's choice) or `multiprocessing.Connection`: orjson is already
the engine's encoder (dataclasses and enums natively, in C: the core's per-step cost is one call
for all rows), a socketpair needs no broker or extra dependency and gives EOF when the peer dies
(the API process's signal that the core is gone, and the core's that its API process is), and
`multiprocessing.Connection` pickles and only offers a blocking `recv` to a loop. (vLLM's
EngineCore sends msgpack over zmq sockets; the shape is the same: one message per step, all
requests' outputs in it.)

Two socketpairs: the API process's requests go over the first (`--core-fd`); everything the core
sends goes over the second (`--core-steps-fd`), written with blocking sends by `StepWriter`: the
worker thread writes each step's frame itself (no wake-up of the core's loop, no loop work per
step), and the loop's few messages (`hello`, `stopping`, `bye`, a refused submit's error) go the
same way, under the same lock, so they keep their order with the steps. A reader that stops
reading fills that socket's buffer and so blocks the worker between steps (the backpressure).

Messages (`kind` first):
- API -> core: `["submit", rid, job]`, `["cancel", rid]`, `["stop"]`.
- core -> API: `["hello", facts]` once the engine serves, `["step", [[rid, [event, ...]], ...]]`
  once per worker step (every row's events of the step in one frame; an event is an
  `EngineDelta` or `StreamError` as orjson encodes a dataclass), `["stopping"]` before the core
  stops its engine (the API process refuses new requests from then on), `["bye"]` once the core
  has stopped its engine (every unfinished stream got its error first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30  # a corrupt length, never a real frame: the peer is treated as gone
#: Bytes an asyncio writer may leave unsent (in its transport's buffer, past what the socket
#: holds) before it is paused (`on_pause`), and it resumes below a quarter of it (`on_resume`):
#: asyncio's flow control. (The core's step frames do not go through a transport: `StepWriter`.)
HIGH_WATER = 1 << 20
#: How long the core's loop waits for one of its own frames (`hello`, `stopping`, `bye`) to go
#: out before it goes on without it: an API process alive but not reading must not hold a stop.
LOOP_SEND_TIMEOUT = 10.0


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
        self,
        on_messages: Callable[[list[Any]], None],
        on_lost: Callable[[], None],
        on_pause: Callable[[], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> None:
        self._on_messages = on_messages
        self._on_lost = on_lost
        self._on_pause = on_pause
        self._on_resume = on_resume
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.Event()  # the connection is gone (after its last write went out)
        self.paused = False  # the peer is `high_water` bytes behind: the writer should wait

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def pause_writing(self) -> None:
        """The transport holds `high_water` unsent bytes (`connect`; asyncio calls this)."""
        self.paused = True
        if self._on_pause is not None:
            self._on_pause()

    def resume_writing(self) -> None:
        """The transport's buffer drained below a quarter of `high_water`."""
        self.paused = False
        if self._on_resume is not None:
            self._on_resume()

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
    on_pause: Callable[[], None] | None = None,
    on_resume: Callable[[], None] | None = None,
    high_water: int = HIGH_WATER,
) -> FrameProtocol:
    """Frames over `sock` (one end of the socketpair) on the running loop; `on_pause` and
    `on_resume` as the peer falls `high_water` bytes behind and catches up."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_unix_connection(
        lambda: FrameProtocol(on_messages, on_lost, on_pause, on_resume), sock=sock
    )
    transport.set_write_buffer_limits(high=high_water, low=high_water // 4)
    return protocol


class StepWriter:
    """Frames written with blocking `sendall` (the GIL is released while the kernel copies them),
    from any thread: one lock around each frame's encoding and send, so frames never interleave
    and go out in the order their writers took the lock. A full socket buffer (the reader fell
    behind) blocks the writer: the worker then waits between steps until the reader catches up.

    The reader gone (EPIPE, ECONNRESET, ...): `send` returns False, never raises, and `on_lost`
    runs once, on `loop` (the session's, as `FrameProtocol.connection_lost` would)."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, on_lost: Callable[[], None]
    ) -> None:
        sock.setblocking(True)
        self._sock = sock
        self._loop = loop
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self.broken = False  # the reader is gone (or `close` ran): nothing more is sent
        self.sending = False  # a send is under way (the worker blocked in it, say)

    def send(self, message: Any) -> bool:
        """One frame; False once the reader is gone."""
        with self._lock:
            if self.broken:
                return False
            data = encode(message)
            self.sending = True
            try:
                self._sock.sendall(data)
            except OSError:
                self.broken = True
                self._lost()
                return False
            finally:
                self.sending = False
            return True

    async def send_from_loop(
        self,
        message: Any,
        patience: float = LOOP_SEND_TIMEOUT,
        *,
        give_up: Awaitable[object] | None = None,
    ) -> bool:
        """`send` for the event loop: in a thread, so the loop never blocks on a reader that
        stopped reading (or on the worker's send ahead of it, under the lock); False if the frame
        did not go out within `patience` seconds, or before `give_up` completes where one is
        given (a test's gate, in place of the clock); the frame may still go, or `close` breaks
        the send."""
        sending = asyncio.ensure_future(asyncio.to_thread(self.send, message))
        waiting = asyncio.ensure_future(give_up if give_up is not None else asyncio.sleep(patience))
        try:
            await asyncio.wait((sending, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            if not sending.done():
                # the thread's send goes on (a thread cannot be cancelled): its outcome is the
                # socket's, and nobody waits for it
                sending.add_done_callback(lambda done: done.cancelled() or done.exception())
        return sending.result() if sending.done() else False

    def _lost(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_lost)
        except RuntimeError:  # the loop is closed: the session is over anyway
            pass

    def close(self) -> None:
        """No more frames (what was sent stays readable by the peer, then EOF). Without the
        lock: a send blocked on a reader that stopped reading holds it; shutting the socket
        down ends that send (EPIPE, `send` returns False), then the socket is closed."""
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        with self._lock:
            self._sock.close()
