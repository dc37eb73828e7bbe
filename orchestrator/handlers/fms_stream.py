"""POST /api/v1/task/server-streaming-classification-with-text-generation: SSE of classified
frames, then exactly one terminal event (DESIGN 4.3). Parse, then the serving loop
(handlers/serving.py) with the FMS writer."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.fms_requests import GuardrailsHttpRequest
from ..streaming.fms_writer import FmsWriter
from .body import read_model
from .fms_task import prepare_task
from .serving import serve


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, GuardrailsHttpRequest)
    return await serve(request, partial(prepare_task, request, body, streaming=True), FmsWriter())
