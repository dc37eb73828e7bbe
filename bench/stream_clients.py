"""Concurrent HTTP streams read by client subprocesses: the client of the benches that measure a
server by the times its streams' lines arrive (bench/engine.py, its `transformers serve` anchor in
bench/anchors.py, bench/engine_host.py).

Why subprocesses. One asyncio client process reading 256 NDJSON streams of 128 lines spent 22 us
of CPU per line (aiohttp + a JSON parse; measured on a 2-core machine): at the 25-30k tokens/s an
H200 serves at 256 streams that process is 55-80% busy, and a reader that falls behind adds its
scheduling lag to every time between tokens it measures. So a level's streams are spread over
`clients` processes (contiguous shares, in request order), each an asyncio loop of its own.

How they start together. Each client gets its requests as one JSON line on stdin, imports, opens
its session and makes one GET /health (its first-use costs, out of the measure), prints "ready",
and sends all its requests when the parent writes "go" to every client (a barrier). Times are
`time.perf_counter`, CLOCK_MONOTONIC on Linux: comparable across the processes of one machine.

Each stream's record: `sent` (its request sent), `arrivals` ([time, tokens so far] per line that
carries tokens), `end` (its last line read), `tokens` and, for the engine's NDJSON, `token_ids`.
Each client's CPU seconds (`time.process_time`) from "go" to its last stream's end, and from its
first token line to its end, come back too: a reader can see when the clients saturate.

This module imports only aiohttp, orjson and the standard library: a client starts in a fraction
of a second, without torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

#: Most streams one client process reads (the default split): at ~22 us of CPU per line, 64
#: streams at a 4 ms step are ~16k lines/s, about a third of a core, so a client keeps up with
#: every line as it comes; 256 streams in one process would need more than a whole core.
STREAMS_PER_CLIENT = 64
#: Cores left to the server when the default picks the clients: its engine's worker thread and
#: its HTTP event loop. More clients than the rest would compete with what they measure.
SERVER_CORES = 2


def default_clients(streams: int) -> int:
    """Enough client processes that each reads at most `STREAMS_PER_CLIENT` streams, at most the
    usable CPUs less `SERVER_CORES` (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(math.ceil(streams / STREAMS_PER_CLIENT), cpus - SERVER_CORES))


@dataclass
class Streams:
    """What the clients read: one record per request, in request order (see the module)."""

    streams: list[dict[str, Any]]
    clients: int
    cpu_s: float  # all clients' CPU seconds, each from "go" to its last stream's end
    cpu_from_first_token_s: float  # the same, each from its first token line

    @property
    def start(self) -> float:
        return min(s["sent"] for s in self.streams)

    @property
    def end(self) -> float:
        return max(s["end"] for s in self.streams)

    @property
    def wall_s(self) -> float:
        """From the first request sent to the last stream's end."""
        return self.end - self.start

    @property
    def cpu_share(self) -> float:
        """The clients' CPU seconds over (clients x wall): near 1, the clients were saturated
        and what they measured includes their own lag."""
        return self.cpu_s / (self.clients * self.wall_s) if self.wall_s > 0 else 0.0


