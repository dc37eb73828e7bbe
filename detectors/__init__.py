"""guardstream detectors: built-in detectors (regex PII, NER PII, profanity/HAP, prompt injection, topic,
Hugging Face classifier), micro-batched model inference, and the detector service (DESIGN 6).

Importing this package is cheap (no torch, no models): the orchestrator imports it to validate a
config. Models load when a detector first needs them, once per (model, device) and process.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .api import ContentsRequest, Detection, ErrorBody
from .base import (
    ORCHESTRATOR_PARAM_KEYS,
    Detector,
    DetectorError,
    InvalidParams,
    Overloaded,
    param_error_lines,
)
from .runtime import check_device

BUILTINS: tuple[str, ...] = (
    "regex",
    "pii_ner",
    "profanity",
    "prompt_injection",
    "topic",
    "hf_classifier",
)

_CLASSES: dict[str, tuple[str, str]] = {
    "regex": (".regex_pii", "RegexDetector"),
    "pii_ner": (".pii_ner", "PiiNerDetector"),
    "profanity": (".profanity", "ProfanityDetector"),
    "prompt_injection": (".prompt_injection", "PromptInjectionDetector"),
    "topic": (".topic", "TopicDetector"),
    "hf_classifier": (".hf_classifier", "HFClassifierDetector"),
}


def detector_class(builtin: str) -> type[Detector]:
    """The class of a built-in; ValueError for an unknown name."""
    if builtin not in _CLASSES:
        raise ValueError(
            f"unknown built-in detector {builtin!r} (expected one of {', '.join(BUILTINS)})"
        )
    module, cls = _CLASSES[builtin]
    return getattr(importlib.import_module(module, __name__), cls)


def validate_params(builtin: str, params: Mapping[str, Any] | None) -> None:
    """Checks a config's params without loading a model (it may read a model folder's
    config.json, and compiles custom patterns); InvalidParams (a ValueError) names the bad one,
    its `problems` give each location (see param_error_lines)."""
    detector_class(builtin).parse_params(params or {})


def validate_request_params(
    builtin: str, config_params: Mapping[str, Any] | None, request_params: Any
) -> None:
    """Checks a request's detector_params for a built-in configured with `config_params`:
    only the params the built-in declares request-settable are accepted (checked first, before
    anything is merged), so a request can never name a path (`model_path`), change batching, or
    send regexes unless the config says `allow_request_patterns: true` (they then compile with
    RE2). Never touches a path a request could influence. InvalidParams (a ValueError, the
    orchestrator's 422) names the problem; ValueError for an unknown built-in.
    `threshold`/`on_detection` in `config_params` are the orchestrator's and are ignored."""
    config = {k: v for k, v in (config_params or {}).items() if k not in ORCHESTRATOR_PARAM_KEYS}
    detector_class(builtin).validate_request(config, request_params)


def build(
    builtin: str, params: Mapping[str, Any] | None = None, *, device: str = "auto"
) -> Detector:
    """A ready detector (its model loads on first use or `await detector.warmup()`).
    InvalidParams for bad params, ValueError for an unknown builtin or device."""
    cls = detector_class(builtin)
    check_device(device)
    return cls(params or {}, device=device)


__all__ = [
    "BUILTINS",
    "ContentsRequest",
    "Detection",
    "Detector",
    "DetectorError",
    "ErrorBody",
    "InvalidParams",
    "Overloaded",
    "build",
    "detector_class",
    "param_error_lines",
    "validate_params",
    "validate_request_params",
]
