"""POST /api/v1/task/server-streaming-classification-with-text-generation: SSE of classified
frames, then exactly one terminal event (DESIGN 4.3)."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..state import STATE
from ..streaming.events import Frame
from ..streaming.fms_writer import sse_event
from .fms_task import prepare_task
from .stream_slots import stream_slot

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


async def handle(request: web.Request) -> web.StreamResponse:
    pipeline = await prepare_task(request, streaming=True)  # every 4xx happens here
    state = request.app[STATE]
    with stream_slot(state, pipeline):
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        pending = b""  # frames of one burst (`more`) go out in one write
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                pending += sse_event(event)
                if isinstance(event, Frame) and event.more:
                    continue
                await response.write(pending)
                pending = b""
        if pending:
            await response.write(pending)
        await response.write_eof()
    return response
