"""Overload without resets (issue 26): a real `python -m orchestrator serve` process, started
with the open-file limits a container or systemd gives it, and more concurrent streams than it
takes. The excess gets 429 with Retry-After, the admitted streams complete, no connection is
reset, /metrics counts the rejections and /info is not ready while the process is saturated.

One worker reset its clients at 1024 streams: the soft RLIMIT_NOFILE (1024) ran out, accept()
failed with EMFILE, and the event loop accepted-and-closed the pending connections; connections
to the engine failed too. The process now raises its soft limit to the hard one at start, and
where even that cannot hold server.max_concurrent_streams streams it takes fewer
(orchestrator/capacity.py)."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from orchestrator import capacity
from orchestrator.app import STREAMING_PATH
from orchestrator.config import parse_config
from orchestrator.handlers.metrics import listen_overflows
from orchestrator.server import start_server
from orchestrator.state import STATE
from tests.fakes.engine import GatedEngine
from tests.orchestrator_support import (
    ROOT,
    Orchestrator,
    generation_body,
    native_config,
    read_sse,
    remote,
    serve,
    terminal,
)
from tests.wait_support import DEADLINE_S, until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_NOFILE and /proc: Linux")

SCRIPT = ["One", " two", " three", "."]


def nofile_of(pid: int) -> tuple[int, int]:
    """(soft, hard) open-file limits of a process, from /proc/PID/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no Max open files line")


def metric(text: str, name: str) -> float:
    (value,) = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
    ]
    return value


async def overload(
    url: str, engine: GatedEngine, clients: int, admitted: int, limit: int
) -> dict[str, Any]:
    """`clients` streams at once, each on its own connection; waits until `admitted` are held
    by the engine and every other one was answered, checks /info and /metrics while saturated,
    then opens the gate. Returns what each client got; a reset would raise out of here."""
    overloaded = {
        "code": 429,
        "details": f"too many concurrent streams (limit {limit})",
        "type": "overloaded",
    }
    rejected: list[tuple[int, str | None, Any]] = []
    completed: list[str] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(i: int) -> None:
            async with session.post(url + STREAMING_PATH, json=generation_body(f"s{i}")) as r:
                if r.status != 200:
                    rejected.append((r.status, r.headers.get("Retry-After"), await r.json()))
                    return
                events = await read_sse(r, lambda events: None)
                completed.append(terminal(events).name)

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]

        def failed() -> list[BaseException]:
            return [e for t in tasks if t.done() and (e := t.exception()) is not None]

        # a client that failed ends the wait at once, and says how (a reset, a refused connect)
        await until(
            lambda: failed() or (engine.held == admitted and len(rejected) == clients - admitted),
            60.0,
            what=f"{admitted} held and {clients - admitted} rejected",
        )
        assert not failed()
        # saturated: not ready, so a load balancer sends the next stream elsewhere
        async with session.get(url + "/info") as r:
            assert r.status == 503
            assert (await r.json())["status"] == "UNHEALTHY"
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        assert metric(text, 'guardstream_rejected_streams_total{reason="overloaded"}') == (
            clients - admitted
        )
        assert metric(text, "guardstream_active_streams") == admitted
        engine.gate.set()
        await asyncio.gather(*tasks)  # a reset connection raises here
        assert engine.held == admitted  # the rejected ones never reached the engine
        # ready again once the streams are over

        async def ready() -> bool:
            async with session.get(url + "/info") as r:
                return r.status == 200

        await until(ready, DEADLINE_S, "/info ready again")
    assert completed == ["completed"] * admitted
    assert rejected == [(429, "1", overloaded)] * (clients - admitted)
    return {"completed": completed, "rejected": rejected}


async def test_streams_beyond_the_cap_get_429_and_none_is_reset(tmp_path: Path) -> None:
    """max_concurrent_streams 8, 40 streams at once, started with a soft limit of 256 (raised
    to the hard 4096 at start, and logged)."""
    engine = GatedEngine(script=list(SCRIPT))
    await engine.start()
    config = native_config(engine.url, server={"max_concurrent_streams": 8})
    try:
        async with serve(tmp_path, config, nofile=(256, 4096)) as served:
            assert nofile_of(served.proc.pid) == (4096, 4096)
            assert "open files: soft limit 4096 (was 256), hard limit 4096" in served.messages()
            await overload(served.url, engine, clients=40, admitted=8, limit=8)
    finally:
        await engine.close()


