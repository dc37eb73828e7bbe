"""POST /admin/reload: the config file read again and applied (orchestrator/reload.py), for a
caller with an admin key (`server.admin_keys_env`; a tenant's key is not one). A file with
errors changes nothing: 422 with DESIGN's error body, plus `errors`, one line per problem.
With `server.workers` > 1 the request reaches one worker: once the file applied there, the
supervisor has every other worker reload it (SIGHUP); the answer does not wait for them."""

from __future__ import annotations

from aiohttp import web

from servicekit.auth import UNAUTHORIZED_MESSAGE

from ..api.errors import ApiError, ErrorType
from ..reload import reload_config
from ..state import STATE

RELOAD_PATH = "/admin/reload"


async def reload(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.admin_keys is None or not state.admin_keys.owner(request.headers):
        raise ApiError(401, ErrorType.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
    errors = await reload_config(state)
    if errors:
        body = {
            "code": 422,
            "details": f"config not reloaded: {len(errors)} error(s): " + "; ".join(errors),
            "type": ErrorType.INVALID_REQUEST.value,
            "errors": errors,
        }
        return web.json_response(body, status=422)
    if state.reload_others is not None:  # a worker: the others reload the file too
        state.reload_others()
    tenants = state.tenants
    assert tenants is not None
    return web.json_response({"reloaded": True, "tenants": sorted(tenants.tenants)})
