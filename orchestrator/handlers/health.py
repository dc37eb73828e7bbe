"""GET /health (liveness) and GET /info (readiness: every replica, detector and chunker).

/info answers from a cache refreshed in the background, so a slow or dead dependency never
makes a probe hang."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from .. import __version__
from ..api.responses import ComponentStatus, HealthResponse, InfoResponse
from ..state import STATE, AppState


async def health(request: web.Request) -> web.Response:
    return web.json_response(HealthResponse(version=__version__).dump())


class DetectorHealth:
    """Cached health of remote detectors, refreshed every `interval_s`."""

    def __init__(self, state: AppState, interval_s: float = 5.0) -> None:
        self._state = state
        self._interval_s = interval_s
        self.status: dict[str, str] = {}
        self.checked_at = 0.0

    async def refresh(self) -> None:
        assert self._state.detectors is not None
        clients = self._state.detectors.clients()
        results = await asyncio.gather(*(c.health() for c in clients.values()))
        self.status = {
            d: "HEALTHY" if ok else "UNHEALTHY" for d, ok in zip(clients, results, strict=True)
        }
        self.checked_at = time.monotonic()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(self._interval_s)


DETECTOR_HEALTH = web.AppKey("detector_health", DetectorHealth)


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    models = {model_id: backend.info() for model_id, backend in state.backends.items()}
    cached = request.app[DETECTOR_HEALTH].status
    detectors = {
        d: ComponentStatus(status=cached.get(d, "UNKNOWN"))  # type: ignore[arg-type]
        for d in state.config.detectors
    }
    chunkers = {c: ComponentStatus(status="HEALTHY") for c in state.chunkers.ids()}
    ready = all(
        any(r.get("status") == "HEALTHY" for r in replicas) for replicas in models.values()
    ) and all(s.status != "UNHEALTHY" for s in detectors.values())
    body = InfoResponse(
        status="HEALTHY" if ready and not state.draining else "UNHEALTHY",
        models=models,
        detectors=detectors,
        chunkers=chunkers,
    )
    return web.json_response(body.dump(), status=200 if body.status == "HEALTHY" else 503)
