"""Event-loop lag and fairness under large detection requests (issue 20, items 1 and 4).
Not part of `make test`.

    .venv/bin/python bench/loop_lag.py [--mb 1] [--concurrent 4] [--small 40] [--json out.json]

One orchestrator process (`python -m orchestrator serve`) with the built-in `regex` (`pii`) and
`profanity` (`hap`) detectors in-process on the `sentence` chunker, against the fake engine of
bench/orchestrator.py. A probe in a process of its own GETs /health back to back (every
--probe-ms) and records each answer's latency: a stalled event loop shows as a slow /health.
The orchestrator's own `guardstream_event_loop_lag_seconds` histogram (a probe every 100 ms)
is read before and after each phase too. Phases:

  idle      the probe alone: the anchor every other figure is read against;
  pii       --concurrent requests at once to /api/v2/text/detection/content, each --mb MB of
            PII-dense text ("Mail jo@example.com or call 555-123-4567 today. " repeated) with
            `pii`: /health latency p50/p99/max while they run, and their own times;
  inputs    (with --inputs) the pii phase's text as the input of --concurrent unary
            generation requests with `pii` on the input: judged as an input (refused, since
            it holds PII), where a window across every sentence end doubled the work before
            issue 33; their wall time and /health latency;
  fairness  one --mb MB request of "Hello there friend. " with `hap` (the attack of issue 20
            item 1: ~50,000 sentences), and while it runs, small requests one after another:
            /content with one rude sentence and `hap`, and a generation stream with `hap` on its
            output; their latency p50/p99/max and how many failed (and with what).

Target (issue 20): /health p99 < 50 ms during the pii phase. Figures are absolute times on
this machine; compare phases of one run (idle is the anchor), never runs on other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# bench/orchestrator.py would shadow the orchestrator package: import it as bench.orchestrator
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(ROOT))

from bench.orchestrator import (  # noqa: E402 (after the sys.path fix)
    MODEL,
    cpu_seconds,
    prompt_for,
    start_orchestrator,
    start_upstream,
    wait_ready,
)

CONTENT = "/api/v2/text/detection/content"
STREAM = "/api/v1/task/server-streaming-classification-with-text-generation"
UNARY = "/api/v1/task/classification-with-text-generation"
PII_SENTENCE = "Mail jo@example.com or call 555-123-4567 today. "
HAP_SENTENCE = "Hello there friend. "
RUDE = "You are a stupid fucking idiot."


def config(upstream: str) -> dict[str, Any]:
    return {
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "max_request_bytes": 16 << 20,
            # the content requests are --mb MB of text: past the default (100,000 characters)
            "max_detection_chars": 16 << 20,
            "request_timeout_s": 600,
        },
        "models": {
            MODEL: {
                "backends": [{"type": "native", "url": upstream}],
                "migration": {"limit": 0},
                # an input as large as the content requests (the inputs phase)
                "limits": {"max_new_tokens": 64, "max_input_chars": 16_000_000},
            }
        },
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {
            # generous: a 1 MB request takes many seconds here, and the figures are about
            # what it does to the others, not whether it fits a deadline
            "pii": {"builtin": "regex", "chunker_id": "sentence", "timeout_s": 600},
            "hap": {"builtin": "profanity", "chunker_id": "sentence", "timeout_s": 600},
        },
    }


def percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    s = sorted(samples)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 1)

    return {"n": len(s), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(s[-1] * 1000, 1)}


# -- the probe, in a process of its own --------------------------------------------------------


def probe_main(argv: list[str]) -> int:
    """GET /health every --interval-ms until stdin closes; prints the latencies (s) as JSON."""
    parser = argparse.ArgumentParser(prog="bench/loop_lag.py _probe")
    parser.add_argument("--url", required=True)
    parser.add_argument("--interval-ms", type=float, default=10)
    args = parser.parse_args(argv)

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        samples: list[float] = []

        async def watch_stdin() -> None:
            await reader.read()
            stop.set()

        watcher = asyncio.create_task(watch_stdin())
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                started = time.perf_counter()
                async with session.get(args.url + "/health") as r:
                    await r.read()
                samples.append(time.perf_counter() - started)
                try:
                    await asyncio.wait_for(stop.wait(), args.interval_ms / 1000)
                except TimeoutError:
                    pass
        watcher.cancel()
        return samples

    print(json.dumps(asyncio.run(run())), flush=True)
    return 0


class Probe:
    def __init__(self, url: str, interval_ms: float) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "_probe", "--url", url, "--interval-ms", str(interval_ms)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> list[float]:
        out, _ = self.popen.communicate("", timeout=60)
        return json.loads(out)


# -- the load ----------------------------------------------------------------------------------


async def lag_histogram(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The orchestrator's event-loop lag histogram: cumulative counts by upper bound."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("guardstream_event_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def over(before: dict[str, float], after: dict[str, float], bound: str) -> dict[str, float]:
    total = after.get("+Inf", 0) - before.get("+Inf", 0)
    under = after.get(bound, 0) - before.get(bound, 0)
    return {"probes": total, f"over_{bound}s": total - under}


async def content(session: aiohttp.ClientSession, url: str, text: str, det: str) -> tuple:
    started = time.perf_counter()
    async with session.post(url + CONTENT, json={"content": text, "detectors": {det: {}}}) as r:
        body = await r.read()
        status = r.status
    seconds = time.perf_counter() - started
    parsed = json.loads(body)
    detail = len(parsed["detections"]) if status == 200 else parsed.get("details", "")
    return status, seconds, detail


async def guarded_input(session: aiohttp.ClientSession, url: str, text: str) -> tuple:
    """A unary generation request whose input `pii` judges; (status, seconds, detections)."""
    body = {
        "model_id": MODEL,
        "inputs": text,
        "guardrail_config": {"input": {"models": {"pii": {}}}},
        "text_gen_parameters": {"max_new_tokens": 16},
    }
    started = time.perf_counter()
    async with session.post(url + UNARY, json=body) as r:
        parsed = json.loads(await r.read())
        status = r.status
    seconds = time.perf_counter() - started
    found = (parsed.get("token_classification_results") or {}).get("input") or []
    return status, seconds, len(found) if status == 200 else parsed.get("details", "")


async def stream(session: aiohttp.ClientSession, url: str) -> tuple:
    body = {
        "model_id": MODEL,
        "inputs": prompt_for("small", 2, 6, 0.0),  # two sentences of six tokens, unpaced
        "guardrail_config": {"output": {"models": {"hap": {}}}},
        "text_gen_parameters": {"max_new_tokens": 16},
    }
    started = time.perf_counter()
    async with session.post(url + STREAM, json=body) as r:
        text = await r.text()
        status = r.status
    seconds = time.perf_counter() - started
    events = [b for b in text.split("\n\n") if b.startswith("event:")]
    last = events[-1].split("\n")[0].removeprefix("event: ") if events else "?"
    if status == 200 and last != "completed":
        status = 599  # a failed stream after a 200
        last = events[-1]
    return status, seconds, last


async def concurrent_phase(
    session: aiohttp.ClientSession,
    url: str,
    pid: int,
    probe_ms: float,
    calls: list[Awaitable[tuple]],
) -> dict[str, Any]:
    """`calls` at once, with the /health probe running: its latency, the server's loop lag,
    the wall time, the server's CPU seconds (what other jobs on a shared machine move least)
    and each call's (status, seconds, detections)."""
    before = await lag_histogram(session, url)
    probe = Probe(url, probe_ms)
    cpu = cpu_seconds(pid)
    started = time.perf_counter()
    replies = await asyncio.gather(*calls)
    wall = time.perf_counter() - started
    cpu = cpu_seconds(pid) - cpu
    return {
        "health": percentiles(probe.stop()),
        "server_loop_lag": over(before, await lag_histogram(session, url), "0.05"),
        "wall_s": round(wall, 2),
        "server_cpu_s": round(cpu, 2),
        "requests": [{"status": s, "seconds": round(t, 2), "detections": d} for s, t, d in replies],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="loop_lag_"))
    upstream = start_upstream(tmp, log=False)
    orch = start_orchestrator(tmp, config(upstream.url))
    results: dict[str, Any] = {"mb": args.mb, "concurrent": args.concurrent}
    try:
        await wait_ready(orch.url, 120)
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # warm: one small call of each, so no phase pays a first-use cost
            await content(session, orch.url, RUDE + " jo@example.com", "pii")
            await content(session, orch.url, RUDE, "hap")
            await stream(session, orch.url)

            probe = Probe(orch.url, args.probe_ms)
            await asyncio.sleep(args.idle_s)
            results["idle"] = {"health": percentiles(probe.stop())}

            size = int(args.mb * 1_000_000)
            pii_text = (PII_SENTENCE * (size // len(PII_SENTENCE) + 1))[:size]
            calls = [content(session, orch.url, pii_text, "pii") for _ in range(args.concurrent)]
            results["pii"] = await concurrent_phase(
                session, orch.url, orch.pid, args.probe_ms, calls
            )
            if args.inputs:
                calls = [guarded_input(session, orch.url, pii_text) for _ in range(args.concurrent)]
                results["inputs"] = await concurrent_phase(
                    session, orch.url, orch.pid, args.probe_ms, calls
                )

            if not args.no_fairness:
                hap_text = (HAP_SENTENCE * (size // len(HAP_SENTENCE) + 1))[:size]
                before = await lag_histogram(session, orch.url)
                probe = Probe(orch.url, args.probe_ms)
                big = asyncio.create_task(content(session, orch.url, hap_text, "hap"))
                small_content: list[tuple] = []
                small_stream: list[tuple] = []
                while not big.done() and len(small_content) < args.small:
                    small_content.append(await content(session, orch.url, RUDE, "hap"))
                    small_stream.append(await stream(session, orch.url))
                status, seconds, detail = await big
                results["fairness"] = {
                    "health": percentiles(probe.stop()),
                    "server_loop_lag": over(before, await lag_histogram(session, orch.url), "0.05"),
                    "big": {"status": status, "seconds": round(seconds, 2), "detail": detail},
                    "small_content": summary(small_content),
                    "small_stream": summary(small_stream),
                }
    finally:
        orch.stop()
        upstream.stop()
    return results


def summary(replies: list[tuple]) -> dict[str, Any]:
    ok = [t for s, t, _ in replies if s == 200]
    failed = [(s, d) for s, _, d in replies if s != 200]
    return {
        "ok": len(ok),
        "failed": len(failed),
        "first_failure": failed[0] if failed else None,
        "latency": percentiles(ok),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_probe":
        sys.exit(probe_main(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=1.0, help="size of each large request (MB)")
    parser.add_argument("--concurrent", type=int, default=4, help="large PII requests at once")
    parser.add_argument("--small", type=int, default=40, help="most small requests of each kind")
    parser.add_argument("--probe-ms", type=float, default=10, help="pause between /health probes")
    parser.add_argument("--idle-s", type=float, default=3, help="length of the idle phase")
    parser.add_argument("--inputs", action="store_true", help="also the inputs phase")
    parser.add_argument("--no-fairness", action="store_true", help="skip the fairness phase")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
