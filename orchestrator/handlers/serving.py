"""The serving loop of every pipeline surface (DESIGN section 1, "one pipeline, many writers"):
FMS streaming and unary, Chat Completions, completions-detection and Responses (streaming or
unary), generation-detection and stream-content. The detection endpoints that run no pipeline
(content, chat, context, generated) answer in their own handlers.

A handler parses its request and hands `serve` (or `serve_unary`) a way to build the pipeline
and its surface's writer (or fold). Everything the surfaces share happens here, once:

- the stream slot is taken FIRST, before the pipeline is built: building it may ask an engine
  (advertised limits, a token count), and a request refused with 429/503 must cost nothing;
- the response starts at once (FMS, stream-content), or at the first event, so that an error
  found before any byte can be a real HTTP error (`errors.is_http_error` decides);
- a burst of frames (`Frame.more`: the pipeline already holds the next event) goes out in one
  write;
- keep-alives (`KeepAlive`) are an SSE comment (only SSE pipelines yield them); the headers are
  the writer's;
- a 408 (the client stopped sending its body) closes the connection after the reply: the rest
  of that body is never read.

A writer only renders events to bytes, so the surfaces cannot disagree on what was judged,
blocked or cut off, and a new surface is a writer, not another loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from functools import partial
from typing import Any, Protocol, TypeVar

from aiohttp import web

from ..api.errors import ApiError, Failure
from ..errors import is_http_error
from ..state import STATE
from ..streaming import request_deadline
from ..streaming.events import Event, Frame, KeepAlive, Refusal, Rendered, Terminal, ToolCall
from ..streaming.text_judgement import BULK_CHARS, off_loop
from ..streaming.wire_json import KEEPALIVE_COMMENT
from ..tenants import CALLER
from .stream_slots import StreamSlot, stream_slot

log = logging.getLogger("guardstream.serving")

A = TypeVar("A")
B = TypeVar("B")

# Past this many findings in one stream, an event that carries findings, and the terminal (whose
# Responses object lists every one of them again), are rendered (or folded) in the bulk
# executor: 14,000 input detections (a prompt of e-mail addresses at the default
# max_input_chars) were 0.25 s of the event loop as a chat chunk, 0.7 s as Responses events.
BULK_FINDINGS = 256

# After request_timeout_s a pipeline ends itself (an in-band timeout); the client then has this
# long to take what is left of the reply before the connection is closed (serve).
FLUSH_GRACE_S = 5.0


class Pipeline(Protocol):
    """What the loop needs of a pipeline (GuardedGeneration, ContentStream)."""

    def events(self) -> AsyncIterator[Event]: ...

    def shut_down(self) -> None: ...


# builds the pipeline: every 4xx of the request is raised here, after the slot was taken
Prepare = Callable[[], Awaitable[Pipeline]]


class Writer(Protocol):
    """A streaming surface's wire format (streaming/*_writer.py)."""

    # the response's headers (its content type: SSE, NDJSON)
    headers: Mapping[str, str]
    # the response starts before the first event (FMS, stream-content); else at the first
    # event, so that an error before any byte can still be an HTTP error
    start_at_once: bool

    def in_band(self, failure: Failure) -> bool:
        """Whether the wire format says `failure` in-band while none of the reply was sent
        (OpenResponses' `error` event); else it is an HTTP error (`errors.is_http_error`)."""
        ...

    def render(self, event: Rendered) -> bytes:
        """The event's bytes on the wire (b"" for none)."""
        ...


class Fold(Protocol):
    """A unary surface's reply: every event folded into one JSON object. A failure the reply
    cannot hold is an HTTP error, decided by the loop (`errors.is_http_error`) before `add`."""

    def in_band(self, failure: Failure) -> bool:
        """Whether the object says `failure` itself (a Responses object that holds output
        says `failed`)."""
        ...

    def add(self, event: Rendered) -> None: ...

    def body(self) -> dict[str, Any]: ...


async def bulk_ask(request: web.Request, ask: Callable[[web.Request, B], A], body: B) -> A:
    """`ask(request, body)`: a surface's request turned into its ask (the pieces the input
    detectors judge, every tool call's arguments decoded), off the loop for a body past
    BULK_CHARS bytes (a megabyte of tool calls is a fraction of a second of Python)."""
    if (request.content_length or 0) > BULK_CHARS:
        return await off_loop(lambda: ask(request, body))
    return ask(request, body)


