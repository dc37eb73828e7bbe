"""GET /v1/models: the configured model ids in OpenAI's list shape, so SDKs and UIs that list
models before chatting work unchanged."""

from __future__ import annotations

from aiohttp import web

from ..api.openai_chat import ModelCard, ModelList
from ..state import STATE


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [ModelCard(id=m, created=state.started_at) for m in state.config.models]
    return web.json_response(ModelList(data=cards).dump())
