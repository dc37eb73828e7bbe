"""`hf_classifier`: any local Hugging Face sequence-classification folder (`model_path`).

Long contents are read in sliding windows of `max_length` tokens that overlap by `stride` tokens,
so nothing is truncated away, and a content of several sentences is also read sentence by sentence
(DESIGN 4.6b: benign padding around a flagged sentence cannot dilute it); a label's score is its
maximum over all these windows, which go to the model in one batch. Probabilities are
softmax over the labels (single-label models) or a sigmoid per label (multi-label models, and
one-logit models), following the model's `problem_type` unless `problem_type` says otherwise.

Detections: one per label that is not in `safe_labels` and whose score reaches its entry in
`thresholds`, else the `min_score`/`threshold` floor. The span is the whole content when it fits
in one sliding window; when it needed several, it is the character span of the window (sliding
or sentence) where the label scored highest (from the tokenizer's offset mapping), and
`metadata` says how many windows (each distinct span once, in text order) and which one.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from .api import Detection
from .base import (
    SCORED_REQUEST_PARAMS,
    InvalidParams,
    ScoredParams,
    parse_params,
    text_bounds,
)
from .hf import labels_of, load_sequence_classifier, model_max_tokens, read_config
from .model import BatchedDetector
from .normalise import normalise
from .runtime import ModelRuntime, get_runtime, resolve_device, torch_thread
from .windows import sentence_spans

Score = Annotated[float, Field(ge=0, le=1)]
ProblemType = Literal["auto", "single_label_classification", "multi_label_classification"]


class HFClassifierParams(ScoredParams):
    """`model_path` is fixed when the detector is built; `max_length` None means the model's own
    limit (at most 512 unless the model says more)."""

    model_path: str = Field(min_length=1)
    safe_labels: list[str] = Field(default_factory=list)
    thresholds: dict[str, Score] = Field(default_factory=dict)
    max_length: int | None = Field(None, ge=8, le=8192)
    stride: int = Field(32, ge=0, le=4096)
    problem_type: ProblemType = "auto"
    detection_type: str = Field("sequence_classification", min_length=1, max_length=64)

    @model_validator(mode="after")
    def _check_stride(self) -> HFClassifierParams:
        if self.max_length is not None and self.stride >= self.max_length // 2:
            raise ValueError(
                f"stride ({self.stride}) must be less than half of max_length ({self.max_length})"
            )
        return self


@functools.lru_cache(maxsize=256)
def _config(path: str, mtime_ns: int) -> dict[str, Any]:
    return read_config(path)


def _model_config(model_path: str) -> dict[str, Any]:
    try:
        mtime = os.stat(os.path.join(model_path, "config.json")).st_mtime_ns
    except OSError:
        mtime = -1
    return _config(model_path, mtime)


@functools.lru_cache(maxsize=256)
def _labels_for(model_path: str) -> tuple[str, ...]:
    """The labels of a configured model folder, read once per process: request validation
    needs them on every request and must not touch the filesystem each time (the path is the
    config's, never a request's)."""
    return tuple(labels_of(_model_config(model_path)))


def _check_labels(p: HFClassifierParams, labels: tuple[str, ...] | list[str]) -> None:
    known = set(labels)
    for field, names in (("safe_labels", p.safe_labels), ("thresholds", list(p.thresholds))):
        for name in names:
            if name not in known:
                raise InvalidParams.at(
                    field, f"unknown label {name!r} (the model's labels: {', '.join(labels)})"
                )


@dataclass(frozen=True)
class _Window:
    """`sliding`: a window of the whole text (else one of its sentences)."""

    start: int
    end: int
    logits: np.ndarray
    sliding: bool = True


@dataclass(frozen=True)
class _Loaded:
    tokenizer: Any
    model: Any
    max_tokens: int
    specials: int


def _load(path: str, device: str) -> _Loaded:
    tokenizer, model = load_sequence_classifier(path, device)
    return _Loaded(
        tokenizer,
        model,
        model_max_tokens(tokenizer, model),
        tokenizer.num_special_tokens_to_add(pair=False),
    )


class HFClassifierDetector(BatchedDetector[tuple[str, int | None, int], list[_Window]]):
    name = "hf_classifier"
    description = (
        "Any local Hugging Face sequence-classification folder (params.model_path). One "
        "detection per label not in safe_labels whose score (max over sliding windows of "
        "max_length tokens overlapping by stride, and over the content's sentences) reaches "
        "thresholds[label], else min_score (default 0.1) or threshold. Span: the whole "
        "content, or the best window's characters when the content needed several sliding "
        "windows."
    )
    Params: ClassVar[type[ScoredParams]] = HFClassifierParams
    # model_path (the only path-like param of any built-in), windowing and problem_type are
    # config-only: a request naming them is refused before anything is read
    REQUEST_PARAMS: ClassVar[frozenset[str]] = SCORED_REQUEST_PARAMS | {
        "safe_labels",
        "thresholds",
    }

    def __init__(self, params: Mapping[str, Any] | None = None, *, device: str = "auto") -> None:
        super().__init__(params, device=device)
        config = _model_config(self.params.model_path)
        self.labels = labels_of(config)
        self._config_problem_type = config.get("problem_type")

    @classmethod
    def parse_params(cls, params: Mapping[str, Any] | None) -> HFClassifierParams:
        """Config params: model_path must be a model folder (its config.json is read)."""
        p = parse_params(HFClassifierParams, params)
        try:
            labels = labels_of(_model_config(p.model_path))
        except (ValueError, TypeError) as exc:
            raise InvalidParams.at("model_path", str(exc)) from None
        _check_labels(p, labels)
        return p

    @classmethod
    def validate_request(cls, config: Mapping[str, Any], request: Any) -> HFClassifierParams:
        """Label names are checked against the configured model's labels, read once."""
        p: HFClassifierParams = super().validate_request(config, request)
        try:
            labels = _labels_for(p.model_path)
        except (ValueError, TypeError) as exc:
            raise InvalidParams.at("model_path", str(exc)) from None
        _check_labels(p, labels)
        return p

    def check_request(self, params: Mapping[str, Any] | None) -> HFClassifierParams:
        p: HFClassifierParams = super(HFClassifierDetector, type(self)).validate_request(
            self._raw_params, params
        )
        _check_labels(p, self.labels)  # this detector's own labels: nothing to read
        return p

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["labels"] = list(self.labels)
        return info

    def _make_runtime(self) -> ModelRuntime:
        device = resolve_device(self.device)
        path = os.path.realpath(self.params.model_path)
        return get_runtime(
            ("seqcls", path, device), lambda: _load(path, device), thread=torch_thread(device)
        )

    def _judge(self, items: list[tuple[str, int | None, int]]) -> list[list[_Window]]:
        """The model reads the normalised view (DESIGN 4.6b), in the worker thread; each
        window's span is mapped back to the original characters."""
        views = [normalise(text) for text, _, _ in items]
        results = self._forward(
            [(view.text, ml, st) for view, (_, ml, st) in zip(views, items, strict=True)]
        )
        for view, windows in zip(views, results, strict=True):
            if not view.identity:
                windows[:] = [
                    replace(w, start=a, end=b)
                    for w in windows
                    for a, b in [view.span(w.start, w.end)]
                ]
        return results

    def _forward(self, items: list[tuple[str, int | None, int]]) -> list[list[_Window]]:
        """Tokenises every item, and each sentence of an item of several, into windows (a
        window whose span another already has is dropped), runs them in sub-batches of at most
        max_batch_size windows (sorted by length to cut padding), returns logits per window."""
        import torch

        loaded: _Loaded = self._runtime.get()
        tokenizer, model = loaded.tokenizer, loaded.model
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (_, max_length, stride) in enumerate(items):
            ml = min(max_length or loaded.max_tokens, loaded.max_tokens)
            st = min(stride, max(0, (ml - loaded.specials) // 2))
            groups.setdefault((ml, st), []).append(i)
        owners: list[int] = []
        spans: list[tuple[int, int]] = []
        sliding: list[bool] = []
        features: list[dict[str, list[int]]] = []
        seen: set[tuple[int, int, int]] = set()
        for (ml, st), idx in groups.items():
            texts: list[str] = []
            origins: list[tuple[int, int | None]] = []  # (item, sentence start or None)
            for i in idx:
                text = items[i][0]
                texts.append(text)
                origins.append((i, None))
                parts = sentence_spans(text)
                if len(parts) > 1:
                    texts.extend(text[a:b] for a, b in parts)
                    origins.extend((i, a) for a, _ in parts)
            enc = tokenizer(
                texts,
                truncation=True,
                max_length=ml,
                stride=st,
                return_overflowing_tokens=True,
                return_offsets_mapping=True,
            )
            keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
            for w, sample in enumerate(enc["overflow_to_sample_mapping"]):
                i, shift = origins[sample]
                at = shift or 0
                offsets = [(a, b) for a, b in enc["offset_mapping"][w] if b > a]
                span = (offsets[0][0] + at, offsets[-1][1] + at) if offsets else (at, at)
                if shift is not None and (i, *span) in seen:
                    continue  # a sentence that a sliding window already read as it is
                seen.add((i, *span))
                spans.append(span)
                sliding.append(shift is None)
                owners.append(i)
                features.append({k: enc[k][w] for k in keys})
        order = sorted(range(len(features)), key=lambda w: len(features[w]["input_ids"]))
        logits: list[np.ndarray | None] = [None] * len(features)
        device = next(model.parameters()).device
        rows = self.params.max_batch_size
        for b in range(0, len(order), rows):
            chunk = order[b : b + rows]
            batch = tokenizer.pad([features[w] for w in chunk], return_tensors="pt")
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.inference_mode():
                out = model(**batch).logits.float().cpu().numpy()
            for r, w in enumerate(chunk):
                logits[w] = out[r]
        windows: list[list[_Window]] = [[] for _ in items]
        for w, i in enumerate(owners):
            row = logits[w]
            assert row is not None
            windows[i].append(_Window(spans[w][0], spans[w][1], row, sliding[w]))
        for per in windows:
            per.sort(key=lambda w: (w.start, w.end))
        return windows

    def _probabilities(self, logits: np.ndarray, problem_type: str) -> np.ndarray:
        if problem_type == "auto":
            problem_type = self._config_problem_type or "single_label_classification"
        if problem_type == "multi_label_classification" or logits.shape[-1] == 1:
            return 1.0 / (1.0 + np.exp(-logits))
        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=-1, keepdims=True)

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        p: HFClassifierParams = self.effective_params(params)
        out: list[list[Detection]] = [[] for _ in contents]
        todo = [i for i, c in enumerate(contents) if c.strip()]
        results = await self._batcher.submit([(contents[i], p.max_length, p.stride) for i in todo])
        safe = set(p.safe_labels)
        for i, windows in zip(todo, results, strict=True):
            content = contents[i]
            probs = self._probabilities(np.stack([w.logits for w in windows]), p.problem_type)
            found: list[Detection] = []
            for j, label in enumerate(self.labels[: probs.shape[1]]):
                if label in safe:
                    continue
                best = int(np.argmax(probs[:, j]))
                score = float(probs[best, j])
                if score < p.thresholds.get(label, p.floor):
                    continue
                if sum(w.sliding for w in windows) == 1:  # the model read it whole
                    (start, end), meta = text_bounds(content), None
                else:
                    start, end = windows[best].start, windows[best].end
                    meta = {"windows": len(windows), "window": best}
                found.append(
                    Detection(
                        start=start,
                        end=end,
                        text=content[start:end],
                        detection=label,
                        detection_type=p.detection_type,
                        score=score,
                        metadata=meta,
                    )
                )
            found.sort(key=lambda d: (d.start, d.end))  # stable: label order within a span
            out[i] = found
        return out
