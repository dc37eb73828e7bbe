"""Orchestrator overhead benchmark (issue 5): the latency the orchestrator adds to each frame, its
CPU time per 1,000 tokens and its memory per active stream, at 1, 64 and 256 concurrent streams.

    .venv/bin/python bench/orchestrator.py [--levels 1,64,256] [--duration 15] [--rate 50]
        [--sentences 20] [--sentence-tokens 10] [--idle S] [--profile out.prof] [--json out.json]

Three processes on this machine:
  - the orchestrator under test: `python -m orchestrator serve --config <tmp>.yaml --port 0`,
    with two output detectors on the `sentence` chunker: `pii` (built-in `regex`, in-process)
    and `noop` (remote, answers `[]` for every content);
  - "upstream" (this script run as `bench/orchestrator.py _upstream`): a fake native engine that
    streams each request's script at a fixed token rate (token i is due at t0 + (i + 1) / rate)
    and the no-op detector, both in one aiohttp server;
  - the client (this process): one streaming request per stream, SSE read line by line.

Each stream's script is deterministic: sentences of --sentence-tokens tokens,
`Item<k> <stream key> alpha bravo ... .`, so every sentence carries a unique marker.

Added latency of a frame = (time the client read the frame's `data:` line) - (the moment the
frame's text became judgeable: its last token was sent AND every detector's result for every
sentence in it was available). All times are CLOCK_MONOTONIC (`time.monotonic()`), which every
process on the machine shares. The upstream logs, per stream, the send time of each token (its
text offsets follow from the script), and, per sentence marker, the time the no-op detector
wrote its reply. The regex detector runs inside the orchestrator (synchronously for contents
this short): its queue is woken by the same chunk as the remote detector's queue and answers
within a few event-loop iterations, before the no-op detector's reply can come back, so the no-op
reply time stands for "all detector results available". (The regex detector's own cost per
sentence is measured in this process and printed: tens of microseconds.) When the orchestrator's
event loop is behind, the regex result is late too, and that delay is rightly counted as added
by the orchestrator. What remains is the orchestrator's own work:
reading the detector reply, the aggregation rule, building and writing the frame, plus two
loopback hops (detector -> orchestrator, orchestrator -> client) and the client's read.

CPU: utime + stime of the orchestrator process (/proc/<pid>/stat) over each level, divided by
the tokens the engine sent in it. Memory per active stream: (peak RSS during the level - RSS
after warm-up, idle) / concurrent streams, RSS sampled every 50 ms from /proc/<pid>/status.

Targets (issue 5): p50 added latency < 2 ms at 64 streams; 256 concurrent streams at 50 tokens/s
each (the engine keeps >= 95% of the rate) with p99 added latency < 100 ms. The machine's CPU
count and load average are printed: all three processes share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
# bench/orchestrator.py would shadow the `orchestrator` package for scripts run from bench/
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(ROOT))

STREAMING_PATH = "/api/v1/task/server-streaming-classification-with-text-generation"
MODEL = "bench"
FILLER = [
    " alpha",
    " bravo",
    " charlie",
    " delta",
    " echo",
    " foxtrot",
    " golf",
    " hotel",
    " india",
    " juliet",
    " kilo",
    " lima",
    " mike",
    " november",
    " oscar",
    " papa",
]
MARKER = re.compile(r"Item(\d+) (k\w+)")


# -- the script every stream follows ------------------------------------------------------------


def script(key: str, sentences: int, per_sentence: int) -> list[str]:
    """The tokens of stream `key`: `Item<k> <key> alpha bravo ... .` per sentence."""
    if per_sentence < 3 or per_sentence - 3 > len(FILLER):
        raise ValueError(f"sentence-tokens must be 3..{len(FILLER) + 3}")
    tokens: list[str] = []
    for k in range(sentences):
        tokens.append(("" if k == 0 else " ") + f"Item{k}")
        tokens.append(f" {key}")
        tokens.extend(FILLER[: per_sentence - 3])
        tokens.append(".")
    return tokens


def prompt_for(key: str, sentences: int, per_sentence: int, rate: float) -> str:
    """The prompt tells the fake engine what to stream (keys match `k\\w+`)."""
    return f"{key} {sentences} {per_sentence} {rate:g}"


# -- upstream: fake engine + no-op detector, with timestamps ------------------------------------


class Upstream:
    """A native-protocol engine paced at a fixed token rate, and a detector answering `[]`."""

    def __init__(self, log: bool) -> None:
        self.log = log
        self.tokens: dict[str, list[float]] = {}  # stream key -> send time of each token
        self.lag: list[float] = []  # send time - due time, per paced token
        self.replies: dict[str, float] = {}  # "<key>/<k>" -> no-op detector reply time
        self.streams = 0
        self.detector_calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/generate", self.generate)
        app.router.add_post("/v1/tokenize", self.tokenize)
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": MODEL}]}))
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_post("/api/v1/text/contents", self.contents)
        app.router.add_get("/bench/log", self.dump_log)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = [min(ord(c), 999) for c in body.get("prompt", "")]
        return web.json_response({"token_ids": ids, "count": len(ids)})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        key, sentences, per_sentence, rate = prompt.split()
        tokens = script(key, int(sentences), int(per_sentence))
        tokens = tokens[: int(body.get("max_new_tokens", len(tokens)))]
        pace = float(rate)
        prompt_ids = [min(ord(c), 999) for c in prompt]
        self.streams += 1
        resp = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await resp.prepare(request)
        sent: list[float] = []
        t0 = time.monotonic()
        try:
            for i, tok in enumerate(tokens):
                if pace > 0:
                    due = t0 + (i + 1) / pace
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self.log:
                        self.lag.append(time.monotonic() - due)
                last = i == len(tokens) - 1
                data: dict[str, Any] = {
                    "token_ids": [1000 + i],
                    "text": tok,
                    "generated_token_count": i + 1,
                    "input_token_count": len(prompt_ids),
                    "finish_reason": None if not last else "EOS_TOKEN",
                }
                if i == 0:
                    data["prompt_token_ids"] = prompt_ids
                line = (json.dumps({"data": data, "complete_final": False}) + "\n").encode()
                sent.append(time.monotonic())
                await resp.write(line)
            await resp.write(b'{"complete_final": true}\n')
            await resp.write_eof()
        finally:
            if self.log:
                self.tokens[key] = sent
        return resp

    async def contents(self, request: web.Request) -> web.Response:
        body = await request.json()
        contents: list[str] = body["contents"]
        self.detector_calls += 1
        reply = json.dumps([[] for _ in contents])
        if self.log:
            now = time.monotonic()
            for content in contents:
                for m in MARKER.finditer(content):
                    self.replies[f"{m[2]}/{m[1]}"] = now
        return web.Response(text=reply, content_type="application/json")

    async def dump_log(self, request: web.Request) -> web.Response:
        out = {
            "tokens": self.tokens,
            "lag": self.lag,
            "replies": self.replies,
            "streams": self.streams,
            "detector_calls": self.detector_calls,
        }
        self.tokens, self.lag, self.replies = {}, [], {}
        self.streams = self.detector_calls = 0
        return web.json_response(out)


def serve_upstream(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/orchestrator.py _upstream")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-log", action="store_true", help="keep no timestamps (soak runs)")
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="share --port with other upstream processes (SO_REUSEPORT), and serve /bench/log "
        "on a private port too, announced on a `log on URL` line",
    )
    args = parser.parse_args(argv)

    async def serve() -> None:
        upstream = Upstream(log=not args.no_log)
        runner = web.AppRunner(upstream.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(
            runner, "127.0.0.1", args.port, backlog=4096, reuse_port=args.reuse_port or None
        )
        await site.start()
        shared = runner.addresses[0][1]
        if args.reuse_port:
            private = web.TCPSite(runner, "127.0.0.1", 0)
            await private.start()
            print(f"upstream log on http://127.0.0.1:{runner.addresses[1][1]}", flush=True)
        print(f"upstream listening on http://127.0.0.1:{shared}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())
    return 0


# -- processes -----------------------------------------------------------------------------------


class Proc:
    """A child process that prints `... listening on <url>` on stdout once it is ready."""

    def __init__(
        self, argv: list[str], log_path: Path, *, timeout_s: float = 60, cwd: Path = ROOT
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # closed in stop()
        self.popen = subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.pid = self.popen.pid
        deadline = time.monotonic() + timeout_s
        assert self.popen.stdout is not None
        self.url = ""
        self.preamble: list[str] = []  # stdout lines before the `listening on` one
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if not line:
                break
            m = re.search(r" listening on (\S+)", line)
            if m:
                self.url = m[1].replace("0.0.0.0", "127.0.0.1")
                break
            self.preamble.append(line.strip())
        if not self.url:
            self.stop()
            raise RuntimeError(f"{argv[:4]} did not start:\n{self.log_tail()}")
        # keep reading stdout so that a chatty child never blocks on a full pipe
        threading.Thread(target=self.popen.stdout.read, daemon=True).start()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()


def start_upstream(tmp: Path, *, log: bool = True) -> Proc:
    argv = [sys.executable, str(Path(__file__).resolve()), "_upstream"]
    return Proc(argv if log else [*argv, "--no-log"], tmp / "upstream.log")


class Upstreams:
    """The fake engine + no-op detector as `n` processes on one port (SO_REUSEPORT: the kernel
    spreads the orchestrator's connections over them), so that one process's event loop does
    not become the bottleneck that the figures then measure. Each keeps its own timestamps,
    read from its private port and merged; CLOCK_MONOTONIC is the same in every process."""

    def __init__(self, tmp: Path, n: int) -> None:
        self.procs: list[Proc] = []
        self.log_urls: list[str] = []
        argv = [sys.executable, str(Path(__file__).resolve()), "_upstream", "--reuse-port"]
        try:
            port = 0
            for i in range(n):
                proc = Proc([*argv, "--port", str(port)], tmp / f"upstream-{i}.log")
                self.procs.append(proc)
                port = int(proc.url.rsplit(":", 1)[1])
                (log_line,) = [line for line in proc.preamble if " log on " in line]
                self.log_urls.append(log_line.split(" log on ")[1])
        except BaseException:
            self.stop()
            raise
        self.url = self.procs[0].url
        self.pid = self.procs[0].pid  # the first; `pids` has them all

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def collect_log(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Every process's /bench/log (which also resets it), merged."""
        merged: dict[str, Any] = {
            "tokens": {},
            "lag": [],
            "replies": {},
            "streams": 0,
            "detector_calls": 0,
            "lag_by_process": [],
        }
        for url in self.log_urls:
            async with session.get(url + "/bench/log") as r:
                part = await r.json()
            merged["tokens"].update(part["tokens"])
            merged["replies"].update(part["replies"])
            merged["lag"].extend(part["lag"])
            merged["lag_by_process"].append(pct(part["lag"], 0.99) if part["lag"] else 0.0)
            merged["streams"] += part["streams"]
            merged["detector_calls"] += part["detector_calls"]
        return merged

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


#: `--server KEY=VALUE`: server settings of the orchestrator under test (e.g. read_coalesce_tokens)
SERVER_OVERRIDES: dict[str, Any] = {}


def add_server_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a `server:` setting of the orchestrator under test (YAML value); repeatable",
    )


