"""Migration with real engine processes: a managed backend of two replicas on a manual
quarantine clock, and how tests read, cut and steer its streams (SIGKILL of the serving replica,
faults armed on the replica the next request goes to)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from orchestrator.clients.backends import ReplicatedModelBackend, build_model_backends
from orchestrator.clients.migration import MigratingStream
from orchestrator.config import ModelConfig
from tests.engine_support import TEST_DEVICE
from tests.fakes.clock import ManualClock
from tests.wait_support import until


@asynccontextmanager
async def managed_backend(
    model: str, *, start_timeout_s: float, stall_timeout_s: float, **backend: Any
) -> AsyncIterator[ReplicatedModelBackend]:
    """Two managed replicas of `model` on CPU (`backend` adds to their backend config), started;
    quarantines end only when `all_healthy()` says so (a manual clock)."""
    async with aiohttp.ClientSession() as session:
        config = ModelConfig.model_validate(
            {
                "backends": [
                    {
                        "type": "managed",
                        "model": model,
                        "device": TEST_DEVICE,
                        **backend,
                        "replicas": 2,
                        "start_timeout_s": start_timeout_s,
                    }
                ],
                "migration": {"limit": 3, "stall_timeout_s": stall_timeout_s, "quarantine_s": 30},
            }
        )
        b = build_model_backends(
            {model: config}, session, registry=CollectorRegistry(), health_interval_s=0.25
        )[model]
        assert isinstance(b, ReplicatedModelBackend)
        b.pool.clock = ManualClock()
        await b.start()
        try:
            yield b
        finally:
            await b.close()


async def collect(
    stream: MigratingStream, kill_after: int | None = None, parts: list[str] | None = None
) -> str:
    """The stream's text; with `kill_after`, SIGKILL the serving replica after that many chunks;
    the chunks' texts go to `parts` as they come."""
    parts = [] if parts is None else parts
    async with stream:
        async for chunk in stream:
            parts.append(chunk.text)
            if kill_after is not None and len(parts) == kill_after:
                await kill_serving(stream)
    return "".join(parts)


async def kill_serving(stream: MigratingStream) -> None:
    replica = next(r for r in stream._pool.replicas if r.name == stream.replicas_used[-1])
    assert replica.process is not None and replica.process.pid is not None
    os.kill(replica.process.pid, signal.SIGKILL)


async def all_healthy(backend: ReplicatedModelBackend) -> None:
    """End every quarantine, then wait until every slot runs (restarts take seconds)."""
    assert isinstance(backend.pool.clock, ManualClock)
    backend.pool.clock.advance(backend.pool.quarantine_s)
    await until(
        lambda: all(r["status"] == "HEALTHY" and not r["quarantined"] for r in backend.info()),
        deadline_s=120,
    )


async def arm(backend: ReplicatedModelBackend, **fault: Any) -> str:
    """Arm a fault on the replica the next request will go to; its name."""
    await all_healthy(backend)
    target = backend.pool.candidates()[0]
    async with (
        aiohttp.ClientSession() as s,
        s.post(target.client.url + "/admin/faults", json=fault) as r,
    ):
        assert r.status == 200, await r.text()
    return target.name
