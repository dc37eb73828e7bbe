"""Engine benchmark: aggregate tokens/s and time to first token for 1, 4 and 16 concurrent streams.

    python bench/engine.py [--model smollm2-135m] [--device auto|cpu|cuda] [--tokens 64]
                           [--concurrency 1,4,16] [--url http://HOST:PORT] [--json out.json]

Starts `python -m generation serve` as a subprocess (unless --url names a running engine) and
drives it over HTTP with aiohttp, like the orchestrator does. Each stream is a different chat
prompt (different lengths, so prefills are not trivially shared) and generates exactly --tokens
tokens (greedy, min_new_tokens = max_new_tokens). Aggregate throughput = all tokens / wall time
from the first request to the last `complete_final`. The headline is the ratio of 16-stream
aggregate throughput to 1-stream throughput, which continuous batching should make >= 4x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from generation.testing import start_engine_subprocess

QUESTIONS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a bicycle works.",
    "What are the main causes of the seasons on Earth? Please explain in detail.",
    "Describe your ideal weekend.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Tell me about the history of Rome, from its founding to the fall of the western empire.",
    "What is photosynthesis?",
    "Write a poem about the sea.",
    "How do airplanes stay in the air?",
    "List some tips for learning a new language quickly and effectively.",
    "What is the capital of France and what is it famous for?",
    "Explain recursion to a child.",
    "Describe a busy market in the morning.",
    "What makes a good friend?",
    "Summarise the plot of a detective novel you would like to read.",
]


async def one_stream(
    session: aiohttp.ClientSession, url: str, prompt: str, tokens: int
) -> dict[str, float]:
    body = {
        "prompt": prompt,
        "chat": True,
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
    }
    start = time.perf_counter()
    first: float | None = None
    generated = 0
    async with session.post(url + "/v1/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            item = json.loads(line)
            if "error" in item:
                raise RuntimeError(item["error"])
            if "data" in item:
                generated += len(item["data"]["token_ids"])
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None and generated == tokens, (generated, tokens)
    return {"start": start, "first": first, "end": end, "tokens": generated}


async def run_level(url: str, concurrency: int, tokens: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(concurrency)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, p, tokens) for p in prompts))
        wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in results)
    ttfts = [r["first"] - r["start"] for r in results]
    per_stream = [
        (r["tokens"] - 1) / (r["end"] - r["first"]) for r in results if r["end"] > r["first"]
    ]
    return {
        "concurrency": concurrency,
        "tokens_total": total,
        "wall_s": wall,
        "aggregate_tokens_per_s": total / wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_max_s": max(ttfts),
        "per_stream_tokens_per_s": statistics.fmean(per_stream) if per_stream else 0.0,
    }


async def bench(url: str, levels: list[int], tokens: int) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:  # warm-up: first-call allocations, caches
        await one_stream(session, url, "Hello!", 4)
    out = []
    for level in levels:
        result = await run_level(url, level, tokens)
        print(
            f"{level:>3} streams: {result['aggregate_tokens_per_s']:8.1f} tok/s aggregate, "
            f"{result['per_stream_tokens_per_s']:6.1f} tok/s per stream, "
            f"TTFT mean {result['ttft_mean_s'] * 1000:7.0f} ms (max {result['ttft_max_s'] * 1000:.0f} ms), "
            f"wall {result['wall_s']:.1f} s",
            flush=True,
        )
        out.append(result)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--url", default=None, help="benchmark an engine that is already running")
    parser.add_argument("--extra-args", default="", help="extra `generation serve` arguments")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x]
    engine = None
    url = args.url
    if url is None:
        engine = start_engine_subprocess(
            args.model, port=0, device=args.device, extra_args=tuple(args.extra_args.split())
        )
        url = engine.url
    try:
        info = asyncio.run(_health(url))
        print(
            f"engine {info['model']} on {info['device']} ({info['dtype']}), {args.tokens} tokens per stream, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        results = asyncio.run(bench(url, levels, args.tokens))
        by_level = {r["concurrency"]: r for r in results}
        summary: dict[str, Any] = {"engine": info, "tokens": args.tokens, "results": results}
        if 1 in by_level and max(by_level) > 1:
            top = max(by_level)
            ratio = by_level[top]["aggregate_tokens_per_s"] / by_level[1]["aggregate_tokens_per_s"]
            summary[f"ratio_{top}_to_1"] = ratio
            print(f"aggregate throughput {top} streams / 1 stream: {ratio:.2f}x (target >= 4x)")
        after = asyncio.run(_health(url))
        print(
            f"max batch size seen: {after['max_batch_size_seen']}, forward passes: {after['forward_passes']}"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        if engine is not None:
            engine.stop()
    return 0


async def _health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        return await resp.json()


if __name__ == "__main__":
    sys.exit(main())
