"""`profanity` (HAP): the scikit-learn model of `alt-profanity-check` (shipped in its wheel).

Score: the model's probability that the content is profane, the maximum over the content's
sentences and 512-character spans (DESIGN 4.6b; ScoredTextDetector), so an insult inside benign
text is not diluted (1.0 alone, 0.13 after 23 benign sentences when read whole). Vectorised, so
every window of a micro-batch of texts is one `predict_proba` call.

A TF-IDF model reads words: it drops single letters and cuts at symbols, so `f*ck` is `ck` to
it, `f u c k` nothing, `fuuuck` and `phuck` unknown words. Each content is also judged as
`views` reads it (the maximum counts): its disguised words read back as the worst word of the
model's vocabulary they can stand for (detectors/disguised_words.py: `f**k`, `sh!t`, `b1tch`,
`f.u.c.k`, one letter per line, `fuuuck`, `phuck`), and the payloads and respellings the
injection detector judges (detectors/decode.py, detectors/respell.py: base64, hex, ROT13,
leetspeak, reversed text, words cut by dots, Pig Latin, filler words). A content holding more
readable payloads than are judged scores 1.0 (fail closed), as for `prompt_injection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .base import ScoredParams
from .decode import payloads
from .disguised_words import Readings, reading
from .english_words import english_words
from .model import ScoredTextDetector
from .normalise import view_text
from .runtime import ModelRuntime, get_runtime, quiet_sklearn_unpickling

# A disguised word is read as a word of the model's vocabulary that scores this much alone
# (chosen on bench/quality.py `--only hap-evasion --split dev`): swear words and insults, not
# the everyday words a noisy model also scores high
READ_AS = 0.9


class ProfanityParams(ScoredParams):
    """min_score/threshold floor (default 0.1) and batching settings; nothing model-specific."""


@dataclass(frozen=True)
class ProfanityModel:
    vectorizer: Any
    model: Any
    column: int
    readings: Readings


def _load() -> tuple[Any, Any, int]:
    """The vectorizer, the model and the column of the profane class."""
    quiet_sklearn_unpickling()
    from profanity_check import profanity_check as pc  # loads the model on import

    model = pc.model
    classes = list(getattr(model, "classes_", [0, 1]))
    return pc.vectorizer, model, classes.index(1) if 1 in classes else 1


def _load_with_readings() -> ProfanityModel:
    vectorizer, model, col = _load()
    return ProfanityModel(vectorizer, model, col, vocabulary_readings(vectorizer, model, col))


def vocabulary_readings(vectorizer: Any, model: Any, col: int) -> Readings:
    """The words of the model's vocabulary (letters only, three or more) that score READ_AS or
    more alone: what a disguised word may be read as (`disguised_words.Readings`); MiniLM's
    whole words are the known words, never read as another (the model's vocabulary is not:
    it holds the misspellings of the comments it was trained on, `shyt` among them)."""
    import numpy as np
    from scipy.sparse import csr_matrix

    vocab = sorted(w for w in vectorizer.vocabulary_ if w.isalpha() and w.isascii())
    # a one-word text's TF-IDF row is that word's column at 1.0 (one term, L2-normalised):
    # built directly, it is the same matrix as `vectorizer.transform(vocab)` at a sixth of
    # the cost (it is built while the first request waits for the model)
    columns = [vectorizer.vocabulary_[w] for w in vocab]
    rows = csr_matrix(
        (np.ones(len(vocab)), (np.arange(len(vocab)), columns)),
        shape=(len(vocab), len(vectorizer.vocabulary_)),
    )
    probs = model.predict_proba(rows)[:, col]
    words = {w: float(p) for w, p in zip(vocab, probs, strict=True) if p >= READ_AS and len(w) >= 3}
    return Readings(words, english_words(), frozenset(vocab))


class ProfanityDetector(ScoredTextDetector):
    name = "profanity"
    description = (
        "HAP/profanity: alt-profanity-check (linear SVM on TF-IDF, calibrated); the score is "
        "the maximum over the content's sentences and 512-character spans, and over its "
        "disguised words read back (f*ck, sh!t, f u c k, fuuuck, phuck) and the payloads "
        "decoded out of it (base64, ROT13, reversed, ...). One whole-content "
        "detection 'profanity' (type 'hap') per content with score >= min_score (or threshold)."
    )
    Params: ClassVar[type[ScoredParams]] = ProfanityParams
    label = "profanity"
    detection_type = "hap"

    def _make_runtime(self) -> ModelRuntime:
        return get_runtime(("profanity",), _load_with_readings)

    def views(self, text: str) -> tuple[list[str], bool]:
        """Its disguised words read back (`disguised_words.reading`, on the view before markup
        is decoded: `f**k` is no emphasis) and its payloads and respellings (`payloads`)."""
        folded = view_text(text, markup=False)
        decoded, overflowed = payloads(folded, text)
        readings = self._runtime.get().readings
        read = [reading(t, readings) for t in dict.fromkeys((folded, *decoded))]
        return [*decoded, *(r for r in read if r is not None)], overflowed

    def _forward(self, items: list[str]) -> list[float]:
        m = self._runtime.get()
        probs = m.model.predict_proba(m.vectorizer.transform(items))
        return [float(x) for x in probs[:, m.column]]
