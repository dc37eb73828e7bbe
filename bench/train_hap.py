"""The search for a better `hap` than `profanity`: logistic-regression heads on all-MiniLM-L6-v2
embeddings (the model `prompt_injection` and `topic` already load), alone and averaged with or
maxed against `profanity`, on bench/quality.py's HAP sets (`hap_sets`).

    OMP_NUM_THREADS=1 python bench/train_hap.py [--cache /tmp/hap-cache] [--json out.json]

Protocol (nothing of a test split is trained on or chosen by):
- Training rows are the dev splits of the insult set, ToxiGen and RealToxicityPrompts (each
  text's first 256-token window), optionally the `train` part of the everyday requests as
  benign rows; ToxiGen's 101 dev rows and RTP's weighted up (CONFIGS).
- Each configuration, and its mean and max with `profanity`, is scored 5-fold on the dev split
  (out of fold, folds by text hash); its threshold is the best F1 over the pooled out-of-fold
  scores, and the configuration chosen is the best mean of (insult F1, ToxiGen F1, RTP
  recall) out of fold. The head trained on the whole dev split is then counted on every set's
  dev and test splits at that threshold, as the detector would judge each text: every window
  (sentences and 512-character spans, detectors/windows.py) embedded with the detector's own
  function, the text's score the maximum.
- Cost: CPU ms per 1,000 characters of the chosen candidate, one text per call (`--cost`).

What it found (README, "Beyond insults"): trained on one set, a head does not carry to the
others (the insult head: insults test F1 0.66, RTP recall 0.54 against `profanity`'s 0.79);
trained on all three, the chosen `mean(profanity, head)` is level with `profanity` on insults
(0.60), better on ToxiGen (0.51 against 0.40, 99 texts) and RTP (recall 0.89 against 0.79), at
~21x its CPU: short of the bar for replacing it (0.05 F1 on two sets).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import detectors
from bench.quality import (
    Labelled,
    _figures_line,
    best_threshold,
    classify_prf,
    everyday_data,
    everyday_part,
    hap_sets,
    run_detector,
    score_of,
    set_figures,
    split_of,
)
from bench.train_injection import embed
from detectors.normalise import view_text
from detectors.prompt_injection import head_probabilities
from detectors.windows import judge_windows

WINDOW = (512, 256)  # ScoredTextDetector's
TRAINED = ("insults", "toxigen", "rtp")  # the sets whose dev splits are trained on
FOLDS = 5
# (ToxiGen weight, RTP weight, C, everyday requests as benign rows); (0, 0, ...) is the
# insult set alone
Config = tuple[float, float, float, bool]
CONFIGS: list[Config] = [
    (tw, rw, c, ev)
    for tw in (1.0, 5.0, 10.0)
    for rw in (1.0, 2.0)
    for c in (0.3, 1.0)
    for ev in (False, True)
] + [(0.0, 0.0, 0.3, False)]
COMBOS: dict[str, Callable[[float, float], float] | None] = {
    "": None,
    "max": max,
    "mean": lambda a, b: (a + b) / 2,
}


def config_name(config: Config) -> str:
    tw, rw, c, ev = config
    return f"lr[tox x{tw:g} rtp x{rw:g} C{c:g}{' +everyday' if ev else ''}]"


def window_embeddings(texts: list[str], cache: Path) -> list[list[np.ndarray]]:
    """Per text, the embeddings of each of its windows (each token windows x 384)."""
    rows, owned = judge_windows([view_text(t) for t in texts], *WINDOW)
    embs: list[np.ndarray] = []
    for b in range(0, len(rows), 3000):  # the cache is written after each part
        embs.extend(embed(rows[b : b + 3000], cache))
    return [[embs[r] for r in own] for own in owned]


def head_scores(layers: list[np.ndarray], per_text: list[list[np.ndarray]]) -> list[float]:
    """The detector's score of each text: its best window."""
    return [max(float(head_probabilities(layers, e).max()) for e in ws) for ws in per_text]


