"""POST /api/v2/text/detection/stream-content: NDJSON lines of text in, one NDJSON result per
judged chunk out (`{detections, start_index, processed_index}`). The first line names the
detectors and is validated before any byte goes out; a bad later line ends the reply with an
in-band error line."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress

from aiohttp import web

from ..api.errors import ApiError, ErrorType, invalid
from ..api.requests import StreamContentLine
from ..api.responses import StreamContentResult
from ..clients.detectors import DetectorCallError
from ..state import STATE
from ..streaming.detection import JudgedFrame, StreamingDetection
from ..streaming.events import ndjson
from ..streaming.fanout import ChunkerFailure
from ..streaming.guarded_generation import first_error
from .body import parse_json, validate
from .stream_slots import stream_slot

_DONE = object()


async def _lines(request: web.Request, max_line: int) -> AsyncIterator[bytes]:
    """Non-blank lines of the body, each at most `max_line` bytes."""
    buf = b""
    async for chunk in request.content.iter_chunked(65536):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if len(line) > max_line:
                raise ApiError(413, ErrorType.INVALID_REQUEST, f"a line exceeds {max_line} bytes")
            if line.strip():
                yield line
        if len(buf) > max_line:
            raise ApiError(413, ErrorType.INVALID_REQUEST, f"a line exceeds {max_line} bytes")
    if buf.strip():
        yield buf


def _parse_line(raw: bytes, first: bool) -> StreamContentLine:
    line = validate(StreamContentLine, parse_json(raw))
    if first and not line.detectors:
        raise invalid("detectors: the first line must name at least one detector")
    if not first and line.detectors is not None:
        raise invalid("detectors: only the first line may name detectors")
    return line


def _result(frame: JudgedFrame) -> StreamContentResult:
    return StreamContentResult(
        detections=[f.to_content() for f in frame.detections],
        start_index=frame.start,
        processed_index=frame.end,
    )


async def handle(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    max_line = state.config.server.max_request_bytes
    lines = _lines(request, max_line)
    first_raw = await anext(lines, None)
    if first_raw is None:
        raise invalid("the body holds no line")
    first = _parse_line(first_raw, first=True)
    assert state.detectors is not None and first.detectors
    dets = state.detectors.resolve(first.detectors, "content", "detectors")
    out: asyncio.Queue[object] = asyncio.Queue()
    detection = StreamingDetection(dets, state.chunkers, lambda f: out.put_nowait(_result(f)))

    async def pump() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(detection.run())
                detection.feed(first.content)
                async for raw in lines:
                    detection.feed(_parse_line(raw, first=False).content)
                detection.end()
            for frame in detection.final_frames():
                if frame.end > frame.start or frame.detections:
                    out.put_nowait(_result(frame))
        except asyncio.CancelledError:
            raise
        except BaseException as group:
            out.put_nowait(_error_line(first_error(group)))
        out.put_nowait(_DONE)

    with stream_slot(state):
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        task = asyncio.create_task(pump())
        try:
            while (item := await out.get()) is not _DONE:
                await response.write(ndjson(item))  # type: ignore[arg-type]
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await response.write_eof()
    return response


def _error_line(exc: BaseException) -> dict[str, object]:
    if isinstance(exc, ApiError):
        return exc.body().dump()
    if isinstance(exc, DetectorCallError):
        code, etype = (
            (422, ErrorType.INVALID_REQUEST)
            if exc.invalid_params
            else (502, ErrorType.DETECTOR_ERROR)
        )
        return {"code": code, "details": str(exc), "type": etype.value}
    if isinstance(exc, ChunkerFailure):
        return {"code": 500, "details": str(exc), "type": ErrorType.CHUNKER_ERROR.value}
    return {"code": 500, "details": "internal error", "type": ErrorType.SERVER_ERROR.value}