def server_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    pairs = (item.partition("=") for item in items)
    return {key: yaml.safe_load(value) for key, _, value in pairs}


def orchestrator_config(
    upstream_url: str, *, max_new_tokens: int, workers: int = 1
) -> dict[str, Any]:
    server: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "max_concurrent_streams": 4096}
    server.update(SERVER_OVERRIDES)
    if workers != 1:
        server["workers"] = workers
    return {
        "server": server,
        "models": {
            MODEL: {
                "backends": [{"type": "native", "url": upstream_url}],
                "migration": {"limit": 0},
                "limits": {"max_new_tokens": max_new_tokens},
            }
        },
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {
            "pii": {"builtin": "regex", "chunker_id": "sentence"},
            "noop": {"url": upstream_url, "chunker_id": "sentence"},
        },
    }


def start_orchestrator(tmp: Path, config: dict[str, Any], argv: list[str] | None = None) -> Proc:
    """`python -m orchestrator serve --config <tmp>/config.yaml --port 0` (or `argv` + config)."""
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = argv or [sys.executable, "-m", "orchestrator", "serve"]
    return Proc([*cmd, "--config", str(path), "--port", "0"], tmp / "orchestrator.log")


async def wait_ready(url: str, timeout_s: float = 60) -> None:
    """Until /info says every backend and detector is usable."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/info") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready in {timeout_s} s")
            await asyncio.sleep(0.1)


def tree(pid: int) -> list[int]:
    """A process and its live descendants (the workers under `server.workers`)."""
    pids = [pid]
    for p in pids:
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                children = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                pids.extend(int(c) for c in children)
        except OSError:
            continue
    return pids


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """utime + stime of a process and its descendants (fields 14 and 15 of /proc/<pid>/stat)."""
    total = 0.0
    for p in tree(pid) if children else [pid]:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def rss_bytes(pid: int) -> int:
    """RSS of a process and its descendants."""
    total = 0
    for p in tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def listen_overflows() -> int:
    """The kernel's TcpExt ListenOverflows (this network namespace, every listener in it):
    connections dropped because an accept queue was full, which a client sees as a stall or a
    reset. 0 where /proc/net/netstat does not exist."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(row.get("ListenOverflows", 0))
    return 0


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


