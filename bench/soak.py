"""Soak benchmark (issue 7): many streams through one orchestrator process, then a check that
it gave back what it took. Not part of `make test`.

    .venv/bin/python bench/soak.py [--sequential 10000] [--concurrent 256] [--waves 4]
        [--disconnect-every 20] [--settle 35] [--recheck 40] [--plain] [--json out.json]

The orchestrator runs in a subprocess with two output detectors on the `sentence` chunker (the
built-in `regex`, in-process, and a remote no-op detector), against the fake engine and detector
of bench/orchestrator.py (`_upstream`, another subprocess). Phases:
  1. warm-up: --warmup sequential streams and one wave of --concurrent streams;
  2. idle for --settle seconds (pooled keep-alive connections to the engine and the detector
     close 15 to 30 s after their last use), then a snapshot: RSS, open file descriptors by
     kind, asyncio tasks, the active-streams gauge;
  3. --sequential streams one after another (unpaced engine), then --waves waves of
     --concurrent streams at once (engine paced at --rate tokens/s, so they all overlap);
     every --disconnect-every-th stream the client hangs up after the first frame;
  4. the client closes its connections; idle for --settle seconds; the same snapshot. If
     anything is left over, the stacks of the extra tasks are printed and, after --recheck
     more seconds, a last snapshot tells "slow to finish" (e.g. a stall timeout) from "leaked".

Pass: RSS after the run within 10% of RSS after warm-up; file descriptors back to the warm-up
state (by kind, from /proc/<pid>/fd and /proc/net/tcp: the same non-TCP fds and listening sockets,
no connection from a client left, and at most the idle keep-alive connections of the two health
pollers, engine and detector, as outbound connections); asyncio tasks back to the warm-up count; `guardstream_active_streams` 0 in /metrics; every stream
that was not hung up on ended with `completed` and its frames tile exactly the engine's text.

Tasks: the orchestrator has no endpoint that lists its asyncio tasks, so by default the
subprocess is started through this script (`bench/soak.py _serve --config C --port 0`), which
runs `orchestrator.workers.run_server` (what `python -m orchestrator serve` runs) plus a second
tiny aiohttp app on another port, in the same event loop, answering
`GET /tasks` with the process's asyncio tasks by coroutine and its gc object count. No
orchestrator code changes. `--plain` runs `python -m orchestrator serve` instead; the task check
is then skipped (fds, RSS and the active-streams gauge remain).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

SELF = Path(__file__).resolve()
ROOT = SELF.parents[1]
BENCH = Path(__file__).resolve().parent
# bench/orchestrator.py would shadow the `orchestrator` package for scripts run from bench/
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(ROOT))

from bench.orchestrator import (  # noqa: E402 (after the sys.path fix)
    STREAMING_PATH,
    Proc,
    open_fds,
    orchestrator_config,
    rss_bytes,
    script,
    start_orchestrator,
    start_upstream,
    stream_body,
    wait_ready,
)

SENTENCE_TOKENS = 10


# -- the orchestrator with a task census (subprocess mode) --------------------------------------


def serve_with_census(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak.py _serve")
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)

    from orchestrator.config import load_config
    from orchestrator.workers import run_server

    async def census(request: web.Request) -> web.Response:
        gc.collect()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        by_coro = Counter(getattr(t.get_coro(), "__qualname__", "?") for t in tasks)
        stacks = []
        if request.query.get("stacks"):
            for t in tasks:
                out = io.StringIO()
                t.print_stack(file=out)
                stacks.append((getattr(t.get_coro(), "__qualname__", "?"), out.getvalue()))
        return web.json_response(
            {
                "tasks": len(tasks),
                "by_coro": dict(by_coro),
                "gc_objects": len(gc.get_objects()),
                "stacks": stacks,
            }
        )

    async def serve() -> int:
        side = web.Application()
        side.router.add_get("/tasks", census)
        side_runner = web.AppRunner(side, access_log=None)
        await side_runner.setup()
        await web.TCPSite(side_runner, "127.0.0.1", 0).start()
        print(f"census on http://127.0.0.1:{side_runner.addresses[0][1]}", flush=True)
        try:
            # what `python -m orchestrator serve` runs: prints `... listening on URL`, drains on
            # SIGTERM
            return await run_server(load_config(args.config), "127.0.0.1", args.port, device="cpu")
        finally:
            await side_runner.cleanup()

    return asyncio.run(serve())


# -- the client ----------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.terminals: Counter[str] = Counter()
        self.bad_text = 0
        self.errors: Counter[str] = Counter()
        self.streams = 0
        self.failure: dict[str, Any] | None = None  # the first `error`/`failed` event's data


async def one_stream(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    sentences: int,
    rate: float,
    hang_up: bool,
    tally: Tally,
) -> None:
    body = stream_body(key, sentences, SENTENCE_TOKENS, rate)
    tally.streams += 1
    text: list[str] = []
    name: str | None = None
    terminal: str | None = None
    try:
        async with session.post(url + STREAMING_PATH, json=body) as resp:
            if resp.status != 200:
                tally.errors[f"HTTP {resp.status}"] += 1
                await resp.read()
                return
            async for line in resp.content:
                if line.startswith(b"event: "):
                    name = line[7:].strip().decode()
                elif line.startswith(b"data: "):
                    if name is None:
                        text.append(json.loads(line[6:]).get("generated_text", ""))
                        if hang_up:
                            resp.close()
                            tally.terminals["(hung up)"] += 1
                            return
                    else:
                        terminal = name
                        if name in ("error", "failed") and tally.failure is None:
                            tally.failure = json.loads(line[6:])
                elif line == b"\n":
                    name = None
    except aiohttp.ClientError as exc:
        tally.errors[type(exc).__name__] += 1
        return
    tally.terminals[terminal or "(none)"] += 1
    if terminal == "completed" and "".join(text) != "".join(
        script(key, sentences, SENTENCE_TOKENS)
    ):
        tally.bad_text += 1


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return float("nan")


async def snapshot(
    pid: int, url: str, census_url: str | None, *, stacks: bool = False
) -> dict[str, Any]:
    ports = {int(u.rsplit(":", 1)[1]) for u in (url, census_url) if u}
    async with aiohttp.ClientSession() as session:
        active = await metric(session, url, "guardstream_active_streams")
        census: dict[str, Any] = {}
        if census_url:
            query = "?stacks=1" if stacks else ""
            async with session.get(census_url + "/tasks" + query) as r:
                census = await r.json()
    # read last, after the probes' connections are closed
    await asyncio.sleep(0.2)
    return {
        "rss_mb": rss_bytes(pid) / 2**20,
        "fds": open_fds(pid),
        "fd_kinds": fd_kinds(pid, ports),
        "active_streams": active,
        "tasks": census.get("tasks"),
        "tasks_by_coro": census.get("by_coro"),
        "gc_objects": census.get("gc_objects"),
        "stacks": census.get("stacks"),
    }


def fd_kinds(pid: int, ports: set[int]) -> dict[str, int]:
    """A process's open fds by kind: `listen`, `inbound` (connections to one of `ports`, the
    process's own), `outbound` (other TCP connections) and `other` (pipes, files, epoll, ...)."""
    tcp: dict[str, tuple[int, str]] = {}  # socket inode -> (local port, state)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                tcp[f[9]] = (int(f[1].rsplit(":", 1)[1], 16), f[3])
    kinds = Counter({"listen": 0, "inbound": 0, "outbound": 0, "other": 0})
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        inode = target[8:-1] if target.startswith("socket:[") else None
        if inode is None or inode not in tcp:
            kinds["other"] += 1
        elif tcp[inode][1] == "0A":  # TCP_LISTEN
            kinds["listen"] += 1
        elif tcp[inode][0] in ports:
            kinds["inbound"] += 1
        else:
            kinds["outbound"] += 1
    return dict(kinds)


