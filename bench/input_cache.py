"""Input verdict cache benchmark: a conversation's input judging, turn by turn, cache on vs off.

    python bench/input_cache.py [--turns 20] [--device cpu] [--repeat 3] [--json out.json]

A chat client sends the whole conversation again every turn, and input detectors judge every
message (DESIGN 4.8). This judges each turn's messages as the orchestrator does
(`text_judgement.judge_pieces`, the in-process `prompt_injection` on whole messages and `regex`
PII on sentences: the shipped config's input guardrails), once with a `detection_cache` partition
and once without, and prints each mode's total time over the conversation, its last turn's time,
the contents the detectors were sent, and the ratio off/on (median of --repeat interleaved runs).
The conversation is seeded: a user message of ~300 characters, an answer of ~900 and every
fifth turn a tool result of ~2,000. CPU figures move with whatever else runs on the machine:
the load average is printed before and after.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp

from orchestrator.api.fms_requests import DetectorParams
from orchestrator.api.input_pieces import InputPiece
from orchestrator.clients.registry import ChunkerRegistry, DetectorRegistry
from orchestrator.config import DetectionCacheConfig, parse_config
from orchestrator.streaming.text_judgement import judge_pieces
from orchestrator.streaming.verdict_cache import VerdictCache

WORDS = (
    "the service returns a summary of every order placed this week with totals per region and "
    "a note on delayed shipments please check the invoice numbers against the ledger and tell "
    "me which customers should get a follow up call before friday"
).split()

CONFIG = {
    "chunkers": {"sentence": {"type": "sentence"}},
    "detectors": {
        "injection": {
            "builtin": "prompt_injection",
            "chunker_id": "whole_doc_chunker",
            "timeout_s": 600,
        },
        "pii": {"builtin": "regex", "chunker_id": "sentence"},
    },
}


def text(rng: random.Random, chars: int) -> str:
    """Sentences of seeded words, about `chars` long, with an address now and then."""
    out: list[str] = []
    size = 0
    while size < chars:
        words = rng.choices(WORDS, k=rng.randint(8, 20))
        if rng.random() < 0.1:
            words.append(f"jo{rng.randint(0, 99)}@example.com")
        sentence = " ".join(words).capitalize() + "."
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)


def conversation(turns: int, seed: int = 7) -> list[list[InputPiece]]:
    """The pieces a client sends on each turn: everything so far, again."""
    rng = random.Random(seed)
    messages = [text(rng, 400)]  # the system message
    sent = []
    for turn in range(turns):
        if turn:
            messages.append(text(rng, 900))  # the previous answer
            if turn % 5 == 0:
                messages.append(text(rng, 2000))  # a tool result
        messages.append(text(rng, 300))
        sent.append([InputPiece(m, message_index=i) for i, m in enumerate(messages)])
    return sent


async def one_run(
    registry: DetectorRegistry, chunkers: ChunkerRegistry, turns: list[list[InputPiece]], on: bool
) -> dict[str, Any]:
    dets = registry.resolve(
        {"injection": DetectorParams(), "pii": DetectorParams()}, "input", "bench"
    )
    settings = DetectionCacheConfig()
    lookups = {"hits": 0, "misses": 0}

    def count(detector_id: str, hits: int, misses: int) -> None:
        lookups["hits"] += hits
        lookups["misses"] += misses

    cache = VerdictCache(settings.max_entries_per_tenant, settings.max_entries, on_lookup=count)
    verdicts = cache.tenant("bench") if on else None
    per_turn = []
    for pieces in turns:
        started = time.perf_counter()
        await judge_pieces(pieces, dets, chunkers, verdicts)
        per_turn.append(time.perf_counter() - started)
    return {"total_s": sum(per_turn), "last_turn_s": per_turn[-1], **lookups}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = parse_config(CONFIG)
    turns = conversation(args.turns)
    chars = [sum(len(p.text) for p in t) for t in turns]
    print(f"turns={args.turns} chars_last_turn={chars[-1]} chars_all_turns={sum(chars)}")
    async with aiohttp.ClientSession() as session:
        registry = DetectorRegistry(config, session, device=args.device)
        chunkers = ChunkerRegistry(config.chunkers)
        for client in registry.clients().values():
            await client.warm_up("Warm up the model once.")  # type: ignore[attr-defined]
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for _ in range(args.repeat):  # interleaved: load from elsewhere hits both alike
            for mode in ("off", "on"):
                runs[mode].append(await one_run(registry, chunkers, turns, mode == "on"))
        await registry.close()
    out: dict[str, Any] = {}
    for mode, results in runs.items():
        out[mode] = {
            "total_s": statistics.median(r["total_s"] for r in results),
            "last_turn_s": statistics.median(r["last_turn_s"] for r in results),
            "hits": results[0]["hits"],
            "misses": results[0]["misses"],
        }
        print(
            f"cache {mode:>3}: total {out[mode]['total_s']:.2f} s over {args.turns} turns, "
            f"last turn {out[mode]['last_turn_s'] * 1000:.0f} ms"
            + (
                f", contents kept {out[mode]['hits']} / sent {out[mode]['misses']}"
                if mode == "on"
                else ""
            ),
            flush=True,
        )
    ratios = [
        off["total_s"] / on["total_s"] for off, on in zip(runs["off"], runs["on"], strict=True)
    ]
    last = [
        off["last_turn_s"] / on["last_turn_s"]
        for off, on in zip(runs["off"], runs["on"], strict=True)
    ]
    out["ratio_total"] = statistics.median(ratios)
    out["ratio_last_turn"] = statistics.median(last)
    print(
        f"ratio off/on (median of {args.repeat} adjacent runs): total {out['ratio_total']:.1f}x, "
        f"last turn {out['ratio_last_turn']:.1f}x",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs (median kept)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    import torch

    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"cpus={os.cpu_count()} python={platform.python_version()} "
        f"loadavg_before={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = asyncio.run(run(args))
    print(f"loadavg_after={os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
