"""GET /v1/usage: the calling tenant's own counters (requests, prompt and generated tokens,
detections, refusals), as /metrics counts them. The tenant is the one the key resolved to: no
parameter names another, so one tenant's key never reads another's usage."""

from __future__ import annotations

from aiohttp import web

from ..state import STATE
from ..tenants import CALLER

USAGE_PATH = "/v1/usage"


async def handle(request: web.Request) -> web.Response:
    caller = request[CALLER]  # every path but the open ones has one (auth middleware)
    usage = await request.app[STATE].metrics.read_usage(caller.tenant.id)  # off the loop
    return web.json_response({"object": "usage", "tenant": caller.tenant.id, **usage})
