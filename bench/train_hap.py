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

import detectors
from bench.quality import (
    Labelled,
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
from bench.train_injection import embed
from detectors.normalise import view_text
from detectors.windows import judge_windows

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


def fit_lr(x: np.ndarray, y: np.ndarray, c: float, w: np.ndarray | None = None) -> list[np.ndarray]:
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=3000)
    clf.fit(x, y, sample_weight=w)
    return [clf.coef_.astype(np.float32), clf.intercept_.astype(np.float32)]


def fit_mlp(x: np.ndarray, y: np.ndarray, seeds: tuple[int, ...] = (0, 1, 2)) -> list[np.ndarray]:
    from bench import train_injection

    old = train_injection.MLP_SEEDS
    train_injection.MLP_SEEDS = seeds
    try:
        return train_injection.fit_mlp(x, y)
    finally:
        train_injection.MLP_SEEDS = old


# (toxigen weight, RTP weight, C, train on everyday requests too): each is scored 5-fold on
# the dev split (out of fold), which chooses among them and their thresholds
CONFIGS = [
    (tw, rw, c, ev)
    for tw in (1.0, 5.0, 10.0)
    for rw in (1.0, 2.0)
    for c in (0.3, 1.0)
    for ev in (False, True)
] + [(0.0, 0.0, 0.3, False)]  # the insult set alone (weight 0 drops the other two)


def config_name(config: tuple[float, float, float, bool]) -> str:
    tw, rw, c, ev = config
    return f"lr[tox x{tw:g} rtp x{rw:g} C{c:g}{' +everyday' if ev else ''}]"


def cross_fit(
    config: tuple[float, float, float, bool],
    data: dict[str, list[Labelled]],
    embs: dict[str, list[list[np.ndarray]]],
    benign: np.ndarray,
    folds: int = 5,
) -> tuple[list[np.ndarray], dict[str, tuple[list[bool], list[float], list[str]]]]:
    """The head trained on the whole dev split, and each dev text's out-of-fold score (fold by
    text hash)."""
    tw, rw, c, ev = config
    weight = {"toxigen": tw, "rtp": rw}
    rows = [
        (k, i, int(_fold_of(r.text, folds)))
        for k in (*LABELLED, *POSITIVE)
        for i, r in enumerate(data[k])
        if split_of(r.text) == "dev"
    ]

    def fit(keep: list[tuple[str, int, int]]) -> list[np.ndarray]:
        x = np.stack([embs[k][i][0][0] for k, i, _ in keep])
        y = np.array([data[k][i].label for k, i, _ in keep])
        w = np.array([weight.get(k, 1.0) for k, _, _ in keep])
        if ev:
            x, y = np.vstack([x, benign]), np.concatenate([y, np.zeros(len(benign), bool)])
            w = np.concatenate([w, np.ones(len(benign))])
        return fit_lr(x, y, c, w)

    oof: dict[str, tuple[list[bool], list[float], list[str]]] = {
        k: ([], [], []) for k in (*LABELLED, *POSITIVE)
    }
    for f in range(folds):
        layers = fit([r for r in rows if r[2] != f])
        held = [r for r in rows if r[2] == f]
        for (k, i, _), s in zip(
            held, head_scores(layers, [embs[k][i] for k, i, _ in held]), strict=True
        ):
            oof[k][0].append(data[k][i].label)
            oof[k][1].append(s)
            oof[k][2].append(data[k][i].text)
    return fit(rows), oof


def _fold_of(text: str, folds: int) -> int:
    import hashlib

    return hashlib.sha256(b"fold:" + text.encode()).digest()[0] % folds


LABELLED = ("insults", "toxigen")  # sets with both labels: F1
POSITIVE = ("rtp",)  # toxic only: recall
BENIGN = ("everyday",)  # benign only: the share flagged


