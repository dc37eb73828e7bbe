"""Detector benchmark: single-request latency and throughput with micro-batching on and off.

    python bench/detectors.py [--device auto|cpu|cuda] [--requests 192] [--repeat 3]
                              [--only topic hf_classifier] [--http] [--json out.json]

Per detector: p50/p90 latency of one request with one text, sent one after another; then
throughput (texts/s) with C clients each sending one-text requests back to back (C = 1, 8, 32;
median of --repeat interleaved runs), with micro-batching on (defaults: max_wait_ms 5), on with
max_wait_ms 0, and off. Detectors run in-process through the same `detect` the service calls;
with --http they sit behind the detector service on 127.0.0.1 and are called over HTTP.
`hf_classifier` runs a MiniLM classifier folder with a seeded random head, built in a temporary
directory. CPU figures move with whatever else runs on the machine: the load average is printed
before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp
from aiohttp import web

import detectors
from detectors.service import create_app

SUBJECTS = ["The team", "Our bank", "The chef", "My neighbour", "The committee", "A reporter"]
VERBS = ["announced", "criticised", "prepared", "reviewed", "celebrated", "questioned"]
OBJECTS = [
    "the new stadium plans",
    "a sharp rise in interest rates",
    "a slow-cooked tomato sauce",
    "the quarterly budget",
    "the championship victory",
    "the recipe for sourdough bread",
]
TAILS = [
    "",
    " after a long meeting on Tuesday",
    " while everyone waited outside in the rain for hours",
    " and promised a detailed report with figures, charts and recommendations next week",
]
TOPICS = {
    "sports": ["football match", "the team won the championship", "basketball game"],
    "finance": ["stock market", "interest rates", "investment portfolio"],
    "cooking": ["recipe for pasta", "bake a cake", "simmer the sauce"],
}


def texts(n: int, seed: int = 0, *, uniform: bool = False) -> list[str]:
    """Sentences of 9-25 word pieces (mixed), or all of about 12 (uniform: no padding waste
    inside a batch, which is where batching gains most)."""
    rng = random.Random(seed)
    tails = TAILS[1:2] if uniform else TAILS
    objects = ["the quarterly budget", "the new stadium plans"] if uniform else OBJECTS
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(objects)}{rng.choice(tails)}."
        for _ in range(n)
    ]


def classifier_folder(root: Path) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from detectors.hf import minilm_path

    torch.manual_seed(0)
    src = minilm_path()
    model = AutoModelForSequenceClassification.from_pretrained(
        src, num_labels=2, local_files_only=True
    )
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(root)
    return root


def percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50_ms": statistics.median(samples),
        "p90_ms": samples[int(0.9 * (len(samples) - 1))],
    }


async def one_call_ms(det: Any, text: str) -> float:
    t0 = time.perf_counter()
    await det.detect([text])
    return (time.perf_counter() - t0) * 1000


async def throughput(det: Any, pool: list[str], concurrency: int, requests: int) -> float:
    counter = iter(range(requests))

    async def client() -> None:
        for i in counter:
            await det.detect([pool[i % len(pool)]])

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return requests / (time.perf_counter() - t0)


def specs(model_dir: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "regex": ("regex", {}),
        "profanity": ("profanity", {}),
        "prompt_injection": ("prompt_injection", {}),
        "nanoguard": ("prompt_injection", {"model": "nanoguard"}),
        "topic": ("topic", {"topics": TOPICS}),
        "hf_classifier": ("hf_classifier", {"model_path": str(model_dir)}),
    }


MODES: dict[str, dict[str, Any]] = {
    "on": {},  # the defaults: max_wait_ms 5, max_batch_size 32
    "on-0ms": {"max_wait_ms": 0},  # no wait when the model is idle; batches form while busy
    "off": {"batching": False},
}


class HttpDetector:
    """The detector behind the detector service on 127.0.0.1, called over HTTP (--http)."""

    def __init__(self, det: detectors.Detector) -> None:
        self.det = det
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None
        self.url = ""

    @classmethod
    async def start(cls, det: detectors.Detector) -> HttpDetector:
        self = cls(det)
        self.runner = web.AppRunner(create_app({"d": det}, warmup=False), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/api/v1/text/contents"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers={"detector-id": "d"}
        )
        return self

    @property
    def forward_passes(self) -> int:
        return self.det.forward_passes

    async def detect(self, contents: list[str]) -> Any:
        assert self.session is not None
        async with self.session.post(self.url, json={"contents": contents}) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.runner is not None:
            await self.runner.cleanup()
        await self.det.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The modes of one detector are measured interleaved (on, off, on, off, ...), so a burst of
    load from elsewhere on the machine hits every mode alike and their ratio stays meaningful."""
    pool = texts(256, uniform=args.uniform)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = classifier_folder(Path(tmp) / "clf")
        for name, (builtin, params) in specs(model_dir).items():
            if args.only and name not in args.only:
                continue
            slow = name == "nanoguard"
            requests = max(32, args.requests // 4) if slow else args.requests
            repeat = 1 if slow else args.repeat
            if builtin == "regex":
                modes = ["on"]
            elif builtin in ("topic", "hf_classifier"):
                modes = list(MODES)
            else:
                modes = ["on", "off"]
            dets: dict[str, Any] = {}
            for mode in modes:
                extra = MODES[mode] if builtin != "regex" else {}
                det: Any = detectors.build(builtin, {**params, **extra}, device=args.device)
                await det.warmup()
                if args.http:
                    det = await HttpDetector.start(det)
                for i in range(4):  # warm caches (topic examples, allocator, kernels)
                    await det.detect([pool[i]])
                dets[mode] = det
            samples: dict[str, list[float]] = {mode: [] for mode in modes}
            for i in range(args.single if not slow else 10):
                for mode in modes:
                    samples[mode].append(await one_call_ms(dets[mode], pool[i % len(pool)]))
            entry: dict[str, Any] = {mode: percentiles(samples[mode]) for mode in modes}
            if builtin != "regex":
                for c in args.concurrency:
                    runs: dict[str, list[float]] = {mode: [] for mode in modes}
                    passes = {mode: dets[mode].forward_passes for mode in modes}
                    for _ in range(repeat):
                        for mode in modes:
                            runs[mode].append(await throughput(dets[mode], pool, c, requests))
                    for mode in modes:
                        done = dets[mode].forward_passes - passes[mode]
                        entry[mode][f"c{c}_texts_per_s"] = statistics.median(runs[mode])
                        entry[mode][f"c{c}_texts_per_pass"] = requests * repeat / max(1, done)
                    if "off" in modes:  # ratios of adjacent runs: robust to load drifting
                        for mode in modes:
                            if mode != "off":
                                ratios = [
                                    a / b for a, b in zip(runs[mode], runs["off"], strict=True)
                                ]
                                entry[f"speedup_c{c}_{mode}_vs_off"] = statistics.median(ratios)
            for det in dets.values():
                await det.close()
            results[name] = entry
            print(format_entry(name, entry, args.concurrency), flush=True)
    return results


def format_entry(name: str, entry: dict[str, Any], concurrency: list[int]) -> str:
    lines = [f"{name}:"]
    for mode in MODES:
        if mode not in entry:
            continue
        row = entry[mode]
        parts = [f"p50 {row['p50_ms']:.2f} ms", f"p90 {row['p90_ms']:.2f} ms"]
        parts += [
            f"c{c} {row[f'c{c}_texts_per_s']:.0f}/s ({row[f'c{c}_texts_per_pass']:.1f}/pass)"
            for c in concurrency
            if f"c{c}_texts_per_s" in row
        ]
        lines.append(f"  batching {mode:>6}: " + ", ".join(parts))
    speedups = [
        f"{k[len('speedup_') :]} {v:.2f}x" for k, v in entry.items() if k.startswith("speedup")
    ]
    if speedups:
        lines.append("  speedup (median of adjacent-run ratios): " + ", ".join(speedups))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests", type=int, default=192, help="requests per throughput run")
    parser.add_argument("--repeat", type=int, default=5, help="throughput runs (median kept)")
    parser.add_argument("--single", type=int, default=50, help="requests for the latency run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--only", nargs="*", help="detector names to run (default all)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--http", action="store_true", help="call the detectors through the service over HTTP"
    )
    parser.add_argument(
        "--uniform", action="store_true", help="texts of one length (default: 9-25 word pieces)"
    )
    args = parser.parse_args()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:
        pass
    import torch

    device = detectors.runtime.resolve_device(args.device)
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"cpus={os.cpu_count()} python={platform.python_version()} "
        f"loadavg_before={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = asyncio.run(run(args))
    # other processes on the machine skew CPU figures: the load average says whether they ran
    print(f"loadavg_after={os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        summary = {"device": device, "http": args.http, "uniform": args.uniform, "results": results}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
