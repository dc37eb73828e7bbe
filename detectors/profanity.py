"""`profanity` (HAP): the scikit-learn model of `alt-profanity-check` (shipped in its wheel).

Score: the model's probability that the content is profane, the maximum over the content's
sentences and 512-character spans (DESIGN 4.6b; ScoredTextDetector), so an insult inside benign
text is not diluted (1.0 alone, 0.13 after 23 benign sentences when read whole). Vectorised, so
every window of a micro-batch of texts is one `predict_proba` call.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .base import ScoredParams
from .model import ScoredTextDetector
from .runtime import ModelRuntime, get_runtime, quiet_sklearn_unpickling


class ProfanityParams(ScoredParams):
    """min_score/threshold floor (default 0.1) and batching settings; nothing model-specific."""


def _load() -> tuple[Any, Any, int]:
    quiet_sklearn_unpickling()
    from profanity_check import profanity_check as pc  # loads the model on import

    model = pc.model
    classes = list(getattr(model, "classes_", [0, 1]))
    return pc.vectorizer, model, classes.index(1) if 1 in classes else 1


class ProfanityDetector(ScoredTextDetector):
    name = "profanity"
    description = (
        "HAP/profanity: alt-profanity-check (linear SVM on TF-IDF, calibrated); the score is "
        "the maximum over the content's sentences and 512-character spans. One whole-content "
        "detection 'profanity' (type 'hap') per content with score >= min_score (or threshold)."
    )
    Params: ClassVar[type[ScoredParams]] = ProfanityParams
    label = "profanity"
    detection_type = "hap"

    def _make_runtime(self) -> ModelRuntime:
        return get_runtime(("profanity",), _load)

    def _forward(self, items: list[str]) -> list[float]:
        vectorizer, model, col = self._runtime.get()
        probs = model.predict_proba(vectorizer.transform(items))
        return [float(x) for x in probs[:, col]]