# -- the client ----------------------------------------------------------------------------------


@dataclass
class StreamResult:
    key: str
    frames: list[tuple[float, int, int, str]] = field(
        default_factory=list
    )  # recv, start, end, text
    terminal: str | None = None
    failure: dict[str, Any] | None = None  # the data of an `error`/`failed` terminal event


def stream_body(key: str, sentences: int, per_sentence: int, rate: float) -> dict[str, Any]:
    return {
        "model_id": MODEL,
        "inputs": prompt_for(key, sentences, per_sentence, rate),
        "guardrail_config": {"output": {"models": {"pii": {}, "noop": {}}}},
        "text_gen_parameters": {"max_new_tokens": sentences * per_sentence},
    }


async def read_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str
) -> StreamResult:
    """One streaming request; every frame with the time its `data:` line was read."""
    result = StreamResult(key)
    async with session.post(url + STREAMING_PATH, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        name: str | None = None
        async for line in resp.content:
            now = time.monotonic()
            if line.startswith(b"data: "):
                data = json.loads(line[6:])
                if name is None:
                    result.frames.append(
                        (
                            now,
                            data["start_index"],
                            data["processed_index"],
                            data.get("generated_text", ""),
                        )
                    )
                else:
                    result.terminal = name
                    if name in ("error", "failed"):
                        result.failure = json.loads(line[6:])
            elif line.startswith(b"event: "):
                name = line[7:].strip().decode()
            elif line in (b"\n", b"\r\n"):
                name = None
    return result


@dataclass
class Level:
    concurrency: int
    results: list[StreamResult] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # time, rss, active
    cpu_s: float = 0.0
    load_cpu_s: float = 0.0  # the upstream's and this client's, together
    wall_s: float = 0.0
    log: dict[str, Any] = field(default_factory=dict)
    stalls: dict[str, float] = field(default_factory=dict)  # /metrics deltas over the level
    client_lag: list[float] = field(default_factory=list)  # the clients' loop-lag probes, s
    load_procs: int = 1
    listen_overflows: int = 0  # the kernel's count over the level (whole network namespace)


STALL_SERIES = {
    **{
        f"gc{g} {part}": (f"guardstream_gc_pause_seconds_{part}", f'generation="{g}"')
        for g in range(3)
        for part in ("count", "sum")
    },
    "lag probes": ("guardstream_event_loop_lag_seconds_count", ""),
    "lag <= 10 ms": ("guardstream_event_loop_lag_seconds_bucket", 'le="0.01"'),
    "lag <= 50 ms": ("guardstream_event_loop_lag_seconds_bucket", 'le="0.05"'),
}


async def stall_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The orchestrator's garbage-collection and event-loop-lag counters (/metrics): what
    stops every stream at once, to read next to the latency percentiles."""
    async with session.get(url + "/metrics") as r:
        page = await r.text()
    out = dict.fromkeys(STALL_SERIES, 0.0)
    for line in page.splitlines():
        for key, (name, label) in STALL_SERIES.items():
            if line.startswith(name + ("{" if label else " ")) and label in line:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def stall_line(stalls: dict[str, float]) -> str:
    gen = "; ".join(
        f"gen{g} {stalls[f'gc{g} count']:.0f} x {1000 * stalls[f'gc{g} sum'] / n:.1f} ms"
        for g in range(3)
        if (n := stalls[f"gc{g} count"])
    )
    probes = stalls["lag probes"]
    late = (
        f"{probes - stalls['lag <= 10 ms']:.0f} over 10 ms, {probes - stalls['lag <= 50 ms']:.0f} "
        f"over 50 ms of {probes:.0f}"
    )
    return f"garbage collections: {gen or 'none'}; event-loop probes (every 100 ms): {late}"


async def probe_loop_lag(done: asyncio.Event, out: list[float]) -> None:
    """The load generator's own event-loop lag: how late a sleep of 100 ms wakes up. A client
    that reads its streams late inflates every added-latency figure by that much."""
    while not done.is_set():
        due = time.monotonic() + 0.1
        await asyncio.sleep(0.1)
        out.append(max(0.0, time.monotonic() - due))


async def run_slots(
    url: str,
    slots: list[int],
    spec: dict[str, Any],
    active: list[int] | None = None,
) -> tuple[list[StreamResult], list[float]]:
    """Client slots `slots` of a level (see run_level), from spec["t0"] until spec["deadline"]
    (monotonic times); returns their results and this process's loop-lag probes."""
    results: list[StreamResult] = []
    lag: list[float] = []
    done = asyncio.Event()
    concurrency = spec["concurrency"]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)

    async def slot(session: aiohttp.ClientSession, j: int) -> None:
        await asyncio.sleep(max(0.0, spec["t0"] + j / concurrency - time.monotonic()))
        n = 0
        while n == 0 or time.monotonic() < spec["deadline"]:
            key = f"k{spec['tag']}x{j}x{n}"
            body = stream_body(key, spec["sentences"], spec["sentence_tokens"], spec["rate"])
            if active is not None:
                active[0] += 1
            try:
                results.append(await read_stream(session, url, body, key))
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                # a reset, a timeout or an HTTP error is a result of the level, not a crash
                failed = StreamResult(key, terminal=f"client {type(exc).__name__}")
                failed.failure = {"client_error": f"{type(exc).__name__}: {exc}"[:300]}
                results.append(failed)
            finally:
                if active is not None:
                    active[0] -= 1
            n += 1

    prober = asyncio.create_task(probe_loop_lag(done, lag))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(slot(session, j) for j in slots))
    done.set()
    await prober
    return results, lag


