"""/info tells the truth (DESIGN 4.1): not ready until in-process detectors loaded and judged once;
a detector that cannot warm up is UNHEALTHY; without a key (auth on) it shows statuses only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.clients.detectors import InProcessDetectorClient
from tests.orchestrator_support import Orchestrator, native_config

KEYS_ENV = "GUARDSTREAM_TEST_READINESS_KEYS"


def builtin_config(engine_url: str, **server: Any) -> dict[str, Any]:
    return native_config(
        engine_url,
        detectors={"pii": {"builtin": "regex", "chunker_id": "sentence"}},
        server=server,
    )


def bearer(key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {key}"} if key else None


async def test_not_ready_until_in_process_detectors_warmed_up(engine, monkeypatch) -> None:
    gate = asyncio.Event()
    judged: list[str] = []
    real = InProcessDetectorClient.warm_up

    async def gated(self: InProcessDetectorClient, text: str) -> None:
        await gate.wait()
        judged.append(self.detector_id)
        await real(self, text)

    monkeypatch.setattr(InProcessDetectorClient, "warm_up", gated)
    async with Orchestrator(builtin_config(engine.url)) as orch:
        status, body = await orch.info()
        assert status == 503 and body["status"] == "UNHEALTHY"
        assert body["detectors"]["pii"] == {"status": "UNKNOWN", "details": {"warming_up": True}}
        gate.set()
        await orch.info_until(lambda status, body: status == 200)
    assert judged == ["pii"]


@pytest.mark.parametrize("enforced", [True, False])
async def test_a_detector_that_cannot_warm_up_is_unhealthy(engine, monkeypatch, enforced) -> None:
    """Enforced by a model's guardrails, it makes the service unready; otherwise DEGRADED."""

    async def broken(self: InProcessDetectorClient, text: str) -> None:
        raise RuntimeError("weights missing")

    monkeypatch.setattr(InProcessDetectorClient, "warm_up", broken)
    config = builtin_config(engine.url)
    if enforced:
        config["models"]["fake-model"]["guardrails"] = {"input": {"pii": {}}}
    async with Orchestrator(config) as orch:
        status, body = await orch.info_until(
            lambda status, body: (
                body["detectors"]["pii"]["status"] != "UNKNOWN"
                and body["models"]["fake-model"][0]["status"] == "HEALTHY"
            ),
        )
    assert (status, body["status"]) == ((503, "UNHEALTHY") if enforced else (200, "DEGRADED"))
    assert body["detectors"]["pii"] == {
        "status": "UNHEALTHY",
        "details": {"error": "RuntimeError: weights missing"},
    }


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEYS_ENV, "the-key")
    return "the-key"


async def test_without_a_key_info_shows_statuses_only(engine, key) -> None:
    async with Orchestrator(builtin_config(engine.url, api_keys_env=KEYS_ENV)) as orch:
        await orch.info_until(lambda status, body: status == 200, bearer(key))
        _, anonymous = await orch.info()
        _, detailed = await orch.info(bearer(key))
        _, wrong = await orch.info(bearer("not-the-key"))
    for body in (anonymous, wrong):  # no model, replica or detector id (DESIGN 4.1)
        assert body == {"status": "HEALTHY"}
    replica = detailed["models"]["fake-model"][0]
    assert replica["url"] == engine.url and replica["status"] == "HEALTHY"
