"""POST /api/v2/text/detection/stream-content: NDJSON lines of text in, one NDJSON result per
judged chunk out (`{detections, start_index, processed_index}`).

Hostile input is expected: anything but NDJSON is 415; a stream slot is taken before the body is
read; the WHOLE body is bounded by `max_request_bytes` (a stream is no excuse for unbounded
input) and the request by `request_timeout_s`. The first line names the detectors and is
validated before any byte goes out (its errors are HTTP errors); a bad later line, an oversized
body, lines past `max_detection_chars`, a detector's failure or the deadline ends the reply with an in-band error line. Served by
the serving loop (serving.py) with the NDJSON writer, like every pipeline surface."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from ..api.errors import ApiError, ErrorType, invalid
from ..api.fms_requests import StreamContentLine
from ..state import STATE
from ..streaming.content_stream import ContentStream
from ..streaming.ndjson_writer import NdjsonWriter
from ..tenants import confirm_caller
from .body import check_content_encoding, parse_json, read_chunk, too_large, validate
from .detection_chars import check_detection_chars, detection_char_limit
from .serving import serve

NDJSON_TYPES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl"})


class BodyLines:
    """Non-blank lines of the body; raises 413 once the body passes `limit` bytes in all, and
    408 when no byte arrives for `idle_s` or no line completes before the request's deadline
    (the stream then ends with an error line and frees its slot: a stalled body must not hold
    one until request_timeout_s)."""

    def __init__(self, request: web.Request, limit: int, deadline: float, idle_s: float) -> None:
        self._content = request.content
        self._limit = limit
        self._deadline = deadline
        self._idle_s = idle_s
        self._seen = 0
        # the pieces of the line still arriving: each piece is scanned for newlines once, and
        # joined once its line is complete (appending each piece to one buffer and splitting it
        # again made a 1 MiB line arriving a byte at a time cost ~10^12 byte copies)
        self._partial: list[bytes] = []
        self._lines: deque[bytes] = deque()
        self._eof = False

    async def next(self) -> bytes | None:
        while not self._lines:
            if self._eof:
                return None
            await self._fill()
        return self._lines.popleft()

    async def _fill(self) -> None:
        remaining = self._deadline - asyncio.get_running_loop().time()
        idle = self._idle_s < remaining
        chunk = await read_chunk(self._content, min(self._idle_s, remaining), idle=idle)
        if not chunk:
            self._eof = True
            self._complete(b"")
            return
        self._seen += len(chunk)
        if self._seen > self._limit:
            raise too_large(self._limit)
        *ends, rest = chunk.split(b"\n")
        if ends:
            self._complete(ends[0])
            self._lines.extend(line for line in ends[1:] if line.strip())
        if rest:
            self._partial.append(rest)

    def _complete(self, end: bytes) -> None:
        """The line still arriving ends with `end`: kept unless blank."""
        line = b"".join((*self._partial, end))
        self._partial.clear()
        if line.strip():
            self._lines.append(line)


def _parse_line(raw: bytes, first: bool) -> StreamContentLine:
    line = validate(StreamContentLine, parse_json(raw))
    if first and not line.detectors:
        raise invalid("detectors: the first line must name at least one detector")
    if not first and line.detectors is not None:
        raise invalid("detectors: only the first line may name detectors")
    return line


async def handle(request: web.Request) -> web.StreamResponse:
    server = request.app[STATE].config.server
    if request.content_type not in NDJSON_TYPES:
        raise ApiError(
            415,
            ErrorType.INVALID_REQUEST,
            f"expected content-type application/x-ndjson, got {request.content_type}",
        )
    check_content_encoding(request)
    if (request.content_length or 0) > server.max_request_bytes:
        raise too_large(server.max_request_bytes)
    return await serve(request, partial(prepare_content, request), NdjsonWriter())


async def prepare_content(request: web.Request) -> ContentStream:
    """The pipeline of one request, built once the stream slot is taken: its body is read from
    here on (a slow body holds a slot, not free memory), its first line parsed and validated."""
    state = request.app[STATE]
    server = state.config.server
    deadline = asyncio.get_running_loop().time() + server.request_timeout_s
    body = BodyLines(request, server.max_request_bytes, deadline, server.body_idle_timeout_s)
    first_raw = await body.next()
    if first_raw is None:
        raise invalid("the body holds no line")
    # the stream starts with its first line: a key a reload took away before it is refused
    confirm_caller(request)
    first = _parse_line(first_raw, first=True)
    assert state.detectors is not None and first.detectors
    dets = state.detectors.resolve(first.detectors, "content", "detectors")
    # the characters streamed so far, bounded like a content's: a line that passes the limit
    # ends the stream (in-band) unjudged, and nothing after it is read
    limit = detection_char_limit(state, request)
    streamed = len(first.content)
    check_detection_chars({"content": streamed}, limit)

    async def contents() -> AsyncIterator[str]:
        nonlocal streamed
        while (raw := await body.next()) is not None:
            content = _parse_line(raw, first=False).content
            streamed += len(content)
            check_detection_chars({"content": streamed}, limit)
            yield content

    remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
    return ContentStream(dets, state.chunkers, first.content, contents(), timeout_s=remaining)
