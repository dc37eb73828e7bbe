"""Candidate HAP heads on all-MiniLM-L6-v2 embeddings (the model `prompt_injection` and `topic`
already load), trained on the dev split of one labelled set of bench/quality.py and checked on
the test splits of every set there, beside `profanity`.

    OMP_NUM_THREADS=1 python bench/train_hap.py [--cache /tmp/hap-cache] [--out DIR]

Every text is judged as the detector judges it: its windows (sentences and 512-character spans,
detectors/windows.py) each embedded with the detector's own function (token windows of 256),
the text's score the maximum over them. Training rows are the whole texts of the dev split
(one row per text: its first token window), never a window of a test text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quality import (  # noqa: E402
    PRF,
    abuse_data,
    best_threshold,
    classify_prf,
    everyday_data,
    everyday_part,
    rtp_toxic_data,
    run_detector,
    score_of,
    split_of,
    toxigen_data,
)
from bench.train_injection import embed  # noqa: E402

import detectors  # noqa: E402
from detectors.normalise import view_text  # noqa: E402
from detectors.windows import judge_windows  # noqa: E402

WINDOW = (512, 256)  # ScoredTextDetector's


def window_embeddings(texts: list[str], cache: Path) -> list[list[np.ndarray]]:
    """Per text, the embeddings of each of its windows (each windows x 384)."""
    rows, owned = judge_windows([view_text(t) for t in texts], *WINDOW)
    embs: list[np.ndarray] = []
    for b in range(0, len(rows), 3000):  # the cache is written after each part
        embs.extend(embed(rows[b : b + 3000], cache))
    return [[embs[r] for r in own] for own in owned]


def head_scores(layers: list[np.ndarray], per_text: list[list[np.ndarray]]) -> list[float]:
    from detectors.prompt_injection import head_probabilities

    return [max(float(head_probabilities(layers, e).max()) for e in ws) for ws in per_text]


def fit_lr(x: np.ndarray, y: np.ndarray, c: float) -> list[np.ndarray]:
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=3000).fit(x, y)
    return [clf.coef_.astype(np.float32), clf.intercept_.astype(np.float32)]


def fit_mlp(x: np.ndarray, y: np.ndarray, seeds: tuple[int, ...] = (0, 1, 2)) -> list[np.ndarray]:
    from bench import train_injection

    old = train_injection.MLP_SEEDS
    train_injection.MLP_SEEDS = seeds
    try:
        return train_injection.fit_mlp(x, y)
    finally:
        train_injection.MLP_SEEDS = old


def report(
    name: str, sets: dict[str, tuple[list[bool], list[bool]]], scores: dict[str, list[float]],
    threshold: float,
) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for set_name, (labels, dev) in sets.items():
        s = scores[set_name]
        row: dict[str, object] = {}
        for split, want in (("dev", True), ("test", False)):
            lab = [lb for lb, d in zip(labels, dev, strict=True) if d == want]
            sc = [x for x, d in zip(s, dev, strict=True) if d == want]
            row[split] = classify_prf(lab, sc, threshold).row()
        out[set_name] = row
    line = " | ".join(
        f"{k}: dev F1 {v['dev']['f1']:.3f} (P {v['dev']['precision']:.2f} R "
        f"{v['dev']['recall']:.2f}) test F1 {v['test']['f1']:.3f} (P "
        f"{v['test']['precision']:.2f} R {v['test']['recall']:.2f})"
        for k, v in out.items()
    )
    print(f"{name} @ {threshold:.3f}: {line}")
    return out


async def profanity_scores(texts: list[str]) -> tuple[list[float], float]:
    det = detectors.build("profanity", {"min_score": 0.0})
    out, ms = await run_detector(det, texts)
    await det.close()
    return [score_of(d) for d in out], ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/hap-cache"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--embed-only", action="store_true")
    args = ap.parse_args(argv)
    data = {
        "insults": abuse_data(),
        "toxigen": toxigen_data(),
        "rtp": rtp_toxic_data(),
        # benign everyday requests, the held-out `check` part: false alarms only
        "everyday": [r for r in everyday_data() if everyday_part(r.group or r.text) == "check"],
    }
    t0 = time.perf_counter()
    embs = {k: window_embeddings([r.text for r in v], args.cache) for k, v in data.items()}
    print(f"embedded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.embed_only:
        return 0
    sets = {k: ([r.label for r in v], [split_of(r.text) == "dev" for r in v]) for k, v in data.items()}
    scores: dict[str, dict[str, list[float]]] = {"profanity": {}}
    for k, v in data.items():
        scores["profanity"][k], ms = asyncio.run(profanity_scores([r.text for r in v]))
    # training: the dev split of the insult set (its whole texts' first token window)
    ins = data["insults"]
    dev_idx = [i for i, r in enumerate(ins) if split_of(r.text) == "dev"]
    x = np.stack([embs["insults"][i][0][0] for i in dev_idx])
    y = np.array([ins[i].label for i in dev_idx])
    heads = {f"lr C={c}": fit_lr(x, y, c) for c in (0.3, 1.0, 3.0)}
    heads["mlp"] = fit_mlp(x, y)
    for name, layers in heads.items():
        scores[name] = {k: head_scores(layers, embs[k]) for k in data}
    for name in list(heads):
        scores[f"max(profanity, {name})"] = {
            k: [max(a, b) for a, b in zip(scores["profanity"][k], scores[name][k], strict=True)]
            for k in data
        }
        scores[f"mean(profanity, {name})"] = {
            k: [(a + b) / 2 for a, b in zip(scores["profanity"][k], scores[name][k], strict=True)]
            for k in data
        }
    results: dict[str, object] = {}
    labels, dev = sets["insults"]
    for name, s in scores.items():
        d_lab = [lb for lb, d in zip(labels, dev, strict=True) if d]
        d_sc = [x for x, d in zip(s["insults"], dev, strict=True) if d]
        chosen = best_threshold(d_lab, d_sc)
        results[name] = {
            "dev_threshold": chosen,
            "at_dev_threshold": report(name, sets, s, chosen),
            "at_0.5": report(name, sets, s, 0.5),
        }
        # toxigen's own dev split chooses too (what a second source's threshold would be)
        t_lab, t_dev = sets["toxigen"]
        tl = [lb for lb, d in zip(t_lab, t_dev, strict=True) if d]
        ts = [x for x, d in zip(s["toxigen"], t_dev, strict=True) if d]
        ct = best_threshold(tl, ts)
        results[name]["toxigen_dev_threshold"] = ct  # type: ignore[index]
        results[name]["at_toxigen_dev_threshold"] = report(name, sets, s, ct)  # type: ignore[index]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hap_candidates.json").write_text(json.dumps(results, indent=1))
        for name, layers in heads.items():
            np.savez_compressed(
                args.out / f"hap_{name.replace(' ', '_').replace('=', '')}.npz",
                **{f"{'wb'[i % 2]}{i // 2}": a for i, a in enumerate(layers)},
            )
    _ = PRF
    return 0


if __name__ == "__main__":
    sys.exit(main())
