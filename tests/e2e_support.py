"""The deployment the end-to-end tests share: the orchestrator in front of two managed
`tiny-random` engine processes with fault injection (model `tiny`), the built-in `regex` and
`profanity` detectors in-process, started once per session (conftest's `e2e_orch`); and how to
watch and steer its replicas over /info and the engines' `/admin/faults`.

A test may SIGKILL a replica: its supervisor restarts it, and every test that uses the
deployment first waits (`all_healthy`) for both replicas to serve and none to be quarantined.
A test leaves no fault armed. What it counts (migrations) it compares before and after."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from orchestrator.state import STATE
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


def engine_key(orch: Orchestrator, model: str, url: str) -> str:
    """The generated Bearer key of the managed engine at `url` (it refuses calls without)."""
    assert orch.runner is not None
    backend: Any = orch.runner.app[STATE].backends[model]
    return next(p.api_key for p in backend.processes if p.url == url)


async def engine_call(orch: Orchestrator, model: str, path: str, body: dict[str, Any]) -> str:
    """POSTs straight to the first managed replica of `model`, with its key; the reply text."""
    assert orch.session is not None
    url = (await replicas(orch, model))[0]["url"]
    headers = {"Authorization": f"Bearer {engine_key(orch, model, url)}"}
    async with orch.session.post(url + path, json=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text
        return text


async def engine_answer(orch: Orchestrator, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's own answer (`text`, `finish_reason`, `generated_token_count`, ...), without
    the orchestrator: the oracle of what the orchestrator streams."""
    text = await engine_call(orch, model, "/v1/generate", body)
    lines = [json.loads(line) for line in text.splitlines() if line]
    assert lines[-1] == {"complete_final": True}
    data = [line["data"] for line in lines[:-1]]
    return {**data[-1], "text": "".join(d["text"] for d in data)}


async def migrations(orch: Orchestrator, model: str = MODEL, kind: str | None = None) -> float:
    """guardstream_migrations_total of `model` (of one `kind`, or all): the deployment is
    shared by every end-to-end file, so a test compares it before and after."""
    assert orch.session is not None
    async with orch.session.get(orch.url + "/metrics") as r:
        page = await r.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "guardstream_migrations_total"
        and s.labels.get("model_id") == model
        and kind in (None, s.labels.get("kind"))
    )


async def stall_every_replica(orch: Orchestrator, after_tokens: int = 8) -> None:
    """Every replica stalls (once) after `after_tokens`: a kill then lands mid-stream whichever
    replica serves."""
    for rep in await replicas(orch):
        await faults(orch, rep, {"after_tokens": after_tokens, "mode": "stall", "times": 1})


async def kill_the_serving_replica(orch: Orchestrator) -> int:
    """SIGKILLs the replica serving the one open stream, after disarming the survivors' faults
    (they must not stall too); its pid. The supervisor restarts it."""
    reps = await replicas(orch)
    serving = next(r for r in reps if r["active"] == 1)
    for other in reps:
        if other is not serving:
            await faults(orch, other, None)
    os.kill(serving["pid"], signal.SIGKILL)
    return serving["pid"]
