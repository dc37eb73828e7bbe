"""`python -m generation` as a real process: port 0 and a chosen port, the listening line,
disconnect handling in the production server setup, graceful SIGTERM, and `prepare`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.engine_processes import (
    EngineProcess,
    child_environment,
    free_port,
    start_engine_subprocess,
)
from tests.engine_support import TEST_DEVICE, generate
from tests.wait_support import until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_process() -> Iterator[EngineProcess]:
    with start_engine_subprocess(
        "tiny-random", port=0, fault_injection=True, device=TEST_DEVICE
    ) as engine:
        yield engine


async def test_port_zero_serves_and_reports(tiny_process: EngineProcess) -> None:
    assert tiny_process.url == f"http://127.0.0.1:{tiny_process.port}"
    assert tiny_process.port > 0
    assert any(
        line.startswith("guardstream-engine listening on http://127.0.0.1:")
        for line in tiny_process.output
    )
    async with aiohttp.ClientSession() as session:
        health = await (await session.get(tiny_process.url + "/health")).json()
        assert health["status"] == "ok" and health["model"] == "tiny-random"
        stream = await generate(
            session, tiny_process.url, {"prompt": "Hello 😀", "max_new_tokens": 16}
        )
        assert stream.completed and len(stream.token_ids) == 16
        resp = await session.post(
            tiny_process.url + "/admin/faults", json={"mode": "error", "after_tokens": 1}
        )
        assert resp.status == 200
        faulted = await generate(
            session, tiny_process.url, {"prompt": "Hello 😀", "max_new_tokens": 16}
        )
        assert faulted.error is not None and faulted.error["type"] == "generation_unavailable"
        assert faulted.token_ids == stream.token_ids[:1]


async def test_disconnect_in_production_server(tiny_process: EngineProcess) -> None:
    """The client drops the connection while the engine is stalled by a fault (no writes that
    could fail): the engine notices the disconnect on its own and the count returns to 0."""
    async with aiohttp.ClientSession() as session:

        async def active() -> int:
            return (await (await session.get(tiny_process.url + "/health")).json())[
                "active_requests"
            ]

        await session.post(
            tiny_process.url + "/admin/faults", json={"mode": "stall", "after_tokens": 1}
        )
        resp = await session.post(
            tiny_process.url + "/v1/generate", json={"prompt": "Hello", "max_new_tokens": 300}
        )
        assert json.loads(await resp.content.readline())["complete_final"] is False
        resp.close()

        async def idle() -> bool:
            return await active() == 0

        await until(idle, what="active requests back to 0")


async def test_chosen_port_and_graceful_sigterm() -> None:
    port = free_port()
    engine = start_engine_subprocess("tiny-random", port=port, device=TEST_DEVICE)
    try:
        assert engine.url == f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            # a long stream (tiny-random's whole context) that SIGTERM interrupts
            resp = await session.post(
                engine.url + "/v1/generate",
                json={"prompt": "Hello", "max_new_tokens": 500, "min_new_tokens": 500},
            )
            assert json.loads(await resp.content.readline())["complete_final"] is False
            engine.process.terminate()
            lines = [json.loads(line) for line in (await resp.read()).splitlines()]
        assert lines, "the stream ended with an in-band item"
        last = lines[-1]
        if "error" in last:  # interrupted: migratable error, no complete_final
            assert last["error"]["type"] == "generation_unavailable"
            assert all(not line.get("complete_final") for line in lines)
        else:  # the 500 tokens were already generated before the signal landed
            assert last == {"complete_final": True}
        assert await asyncio.to_thread(engine.process.wait, 30) == 0
    finally:
        engine.stop()


def test_prepare_command_and_bad_spec(tmp_path: Path) -> None:
    env = child_environment()
    done = subprocess.run(
        [sys.executable, "-m", "generation", "prepare", "tiny-random"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tiny-random ready at" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "generation", "serve", "--model", str(tmp_path / "nothing"), "--port", "0"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "is neither a built-in" in bad.stderr


def test_build_is_locked_and_deterministic(tmp_path: Path) -> None:
    """Two processes preparing into an empty cache at once: one builds, both see the same folder."""
    env = child_environment({"GUARDSTREAM_CACHE": str(tmp_path)})
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "generation", "prepare", "tiny-random"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    logs = "".join(err for _, err in outputs)
    assert logs.count("preparing model tiny-random") == 1
    folder = tmp_path / "models" / "tiny-random-v1"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]
    assert leftovers == []
