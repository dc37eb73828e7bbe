"""What every handler needs, built once per app at start-up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from servicekit.auth import KeyRing

from .clients.backend import ModelBackend
from .clients.migration import MigrationMetrics
from .clients.registry import ChunkerRegistry, DetectorRegistry, EnforcedGuardrails
from .config import DEFAULT_TENANT, Config, DetectionCacheConfig
from .metrics import OrchestratorMetrics
from .rate_limits import Clock
from .streaming.loop_lag import LoopLag
from .streaming.verdict_cache import TenantVerdicts, VerdictCache
from .tenants import Caller, Tenant, TenantGate, Tenants


class Admitted:
    """The requests admitted under one config (from the auth middleware to their last byte):
    what a reload replaced is closed only once every request that may use it has ended."""

    def __init__(self) -> None:
        self.running = 0
        self.ended = asyncio.Event()
        self.ended.set()

    def enter(self) -> None:
        self.running += 1
        self.ended.clear()

    def leave(self) -> None:
        self.running -= 1
        if not self.running:
            self.ended.set()


@dataclass
class AppState:
    config: Config
    metrics: OrchestratorMetrics
    chunkers: ChunkerRegistry
    session: aiohttp.ClientSession | None = None
    detectors: DetectorRegistry | None = None
    backends: dict[str, ModelBackend] = field(default_factory=dict)
    enforced: dict[str, EnforcedGuardrails] = field(default_factory=dict)  # by model id
    active_streams: int = 0
    # the taken stream slots (handlers/stream_slots.py), so a drain can end each pipeline with a
    # terminal event
    streams: set[Any] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no stream runs
    draining: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    loop_lag: LoopLag = field(default_factory=LoopLag)  # read pacing applies while it is busy
    # who may call, and what each tenant gets: a snapshot, swapped whole by a reload
    tenants: Tenants | None = None
    # each tenant's streams and buckets, by tenant id, kept across reloads
    gates: dict[str, TenantGate] = field(default_factory=dict)
    clock: Clock = time.monotonic  # the tenants' buckets (tests set it)
    admin_keys: KeyRing[bool] | None = None  # POST /admin/reload's (server.admin_keys_env)
    reloading: asyncio.Lock = field(default_factory=asyncio.Lock)  # one reload at a time
    # server.workers of the supervisor this process serves under (1: it serves alone): each
    # worker enforces its share of a tenant's limits (tenants.per_worker)
    workers: int = 1
    # a worker's: has the supervisor make every other worker reload (POST /admin/reload
    # reached only this one), with a deadline per worker; their problems, [] when all applied
    # the file (reload_channel.py). None when serving alone
    reload_others: Callable[[float], Awaitable[list[str]]] | None = None
    device: str = "auto"  # where in-process detectors run (`serve --device`), a reload's too
    migration_metrics: MigrationMetrics | None = None  # one set for every backend, reloads' too
    # the requests admitted under the config in use; a reload starts a new count (reload.py)
    admitted: Admitted = field(default_factory=Admitted)
    # the last reload's closing of what it replaced, once the requests that may use it ended
    retiring: asyncio.Task[None] | None = None
    # kept input verdicts, per tenant (config detection_cache); None: disabled
    verdicts: VerdictCache | None = None

    def build_verdicts(self, settings: DetectionCacheConfig) -> None:
        """The verdict cache `settings` ask for: a new one (empty) unless the running one was
        built with the same settings (a reload keeps it: its entries are keyed by detector
        client and config, so a rebuilt detector never meets an old verdict)."""
        if not settings.enabled:
            self.verdicts = None
            return
        if self.verdicts is not None and (
            self.verdicts.max_entries_per_tenant,
            self.verdicts.max_entries,
        ) == (settings.max_entries_per_tenant, settings.max_entries):
            return
        self.verdicts = VerdictCache(
            settings.max_entries_per_tenant,
            settings.max_entries,
            on_lookup=self.metrics.record_cache_lookup,
            on_evict=self.metrics.record_cache_eviction,
        )

    def input_verdicts(self, caller: Caller | None) -> TenantVerdicts | None:
        """The kept input verdicts a request of `caller` uses (its tenant's partition; the
        tenant `default` without tenants)."""
        if self.verdicts is None:
            return None
        return self.verdicts.tenant(caller.tenant.id if caller is not None else DEFAULT_TENANT)

    def caller(self, tenant: Tenant) -> Caller:
        """A request of `tenant`, with its gate (made on its first request, its limits as of
        the snapshot the request resolved against)."""
        gate = self.gates.get(tenant.id)
        if gate is None:
            gate = self.gates[tenant.id] = TenantGate(
                tenant.limits, lambda: self.clock(), self.workers
            )
        elif gate.configured is not tenant.limits:
            gate.apply(tenant.limits)
        return Caller(tenant, gate)


STATE = web.AppKey("state", AppState)