def fds_ok(before: dict[str, int], after: dict[str, int]) -> bool:
    return (
        after["other"] == before["other"]
        and after["listen"] == before["listen"]
        and after["inbound"] == 0
        and after["outbound"] <= max(before["outbound"], 2)
    )


def show(label: str, snap: dict[str, Any]) -> None:
    tasks = (
        "" if snap["tasks"] is None else f", {snap['tasks']} tasks, {snap['gc_objects']} objects"
    )
    print(
        f"{label}: RSS {snap['rss_mb']:.1f} MiB, {snap['fds']} fds {snap['fd_kinds']}{tasks}, "
        f"active streams {snap['active_streams']:g}",
        flush=True,
    )


async def sequential(
    url: str, pid: int, n: int, args: argparse.Namespace, tally: Tally, tag: str, report: bool
) -> float:
    t0 = time.monotonic()
    step = max(1, n // 10)
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            hang_up = (
                bool(args.disconnect_every)
                and i % args.disconnect_every == args.disconnect_every - 1
            )
            await one_stream(session, url, f"k{tag}x{i}", args.sentences, 0, hang_up, tally)
            if report and (i + 1) % step == 0:
                print(
                    f"  sequential {i + 1:>6}/{n}: {time.monotonic() - t0:6.1f} s, "
                    f"RSS {rss_bytes(pid) / 2**20:.1f} MiB, {open_fds(pid)} fds",
                    flush=True,
                )
    return time.monotonic() - t0


async def waves(
    url: str, pid: int, count: int, args: argparse.Namespace, tally: Tally, tag: str, report: bool
) -> tuple[float, int]:
    t0 = time.monotonic()
    peak = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    for w in range(count):
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as session:
            done = asyncio.Event()

            async def watch(
                session: aiohttp.ClientSession = session, done: asyncio.Event = done
            ) -> None:
                nonlocal peak
                while not done.is_set():
                    active = await metric(session, url, "guardstream_active_streams")
                    peak = max(peak, int(active))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            await asyncio.gather(
                *(
                    one_stream(
                        session,
                        url,
                        f"k{tag}w{w}x{j}",
                        args.sentences,
                        args.rate,
                        bool(args.disconnect_every)
                        and j % args.disconnect_every == args.disconnect_every - 1,
                        tally,
                    )
                    for j in range(args.concurrent)
                )
            )
            done.set()
            await watcher
        if report:
            print(
                f"  wave {w + 1}/{count} of {args.concurrent}: {time.monotonic() - t0:6.1f} s, "
                f"RSS {rss_bytes(pid) / 2**20:.1f} MiB, {open_fds(pid)} fds",
                flush=True,
            )
    return time.monotonic() - t0, peak


async def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    upstream = start_upstream(tmp, log=False)
    orch: Proc | None = None
    try:
        config = orchestrator_config(
            upstream.url, max_new_tokens=max(64, args.sentences * SENTENCE_TOKENS)
        )
        argv = None if args.plain else [sys.executable, str(SELF), "_serve"]
        orch = start_orchestrator(tmp, config, argv)
        census_url = None if args.plain else orch.preamble[-1].rsplit(" ", 1)[-1]
        await wait_ready(orch.url)
        pid = orch.pid
        print(
            f"orchestrator pid {pid}; streams of {args.sentences} sentences x {SENTENCE_TOKENS} "
            f"tokens; hang-up every {args.disconnect_every or 'never'}; {os.cpu_count()} CPUs",
            flush=True,
        )
        show("start", await snapshot(pid, orch.url, census_url))
        warm = Tally()
        await sequential(orch.url, pid, args.warmup, args, warm, "warm", False)
        await waves(orch.url, pid, 1, args, warm, "warm", False)
        print(f"warm-up done ({warm.streams} streams); idle {args.settle:g} s", flush=True)
        await asyncio.sleep(args.settle)
        before = await snapshot(pid, orch.url, census_url)
        show("after warm-up", before)

        tally = Tally()
        seq_s = await sequential(orch.url, pid, args.sequential, args, tally, "s", True)
        con_s, peak = await waves(orch.url, pid, args.waves, args, tally, "c", True)
        print(f"run done; idle {args.settle:g} s", flush=True)
        await asyncio.sleep(args.settle)
        after = await snapshot(pid, orch.url, census_url)
        show("after run", after)
        late = None
        if args.recheck and (
            after["active_streams"] != 0
            or not fds_ok(before["fd_kinds"], after["fd_kinds"])
            or (after["tasks"] is not None and after["tasks"] != before["tasks"])
        ):
            stuck = await snapshot(pid, orch.url, census_url, stacks=True)
            extra = {
                name
                for name, n in (stuck["tasks_by_coro"] or {}).items()
                if n > (before["tasks_by_coro"] or {}).get(name, 0)
            }
            for name, stack in stuck["stacks"] or []:
                if name in extra:
                    print(stack.rstrip())
            print(f"leftovers: idle {args.recheck:g} s more, then look again", flush=True)
            await asyncio.sleep(args.recheck)
            late = await snapshot(pid, orch.url, census_url)
            show("after run + recheck", late)
        alive = orch.popen.poll() is None
    finally:
        if orch is not None:
            orch.stop()
        upstream.stop()

    growth = (after["rss_mb"] - before["rss_mb"]) / before["rss_mb"] * 100
    hung_up = tally.terminals["(hung up)"]
    checks = {
        "rss_within_10pct": abs(growth) <= 10,
        "fds_back_to_warmup": fds_ok(before["fd_kinds"], after["fd_kinds"]),
        "tasks_back_to_warmup": None if args.plain else after["tasks"] == before["tasks"],
        "active_streams_zero": after["active_streams"] == 0,
        "every_stream_completed": tally.terminals["completed"] + hung_up == tally.streams
        and not tally.errors
        and tally.bad_text == 0,
        "orchestrator_alive": alive,
    }
    if late is not None:
        checks["leftovers_gone_after_recheck"] = (
            late["active_streams"] == 0
            and fds_ok(before["fd_kinds"], late["fd_kinds"])
            and (args.plain or late["tasks"] == before["tasks"])
        )
    print()
    print(
        f"sequential: {args.sequential} streams in {seq_s:.1f} s "
        f"({args.sequential / seq_s if seq_s else 0:.0f} streams/s)"
    )
    print(
        f"concurrent: {args.waves} waves x {args.concurrent} streams in {con_s:.1f} s, "
        f"peak active streams (/metrics) {peak}"
    )
    print(
        f"terminals: {dict(tally.terminals)}; client errors: {dict(tally.errors) or 'none'}; "
        f"text mismatches: {tally.bad_text}"
    )
    if tally.failure is not None:
        print(f"first error/failed event: {tally.failure}")
    print()
    print("                 | after warm-up | after run")
    print(f"RSS MiB          | {before['rss_mb']:13.1f} | {after['rss_mb']:.1f} ({growth:+.1f}%)")
    print(f"open fds         | {before['fds']:13d} | {after['fds']}")
    for kind in ("listen", "inbound", "outbound", "other"):
        print(f"  {kind:<14} | {before['fd_kinds'][kind]:13d} | {after['fd_kinds'][kind]}")
    if not args.plain:
        print(f"asyncio tasks    | {before['tasks']:13d} | {after['tasks']}")
        print(f"gc objects       | {before['gc_objects']:13d} | {after['gc_objects']}")
    print(f"active streams   | {before['active_streams']:13g} | {after['active_streams']:g}")
    if not args.plain and after["tasks_by_coro"] != before["tasks_by_coro"]:
        print(f"tasks after warm-up: {before['tasks_by_coro']}")
        print(f"tasks after run:     {after['tasks_by_coro']}")
    print()
    for name, ok in checks.items():
        print(f"check {name}: {'skipped' if ok is None else 'PASS' if ok else 'FAIL'}")
    return {
        "args": vars(args),
        "before": before,
        "after": after,
        "rss_growth_pct": growth,
        "sequential_s": seq_s,
        "concurrent_s": con_s,
        "peak_active_streams": peak,
        "terminals": dict(tally.terminals),
        "errors": dict(tally.errors),
        "text_mismatches": tally.bad_text,
        "after_recheck": late,
        "checks": checks,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        return serve_with_census(sys.argv[2:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sequential", type=int, default=10_000)
    parser.add_argument("--concurrent", type=int, default=256, help="streams per wave")
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=500, help="sequential warm-up streams")
    parser.add_argument("--sentences", type=int, default=3, help="sentences (10 tokens) each")
    parser.add_argument("--rate", type=float, default=100, help="tokens/s in concurrent waves")
    parser.add_argument("--disconnect-every", type=int, default=20, help="0: never hang up")
    parser.add_argument(
        "--settle", type=float, default=35, help="idle seconds before a snapshot (2 x keep-alive)"
    )
    parser.add_argument(
        "--recheck",
        type=float,
        default=40,
        help="on leftovers after the run, print their stacks and look again after S s (0: no)",
    )
    parser.add_argument("--plain", action="store_true", help="python -m orchestrator serve")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        summary = asyncio.run(soak(args, Path(tmp)))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if all(ok is not False for ok in summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
