"""POST /api/v1/task/server-streaming-classification-with-text-generation: SSE of classified
frames, then exactly one terminal event (DESIGN 4.3). Parse, then the serving loop
(handlers/serving.py) with the FMS writer."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.fms_requests import GuardrailsHttpRequest
from ..state import STATE
from ..streaming.fms_writer import FmsWriter
from .body import read_model
from .fms_task import task_ask
from .prepare import prepare
from .serving import serve


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, GuardrailsHttpRequest)
    ask = task_ask(request, body, streaming=True)
    return await serve(request, partial(prepare, request.app[STATE], ask), FmsWriter())