async def test_too_few_open_files_for_the_cap_lower_it_instead_of_resetting(
    tmp_path: Path,
) -> None:
    """A hard limit of 200 open files cannot hold the default 1024 streams (2 descriptors each
    here): the process takes (200 - RESERVED_FDS) // 2 = 36 and says so. 100 clients at once
    would need about 220 descriptors without the cap: connections were reset then."""
    engine = GatedEngine(script=list(SCRIPT))
    await engine.start()
    config = native_config(engine.url)
    fits = (200 - capacity.RESERVED_FDS) // 2
    assert fits == 36
    try:
        async with serve(tmp_path, config, nofile=(200, 200)) as served:
            assert nofile_of(served.proc.pid) == (200, 200)
            assert any(
                m.startswith(
                    "server.max_concurrent_streams 1024 needs about 2176 open files (2 per "
                    f"stream + {capacity.RESERVED_FDS}), the limit is 200: taking at most 36 "
                    "streams"
                )
                for m in served.messages()
            ), served.messages()
            await overload(served.url, engine, clients=100, admitted=fits, limit=fits)
    finally:
        await engine.close()


# -- the pieces -----------------------------------------------------------------------------------


def test_descriptors_per_stream_count_the_remote_detectors() -> None:
    config = parse_config(
        native_config(
            "http://engine:1",
            detectors={
                "pii": {"builtin": "regex", "chunker_id": "sentence"},
                "a": remote("http://det-a:1"),
                "b": remote("http://det-b:1"),
            },
        )
    )
    assert capacity.fds_per_stream(config) == 4  # client, engine, two remote detectors
    assert capacity.streams_that_fit(config, 1024) == (1024 - capacity.RESERVED_FDS) // 4
    assert capacity.streams_that_fit(config, resource.RLIM_INFINITY) == 1024
    assert capacity.streams_that_fit(config, 10) == 1  # never 0: one stream always fits


