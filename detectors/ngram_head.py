"""A character n-gram logistic regression, the second half of `prompt_injection`'s `model: minilm`
(detectors/data/injection_ngrams.npz, written by bench/train_injection.py).

Hashed character 3- to 5-grams within words (scikit-learn's HashingVectorizer, `char_wb`,
2**17 buckets, lower-cased), sublinear TF-IDF, L2-normalised rows, one logistic regression.
It reads the words themselves where MiniLM's mean-pooled sentence embedding reads their gist:
the two err on different texts, and their mean beat either on bench/quality.py's dev split.

The file holds only numbers (no pickle): the buckets seen in training with their IDF and
weight; every other bucket has the IDF of a term seen in no document and weight 0, exactly
what scikit-learn's TfidfTransformer and LogisticRegression fitted on those documents compute
(the training script checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ANALYZER = "char_wb"
NGRAMS = (3, 5)
BUCKETS = 2**17


def vectorizer() -> Any:
    """The stateless hashing vectorizer of training and inference (counts, no norm)."""
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(
        n_features=BUCKETS,
        analyzer=ANALYZER,
        ngram_range=NGRAMS,
        alternate_sign=False,
        norm=None,
    )


@dataclass(frozen=True)
class NgramHead:
    idf: np.ndarray  # BUCKETS
    coef: np.ndarray  # BUCKETS
    intercept: float
    hasher: Any

    def probabilities(self, texts: list[str]) -> np.ndarray:
        """P(injection) of each text."""
        counts = self.hasher.transform(texts).tocsr().astype(np.float64)
        counts.data = 1.0 + np.log(counts.data)  # sublinear TF
        weighted = counts.multiply(self.idf).tocsr()
        norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(axis=1)).ravel())
        logits = weighted @ self.coef / np.where(norms > 0, norms, 1.0) + self.intercept
        return 1.0 / (1.0 + np.exp(-logits))


def load_ngram_head(path: Path) -> NgramHead:
    """ValueError when the file is not such a head."""
    with np.load(path, allow_pickle=False) as f:
        idx, idf, coef = f["index"], f["idf"], f["coef"]
        n_docs, intercept = int(f["documents"]), float(f["intercept"])
        buckets = int(f["buckets"])
    if buckets != BUCKETS or not (idx.shape == idf.shape == coef.shape) or idx.ndim != 1:
        raise ValueError(f"{path.name}: not a {BUCKETS}-bucket n-gram head")
    if len(idx) and (idx.min() < 0 or idx.max() >= BUCKETS):
        raise ValueError(f"{path.name}: bucket out of range")
    if not (np.isfinite(idf).all() and np.isfinite(coef).all() and np.isfinite(intercept)):
        raise ValueError(f"{path.name}: weights are not finite")
    full_idf = np.full(BUCKETS, np.log((1 + n_docs) / 1) + 1.0)  # a bucket seen in no document
    full_idf[idx] = idf
    full_coef = np.zeros(BUCKETS)
    full_coef[idx] = coef
    return NgramHead(full_idf, full_coef, intercept, vectorizer())


def save_ngram_head(
    path: Path,
    idf: np.ndarray,
    coef: np.ndarray,
    intercept: float,
    documents: int,
    seen: np.ndarray,
) -> None:
    """What `load_ngram_head` reads: the `seen` buckets' IDF and weights."""
    idx = np.flatnonzero(seen).astype(np.int32)
    np.savez_compressed(
        path,
        index=idx,
        idf=idf[idx].astype(np.float32),
        coef=coef[idx].astype(np.float32),
        intercept=np.float64(intercept),
        documents=np.int64(documents),
        buckets=np.int64(BUCKETS),
    )
