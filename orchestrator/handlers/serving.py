"""The one serving loop of every generation surface (DESIGN section 1, "one pipeline, many
writers"): FMS streaming, Chat Completions and Responses, streaming or unary.

A handler parses its request and hands `serve` (or `serve_unary`) a way to build the pipeline
and its surface's writer (or fold). Everything the surfaces share happens here, once:

- the stream slot is taken FIRST, before the pipeline is built: building it may ask an engine
  (advertised limits, a token count), and a request refused with 429/503 must cost nothing;
- the response starts at once (FMS), or at the first event, so that an error found before any
  byte is a real HTTP error where the surface wants one (`Writer.refuses`);
- a burst of frames (`Frame.more`: the pipeline already holds the next event) goes out in one
  write;
- keep-alives (`KeepAlive`) are an SSE comment on every surface; the SSE headers are these.

A writer only renders events to bytes, so the surfaces cannot disagree on what was judged,
blocked or cut off, and a new surface is a writer, not another loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol

from aiohttp import web

from ..api.errors import ApiError, Failure
from ..state import STATE
from ..streaming.events import Event, Frame, KeepAlive, Rendered, Terminal
from ..streaming.wire_json import KEEPALIVE_COMMENT
from .stream_slots import stream_slot

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


class Pipeline(Protocol):
    """What the loop needs of a guarded generation (streaming.guarded_generation)."""

    def events(self) -> AsyncIterator[Event]: ...

    def shut_down(self) -> None: ...


# builds the pipeline: every 4xx of the request is raised here, after the slot was taken
Prepare = Callable[[], Awaitable[Pipeline]]


class Writer(Protocol):
    """A streaming surface's wire format (streaming/*_writer.py)."""

    # the response starts before the first event (FMS); else at the first event, so that an
    # error before any byte can still be an HTTP error
    start_at_once: bool

    def refuses(self, failure: Failure) -> bool:
        """Whether a stream that fails before its first byte is answered with an HTTP error
        (rendered by the error middleware) instead of an in-band one."""
        ...

    def render(self, event: Rendered) -> bytes:
        """The event's bytes on the wire (b"" for none)."""
        ...


class Fold(Protocol):
    """A unary surface's reply: every event folded into one JSON object. `add` raises ApiError
    for an error the surface answers as an HTTP error."""

    def add(self, event: Rendered) -> None: ...

    def body(self) -> dict[str, Any]: ...


async def serve(request: web.Request, prepare: Prepare, writer: Writer) -> web.StreamResponse:
    """Streams the pipeline `prepare` builds through `writer`."""
    with stream_slot(request.app[STATE]) as slot:
        pipeline = slot.attach(await prepare())
        response = await _start(request) if writer.start_at_once else None
        pending = b""  # the frames of one burst: one write
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                if response is None:
                    if (
                        isinstance(event, Terminal)
                        and event.error is not None
                        and writer.refuses(event.error)
                    ):
                        raise ApiError.of(event.error)  # nothing was sent: a real HTTP error
                    response = await _start(request)
                if isinstance(event, KeepAlive):
                    pending += KEEPALIVE_COMMENT
                else:
                    pending += writer.render(event)
                    if isinstance(event, Frame) and event.more:
                        continue
                if pending:
                    await response.write(pending)
                    pending = b""
        assert response is not None  # the pipeline always ends with a Terminal
        await response.write_eof()
        return response


async def serve_unary(request: web.Request, prepare: Prepare, fold: Fold) -> web.Response:
    """Folds the pipeline `prepare` builds into one JSON reply."""
    return web.json_response(await fold_unary(request, prepare, fold))


async def fold_unary(request: web.Request, prepare: Prepare, fold: Fold) -> dict[str, Any]:
    """The folded reply, for a handler that adds to it (generation-detection); the stream slot
    is held while the pipeline runs."""
    with stream_slot(request.app[STATE]) as slot:
        pipeline = slot.attach(await prepare())
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                if not isinstance(event, KeepAlive):
                    fold.add(event)
    return fold.body()


async def _start(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    return response
