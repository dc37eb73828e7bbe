"""The managed-engine supervisor with fake engine processes (tests/fakes/engine.py run as a
program): start on free ports, SIGKILL of the serving replica mid-stream, restart with backoff,
stop on shutdown. The same with real engine processes is in test_migration_engine.py."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from generation import __main__ as generation_cli
from orchestrator.clients import managed
from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.clients.backends import ReplicatedModelBackend, build_model_backends
from orchestrator.config import ManagedBackend, ModelConfig
from tests.wait_support import until

FAKE = str(Path(__file__).parent / "fakes" / "engine.py")
WORDS = [f"w{i}" for i in range(300)]
FULL = " ".join(WORDS)


def fake_command(*extra: str) -> Callable[[ManagedBackend], managed.CommandFactory]:
    def factory(cfg: ManagedBackend) -> managed.CommandFactory:
        def command(port: int) -> list[str]:
            return [sys.executable, FAKE, "--port", str(port), "--script", FULL, *extra]

        return command

    return factory


def build(
    session: aiohttp.ClientSession,
    replicas: int,
    factory: Callable[[ManagedBackend], managed.CommandFactory],
    **backend: object,
) -> ReplicatedModelBackend:
    config = ModelConfig.model_validate(
        {
            "backends": [{"type": "managed", "model": "fake", "replicas": replicas, **backend}],
            "migration": {"quarantine_s": 30, "stall_timeout_s": 5},
        }
    )
    b = build_model_backends(
        {"m": config},
        session,
        registry=CollectorRegistry(),
        health_interval_s=0.2,
        command_factory=factory,
    )["m"]
    assert isinstance(b, ReplicatedModelBackend)
    return b


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def req(n: int) -> GenerationRequest:
    return GenerationRequest(prompt="go", params=GenerationParams(max_new_tokens=n))


async def test_sigkill_mid_stream_migrates_and_the_replica_restarts(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(managed, "BACKOFF_BASE_S", 0.1)
    # a fresh stream goes silent after 20 tokens, so the kill lands mid-stream on a slow machine
    # too; the replica that resumes it is not held
    b = build(session, 2, fake_command("--hold-after", "20"))
    await b.start()
    try:
        info = b.info()
        assert [r["status"] for r in info] == ["HEALTHY", "HEALTHY"]
        assert [r["type"] for r in info] == ["managed", "managed"]
        pids = [r["pid"] for r in info]
        assert all(pids) and pids[0] != pids[1]
        assert {r["url"] for r in info} == {p.url for p in b.processes}

        stream = b.stream(req(200))
        text: list[str] = []
        async with stream:
            async for chunk in stream:
                text.append(chunk.text)
                if len(text) == 20:
                    serving = stream.replicas_used[0]
                    index = [r.name for r in b.replicas].index(serving)
                    os.kill(b.processes[index].pid or 0, signal.SIGKILL)
        assert "".join(text) == " ".join(WORDS[:200])
        assert stream.migrations == 1 and stream.generated_token_count == 200

        # the killed slot comes back with a new process, same name, and serves again
        proc = b.processes[index]
        # ready: its supervisor saw it healthy and lifted the quarantine (a health probe may
        # call the new process HEALTHY a moment earlier)
        await until(lambda: proc.restarts == 1 and proc.ready.is_set(), 60)
        assert b.info()[index]["status"] == "HEALTHY" and not b.info()[index]["quarantined"]
        assert b.info()[index]["pid"] not in pids
        served = set()
        for _ in range(4):
            s = b.stream(req(3))
            async with s:
                assert "".join([c.text async for c in s]) == " ".join(WORDS[:3])
            served.add(s.replicas_used[0])
        assert served == {"managed-0", "managed-1"}
    finally:
        pids = [p.pid for p in b.processes]
        await b.close()
    assert not any(alive(pid) for pid in pids if pid)
    assert [r["status"] for r in b.info()] == ["UNHEALTHY", "UNHEALTHY"]


async def test_crash_loop_backs_off_and_keeps_its_slot(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(managed, "BACKOFF_BASE_S", 0.05)
    b = build(session, 1, fake_command("--exit-after", "0.3"))
    proc = b.processes[0]
    # the slot itself, not b.start(): whether a probe catches the process in its 0.3 s of life
    # is up to the machine's speed, and the crash loop is the same either way
    await proc.start()
    try:
        await until(lambda: proc.restarts >= 2, 60)
        assert proc.last_exit == 3
        assert b.info()[0]["name"] == "managed-0"
    finally:
        await b.close()
    assert not proc.running


async def test_start_fails_when_no_engine_comes_up(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(managed, "BACKOFF_BASE_S", 0.05)

    def broken(cfg: ManagedBackend) -> managed.CommandFactory:
        return lambda port: [sys.executable, "-c", "import sys; sys.exit(7)"]

    b = build(session, 2, broken)
    with pytest.raises(RuntimeError, match="no managed engine became healthy"):
        await b.start()
    assert not any(p.running for p in b.processes)


async def test_stop_kills_an_engine_that_ignores_sigterm(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "print('stubborn', flush=True); time.sleep(60)"
    )
    output = io.StringIO()
    proc = managed.EngineProcess(
        "stubborn",
        lambda port: [sys.executable, "-c", script],
        session,
        start_timeout_s=60,
        output=output,
    )
    task = asyncio.create_task(proc.start())
    await until(lambda: "stubborn" in output.getvalue(), 30)  # SIGTERM is ignored from now on
    pid = proc.pid
    with caplog.at_level("WARNING", logger="guardstream.managed"):
        await proc.stop(grace_s=0.3)
    task.cancel()
    assert pid is not None and not alive(pid)
    assert f"engine stubborn (pid {pid}) ignored SIGTERM; killing it" in caplog.messages


def test_engine_command_matches_the_cli() -> None:
    cmd = managed.engine_command("tiny-random", "cpu", True)(8123)
    assert cmd == [
        sys.executable,
        "-m",
        "generation",
        "serve",
        "--model",
        "tiny-random",
        "--device",
        "cpu",
        "--port",
        "8123",
        "--enable-fault-injection",
    ]
    cmd = managed.engine_command("smollm2-135m", "cpu", dtype="bfloat16", batch_invariant=True)(
        8123
    )
    assert cmd[5:] == [
        "smollm2-135m",
        "--device",
        "cpu",
        "--port",
        "8123",
        "--dtype",
        "bfloat16",
        "--batch-invariant",
    ]
    cmd = managed.engine_command("tiny-random", "cuda", prefill_chunk_tokens=256)(8123)
    assert cmd[5:] == [
        "tiny-random",
        "--device",
        "cuda",
        "--port",
        "8123",
        "--prefill-chunk-tokens",
        "256",
    ]
    cmd = managed.engine_command("tiny-random", "cuda", overlap=False)(8123)
    assert cmd[10:] == ["--no-overlap"]
    assert generation_cli._parser().parse_args(cmd[3:]).overlap is False
    cmd = managed.engine_command("tiny-random", "cuda", overlap=True)(8123)
    assert cmd[10:] == ["--overlap"]
    assert generation_cli._parser().parse_args(cmd[3:]).overlap is True
    cmd = managed.engine_command("tiny-random", "cuda", compile_step=True)(8123)
    assert cmd[10:] == ["--compile"]
    assert generation_cli._parser().parse_args(cmd[3:]).compile is True
    assert generation_cli._parser().parse_args(cmd[3:-1]).compile is False