def read_streams(
    url: str,
    requests: list[tuple[str, dict[str, Any]]],
    clients: int | None = None,
    protocol: str = "ndjson",
    timeout_s: float = 600.0,
) -> Streams:
    """POST every (path, body) of `requests` to `url` at once, from `clients` client processes
    (default: `default_clients`), and read every stream to its end. `protocol`: "ndjson" (the
    engine's /v1/generate) or "sse" (OpenAI streamed chat completions). Raises RuntimeError when
    a client fails (a stream's error, an HTTP status, a stream cut short)."""
    count = max(1, min(clients or default_clients(len(requests)), len(requests)))
    shares = [
        len(requests) // count + (1 if i < len(requests) % count else 0) for i in range(count)
    ]
    procs: list[subprocess.Popen[str]] = []
    try:
        first = 0
        for share in shares:
            proc = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            spec = {"url": url, "protocol": protocol, "requests": requests[first : first + share]}
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            first += share
        for proc in procs:  # every client connected and warm
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a stream client did not start (exit {proc.wait()})")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        streams: list[dict[str, Any]] = []
        cpu = from_first = 0.0
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"a stream client exited with {proc.returncode}")
            reply = json.loads(out)
            streams.extend(reply["streams"])
            cpu += reply["cpu_s"]
            from_first += reply["cpu_from_first_token_s"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Streams(streams, count, cpu, from_first)


def level_figures(read: Streams, decoding: str, concurrency: int) -> dict[str, Any]:
    """A level's figures from its streams' times (also the `transformers serve` anchor's, so
    both are measured alike): aggregate tok/s over the wall from the first request sent to the
    last stream's end, TTFT from each request sent to its first token, per-stream tok/s from a
    stream's first token to its end, and the clients' CPU share (near 1: saturated, their lag
    is in these figures)."""
    results = [
        {
            "start": s["sent"],
            "first": s["arrivals"][0][0] if s["arrivals"] else s["end"],
            "end": s["end"],
            "tokens": s["tokens"],
        }
        for s in read.streams
    ]
    wall = read.wall_s
    total = sum(r["tokens"] for r in results)
    ttfts = [r["first"] - r["start"] for r in results]
    per_stream = [
        (r["tokens"] - 1) / (r["end"] - r["first"]) for r in results if r["end"] > r["first"]
    ]
    return {
        "decoding": decoding,
        "concurrency": concurrency,
        "tokens_total": total,
        "wall_s": wall,
        "aggregate_tokens_per_s": total / wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
        "per_stream_tokens_per_s": statistics.fmean(per_stream) if per_stream else 0.0,
        "clients": read.clients,
        "client_cpu_s": read.cpu_s,
        "client_cpu_share": read.cpu_share,
        # > 1: the engine sent several tokens per line, i.e. its delivery found the stream
        # behind (the API process or this client did not keep up with the steps)
        "tokens_per_line": total / max(1, sum(len(s["arrivals"]) for s in read.streams)),
        # random weights: greedy repeats one token (a host path that grows with repetition
        # would show as greedy slower than sampling: issue 35)
        "distinct_tokens_p50": statistics.median(
            len(set(s["token_ids"])) for s in read.streams if s.get("token_ids") is not None
        )
        if any(s.get("token_ids") is not None for s in read.streams)
        else None,
    }


def client_note(r: dict[str, Any]) -> str:
    """`, N clients at X% CPU, T tokens per line[, D distinct tokens per stream]` of a level's
    line: the clients' CPU share, how far behind the engine's delivery found the streams, and
    (NDJSON) how repetitive the text was."""
    note = (
        f", {r['clients']} client{'s' if r['clients'] > 1 else ''} at "
        f"{r['client_cpu_share']:.0%} CPU, {r['tokens_per_line']:.2f} tokens per line"
    )
    if r.get("distinct_tokens_p50") is not None:
        note += f", {r['distinct_tokens_p50']:g} distinct tokens per stream"
    return note


# ----- the client process -----------------------------------------------------------------------


async def _client(url: str, protocol: str, requests: list[list[Any]]) -> dict[str, Any]:
    """Read `requests` concurrently after the "go" line; the reply of `read_streams`' child."""
    import aiohttp
    import orjson

    cpu_at_first_token: list[float] = []

    async def ndjson(resp: aiohttp.ClientResponse, record: dict[str, Any]) -> None:
        """The engine's /v1/generate: one JSON object a line, `complete_final` last."""
        ids: list[int] = record["token_ids"]
        async for raw in resp.content:  # line by line, as the orchestrator reads
            item = orjson.loads(raw)
            if item.get("complete_final"):
                return
            if "error" in item:
                raise RuntimeError(item["error"])
            if "data" in item:
                now = time.perf_counter()
                if not cpu_at_first_token:
                    cpu_at_first_token.append(time.process_time())
                ids.extend(item["data"]["token_ids"])
                record["arrivals"].append((now, item["data"]["generated_token_count"]))
        raise RuntimeError("stream ended without complete_final")

    async def sse(resp: aiohttp.ClientResponse, record: dict[str, Any]) -> None:
        """OpenAI streamed chat completions: a token per content delta; the usage's count of
        completion tokens where the server sends one."""
        chunks = 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                record["tokens"] = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if not cpu_at_first_token:
                        cpu_at_first_token.append(time.process_time())
                    record["arrivals"].append((time.perf_counter(), chunks))
        if record["tokens"] is None:
            record["tokens"] = chunks

    read = {"ndjson": ndjson, "sse": sse}[protocol]

    async def one(session: aiohttp.ClientSession, path: str, body: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"arrivals": [], "tokens": None}
        if protocol == "ndjson":
            record["token_ids"] = []
        record["sent"] = time.perf_counter()
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path}: HTTP {resp.status} {await resp.text()}")
            await read(resp, record)
        record["end"] = time.perf_counter()
        if protocol == "ndjson":
            record["tokens"] = len(record["token_ids"])
        return record

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(url + "/health") as resp:  # this client's first-use costs
            await resp.read()
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await asyncio.to_thread(sys.stdin.readline)
        cpu = time.process_time()
        streams = await asyncio.gather(*(one(session, path, body) for path, body in requests))
        done = time.process_time()
    first = cpu_at_first_token[0] if cpu_at_first_token else done
    return {"streams": streams, "cpu_s": done - cpu, "cpu_from_first_token_s": done - first}


def _main() -> None:
    spec = json.loads(sys.stdin.readline())
    reply = asyncio.run(_client(spec["url"], spec["protocol"], spec["requests"]))
    sys.stdout.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    _main()
