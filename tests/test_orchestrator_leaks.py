"""What the service tells a caller without a key, and what its children inherit (issue 20, item
9), reproduced against the real service: /info statuses only, /metrics behind the key unless
`server.public_metrics`, no version in `Server`, no internal address in a client-facing error,
managed engines started without the orchestrator's key variables, and readiness that an unused
unhealthy detector cannot fail."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from orchestrator.app import CONTENT_PATH, STREAMING_PATH, UNARY_PATH
from orchestrator.clients import managed
from orchestrator.clients.backends import ReplicatedModelBackend, build_model_backends
from orchestrator.clients.line_transport import transport_error
from orchestrator.config import ManagedBackend, parse_config, secret_env_names
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    generation_body,
    native_config,
    remote,
    terminal,
)

KEYS_ENV = "GUARDSTREAM_TEST_LEAK_KEYS"
KEY = "the-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAKE_ENGINE = str(Path(__file__).parent / "fakes" / "engine.py")


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEYS_ENV, KEY)
    return KEY


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def get(orch: Orchestrator, path: str, headers: dict[str, str] | None = None) -> Any:
    assert orch.session is not None
    async with orch.session.get(orch.url + path, headers=headers) as r:
        text = await r.text()
        return r.status, r.headers, text


# -- /info and /metrics without a key ---------------------------------------------------------


async def test_info_without_a_key_shows_the_status_only(engine, key) -> None:
    """Repro: /info without a key listed every model, replica and detector id."""
    dets = FakeDetectorServer()
    dets.add("secret-detector", DetectorBehaviour())
    await dets.start()
    config = native_config(
        engine.url,
        detectors={"secret-detector": remote(dets.url)},
        server={"api_keys_env": KEYS_ENV},
    )
    try:
        async with Orchestrator(config) as orch:
            _, detailed = await orch.info_until(lambda s, b: s == 200, AUTH)
            anonymous = await orch.info_until(lambda s, b: True)
            wrong = await orch.info_until(lambda s, b: True, {"Authorization": "Bearer no"})
    finally:
        await dets.close()
    assert anonymous == (200, {"status": "HEALTHY"})
    assert wrong == (200, {"status": "HEALTHY"})
    assert detailed["models"][MODEL][0]["url"] == engine.url
    assert detailed["detectors"]["secret-detector"] == {"status": "HEALTHY"}


async def test_metrics_need_a_key_unless_public(engine, key) -> None:
    """Repro: /metrics answered anyone, naming replicas and detectors."""
    async with Orchestrator(native_config(engine.url, server={"api_keys_env": KEYS_ENV})) as orch:
        anonymous = await get(orch, "/metrics")
        keyed = await get(orch, "/metrics", AUTH)
        health = await get(orch, "/health")
        openapi = await get(orch, "/openapi.json")
    assert anonymous[0] == 401
    assert keyed[0] == 200 and "guardstream" in keyed[2]
    assert health[0] == 200 and openapi[0] == 200
    assert MODEL not in openapi[2]  # ids are for callers with a key
    public = native_config(engine.url, server={"api_keys_env": KEYS_ENV, "public_metrics": True})
    async with Orchestrator(public) as orch:
        assert (await get(orch, "/metrics"))[0] == 200
        assert (await get(orch, "/v1/models"))[0] == 401  # only /metrics opened


async def test_the_server_header_names_no_version(engine, key) -> None:
    """Repro: `Server: Python/3.11 aiohttp/3.14.5`."""
    async with Orchestrator(native_config(engine.url, server={"api_keys_env": KEYS_ENV})) as orch:
        assert orch.session is not None
        replies = [await get(orch, p) for p in ("/health", "/info", "/metrics", "/nowhere")]
        async with orch.session.post(
            orch.url + STREAMING_PATH, json=generation_body(), headers=AUTH
        ) as r:
            await r.read()
            replies.append((r.status, r.headers, ""))
    assert [status for status, _, _ in replies] == [200, 200, 401, 401, 200]
    assert {headers["Server"] for _, headers, _ in replies} == {"guardstream"}


# -- internal addresses stay in the logs --------------------------------------------------------


async def test_a_dead_detector_is_named_without_its_address(engine, caplog) -> None:
    """Repro: `detector `d`: request failed: Cannot connect to host 127.0.0.1:PORT ...`."""
    port = closed_port()
    config = native_config(engine.url, detectors={"d": remote(f"http://127.0.0.1:{port}")})
    async with Orchestrator(config) as orch:
        status, body = await orch.post(CONTENT_PATH, {"content": "Hi.", "detectors": {"d": {}}})
        events = await orch.stream(generation_body(output={"d": {}}))
    expected = "detector `d`: request failed: cannot connect (connection refused)"
    assert (status, body) == (502, {"code": 502, "details": expected, "type": "detector_error"})
    end = terminal(events)
    assert end.name == "error" and end.data["details"] == expected
    assert any(str(port) in r.getMessage() for r in caplog.records)  # the operator sees it


async def test_a_dead_engine_is_named_without_its_address() -> None:
    port = closed_port()
    async with Orchestrator(native_config(f"http://127.0.0.1:{port}")) as orch:
        status, body = await orch.post(UNARY_PATH, generation_body())
    assert (status, body) == (
        503,
        {
            "code": 503,
            "details": f"no healthy replica of model `{MODEL}` is available",
            "type": "generation_unavailable",
        },
    )


async def test_connection_failures_are_described_without_the_address() -> None:
    """The one place engine errors are built from a failed connection, fed aiohttp's real
    exception: its text names the address, the client's message does not."""
    port = closed_port()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorError) as caught:
            await session.get(f"http://127.0.0.1:{port}/")
    assert str(port) in str(caught.value)
    error = transport_error("native-0", caught.value)
    assert str(error) == "replica native-0: connection failed: cannot connect (connection refused)"


