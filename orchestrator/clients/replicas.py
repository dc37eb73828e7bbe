"""Replica selection, quarantine and cached health for the replicas of one model.

Selection is least-active among healthy replicas (round-robin on ties) so a long stream does not
pile new ones onto its replica. A failed replica is quarantined for `quarantine_s` whatever its
health probe says, because a replica that just reset a stream often still answers `/health`.
Health is polled in the background and cached; nothing on a request path waits for a probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .backend import ReplicaClient

if TYPE_CHECKING:
    from .managed import EngineProcess

log = logging.getLogger("guardstream.replicas")

HEALTHY, UNHEALTHY, UNKNOWN = "HEALTHY", "UNHEALTHY", "UNKNOWN"


@dataclass(eq=False)
class Replica:
    name: str
    client: ReplicaClient
    process: EngineProcess | None = None  # managed replicas only
    status: str = UNKNOWN  # from the last probe (or the supervisor); UNKNOWN before the first
    active: int = 0
    quarantined_until: float = 0.0
    last_error: str | None = None
    failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return "managed" if self.process is not None else self.client.type

    def info(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "url": self.client.url,
            "type": self.type,
            "status": self.status,
            "active": self.active,
            "quarantined": now < self.quarantined_until,
            "failures": self.failures,
        }
        if self.last_error is not None:
            out["last_error"] = self.last_error
        if self.process is not None:
            out.update(self.process.info())
        out.update(self.extra)
        return out


class ReplicaPool:
    def __init__(
        self,
        model_id: str,
        replicas: list[Replica],
        *,
        quarantine_s: float,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_id = model_id
        self.replicas = replicas
        self.quarantine_s = quarantine_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.clock = clock  # public: tests end a quarantine by moving a manual clock
        self._rr = 0
        self._poller: asyncio.Task[None] | None = None

    # -- selection ------------------------------------------------------------------------------

    def candidates(self) -> list[Replica]:
        """Replicas a request may go to now, best first: healthy before unknown, then fewest
        active requests, then round-robin order."""
        now = self.clock()
        n = len(self.replicas)
        usable = [
            (i, r)
            for i, r in enumerate(self.replicas)
            if r.status != UNHEALTHY and now >= r.quarantined_until
        ]
        usable.sort(key=lambda ir: (ir[1].status != HEALTHY, ir[1].active, (ir[0] - self._rr) % n))
        return [r for _, r in usable]

    def acquire(
        self, avoid: Replica | None = None, exclude: Collection[Replica] = ()
    ) -> Replica | None:
        """The replica for the next dispatch (its active count is raised), or None; not `avoid`
        (one that just failed the request without being quarantined) while another is usable,
        never one of `exclude` (busy with others' requests: they answered this one 429)."""
        candidates = [r for r in self.candidates() if r not in exclude]
        if not candidates:
            return None
        others = [r for r in candidates if r is not avoid]
        chosen = others[0] if others else candidates[0]
        self._rr = (self.replicas.index(chosen) + 1) % len(self.replicas)
        chosen.active += 1
        return chosen

    def release(self, replica: Replica) -> None:
        replica.active = max(0, replica.active - 1)

    def quarantine(self, replica: Replica, reason: str) -> None:
        """Keep a failed replica out of selection for quarantine_s."""
        replica.quarantined_until = self.clock() + self.quarantine_s
        replica.last_error = reason
        replica.failures += 1
        log.warning(
            "model %s: replica %s quarantined for %g s: %s",
            self.model_id,
            replica.name,
            self.quarantine_s,
            reason,
        )

    # -- health ---------------------------------------------------------------------------------

    async def probe(self, replica: Replica) -> None:
        if replica.process is not None and not replica.process.running:
            replica.status = UNHEALTHY
            return
        ok = await replica.client.health(self.health_timeout_s)
        if replica.process is not None and not replica.process.running:
            ok = False  # it died while the probe was in flight
        replica.status = HEALTHY if ok else UNHEALTHY

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas), return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # never let the poller die
                log.exception("model %s: health polling failed", self.model_id)
            await asyncio.sleep(self.health_interval_s)

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll(), name=f"health-{self.model_id}")

    async def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    def info(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [r.info(now) for r in self.replicas]
