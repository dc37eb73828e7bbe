"""POST /api/v1/task/classification-with-text-generation: the same pipeline as the streaming
endpoint, folded into one JSON object. Failures become real HTTP errors (nothing was sent)."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..state import STATE
from ..streaming.fms_writer import UnaryFold
from .fms_task import prepare_task
from .stream_slots import stream_slot


async def handle(request: web.Request) -> web.Response:
    pipeline = await prepare_task(request, streaming=False)
    state = request.app[STATE]
    fold = UnaryFold()
    with stream_slot(state, pipeline):
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                fold.add(event)
    return web.json_response(fold.body())