# -- managed engines' environment ---------------------------------------------------------------


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/environ")
async def test_managed_engines_do_not_inherit_the_orchestrators_keys(monkeypatch) -> None:
    """Repro: a managed engine's environment held the orchestrator's API keys variable."""
    secrets = {
        "GUARDSTREAM_TEST_SERVER_KEYS": "server-key",
        "GUARDSTREAM_TEST_VLLM_KEY": "vllm-key",
        "GUARDSTREAM_TEST_DETECTOR_KEY": "detector-key",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GUARDSTREAM_TEST_HARMLESS", "kept")
    config = parse_config(
        {
            "server": {"api_keys_env": "GUARDSTREAM_TEST_SERVER_KEYS"},
            "models": {
                "m": {
                    "backends": [
                        {"type": "managed", "model": "tiny-random", "replicas": 1},
                        {
                            "type": "openai",
                            "url": "http://127.0.0.1:9",
                            "model": "x",
                            "api_key_env": "GUARDSTREAM_TEST_VLLM_KEY",
                        },
                    ]
                }
            },
            "detectors": {
                "d": {
                    "url": "http://127.0.0.1:9",
                    "api_key_env": "GUARDSTREAM_TEST_DETECTOR_KEY",
                }
            },
        }
    )
    assert secret_env_names(config) == set(secrets)

    def factory(cfg: ManagedBackend) -> managed.CommandFactory:
        return lambda port: [sys.executable, FAKE_ENGINE, "--port", str(port)]

    async with aiohttp.ClientSession() as session:
        backend = build_model_backends(
            config.models,
            session,
            registry=CollectorRegistry(),
            command_factory=factory,
            hidden_env=secret_env_names(config),
        )["m"]
        assert isinstance(backend, ReplicatedModelBackend)
        await backend.start()
        try:
            pid = backend.processes[0].pid
            assert pid is not None
            env = environ_of(pid)
        finally:
            await backend.close()
    assert not set(secrets) & set(env)
    assert not {v for v in env.values()} & set(secrets.values())
    assert env["GUARDSTREAM_TEST_HARMLESS"] == "kept"
    assert env[managed.ENGINE_API_KEYS_ENV] == backend.processes[0].api_key  # its own key only


# -- readiness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("enforced", [False, True])
async def test_an_unused_unhealthy_detector_degrades_without_failing_readiness(
    engine, enforced
) -> None:
    """Repro: one unused, unhealthy remote detector kept /info at 503 for the whole run. Now
    only the detectors an enforced guardrail uses decide readiness; others make it DEGRADED."""
    dead = remote(f"http://127.0.0.1:{closed_port()}")
    model = {"guardrails": {"output": {"dead": {}}}} if enforced else None
    config = native_config(engine.url, detectors={"dead": dead}, model=model)
    async with Orchestrator(config) as orch:
        status, body = await orch.info_until(
            lambda s, b: (
                b["detectors"]["dead"]["status"] == "UNHEALTHY"
                and b["models"][MODEL][0]["status"] == "HEALTHY"
            ),
        )
    if enforced:
        assert (status, body["status"]) == (503, "UNHEALTHY")
    else:
        assert (status, body["status"]) == (200, "DEGRADED")
    assert body["models"][MODEL][0]["status"] == "HEALTHY"
