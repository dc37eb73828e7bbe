"""GET /metrics in the Prometheus text format."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..state import STATE


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


async def handle(request: web.Request) -> web.Response:
    metrics = request.app[STATE].metrics
    metrics.flush_gc_pauses()
    overflows = listen_overflows()
    if overflows is not None:
        metrics.listen_overflows.set(overflows)
    body = generate_latest(metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