def serve_clients(argv: list[str]) -> int:
    """`bench/orchestrator.py _clients`: one client process of --load-procs. Says `ready`, reads
    its spec (one JSON line: url, slots, level settings, t0, deadline) from stdin, runs the
    slots and writes one JSON line: results, loop-lag probes, its CPU seconds."""
    print("ready", flush=True)
    spec = json.loads(sys.stdin.readline())
    results, lag = asyncio.run(run_slots(spec["url"], spec["slots"], spec))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "results": [r.__dict__ for r in results],
        "lag": lag,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


async def run_level(
    url: str,
    upstream: Upstreams,
    pid: int,
    concurrency: int,
    args: argparse.Namespace,
    tag: str,
) -> Level:
    """`concurrency` slots, each running streams back to back until --duration has passed;
    slot starts are spread over one second so streams do not tick in lock-step. With
    --load-procs N > 1 the slots are dealt over N client processes (slot j to process j mod N)."""
    level = Level(concurrency)
    active = [0]
    done = asyncio.Event()
    procs = min(args.load_procs, concurrency)

    async def sample() -> None:
        while not done.is_set():
            shown = active[0] if procs == 1 else concurrency
            level.samples.append((time.monotonic(), rss_bytes(pid), shown))
            await asyncio.sleep(0.05)

    spec: dict[str, Any] = {
        "url": url,
        "concurrency": concurrency,
        "tag": tag,
        "sentences": args.sentences,
        "sentence_tokens": args.sentence_tokens,
        "rate": args.rate,
    }
    async with aiohttp.ClientSession() as session:
        stalls0 = await stall_counters(session, url)
        overflows0 = listen_overflows()
        cpu0 = cpu_seconds(pid)
        load0 = sum(cpu_seconds(p) for p in upstream.pids) + cpu_seconds(
            os.getpid(), children=False
        )
        clients = []
        if procs > 1:
            argv = [sys.executable, str(BENCH / "orchestrator.py"), "_clients"]
            for _ in range(procs):
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=ROOT,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    limit=2**30,
                )
                clients.append(proc)
            for proc in clients:
                assert proc.stdout is not None
                if (await proc.stdout.readline()).strip() != b"ready":
                    raise RuntimeError("a client process did not start")
        t0 = time.monotonic() + (0.2 if procs > 1 else 0.0)
        spec.update(t0=t0, deadline=t0 + args.duration)
        sampler = asyncio.create_task(sample())
        client_cpu = 0.0
        if procs == 1:
            level.results, level.client_lag = await run_slots(
                url, list(range(concurrency)), spec, active
            )
        else:

            async def run_client(i: int, proc: asyncio.subprocess.Process) -> dict[str, Any]:
                mine = {**spec, "slots": list(range(i, concurrency, procs))}
                out, _ = await proc.communicate((json.dumps(mine) + "\n").encode())
                if proc.returncode != 0:
                    raise RuntimeError(f"client process {i} exited with {proc.returncode}")
                return json.loads(out)

            parts = await asyncio.gather(*(run_client(i, p) for i, p in enumerate(clients)))
            for part in parts:
                level.results += [StreamResult(**r) for r in part["results"]]
                level.client_lag += part["lag"]
                client_cpu += part["cpu_s"]
        level.wall_s = time.monotonic() - t0
        level.cpu_s = cpu_seconds(pid) - cpu0
        level.load_cpu_s = (
            sum(cpu_seconds(p) for p in upstream.pids)
            + cpu_seconds(os.getpid(), children=False)
            + client_cpu
            - load0
        )
        level.listen_overflows = listen_overflows() - overflows0
        done.set()
        await sampler
        level.log = await upstream.collect_log(session)
        stalls1 = await stall_counters(session, url)
        level.stalls = {k: stalls1[k] - stalls0[k] for k in stalls0}
    level.load_procs = procs
    return level


