"""POST /api/v1/task/classification-with-text-generation: the same pipeline as the streaming
endpoint, folded into one JSON object. Failures become real HTTP errors (nothing was sent)."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.fms_requests import GuardrailsHttpRequest
from ..state import STATE
from ..streaming.fms_writer import UnaryFold
from .body import read_model
from .fms_task import task_ask
from .prepare import prepare
from .serving import serve_unary


async def handle(request: web.Request) -> web.Response:
    body = await read_model(request, GuardrailsHttpRequest)
    ask = task_ask(request, body, streaming=False)
    return await serve_unary(request, partial(prepare, request.app[STATE], ask), UnaryFold())
