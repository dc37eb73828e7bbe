"""POST /admin/reload: the config file read again and applied (orchestrator/reload.py), for a
caller with an admin key (`server.admin_keys_env`; a tenant's key is not one). A file with
errors changes nothing: 422 with DESIGN's error body, plus `errors`, one line per problem.
With `server.workers` > 1 the request reaches one worker: once the file applied there, the
supervisor has every other worker apply it (reload_channel.py), and the answer waits for each
one's result (a deadline of request_timeout_s each): a worker that did not apply it makes the
answer a 500 `server_error` whose `errors` name each such worker and why. The file was good
(this worker applied it), so it is no client mistake; the workers then run different configs
until a reload applies everywhere, which an operator must hear of, not read as "reloaded"."""

from __future__ import annotations

import asyncio

from aiohttp import web

from servicekit.auth import UNAUTHORIZED_MESSAGE

from ..api.errors import ApiError, ErrorType
from ..reload import reload_config
from ..state import STATE, AppState

RELOAD_PATH = "/admin/reload"
_RELOADS: set[asyncio.Future[tuple[list[str], list[str]]]] = (
    set()
)  # running reloads: the loop holds tasks weakly


async def reload(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.admin_keys is None or not state.admin_keys.owner(request.headers):
        raise ApiError(401, ErrorType.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
    # a client that hangs up must not cancel a reload half-way (engines started, nothing
    # swapped in, nothing closed): it runs to its end either way
    reloading = asyncio.ensure_future(_reload_everywhere(state))
    _RELOADS.add(reloading)
    reloading.add_done_callback(_RELOADS.discard)
    errors, others = await asyncio.shield(reloading)
    if others:
        body = {
            "code": 500,
            "details": f"config reloaded by this worker, not by every other: {len(others)} "
            "error(s): " + "; ".join(others),
            "type": ErrorType.SERVER_ERROR.value,
            "errors": others,
        }
        return web.json_response(body, status=500)
    if errors:
        body = {
            "code": 422,
            "details": f"config not reloaded: {len(errors)} error(s): " + "; ".join(errors),
            "type": ErrorType.INVALID_REQUEST.value,
            "errors": errors,
        }
        return web.json_response(body, status=422)
    tenants = state.tenants
    assert tenants is not None
    return web.json_response({"reloaded": True, "tenants": sorted(tenants.tenants)})


async def _reload_everywhere(state: AppState) -> tuple[list[str], list[str]]:
    """This process's reload's errors, then (a worker whose reload applied) every other
    worker's problems applying the file."""
    errors = await reload_config(state)
    if errors or state.reload_others is None:
        return errors, []
    return [], await state.reload_others(state.config.server.request_timeout_s)
