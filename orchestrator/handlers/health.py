"""GET /health (liveness) and GET /info (readiness: every replica, detector and chunker).

/info answers from a cache refreshed in the background, so a slow or dead dependency never
makes a probe hang."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import web

from .. import __version__
from ..api.fms_responses import ComponentStatus, HealthResponse, InfoResponse
from ..clients.detectors import InProcessDetectorClient
from ..state import STATE, AppState
from ..tenants import CALLER

log = logging.getLogger("guardstream.health")


async def health(request: web.Request) -> web.Response:
    return web.json_response(HealthResponse(version=__version__).dump())


AUTHENTICATED = "guardstream.authenticated"
WARMUP_TEXT = "Warm-up: is this text fine? Contact ops@example.com."


class DetectorHealth:
    """Cached health of remote detectors, refreshed every `interval_s`, and the start-up warm-up
    of in-process ones: until each has loaded its model and judged a text once, /info is not
    ready; one that fails is UNHEALTHY with the reason."""

    def __init__(self, state: AppState, interval_s: float = 5.0) -> None:
        self._state = state
        self._interval_s = interval_s
        self.status: dict[str, str] = {}
        self.checked_at = 0.0
        self.warmed = asyncio.Event()
        self.warmup_errors: dict[str, str] = {}

    async def warm_up(self) -> None:
        assert self._state.detectors is not None
        clients = {
            d: c
            for d, c in self._state.detectors.clients().items()
            if isinstance(c, InProcessDetectorClient)
        }

        async def one(detector_id: str, client: InProcessDetectorClient) -> None:
            try:
                await client.warm_up(WARMUP_TEXT)
            except Exception as exc:  # reported on /info, never raised
                log.error("detector %s failed its warm-up: %s", detector_id, exc)
                self.warmup_errors[detector_id] = f"{type(exc).__name__}: {exc}"

        started = time.monotonic()
        await asyncio.gather(*(one(d, c) for d, c in clients.items()))
        if clients:
            log.info(
                "in-process detectors warmed up in %.1f s: %s",
                time.monotonic() - started,
                ", ".join(clients),
            )
        self.warmed.set()

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


def required_detectors(state: AppState) -> set[str]:
    """The detectors readiness depends on: those some model's enforced guardrails use (every
    request to that model needs them). A detector only clients name is their choice: when it
    is down, requests naming it fail, and the service is DEGRADED, not unready."""
    return {
        detector_id
        for model in state.config.models.values()
        for detector_id in (*model.guardrails.input, *model.guardrails.output)
    }


async def info(request: web.Request) -> web.Response:
    """Ready when every model has a healthy replica, no detector an enforced guardrail uses is
    unhealthy, the in-process detectors finished their warm-up, and the process is neither
    draining nor saturated (server.max_concurrent_streams streams running). With auth on, a
    caller without a key sees the overall status only: model, detector and replica ids, URLs,
    pids and last errors map the deployment for an attacker."""
    state = request.app[STATE]
    checks = request.app[DETECTOR_HEALTH]
    full = request.get(AUTHENTICATED, False)  # always set (True with auth off)
    models = {model_id: backend.info() for model_id, backend in state.backends.items()}
    cached = checks.status
    warmed = checks.warmed.is_set()
    detectors: dict[str, ComponentStatus] = {}
    for d in state.config.detectors:
        if d in checks.warmup_errors:
            detail = {"error": checks.warmup_errors[d]} if full else None
            detectors[d] = ComponentStatus(status="UNHEALTHY", details=detail)
        elif not warmed and state.config.detectors[d].builtin is not None:
            detectors[d] = ComponentStatus(status="UNKNOWN", details={"warming_up": True})
        else:
            detectors[d] = ComponentStatus(status=cached.get(d, "UNKNOWN"))  # type: ignore[arg-type]
    chunkers = {c: ComponentStatus(status="HEALTHY") for c in state.chunkers.ids()}
    required = required_detectors(state)
    # saturated: another stream would get 429, so the load balancer should pick another pod
    saturated = state.active_streams >= state.config.server.max_concurrent_streams
    ready = (
        not saturated
        and warmed
        and all(any(r.get("status") == "HEALTHY" for r in replicas) for replicas in models.values())
        and all(s.status != "UNHEALTHY" for d, s in detectors.items() if d in required)
    )
    degraded = any(s.status == "UNHEALTHY" for s in detectors.values()) or any(
        r.get("status") != "HEALTHY" for replicas in models.values() for r in replicas
    )
    if not ready or state.draining:
        status = "UNHEALTHY"
    else:
        status = "DEGRADED" if degraded else "HEALTHY"
    code = 503 if status == "UNHEALTHY" else 200
    if not full:
        return web.json_response(InfoResponse(status=status).dump(), status=code)
    caller = request.get(CALLER)  # a tenant sees only its own models' replicas
    shown = {m: r for m, r in models.items() if caller is None or caller.tenant.sees(m)}
    body = InfoResponse(status=status, models=shown, detectors=detectors, chunkers=chunkers)
    return web.json_response(body.dump(), status=code)