@dataclass
class Figures:
    concurrency: int
    streams: int
    frames: int
    unmatched: int
    terminals: dict[str, int]
    tokens: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    cpu_per_1k_tokens_s: float
    cpu_percent: float  # the orchestrator's CPU time / wall time
    load_cpu_percent: float  # the same for the upstream and the client together
    peak_rss_mb: float
    mem_per_stream_kb: float
    rate_per_stream: float
    engine_lag_p99_ms: float
    client_lag_p99_ms: float  # the client processes' event-loop lag (100 ms probes)
    load_procs: int
    kept_up: bool  # the generator kept its rate and its lag under --max-load-lag-ms
    detector_calls: int
    wall_s: float
    first_failure: dict[str, Any] | None


def analyse(level: Level, args: argparse.Namespace, baseline_rss: int) -> Figures:
    log = level.log
    added: list[float] = []
    unmatched = 0
    frames = 0
    rates: list[float] = []
    for res in level.results:
        sent = log["tokens"].get(res.key)
        if not sent:
            unmatched += len(res.frames)
            continue
        if len(sent) > 1 and sent[-1] > sent[0]:
            rates.append((len(sent) - 1) / (sent[-1] - sent[0]))
        ends: list[int] = []  # text offset after each token
        at = 0
        for tok in script(res.key, args.sentences, args.sentence_tokens)[: len(sent)]:
            at += len(tok)
            ends.append(at)
        for recv, start, end, text in res.frames:
            if end <= start:
                continue  # the empty closing frame carries no text to judge
            frames += 1
            last_token = next((i for i, e in enumerate(ends) if e >= end), None)
            markers = [f"{m[2]}/{m[1]}" for m in MARKER.finditer(text)]
            replies = [log["replies"].get(m) for m in markers]
            if last_token is None or not markers or None in replies:
                unmatched += 1
                continue
            available = max(sent[last_token], *replies)
            added.append((recv - available) * 1000)
    tokens = sum(len(v) for v in log["tokens"].values())
    peak_rss = max((s[1] for s in level.samples), default=0)
    peak_active = max((s[2] for s in level.samples), default=0) or level.concurrency
    lag = log["lag"]
    engine_lag_ms = pct(lag, 0.99) * 1000 if lag else math.nan
    client_lag_ms = pct(level.client_lag, 0.99) * 1000 if level.client_lag else 0.0
    rate = statistics.fmean(rates) if rates else math.nan
    kept_up = (
        not (engine_lag_ms > args.max_load_lag_ms)  # NaN (no pacing) counts as kept up
        and client_lag_ms <= args.max_load_lag_ms
        and (args.rate <= 0 or rate >= 0.95 * args.rate)
    )
    return Figures(
        concurrency=level.concurrency,
        streams=len(level.results),
        frames=frames,
        unmatched=unmatched,
        terminals=dict(Counter(r.terminal or "(none)" for r in level.results)),
        tokens=tokens,
        p50_ms=pct(added, 0.5) if added else math.nan,
        p90_ms=pct(added, 0.9) if added else math.nan,
        p99_ms=pct(added, 0.99) if added else math.nan,
        max_ms=max(added) if added else math.nan,
        cpu_per_1k_tokens_s=level.cpu_s / tokens * 1000 if tokens else math.nan,
        cpu_percent=level.cpu_s / level.wall_s * 100,
        load_cpu_percent=level.load_cpu_s / level.wall_s * 100,
        peak_rss_mb=peak_rss / 2**20,
        mem_per_stream_kb=(peak_rss - baseline_rss) / peak_active / 1024,
        rate_per_stream=rate,
        engine_lag_p99_ms=engine_lag_ms,
        client_lag_p99_ms=client_lag_ms,
        load_procs=level.load_procs,
        kept_up=kept_up,
        detector_calls=log["detector_calls"],
        wall_s=level.wall_s,
        first_failure=next((r.failure for r in level.results if r.failure), None),
    )