def test_fit_keeps_a_cap_the_limit_holds_and_lowers_one_it_cannot(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    limits = {"now": (1024, 65536)}
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(capacity.resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(capacity.resource, "setrlimit", lambda _, v: set_to.append(v))
    config = parse_config(native_config("http://engine:1"))
    assert capacity.fit_to_process_limits(config) is config
    assert set_to == [(65536, 65536)]
    # a hard limit that cannot hold 1024 streams of 2 descriptors: the cap comes down
    limits["now"] = (1024, 1024)
    fitted = capacity.fit_to_process_limits(config)
    assert fitted.server.max_concurrent_streams == (1024 - capacity.RESERVED_FDS) // 2 == 448
    assert config.server.max_concurrent_streams == 1024  # the caller's config is left alone
    assert "taking at most 448 streams" in caplog.text
    # a refusal to raise keeps the soft limit (and says so)
    limits["now"] = (512, 65536)

    def refuse(_: int, __: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(capacity.resource, "setrlimit", refuse)
    assert capacity.raise_open_file_limit() == (512, 512, 65536)
    assert "cannot raise the soft limit 512 to 65536" in caplog.text


def test_an_unlimited_hard_limit_raises_to_the_kernels_maximum(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    nr_open = tmp_path / "nr_open"
    nr_open.write_text("1048576\n")
    monkeypatch.setattr(capacity, "NR_OPEN", nr_open)
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(
        capacity.resource, "getrlimit", lambda _: (1024, capacity.resource.RLIM_INFINITY)
    )
    monkeypatch.setattr(capacity.resource, "setrlimit", lambda _, v: set_to.append(v))
    assert capacity.raise_open_file_limit() == (1024, 1048576, capacity.resource.RLIM_INFINITY)
    assert set_to == [(1048576, capacity.resource.RLIM_INFINITY)]


async def test_the_listen_backlog_is_the_configured_one() -> None:
    """aiohttp listens with a backlog of 128 unless told; `ss` shows a listening socket's
    backlog in its Send-Q column."""
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    assert parse_config({}).server.listen_backlog == 2048
    config = parse_config(native_config("http://127.0.0.1:9", server={"listen_backlog": 77}))
    runner, port = await start_server(config, "127.0.0.1", 0)
    try:
        proc = await asyncio.create_subprocess_exec(
            "ss", "-Hltn", f"sport = :{port}", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
    finally:
        await runner.cleanup()
    (line,) = out.decode().splitlines()
    state, _recv_q, send_q = line.split()[:3]
    assert (state, send_q) == ("LISTEN", "77")


def test_listen_overflows_come_from_the_kernels_tcpext_counters(tmp_path: Path) -> None:
    netstat = tmp_path / "netstat"
    netstat.write_text(
        "TcpExt: SyncookiesSent SyncookiesRecv ListenOverflows ListenDrops\n"
        "TcpExt: 0 0 17 19\n"
        "IpExt: InNoRoutes InTruncatedPkts\n"
        "IpExt: 0 0\n"
    )
    assert listen_overflows(netstat) == 17
    assert listen_overflows(tmp_path / "missing") is None
    if Path("/proc/net/netstat").exists():
        assert isinstance(listen_overflows(), int)


async def test_info_is_not_ready_while_draining_or_saturated() -> None:
    """Readiness (the k8s probe on /info) goes false while the process drains (SIGTERM, after
    preStop) and while it holds max_concurrent_streams streams, and true otherwise."""
    engine = GatedEngine(script=list(SCRIPT))
    await engine.start()
    config = native_config(engine.url, server={"max_concurrent_streams": 1})
    try:
        async with Orchestrator(config) as orch:
            assert orch.session is not None and orch.runner is not None
            state = orch.runner.app[STATE]

            async def info() -> tuple[int, str]:
                assert orch.session is not None
                async with orch.session.get(orch.url + "/info") as r:
                    return r.status, (await r.json())["status"]

            await until(lambda: bool(state.backends))

            async def healthy() -> bool:  # the replica's first health check
                return await info() == (200, "HEALTHY")

            await until(healthy, DEADLINE_S, "/info healthy")
            held = await orch.session.post(orch.url + STREAMING_PATH, json=generation_body())
            await until(lambda: engine.held == 1 and state.active_streams == 1)
            assert await info() == (503, "UNHEALTHY")  # saturated
            engine.gate.set()
            assert terminal(await read_sse(held, lambda events: None)).name == "completed"
            await until(lambda: state.active_streams == 0)
            assert await info() == (200, "HEALTHY")
            state.draining = True
            assert await info() == (503, "UNHEALTHY")
            state.draining = False
    finally:
        await engine.close()


# -- memory per worker ----------------------------------------------------------------------------


def test_the_orchestrator_imports_punkt_without_the_rest_of_nltk() -> None:
    """`import nltk.tokenize.punkt` ran nltk's __init__, which imports scipy, scikit-learn and
    numpy: 115 MiB of each worker's RSS at rest. Importing the app loads none of them (and leaves
    no partial `nltk` in sys.modules), and a later `import nltk` gets the whole package."""
    code = (
        "import sys, orchestrator.app, chunkers.punkt_stream as p\n"
        "heavy = sorted(m for m in ('scipy', 'sklearn', 'numpy', 'joblib') if m in sys.modules)\n"
        "left = sorted(m for m in sys.modules if m.split('.')[0] == 'nltk')\n"
        "import nltk, nltk.tokenize.punkt\n"
        "text = 'Dr. Smith went home. He slept. Then he ate.'\n"
        "stock = nltk.tokenize.punkt.PunktSentenceTokenizer()\n"
        "ours = p.PunktSentenceTokenizer()\n"
        "same = list(stock.span_tokenize(text)) == list(ours.span_tokenize(text))\n"
        "print(heavy, left, callable(nltk.sent_tokenize), 'scipy' in sys.modules, same)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[] [] True True True\n"