class BulkFindings:
    """Counts a stream's findings, and says which of its events are rendered off the loop."""

    def __init__(self) -> None:
        self.seen = 0

    def off_loop(self, event: Rendered) -> bool:
        if isinstance(event, Frame):
            count = len(event.detections) + len(event.input_detections or ())
        elif isinstance(event, ToolCall | Refusal):
            count = len(event.detections)
        else:
            count = 0
        self.seen += count
        return self.seen > BULK_FINDINGS and (count > 0 or isinstance(event, Terminal))


async def serve(request: web.Request, prepare: Prepare, writer: Writer) -> web.StreamResponse:
    """Streams the pipeline `prepare` builds through `writer`."""
    state = request.app[STATE]
    with stream_slot(state, request.get(CALLER)) as slot:
        pipeline = slot.attach(await prepare())
        # the pipeline's deadline is an event its consumer (this loop) takes: a client that
        # stops reading leaves this loop waiting on a write, and holding the slot, for as long
        # as it keeps the connection. Past the deadline and a grace, the connection is closed:
        # the handler is cancelled as when a client leaves (DESIGN 4: every endpoint is bounded)
        cut = request_deadline.deadline_clock.call_later(
            state.config.server.request_timeout_s + FLUSH_GRACE_S, _cut_off, request
        )
        try:
            return await _serve(request, pipeline, writer)
        finally:
            cut.cancel()


def _cut_off(request: web.Request) -> None:
    log.info("request_timeout_s and its grace passed with the reply unsent: connection closed")
    transport = request.transport
    if transport is not None:
        transport.abort()  # close() would wait for the client to take what is buffered


async def _serve(request: web.Request, pipeline: Pipeline, writer: Writer) -> web.StreamResponse:
    """The events of `pipeline` through `writer`, a burst of frames in one write."""
    response = await _start(request, writer) if writer.start_at_once else None
    pending = b""  # the frames of one burst: one write
    body_unread = False
    bulk = BulkFindings()
    async with aclosing(pipeline.events()) as events:
        async for event in events:
            if isinstance(event, Terminal) and event.error is not None:
                failure = event.error
                if is_http_error(failure, sent=response is not None, in_band=writer.in_band):
                    raise ApiError.of(failure)  # nothing was sent: a real HTTP error
                body_unread = failure.code == 408
            if response is None:
                response = await _start(request, writer)
            if isinstance(event, KeepAlive):
                pending += KEEPALIVE_COMMENT
            elif bulk.off_loop(event):
                pending += await off_loop(partial(writer.render, event))
            else:
                pending += writer.render(event)
                if isinstance(event, Frame) and event.more:
                    continue
            if pending:
                await response.write(pending)
                pending = b""
    assert response is not None  # the pipeline always ends with a Terminal
    await response.write_eof()
    if body_unread:  # the client stopped sending: nothing more is read from it
        request.protocol.force_close()
    return response


async def serve_unary(request: web.Request, prepare: Prepare, fold: Fold) -> web.Response:
    """Folds the pipeline `prepare` builds into one JSON reply."""
    await _fold(request, prepare, fold)
    text = await off_loop(lambda: json.dumps(fold.body()))
    return web.Response(text=text, content_type="application/json")


async def fold_unary(prepare: Prepare, fold: Fold, slot: StreamSlot) -> dict[str, Any]:
    """The folded reply, for a handler that adds to it (generation-detection judges the
    generated text after) and so holds the stream slot itself, across both."""
    await _fold_in(slot, prepare, fold)
    return await off_loop(fold.body)


async def _fold(request: web.Request, prepare: Prepare, fold: Fold) -> None:
    """Every event into `fold`; the stream slot is held while the pipeline runs. The reply
    itself is built (and encoded) off the loop, by the callers: a refused 1 MB input holds tens
    of thousands of detections, a second of work that would stall every other request."""
    with stream_slot(request.app[STATE], request.get(CALLER)) as slot:
        await _fold_in(slot, prepare, fold)


async def _fold_in(slot: StreamSlot, prepare: Prepare, fold: Fold) -> None:
    pipeline = slot.attach(await prepare())
    bulk = BulkFindings()
    async with aclosing(pipeline.events()) as events:
        async for event in events:
            if isinstance(event, KeepAlive):
                continue
            if isinstance(event, Terminal) and event.error is not None:
                if is_http_error(event.error, sent=False, in_band=fold.in_band):
                    raise ApiError.of(event.error)  # nothing was sent: a real HTTP error
            if bulk.off_loop(event):
                await off_loop(partial(fold.add, event))
            else:
                fold.add(event)


async def _start(request: web.Request, writer: Writer) -> web.StreamResponse:
    response = web.StreamResponse(headers=writer.headers)
    await response.prepare(request)
    return response