async def regex_cost_us() -> float:
    """The in-process regex detector's time for one sentence, as the orchestrator calls it."""
    import detectors

    det = detectors.build("regex")
    text = " " + "".join(script("kbench", 1, 10))
    for _ in range(50):
        await det.detect([text])
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        await det.detect([text])
    return (time.perf_counter() - t0) / n * 1e6


async def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    levels = [int(x) for x in args.levels.split(",") if x]
    if args.load_procs is None:
        # enough processes that each carries at most 256 streams, one per core at most
        args.load_procs = max(1, min(os.cpu_count() or 1, math.ceil(max(levels) / 256)))
    regex_us = await regex_cost_us()
    upstream = Upstreams(tmp, args.load_procs)
    orch: Proc | None = None
    try:
        max_tokens = max(args.sentences * args.sentence_tokens, 64)
        prof = [sys.executable, "-m", "cProfile", "-o", args.profile, "-m", "orchestrator"]
        orch = start_orchestrator(
            tmp,
            orchestrator_config(upstream.url, max_new_tokens=max_tokens, workers=args.workers),
            [*prof, "serve"] if args.profile else None,
        )
        await wait_ready(orch.url)
        idle_cpu = math.nan
        if args.idle:
            idle0 = cpu_seconds(orch.pid)
            await asyncio.sleep(args.idle)
            idle_cpu = (cpu_seconds(orch.pid) - idle0) / args.idle
        # warm-up: first requests, regex compilation, connection pools
        async with aiohttp.ClientSession() as session:
            for i in range(3):
                await read_stream(
                    session, orch.url, stream_body(f"kwarm{i}", 3, args.sentence_tokens, 0), ""
                )
            await asyncio.gather(
                *(
                    read_stream(
                        session,
                        orch.url,
                        stream_body(f"kwarmc{i}", 3, args.sentence_tokens, args.rate),
                        "",
                    )
                    for i in range(8)
                )
            )
            await upstream.collect_log(session)
        await asyncio.sleep(0.5)
        baseline_rss = rss_bytes(orch.pid)
        print(
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.2f}; orchestrator pid {orch.pid} "
            f"(workers: {args.workers}), RSS after "
            f"warm-up {baseline_rss / 2**20:.1f} MiB; streams of {args.sentences} sentences x "
            f"{args.sentence_tokens} tokens at {args.rate:g} tokens/s; {args.duration:g} s per "
            f"level; regex detector in-process: {regex_us:.1f} us per sentence; load generator: "
            f"{args.load_procs} upstream process(es) on one port, clients in "
            f"{args.load_procs} process(es)"
            + (f"; idle CPU {idle_cpu * 100:.2f}%" if args.idle else ""),
            flush=True,
        )
        figures: list[Figures] = []
        for c in levels:
            level = await run_level(orch.url, upstream, orch.pid, c, args, f"{c}")
            f = analyse(level, args, baseline_rss)
            figures.append(f)
            print(
                f"  {c:>4} streams: {f.streams} streams, {f.frames} frames, "
                + (
                    f"p50 {f.p50_ms:.2f} ms, p99 {f.p99_ms:.2f} ms, "
                    if f.kept_up
                    else "no latency figure (the load generator did not keep up), "
                )
                + f"{f.rate_per_stream:.1f} tok/s per stream, generator lag p99: upstream "
                f"{f.engine_lag_p99_ms:.1f} ms, clients {f.client_lag_p99_ms:.1f} ms, "
                f"wall {f.wall_s:.1f} s",
                flush=True,
            )
            print(
                f"         {stall_line(level.stalls)}; listen-queue overflows on this machine: "
                f"{level.listen_overflows}",
                flush=True,
            )
            if orch.popen.poll() is not None:
                raise RuntimeError(f"orchestrator exited:\n{orch.log_tail()}")
        load_after = os.getloadavg()[0]
    finally:
        if orch is not None:
            orch.stop()
        upstream.stop()
    print_table(figures, args)
    return {
        "cpus": os.cpu_count(),
        "load_average_after": load_after,
        "rate": args.rate,
        "sentences": args.sentences,
        "sentence_tokens": args.sentence_tokens,
        "duration_s": args.duration,
        "regex_us_per_sentence": regex_us,
        "idle_cpu_fraction": idle_cpu,
        "baseline_rss_mb": baseline_rss / 2**20,
        "levels": [f.__dict__ for f in figures],
        "targets": targets(figures, args),
    }


