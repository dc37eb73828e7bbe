"""GET /metrics in the Prometheus text format.

Its per-tenant series hold every tenant's id and usage: with `tenants` configured, a tenant's key
must not read them (`GET /v1/usage` gives each tenant its own), so /metrics then answers to an
admin key only (`server.admin_keys_env`: what the deployment's Prometheus scrapes with), unless
`server.public_metrics` opens it to everyone."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from servicekit.auth import UNAUTHORIZED_MESSAGE

from ..api.errors import ApiError, ErrorType
from ..state import STATE, AppState


def listen_overflows(netstat: Path = Path("/proc/net/netstat")) -> int | None:
    """TcpExt ListenOverflows from /proc/net/netstat (None where there is no such file)."""
    try:
        lines = netstat.read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            if "ListenOverflows" in row:
                return int(row["ListenOverflows"])
    return None


METRICS_PATH = "/metrics"


def admin_only(state: AppState) -> bool:
    """Whether /metrics answers to an admin key only (the auth middleware then leaves the key
    to `handle`, as for /admin/ paths)."""
    return bool(state.config.tenants) and not state.config.server.public_metrics


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if admin_only(state) and (
        state.admin_keys is None or not state.admin_keys.owner(request.headers)
    ):
        raise ApiError(401, ErrorType.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
    metrics = state.metrics
    overflows = listen_overflows()
    if overflows is not None:
        metrics.listen_overflows.set(overflows)
    body = await metrics.exposition()  # off the loop: CPU work that grows with the workers
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
