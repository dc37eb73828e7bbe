"""POST /api/v1/task/server-streaming-classification-with-text-generation: SSE of classified
frames, then exactly one terminal event (DESIGN 4.3)."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..state import STATE
from .stream_slots import stream_slot
from .task_request import prepare_generation


async def handle(request: web.Request) -> web.StreamResponse:
    pipeline = await prepare_generation(request)  # every 4xx happens here, before any byte
    state = request.app[STATE]
    with stream_slot(state, pipeline):
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                await response.write(event.sse())
        await response.write_eof()
    return response
