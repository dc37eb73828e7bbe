"""How fast bench/stream_clients.py's client processes read NDJSON streams: 1 process against K.

    python bench/client_rate.py [--streams 64,256] [--lines 128] [--clients 1,2,4]
                                [--step-ms 0,8] [--repeat 1]

Why. bench/engine.py measures the engine by its streams' line arrival times; a client that cannot
read the lines as fast as they come adds its own lag to the measured step. On a CPU machine the
tiny engine is itself the bottleneck, so that cannot be seen against it: here a minimal aiohttp
server (a subprocess) streams `--lines` lines of the engine's shape per stream, every stream in
lock-step, one line each per `--step-ms` (0: as fast as the server can write, a chunk write a
line), and the same
`read_streams` as the benches reads them with each `--clients` count.

Per run: lines read per second of wall (step 0: the clients' reading rate, the server's writing
shares the machine), the clients' lag per line (its arrival less the time the server wrote it,
which the server puts in the line's token id; p50 and p99), the step the clients measured (1 / per-stream lines/s: with a paced server
the measured step less `--step-ms` is the clients' lag), the clients' CPU microseconds per line
and their CPU share (CPU seconds / (clients x wall)). Of `--repeat` runs, the one with the least
median lag counts (on a shared machine other processes only ever add lag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stream_clients import level_figures, read_streams
from orchestrator.clients.managed import free_port


def data_line(k: int, lines: int) -> tuple[bytes, bytes]:
    """Line `k` of a stream of `lines`, in the engine's shape (one token a line), split where
    its token id goes: the server writes there the time it wrote the line (perf_counter, in
    microseconds), so a client's lag per line is its arrival time less that."""
    data = {
        "token_ids": [0],
        "text": " the",
        "generated_token_count": k,
        "input_token_count": 16,
        "finish_reason": "length" if k == lines else None,
    }
    head, tail = json.dumps({"data": data, "complete_final": False}).split("[0]", 1)
    return (head + "[").encode(), ("]" + tail + "\n").encode()


def serve(port: int, step_ms: float) -> None:
    """The stand-in engine: POST /v1/generate streams `max_new_tokens` data lines, then
    `complete_final`; GET /health. One ticker task writes every open stream's next line per
    step (pre-encoded), as an engine step emits a token per row: the server's cost per line is a
    chunk write, far below a client's read, so the clients' reading is what is measured."""
    from aiohttp import web

    open_streams: list[list[Any]] = []  # [response, lines, lines written, done future]
    encoded: dict[int, list[tuple[bytes, bytes]]] = {}

    async def generate(request: web.Request) -> web.StreamResponse:
        lines = int((await request.json())["max_new_tokens"])
        if lines not in encoded:
            encoded[lines] = [data_line(k, lines) for k in range(1, lines + 1)]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        done = asyncio.get_running_loop().create_future()
        open_streams.append([resp, lines, 0, done])
        await done
        await resp.write(b'{"complete_final": true}\n')
        await resp.write_eof()
        return resp

    async def ticker() -> None:
        tick = time.perf_counter()
        while True:
            if not open_streams:
                await asyncio.sleep(0.0005)
                tick = time.perf_counter()
                continue
            for stream in list(open_streams):
                resp, lines, written, done = stream
                head, tail = encoded[lines][written]
                await resp.write(b"%s%d%s" % (head, time.perf_counter_ns() // 1000, tail))
                stream[2] = written + 1
                if written + 1 == lines:
                    open_streams.remove(stream)
                    done.set_result(None)
            tick += step_ms / 1000
            await asyncio.sleep(max(tick - time.perf_counter(), 0.0))

    async def start_ticker(app: web.Application) -> Any:
        task = asyncio.create_task(ticker())
        yield
        task.cancel()

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/generate", generate)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(start_ticker)
    web.run_app(app, host="127.0.0.1", port=port, print=None, backlog=1024)


def start_server(step_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--step-ms", str(step_ms)]
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the stand-in server did not start in 60 s")


def run(url: str, streams: int, lines: int, clients: int) -> dict[str, Any]:
    requests = [("/v1/generate", {"max_new_tokens": lines}) for _ in range(streams)]
    read = read_streams(url, requests, clients)
    r = level_figures(read, "greedy", streams)
    r["lines_per_s"] = r["aggregate_tokens_per_s"]
    r["step_ms"] = 1000 / r["per_stream_tokens_per_s"] if r["per_stream_tokens_per_s"] else 0.0
    r["client_cpu_us_per_line"] = read.cpu_s * 1e6 / r["tokens_total"]
    lags = sorted(
        at - written / 1e6
        for stream in read.streams
        for (at, _), written in zip(stream["arrivals"], stream["token_ids"], strict=True)
    )
    r["lag_ms"] = {q: 1000 * lags[min(int(q * len(lags)), len(lags) - 1)] for q in (0.5, 0.99)}
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--lines", type=int, default=128)
    parser.add_argument("--clients", default="1,2,4")
    parser.add_argument("--step-ms", default="0,8")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, float(args.step_ms))
        return
    print(f"# client_rate: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}")
    for step_ms in [float(x) for x in args.step_ms.split(",")]:
        proc, url = start_server(step_ms)
        try:
            for streams in [int(x) for x in args.streams.split(",")]:
                for clients in [int(x) for x in args.clients.split(",")]:
                    runs = [run(url, streams, args.lines, clients) for _ in range(args.repeat)]
                    # other processes only ever add lag (and, unpaced, cut the rate)
                    r = min(runs, key=lambda x: (x["lag_ms"][0.5], -x["lines_per_s"]))
                    print(
                        f"server step {step_ms:4.1f} ms {streams:4} streams x {args.lines} lines, "
                        f"{clients} clients: {r['lines_per_s']:8.0f} lines/s, measured step "
                        f"{r['step_ms']:6.2f} ms, lag p50 {r['lag_ms'][0.5]:5.2f} ms p99 "
                        f"{r['lag_ms'][0.99]:6.2f} ms, client CPU {r['client_cpu_us_per_line']:5.1f} "
                        f"us/line, CPU share {r['client_cpu_share']:.0%}, load average "
                        f"{os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
        finally:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