def targets(figures: list[Figures], args: argparse.Namespace) -> dict[str, bool | None]:
    by = {f.concurrency: f for f in figures}
    out: dict[str, bool | None] = {"p50_lt_2ms_at_64": None, "p99_lt_100ms_at_256": None}
    if 64 in by:
        out["p50_lt_2ms_at_64"] = by[64].p50_ms < 2.0
    if 256 in by:
        f = by[256]
        out["p99_lt_100ms_at_256"] = (
            f.kept_up
            and f.p99_ms < 100.0
            and f.rate_per_stream >= 0.95 * args.rate
            and f.unmatched == 0
        )
    return out


def print_table(figures: list[Figures], args: argparse.Namespace) -> None:
    header = (
        "streams",
        "frames",
        "added p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "CPU s/1k tok",
        "orch CPU %",
        "load CPU %",
        "peak RSS MiB",
        "KiB/stream",
        "tok/s/stream",
        "gen lag p99 ms",
        "terminals",
    )
    rows = []
    for f in figures:
        terms = ", ".join(f"{k} {v}" for k, v in sorted(f.terminals.items()))
        if f.unmatched:
            terms += f"; {f.unmatched} unmatched frames"
        # a latency figure only where the generator kept up: otherwise it measures the generator
        shown = (
            (f"{f.p50_ms:.2f}", f"{f.p90_ms:.2f}", f"{f.p99_ms:.2f}", f"{f.max_ms:.2f}")
            if f.kept_up
            else ("(lagged)", "-", "-", "-")
        )
        rows.append(
            (
                str(f.concurrency),
                str(f.frames),
                *shown,
                f"{f.cpu_per_1k_tokens_s:.3f}",
                f"{f.cpu_percent:.0f}",
                f"{f.load_cpu_percent:.0f}",
                f"{f.peak_rss_mb:.1f}",
                f"{f.mem_per_stream_kb:.1f}",
                f"{f.rate_per_stream:.1f}",
                f"{f.engine_lag_p99_ms:.1f} / {f.client_lag_p99_ms:.1f} ({f.load_procs}p)",
                terms,
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, *rows]:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    for f in figures:
        if f.first_failure:
            print(f"{f.concurrency} streams, first error/failed event: {f.first_failure}")
    print(
        "(added = client receive - max(last token sent, detector replies); orch CPU % = the "
        "orchestrator's CPU time / wall time, 100 = one core; load CPU % = upstream + client; "
        "gen lag = the load generator's p99 lateness: upstream token sends / client event loop, "
        f"(Np) = its processes; latency is shown only when both stay <= {args.max_load_lag_ms:g} "
        "ms and the streams kept 95% of the rate)"
    )
    fine = [f.concurrency for f in figures if f.kept_up and f.p99_ms < 100 and not f.unmatched]
    print(
        f"largest level with p99 added latency < 100 ms (workers: {args.workers}): "
        + (str(max(fine)) if fine else "none")
    )
    print()
    verdict = targets(figures, args)
    names = {
        "p50_lt_2ms_at_64": "p50 added latency < 2 ms at 64 streams",
        "p99_lt_100ms_at_256": (
            f"256 streams at {args.rate:g} tokens/s each (>= 95% kept) with p99 < 100 ms"
        ),
    }
    for k, ok in verdict.items():
        status = "not measured" if ok is None else "MET" if ok else "NOT MET"
        print(f"target: {names[k]}: {status}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        return serve_upstream(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_clients":
        return serve_clients(sys.argv[2:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,64,256", help="concurrent streams per level")
    parser.add_argument("--duration", type=float, default=15, help="seconds per level")
    parser.add_argument("--rate", type=float, default=50, help="tokens/s per stream")
    parser.add_argument("--sentences", type=int, default=20, help="sentences per stream")
    parser.add_argument("--sentence-tokens", type=int, default=10, help="tokens per sentence")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--idle", type=float, default=0, help="first measure the idle CPU use for this many s"
    )
    parser.add_argument("--profile", default=None, help="run the orchestrator under cProfile")
    parser.add_argument(
        "--workers", type=int, default=1, help="server.workers (CPU and RSS: all processes)"
    )
    parser.add_argument(
        "--load-procs",
        type=int,
        default=None,
        help="processes for the fake upstream and, as many, for the clients (default: one per "
        "256 streams of the largest level, at most one per CPU)",
    )
    parser.add_argument(
        "--max-load-lag-ms",
        type=float,
        default=25,
        help="latency figures are printed only where the generator's p99 lag stays below this",
    )
    add_server_option(parser)
    args = parser.parse_args()
    SERVER_OVERRIDES.update(server_overrides(args.server))
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        summary = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
