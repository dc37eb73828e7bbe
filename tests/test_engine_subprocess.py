"""`python -m generation` as a real process: port 0 and a chosen port, the listening line,
disconnect handling in the production server setup, graceful SIGTERM, `prepare`, and the
replica's two processes (the API process and its engine core) living and dying as one."""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from generation.__main__ import LISTENING_PREFIX
from generation.core_client import CoreClient
from generation.jobs import EngineDelta, EngineUnavailable, Job, StreamError
from generation.sampling import SamplingParams
from tests.engine_processes import (
    EngineProcess,
    child_environment,
    free_port,
    start_engine_subprocess,
)
from tests.engine_support import TEST_DEVICE, batch_bodies, generate
from tests.http_support import Reply, exchange_at, post_head
from tests.wait_support import until

ROOT = Path(__file__).resolve().parents[1]
START_LINES: list[str] = []  # what `tiny_process`'s start passed to on_start_line


@pytest.fixture(scope="module")
def tiny_process() -> Iterator[EngineProcess]:
    with start_engine_subprocess(
        "tiny-random",
        port=0,
        fault_injection=True,
        device=TEST_DEVICE,
        on_start_line=START_LINES.append,
    ) as engine:
        yield engine


def test_start_up_lines_reach_the_caller_before_it_listens(tiny_process: EngineProcess) -> None:
    """`on_start_line` (bench/engine.py echoes the replica's start-up with it, live) got every
    line the replica printed before its listening line, in order, and nothing after."""
    output = list(tiny_process.output)
    listening = next(i for i, line in enumerate(output) if line.startswith(LISTENING_PREFIX))
    assert START_LINES == output[:listening]
    assert any(f"loaded tiny-random on {TEST_DEVICE}" in line for line in START_LINES)


