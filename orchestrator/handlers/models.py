"""GET /v1/models: the configured model ids the caller's tenant sees, in OpenAI's list shape, so
SDKs and UIs that list models before chatting work unchanged."""

from __future__ import annotations

from aiohttp import web

from ..api.openai_chat import ModelCard, ModelList
from ..state import STATE
from ..tenants import CALLER


async def handle(request: web.Request) -> web.Response:
    """Only the models the caller's tenant sees (the others do not exist for it)."""
    state = request.app[STATE]
    caller = request.get(CALLER)
    cards = [
        ModelCard(id=m, created=state.started_at)
        for m in state.config.models
        if caller is None or caller.tenant.sees(m)
    ]
    return web.json_response(ModelList(data=cards).dump())
