"""Judge a candidate set of `prompt_injection` heads (a folder written by
bench/train_injection.py --out) as the detector judges texts, with MiniLM embeddings cached
across runs (the MiniLM body is frozen: only the heads change between candidates), so a few
trainings can be compared on two shared cores.

    python bench/injection_candidates.py --heads DIR            # dev figures only
    python bench/injection_candidates.py --heads DIR --held-out # once, at the end

Dev (for choosing): bench/quality.py's injection dev split (threshold by `threshold_for`), the
documents' dev split (`planted_documents.docs_dev_package`: benign sections, and instructions
planted in them: ours with another seed, and neuralchemy's held-out core-test injections).
Held out (read once): bench/quality.py's own benches at the dev threshold (`bench_injection`'s
test split, everyday requests, encoded data, tool definitions, documents and DOC_INJECTIONS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import quality  # noqa: E402
from bench.planted_documents import (  # noqa: E402
    docs_dev_package,
    generated_instructions,
    plant,
)

DEV_PLANTED_SEED = 99  # our instructions on the documents' dev split (training uses 7)
DEV_PLANTED = 60
DEV_NEURALCHEMY = 60  # neuralchemy core-test injections (never trained on) planted likewise


def cache_embeddings(path: Path) -> None:
    """Wrap the detector's `minilm_embeddings` in a cache of every window it embeds, read from
    and written back to `path` (the same text always gets the same embedding)."""
    import atexit

    import detectors.prompt_injection as pi

    known: dict[str, np.ndarray] = {}
    if path.exists():
        with np.load(path) as f:
            parts = np.split(f["flat"], np.cumsum(f["counts"])[:-1])
            known = dict(zip(f["texts"].tolist(), parts, strict=True))
    real = pi.minilm_embeddings
    size = len(known)

    def cached(tokenizer: Any, model: Any, texts: list[str], rows: int) -> list[np.ndarray]:
        todo = list(dict.fromkeys(t for t in texts if t not in known))
        if todo:
            known.update(zip(todo, real(tokenizer, model, todo, rows), strict=True))
        return [known[t] for t in texts]

    def save() -> None:
        if len(known) == size:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(known)
        np.savez(
            path,
            texts=np.array(keys),
            flat=np.concatenate([known[k] for k in keys]),
            counts=np.array([len(known[k]) for k in keys]),
        )

    pi.minilm_embeddings = cached
    atexit.register(save)


def use_heads(folder: Path) -> None:
    """The detector loads its heads from `folder` (those missing there: the shipped ones)."""
    import detectors.prompt_injection as pi

    shipped = pi.head_path

    def head_path(name: str) -> Path:
        return folder / name if (folder / name).exists() else shipped(name)

    pi.head_path = head_path


def dev_instructions() -> list[str]:
    """Our instructions planted in the documents' dev split (never trained on)."""
    return generated_instructions(DEV_PLANTED, DEV_PLANTED_SEED)


def docs_dev() -> tuple[list[str], list[str]]:
    """The documents' dev split: benign sections, and sections with an instruction planted."""
    from bench.train_injection import neuralchemy

    benign = [r for r in quality.docs_data("train") if docs_dev_package(r.group)]
    hosts = [(r.group, r.text) for r in benign]
    attacks = dev_instructions()
    rng = random.Random(5)
    held = [r.text for r in neuralchemy(("test",)) if r.label and 30 <= len(r.text) <= 400]
    attacks += rng.sample(held, DEV_NEURALCHEMY)
    planted = [p.text for p in plant(hosts, attacks, seed=DEV_PLANTED_SEED)]
    return [r.text for r in benign], planted


async def scores(texts: list[str]) -> list[float]:
    import detectors

    det = detectors.build("prompt_injection", {"model": "minilm", "min_score": 0.0})
    out, _ = await quality.run_detector(det, texts)
    await det.close()
    return [quality.score_of(d) for d in out]


async def dev_figures() -> dict[str, Any]:
    data = quality.injection_data()
    texts, labels, dev = quality._columns(data)
    d_texts = [t for t, d in zip(texts, dev, strict=True) if d]
    d_labels = [lb for lb, d in zip(labels, dev, strict=True) if d]
    d_scores = await scores(d_texts)
    t = quality.threshold_for(d_labels, d_scores) or quality.best_threshold(d_labels, d_scores)
    benign, planted = docs_dev()
    b_scores, p_scores = await scores(benign), await scores(planted)
    return {
        "threshold": t,
        "injection_dev": quality.classify_prf(d_labels, d_scores, t).row(),
        "docs_dev_benign": len(benign),
        "docs_dev_flagged": sum(x >= t for x in b_scores),
        "docs_dev_planted": len(planted),
        "docs_dev_planted_found": sum(x >= t for x in p_scores),
        "docs_dev_planted_found_ours": sum(x >= t for x in p_scores[:DEV_PLANTED]),
    }


async def held_out(threshold: float) -> dict[str, Any]:
    """bench/quality.py's benches of `injection`, as if config.yaml shipped these heads at
    `threshold`."""
    quality._shipped_injection = lambda: ("minilm", threshold)
    results: dict[str, Any] = {}
    await quality.bench_injection(results, ["minilm"])
    await quality.bench_everyday(results)
    await quality.bench_encoded(results)
    await quality.bench_tool_definitions(results)
    await quality.bench_documents(results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=Path, help="folder of candidate heads (default: shipped)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "eval" / "windows.npz")
    ap.add_argument("--held-out", action="store_true", help="read the held-out benches (once)")
    ap.add_argument("--threshold", type=float, help="held out at this threshold, not dev's")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    quality.one_blas_thread_per_process()
    cache_embeddings(args.cache)
    if args.heads is not None:
        use_heads(args.heads)
    out: dict[str, Any] = {"heads": str(args.heads or "shipped")}
    out["dev"] = asyncio.run(dev_figures())
    print(json.dumps(out["dev"]), flush=True)
    if args.held_out:
        out["held_out"] = asyncio.run(held_out(args.threshold or out["dev"]["threshold"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