def test_an_interrupted_start_kills_the_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or bench/engine.py's SIGTERM, turned into SystemExit) while waiting for the
    replica to listen kills it: no replica outlives a benchmark cut by its time limit, holding
    the GPU's memory for the next step."""
    started: list[subprocess.Popen[str]] = []
    popen = subprocess.Popen

    def recording(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        process = popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(process)
        return process  # type: ignore[no-any-return]

    monkeypatch.setattr(subprocess, "Popen", recording)
    with pytest.raises(KeyboardInterrupt):  # at its first start-up line, long before it listens
        start_engine_subprocess(
            "tiny-random", device=TEST_DEVICE, on_start_line=lambda line: _thread.interrupt_main()
        )
    assert len(started) == 1
    assert started[0].poll() is not None


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


def _children(pid: int) -> list[int]:
    """The pids a process started (Linux /proc): a replica's engine core."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaps (its parent is dead)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
async def test_sigkill_of_the_replica_kills_its_engine_core() -> None:
    """`serve` runs its engine in a child (the engine core): a SIGKILL of the replica's pid, the
    one a supervisor knows, leaves no engine behind."""
    engine = start_engine_subprocess("tiny-random", device=TEST_DEVICE)
    try:
        (core,) = _children(engine.process.pid)
        assert not _gone(core)
        engine.kill()
        await until(lambda: _gone(core), what="the engine core's death")
    finally:
        engine.stop()


@linux_only
async def test_a_dead_engine_core_fails_open_streams_and_the_replica_exits() -> None:
    """The engine core dies under an open stream: the stream ends in-band with the migratable
    `generation_unavailable` error (no complete_final), and the replica's process exits 1, so
    its supervisor sees a dead replica, as if the one process had died."""
    engine = start_engine_subprocess("tiny-random", device=TEST_DEVICE)
    try:
        (core,) = _children(engine.process.pid)
        os.kill(core, signal.SIGSTOP)  # the request reaches the core, which never answers it
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                engine.url + "/v1/generate", json={"prompt": "Hello", "max_new_tokens": 8}
            )
            assert resp.status == 200
            os.kill(core, signal.SIGKILL)
            lines = [json.loads(line) for line in (await resp.read()).splitlines()]
        assert lines == [
            {
                "error": {
                    "code": 503,
                    "type": "generation_unavailable",
                    "message": "the engine process stopped",
                },
                "complete_final": False,
            }
        ]
        assert await asyncio.to_thread(engine.process.wait, 30) == 1
    finally:
        engine.stop()


async def test_one_process_mode_serves_the_split_replicas_streams_exactly() -> None:
    """`--no-api-process` (debugging: the HTTP side and the worker in one process) serves the
    same 16 concurrent streams (greedy, seeded sampling, stop sequences; rows joining and
    leaving at different steps) as the default layout, byte for byte, and starts no child.
    The split replica's worker writes its steps to the API process itself: its core's loop
    takes no delivery for them (/health `worker.deliveries` stays as it was)."""
    bodies = batch_bodies()
    async with aiohttp.ClientSession() as session:
        streams = []
        for flags in ((), ("--no-api-process",)):
            with start_engine_subprocess(
                "tiny-random", device=TEST_DEVICE, extra_args=flags
            ) as engine:
                if sys.platform.startswith("linux"):
                    assert len(_children(engine.process.pid)) == (0 if flags else 1)
                before = await _worker(session, engine.url)
                streams.append(
                    await asyncio.gather(*(generate(session, engine.url, b) for b in bodies))
                )
                after = await _worker(session, engine.url)
                if not flags:
                    assert after["deliveries"] == before["deliveries"]
                    assert after["delivered_posts"] == before["delivered_posts"]
                else:  # the one process's loop delivers every step: the check above can fail
                    assert after["deliveries"] > before["deliveries"]
    split, one = streams
    assert all(s.completed for s in split)
    assert [s.raw for s in one] == [s.raw for s in split]


async def _worker(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/health") as resp:
        return (await resp.json())["worker"]


@linux_only
async def test_a_burst_of_connections_is_queued_while_the_replica_is_busy(
    tiny_process: EngineProcess,
) -> None:
    """300 clients connect at once while the replica's event loop cannot accept (stopped here;
    busy, in a burst of new streams): the kernel completes every handshake into the listening
    socket's accept queue, none is dropped to retry a second later (aiohttp's default queue of
    128 dropped the rest), and every connection is served once the replica runs again."""
    count = 300
    os.kill(tiny_process.process.pid, signal.SIGSTOP)
    try:
        sockets = []
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", tiny_process.port))
            sockets.append(sock)

        def connected() -> bool:
            _, writable, _ = select.select([], sockets, [], 0)
            return len(writable) == count and all(
                s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in sockets
            )

        await until(connected, what=f"{count} handshakes completed while the replica is stopped")
    finally:
        os.kill(tiny_process.process.pid, signal.SIGCONT)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    loop = asyncio.get_running_loop()

    async def health(sock: socket.socket) -> bytes:
        await loop.sock_sendall(sock, request)
        return await loop.sock_recv(sock, 12)

    try:
        answers = await asyncio.gather(*(health(s) for s in sockets))
    finally:
        for sock in sockets:
            sock.close()
    assert answers == [b"HTTP/1.1 200"] * count


class _Sink:
    """A stream's sink in the API process that notes, with each delivery, whether its
    `CoreClient` still took new requests at that moment."""

    def __init__(self, core: CoreClient) -> None:
        self.core = core
        self.deliveries: list[tuple[bool, list[EngineDelta | StreamError]]] = []
        self.ended = asyncio.Event()

    def put_many(self, events: list[EngineDelta | StreamError]) -> None:
        self.deliveries.append((self.core.healthy, events))
        if isinstance(events[-1], StreamError) or events[-1].finish_reason is not None:
            self.ended.set()


@linux_only
async def test_an_engine_core_that_stops_on_its_own_says_so_before_any_stream_fails(
    tmp_path: Path,
) -> None:
    """The engine core gets a SIGTERM of its own under an open stream: it tells its API process
    before it stops its engine, so by the time the stream's in-band error (migratable) reaches
    the API process, a new request is refused there, before any byte (server.py answers 503), not
    sent to a core that would answer it with a 200 whose only line is that error."""
    command = [sys.executable, "-m", "generation", "serve", "--model", "tiny-random"]
    core = CoreClient([*command, "--device", TEST_DEVICE], str(tmp_path / "core.sock"))
    await core.start()
    try:
        loop = asyncio.get_running_loop()
        sink = _Sink(core)
        job = Job(
            prompt_ids=[5, 6, 7],
            max_new_tokens=4000,
            sampling=SamplingParams(),
            loop=loop,
            queue=sink,  # type: ignore[arg-type]
        )
        core.submit(job)
        await until(lambda: sink.deliveries, what="the stream's first token")
        assert core.process is not None
        os.kill(core.process.pid, signal.SIGTERM)
        await asyncio.wait_for(sink.ended.wait(), 30)  # a guard, not a window
        healthy, events = sink.deliveries[-1]
        assert events[-1] == StreamError(
            503, "generation_unavailable", "the engine is shutting down"
        )
        assert not healthy  # the core's notice came first
        late = Job(
            prompt_ids=[5], max_new_tokens=2, sampling=SamplingParams(), loop=loop, queue=sink
        )  # type: ignore[arg-type]
        with pytest.raises(EngineUnavailable):
            core.submit(late)
    finally:
        await core.stop()


def test_the_api_process_starts_its_core_before_importing_torch() -> None:
    """What `serve` needs to start its engine core (the command line and `CoreClient`) imports
    no torch, so the core (torch, the model, the engine) starts at once and the API process's
    own imports (server.py: torch and transformers, seconds on a CPU) run while it loads."""
    probe = (
        "import sys, generation.__main__, generation.core_client;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=child_environment(),
        timeout=120,
    )
    assert out.stdout.strip() == "[]"


async def test_unfinished_request_heads_and_stalled_bodies_do_not_hold_connections() -> None:
    """Repro: `python -m generation serve` (deployed on 0.0.0.0) held a connection whose request
    head never completed for aiohttp's keep-alive timeout (3630 s), before any key was checked,
    and a body that stalled after its first byte for ever. With --header-timeout-s and
    --body-timeout-s at 0.3 s (the settings under test, not windows the test measures: each
    client has sent all it ever will): the first are closed with nothing sent; the second get
    408 with the engine's error body and the connection closes, on the API process's own
    route (/v1/generate) and on a route it forwards to its core (/v1/tokenize)."""
    flags = ("--header-timeout-s", "0.3", "--body-timeout-s", "0.3")
    with start_engine_subprocess("tiny-random", device=TEST_DEVICE, extra_args=flags) as engine:
        heads = [b"", b"POST /v1/gen", b"POST /v1/generate HTTP/1.1\r\nHost: x\r\n"]
        bodies = [post_head(path, 200) + b"{" for path in ("/v1/generate", "/v1/tokenize")]
        replies = await asyncio.gather(
            *(exchange_at(engine.port, sent) for sent in [*heads, *bodies])
        )
    assert replies[: len(heads)] == [b""] * len(heads)
    for raw in replies[len(heads) :]:
        reply = Reply(raw)
        assert (reply.status, reply.headers["connection"]) == (408, "close"), raw
        assert reply.json() == {
            "code": 408,
            "details": "the request body did not arrive within 0.3 s",
            "type": "timeout",
        }
