"""Migration benchmark: SIGKILL the replica serving a stream, N times, and measure what the client
sees (issue 6).

For each kill: a stream runs on real engine processes (managed, `tiny-random` by default); after
a varying number of tokens the serving replica is SIGKILLed; the stream migrates to the other
replica. Reported:
  - gap: time between the last token received before the kill and the first token after it
    (p50, p90, max), and kill-to-next-token;
  - slowdown: total request time with one kill divided by the time of the same request without
    a kill, run just before it (per-pair ratios, so load from elsewhere on the machine cancels
    out as far as it can; the machine's load average is reported too);
  - exactness: every migrated stream's text equals the uninterrupted run's.

    .venv/bin/python bench/migration.py [--kills 20] [--model tiny-random] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.clients.backends import ReplicatedModelBackend, build_model_backends
from orchestrator.config import ModelConfig

PROMPT = "Once upon a time, in a land far away,"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def wait_all_healthy(backend: ReplicatedModelBackend, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r["status"] == "HEALTHY" and not r["quarantined"] for r in backend.info()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas not healthy: {backend.info()}")
        await asyncio.sleep(0.05)


async def timed_run(
    backend: ReplicatedModelBackend, params: GenerationParams, kill_after: int | None, rid: str
) -> dict[str, object]:
    """One request; with kill_after, SIGKILL its replica after that many tokens."""
    stream = backend.stream(GenerationRequest(PROMPT, params, request_id=rid))
    stamps: list[tuple[float, int]] = []  # (arrival, migrations at arrival)
    parts: list[str] = []
    killed_at = None
    t0 = time.perf_counter()
    async with stream:
        async for chunk in stream:
            now = time.perf_counter()
            stamps.append((now, stream.migrations))
            parts.append(chunk.text)
            if kill_after is not None and killed_at is None and len(parts) >= kill_after:
                replica = next(r for r in backend.replicas if r.name == stream.replicas_used[-1])
                assert replica.process is not None and replica.process.pid is not None
                killed_at = time.perf_counter()
                os.kill(replica.process.pid, signal.SIGKILL)
    total = time.perf_counter() - t0
    out: dict[str, object] = {
        "text": "".join(parts),
        "total_s": total,
        "tokens": stream.generated_token_count,
        "migrations": stream.migrations,
    }
    if killed_at is not None:
        before = [t for t, m in stamps if m == 0]
        after = [t for t, m in stamps if m >= 1]
        out["gap_s"] = (after[0] - before[-1]) if before and after else None
        out["kill_to_next_s"] = (after[0] - killed_at) if after else None
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--engine-log", default=os.devnull, help="engine output (default: none)")
    parser.add_argument("--verbose", action="store_true", help="show migration log lines")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    load_before = os.getloadavg()

    config = ModelConfig.model_validate(
        {
            "backends": [
                {
                    "type": "managed",
                    "model": args.model,
                    "device": args.device,
                    "replicas": args.replicas,
                }
            ],
            "migration": {"limit": 3, "stall_timeout_s": 10, "quarantine_s": 1},
        }
    )
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    with open(args.engine_log, "w") as engine_log:  # noqa: ASYNC230
        async with aiohttp.ClientSession() as session:
            backend = build_model_backends(
                {"m": config},
                session,
                registry=CollectorRegistry(),
                health_interval_s=0.25,
                engine_output=engine_log,
            )["m"]
            assert isinstance(backend, ReplicatedModelBackend)
            t = time.perf_counter()
            await backend.start()
            print(f"{args.replicas} replicas of {args.model} up in {time.perf_counter() - t:.1f} s")
            try:
                # warm-up, then the oracle
                for i in range(3):
                    await timed_run(backend, params, None, f"warm-{i}")
                oracle = await timed_run(backend, params, None, "oracle")
                n = int(oracle["tokens"])  # type: ignore[call-overload]
                print(f"uninterrupted: {n} tokens in {oracle['total_s']:.3f} s")
                runs, baselines = [], []
                for i in range(args.kills):
                    await wait_all_healthy(backend)
                    base = await timed_run(backend, params, None, f"base-{i}")
                    kill_after = 3 + (i * 7) % max(1, n // 2)
                    run = await timed_run(backend, params, kill_after, f"kill-{i}")
                    exact = run["text"] == oracle["text"]
                    baselines.append(base["total_s"])
                    runs.append({**run, "kill_after": kill_after, "exact": exact})
                    print(
                        f"kill {i + 1:2d}: after {kill_after:3d} tokens, gap "
                        f"{1000 * run['gap_s']:.1f} ms, total {run['total_s']:.3f} s "  # type: ignore[operator]
                        f"(uninterrupted {base['total_s']:.3f} s), migrations "
                        f"{run['migrations']}, exact {exact}"
                    )
            finally:
                await backend.close()

    gaps = [float(r["gap_s"]) for r in runs if r.get("gap_s") is not None]  # type: ignore[arg-type]
    k2n = [float(r["kill_to_next_s"]) for r in runs if r.get("kill_to_next_s") is not None]  # type: ignore[arg-type]
    with_kill = [float(r["total_s"]) for r in runs]  # type: ignore[arg-type]
    without = [float(b) for b in baselines]  # type: ignore[arg-type]
    ratios = [w / b for w, b in zip(with_kill, without, strict=True)]
    figures = {
        "model": args.model,
        "device": args.device,
        "kills": len(runs),
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_request": n,
        "gap_ms_p50": 1000 * statistics.median(gaps),
        "gap_ms_p90": 1000 * pct(gaps, 0.9),
        "gap_ms_max": 1000 * max(gaps),
        "kill_to_next_token_ms_p50": 1000 * statistics.median(k2n),
        "total_s_with_kill_median": statistics.median(with_kill),
        "total_s_without_kill_median": statistics.median(without),
        "slowdown_ratio_median_of_pairs": statistics.median(ratios),
        "slowdown_ratio_of_medians": statistics.median(with_kill) / statistics.median(without),
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "all_exact": all(r["exact"] for r in runs),
        "all_migrated_once": all(r["migrations"] == 1 for r in runs),
    }
    print(json.dumps(figures, indent=2))
    print(f"target gap p50 < 500 ms: {'met' if figures['gap_ms_p50'] < 500 else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "runs": runs}, indent=2))  # noqa: ASYNC240


if __name__ == "__main__":
    asyncio.run(main())
