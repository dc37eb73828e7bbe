"""The deployment the end-to-end tests share: the orchestrator in front of two managed
`tiny-random` engine processes with fault injection (model `tiny`), the built-in `regex` and
`profanity` detectors in-process; and how to watch and steer its replicas over /info and the
engines' `/admin/faults`."""

from __future__ import annotations

from typing import Any

from tests.orchestrator_support import Orchestrator
from tests.wait_support import until

MODEL = "tiny"


def managed_model(
    replicas: int = 2,
    *,
    fault_injection: bool = True,
    start_timeout_s: float = 120,
    migration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A model served by `replicas` managed `tiny-random` engine processes on CPU."""
    backend: dict[str, Any] = {
        "type": "managed",
        "model": "tiny-random",
        "device": "cpu",
        "replicas": replicas,
        "start_timeout_s": start_timeout_s,
    }
    if fault_injection:
        backend["enable_fault_injection"] = True
    if migration is None:
        migration = {"limit": 3, "stall_timeout_s": 30, "quarantine_s": 30}
    return {"backends": [backend], "migration": migration}


def e2e_config() -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "models": {MODEL: managed_model()},
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {
            "pii": {"builtin": "regex", "chunker_id": "sentence"},
            "hap": {"builtin": "profanity", "chunker_id": "sentence"},
        },
    }


async def replicas(orch: Orchestrator, model: str = MODEL) -> list[dict[str, Any]]:
    assert orch.session is not None
    async with orch.session.get(orch.url + "/info") as r:
        return (await r.json())["models"][model]


async def all_healthy(orch: Orchestrator, model: str = MODEL) -> None:
    """Until every replica of `model` runs and none is quarantined (engines load torch)."""

    async def healthy() -> bool:
        reps = await replicas(orch, model)
        return all(r["status"] == "HEALTHY" and not r["quarantined"] for r in reps)

    await until(healthy, 120, f"every replica of {model} healthy", poll_s=0.2)


async def faults(orch: Orchestrator, replica: dict[str, Any], arm: dict[str, Any] | None) -> None:
    assert orch.session is not None
    url = replica["url"] + "/admin/faults"
    if arm is None:
        async with orch.session.delete(url) as r:
            assert r.status == 200, await r.text()
    else:
        async with orch.session.post(url, json=arm) as r:
            assert r.status == 200, await r.text()