def figures(
    data: dict[str, list[Labelled]], scores: dict[str, list[float]], threshold: float, split: str
) -> dict[str, dict[str, float | int]]:
    """Per set, on `split`: F1 (P, R) where both labels are present, recall or the share flagged
    where one is."""
    out: dict[str, dict[str, float | int]] = {}
    for k, rows in data.items():
        keep = [i for i, r in enumerate(rows) if split_of(r.text) == split]
        lab = [rows[i].label for i in keep]
        sc = [scores[k][i] for i in keep]
        c = classify_prf(lab, sc, threshold)
        if k in BENIGN:
            out[k] = {"flagged": c.fp, "of": len(keep), "rate": round(c.fp / max(1, len(keep)), 3)}
        else:
            out[k] = c.row()
    return out


def show(name: str, threshold: float, fig: dict[str, dict[str, dict[str, float | int]]]) -> str:
    parts = []
    for k in (*LABELLED, *POSITIVE, *BENIGN):
        d, t = fig["dev"][k], fig["test"][k]
        if k in BENIGN:
            parts.append(f"{k} flags dev {d['rate']:.3f} test {t['rate']:.3f}")
        elif k in POSITIVE:
            parts.append(f"{k} R dev {d['recall']:.3f} test {t['recall']:.3f}")
        else:
            parts.append(
                f"{k} F1 dev {d['f1']:.3f} test {t['f1']:.3f} (P {t['precision']:.2f} "
                f"R {t['recall']:.2f})"
            )
    return f"{name:34s} @{threshold:.3f}: " + " | ".join(parts)


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
        # benign everyday requests: `train` part trained on, the `check` part held out
        "everyday": [r for r in everyday_data() if everyday_part(r.group or r.text) == "check"],
    }
    train_benign = [r for r in everyday_data() if everyday_part(r.group or r.text) == "train"]
    t0 = time.perf_counter()
    embs = {k: window_embeddings([r.text for r in v], args.cache) for k, v in data.items()}
    benign_embs = embed([r.text for r in train_benign], args.cache)
    print(f"embedded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.embed_only:
        return 0
    scores: dict[str, dict[str, list[float]]] = {"profanity": {}}
    for k, v in data.items():
        scores["profanity"][k], _ = asyncio.run(profanity_scores([r.text for r in v]))

    def dev_rows(sets: tuple[str, ...], weight: dict[str, float]) -> tuple[np.ndarray, ...]:
        xs, ys, ws = [], [], []
        for k in sets:
            for r, e in zip(data[k], embs[k], strict=True):
                if split_of(r.text) == "dev":
                    xs.append(e[0][0])
                    ys.append(r.label)
                    ws.append(weight.get(k, 1.0))
        return np.stack(xs), np.array(ys), np.array(ws)

    xb = np.stack([e[0] for e in benign_embs])
    heads: dict[str, list[np.ndarray]] = {}
    oof_thresholds: dict[str, float] = {}
    cv: dict[str, float] = {}
    oofs: dict[str, dict[str, tuple[list[bool], list[float], list[str]]]] = {}
    # each dev text's profanity score, to score the combinations out of fold too
    prof = {
        k: dict(zip((r.text for r in data[k]), scores["profanity"][k], strict=True)) for k in data
    }
    combos = {"": None, "max": max, "mean": lambda a, b: (a + b) / 2}
    for config in CONFIGS:
        name = config_name(config)
        layers, oof = cross_fit(config, data, embs, xb)
        heads[name] = layers
        oofs[name] = oof
        for combo, f in combos.items():
            full = f"{combo}(profanity, {name})" if f else name
            lab = [lb for k in (*LABELLED, *POSITIVE) for lb in oof[k][0]]
            sc = [
                f(prof[k][t], x) if f else x
                for k in (*LABELLED, *POSITIVE)
                for t, x in zip(oof[k][2], oof[k][1], strict=True)
            ]
            t = best_threshold(lab, sc)
            oof_thresholds[full] = t
            per, at = [], 0
            for k in (*LABELLED, *POSITIVE):
                n = len(oof[k][0])
                per.append(classify_prf(oof[k][0], sc[at : at + n], t))
                at += n
            mean = np.mean([per[0].f1, per[1].f1, per[2].recall])
            cv[full] = float(mean)
            print(
                f"{full:50s} 5-fold on dev @{t:.3f}: insults F1 {per[0].f1:.3f} toxigen F1 "
                f"{per[1].f1:.3f} rtp R {per[2].recall:.3f} (mean {mean:.3f})"
            )
    ins = config_name((0.0, 0.0, 0.3, False))
    three = {
        "mean3": lambda p, a, b: (p + a + b) / 3,
        "max(insult head, mean)": lambda p, a, b: max(a, (p + b) / 2),
    }
    for name in list(oofs):
        if name == ins:
            continue
        for combo, f in three.items():
            full = f"{combo}(profanity, {ins}, {name})"
            ia = {
                t: x
                for k in oofs[ins]
                for t, x in zip(oofs[ins][k][2], oofs[ins][k][1], strict=True)
            }
            lab, sc, per_set = [], [], []
            for k in (*LABELLED, *POSITIVE):
                labs, xs, ts = oofs[name][k]
                got = [f(prof[k][t], ia[t], x) for t, x in zip(ts, xs, strict=True)]
                lab += labs
                sc += got
                per_set.append((labs, got))
            t = best_threshold(lab, sc)
            oof_thresholds[full] = t
            per = [classify_prf(a, b, t) for a, b in per_set]
            cv[full] = float(np.mean([per[0].f1, per[1].f1, per[2].recall]))
            print(
                f"{full:50s} 5-fold on dev @{t:.3f}: insults F1 {per[0].f1:.3f} toxigen F1 "
                f"{per[1].f1:.3f} rtp R {per[2].recall:.3f} (mean {cv[full]:.3f})"
            )
    for name, layers in heads.items():
        scores[name] = {k: head_scores(layers, embs[k]) for k in data}
        for combo, f in combos.items():
            if f:
                scores[f"{combo}(profanity, {name})"] = {
                    k: [
                        f(a, b)
                        for a, b in zip(scores["profanity"][k], scores[name][k], strict=True)
                    ]
                    for k in data
                }
    for name in list(heads):
        if name == ins:
            continue
        for combo, f in three.items():
            full = f"{combo}(profanity, {ins}, {name})"
            scores[full] = {
                k: [
                    f(p_, a, b)
                    for p_, a, b in zip(
                        scores["profanity"][k], scores[ins][k], scores[name][k], strict=True
                    )
                ]
                for k in data
            }
    best = max(cv, key=cv.__getitem__)
    print(f"chosen on dev (5-fold): {best} (mean {cv[best]:.3f})")
    results: dict[str, object] = {}
    for name, s in scores.items():
        # the threshold: best F1 on the pooled dev split of the labelled and toxic-only sets
        lab, sc = [], []
        for k in (*LABELLED, *POSITIVE):
            for r, v in zip(data[k], s[k], strict=True):
                if split_of(r.text) == "dev":
                    lab.append(r.label)
                    sc.append(v)
        chosen = oof_thresholds.get(name, best_threshold(lab, sc))
        for tname, t in (("dev (out of fold for heads)", chosen), ("0.5", 0.5)):
            fig = {sp: figures(data, s, t, sp) for sp in ("dev", "test")}
            results[f"{name} @ {tname}"] = {"threshold": t, **fig}
            print(show(name, t, fig))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hap_candidates.json").write_text(json.dumps(results, indent=1))
        for name, layers in heads.items():
            safe = "".join(ch if ch.isalnum() else "_" for ch in name)
            np.savez_compressed(
                args.out / f"hap_{safe}.npz",
                **{f"{'wb'[i % 2]}{i // 2}": a for i, a in enumerate(layers)},
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