def fit_lr(x: np.ndarray, y: np.ndarray, c: float, w: np.ndarray) -> list[np.ndarray]:
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=3000)
    clf.fit(x, y, sample_weight=w)
    return [clf.coef_.astype(np.float32), clf.intercept_.astype(np.float32)]


def fold_of(text: str) -> int:
    return hashlib.sha256(b"fold:" + text.encode()).digest()[0] % FOLDS


def cross_fit(
    config: Config,
    sets: dict[str, list[Labelled]],
    embs: dict[str, list[list[np.ndarray]]],
    benign: np.ndarray,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """The head trained on the whole dev split, and each dev text's out-of-fold score."""
    tw, rw, c, ev = config
    weight = {"insults": 1.0, "toxigen": tw, "rtp": rw}
    rows = [
        (k, i, fold_of(r.text))
        for k in TRAINED
        for i, r in enumerate(sets[k])
        if split_of(r.text) == "dev" and weight[k] > 0
    ]

    def fit(keep: list[tuple[str, int, int]]) -> list[np.ndarray]:
        x = np.stack([embs[k][i][0][0] for k, i, _ in keep])
        y = np.array([sets[k][i].label for k, i, _ in keep])
        w = np.array([weight[k] for k, _, _ in keep])
        if ev:
            x, y = np.vstack([x, benign]), np.concatenate([y, np.zeros(len(benign), bool)])
            w = np.concatenate([w, np.ones(len(benign))])
        return fit_lr(x, y, c, w)

    oof: dict[str, float] = {}
    all_dev = [(k, i) for k in TRAINED for i, r in enumerate(sets[k]) if split_of(r.text) == "dev"]
    for f in range(FOLDS):
        layers = fit([r for r in rows if r[2] != f])
        held = [(k, i) for k, i in all_dev if fold_of(sets[k][i].text) == f]
        for (k, i), s in zip(held, head_scores(layers, [embs[k][i] for k, i in held]), strict=True):
            oof[sets[k][i].text] = s
    return fit(rows), oof


def out_of_fold(
    sets: dict[str, list[Labelled]], score: Callable[[str, int], float]
) -> tuple[float, float, list[float]]:
    """(threshold, mean of insult F1, ToxiGen F1 and RTP recall, those three) over the dev
    split's out-of-fold scores; `score(set, index)`."""
    labels, scores, where = [], [], []
    for k in TRAINED:
        for i, r in enumerate(sets[k]):
            if split_of(r.text) == "dev":
                labels.append(r.label)
                scores.append(score(k, i))
                where.append(k)
    t = best_threshold(labels, scores)
    per = []
    for k in TRAINED:
        c = classify_prf(
            [lb for lb, w in zip(labels, where, strict=True) if w == k],
            [s for s, w in zip(scores, where, strict=True) if w == k],
            t,
        )
        per.append(c.recall if k == "rtp" else c.f1)
    return t, float(np.mean(per)), per


async def profanity_scores(texts: list[str]) -> list[float]:
    det = detectors.build("profanity", {"min_score": 0.0})
    out, _ = await run_detector(det, texts)
    await det.close()
    return [score_of(d) for d in out]


def candidate_cost(layers: list[np.ndarray], texts: list[str]) -> dict[str, float]:
    """CPU ms per 1,000 characters, one text per call, of the MiniLM head alone (every window
    embedded, as the detector would) and of `profanity` on the same texts."""
    from detectors.hf import load_embedder, minilm_path
    from detectors.profanity import _load
    from detectors.prompt_injection import minilm_embeddings
    from detectors.windows import windows

    tokenizer, model = load_embedder(minilm_path(), "cpu")
    vectorizer, clf, col = _load()
    chars = sum(map(len, texts))
    out = {}
    for name, run in (
        (
            "minilm head",
            lambda ws: [
                head_probabilities(layers, e) for e in minilm_embeddings(tokenizer, model, ws, 64)
            ],
        ),
        ("profanity", lambda ws: clf.predict_proba(vectorizer.transform(ws))[:, col]),
    ):
        run(windows(view_text(texts[0]), *WINDOW))
        cpu0 = time.process_time()
        for t in texts:
            run(windows(view_text(t), *WINDOW))
        out[name] = round((time.process_time() - cpu0) * 1000 / chars * 1000, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/hap-cache"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cost", type=int, default=300, help="texts the cost is measured on")
    args = ap.parse_args(argv)
    sets = hap_sets()
    train_benign = [r for r in everyday_data() if everyday_part(r.group or r.text) == "train"]
    t0 = time.perf_counter()
    embs = {k: window_embeddings([r.text for r in v], args.cache) for k, v in sets.items()}
    benign = np.stack([e[0] for e in embed([r.text for r in train_benign], args.cache)])
    print(f"embedded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    prof = {k: asyncio.run(profanity_scores([r.text for r in v])) for k, v in sets.items()}

    cv: dict[str, tuple[float, float, list[float]]] = {}
    heads: dict[str, list[np.ndarray]] = {}
    t, mean, per = out_of_fold(sets, lambda k, i: prof[k][i])
    cv["profanity"] = (t, mean, per)
    for config in CONFIGS:
        name = config_name(config)
        heads[name], oof = cross_fit(config, sets, embs, benign)
        for combo, f in COMBOS.items():
            full = f"{combo}(profanity, {name})" if f else name

            def score(
                k: str,
                i: int,
                f: Callable[[float, float], float] | None = f,
                oof: dict[str, float] = oof,
            ) -> float:
                s = oof[sets[k][i].text]
                return f(prof[k][i], s) if f else s

            cv[full] = out_of_fold(sets, score)
    for name, (t, mean, per) in sorted(cv.items(), key=lambda kv: -kv[1][1]):
        print(
            f"{name:52s} 5-fold on dev @{t:.3f}: insults F1 {per[0]:.3f} toxigen F1 "
            f"{per[1]:.3f} rtp R {per[2]:.3f} (mean {mean:.3f})"
        )
    chosen = max((n for n in cv if n != "profanity"), key=lambda n: cv[n][1])
    print(f"\nchosen on dev (out of fold): {chosen}")
    results: dict[str, object] = {"chosen": chosen, "cv": cv}
    head = next(h for h in heads if h in chosen)
    head_s = {k: head_scores(heads[head], embs[k]) for k in sets}
    combo = chosen.split("(")[0] if chosen != head else ""
    f = COMBOS[combo]
    insults_only = config_name((0.0, 0.0, 0.3, False))  # does one set's head carry to others?
    for name, threshold, per_set in (
        ("profanity @ 0.5 (config.yaml hap)", 0.5, prof),
        (f"profanity @ {cv['profanity'][0]}", cv["profanity"][0], prof),
        (
            f"{insults_only} @ {cv[insults_only][0]}",
            cv[insults_only][0],
            {k: head_scores(heads[insults_only], embs[k]) for k in sets},
        ),
        (
            f"{chosen} @ {cv[chosen][0]}",
            cv[chosen][0],
            {
                k: [f(a, b) if f else b for a, b in zip(prof[k], head_s[k], strict=True)]
                for k in sets
            },
        ),
    ):
        figs = {k: set_figures(sets[k], per_set[k], threshold) for k in sets}
        results[name] = figs
        print(f"{name}: {_figures_line(figs)}")
    cost_texts = [r.text for r in sets["insults"][: args.cost]]
    results["cpu_ms_per_1k_chars"] = cost = candidate_cost(heads[head], cost_texts)
    print(f"CPU ms per 1,000 characters ({args.cost} insult-set texts, one per call): {cost}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
