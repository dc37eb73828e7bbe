"""The abuse models bench/quality.py puts next to `profanity`: other models shipped with their
weights in PyPI packages (no download at run time), each read from its installed package.

Each is a scikit-learn bag-of-words model, as `profanity` is; the packages' own modules are not
imported (they load every model at import and need `pkg_resources` or nltk downloads), their
pickled vectorizer and classifier are, and applied to the whole text as the packages do:

- `cuss-inspect==1.0.2b0` (MIT): TF-IDF + logistic regression. Pickled with scikit-learn 0.23,
  whose TfidfTransformer kept its idf weights as a diagonal matrix (`_idf_diag`); today's reads
  them from `idf_`, so the weights are moved there (the same numbers).
- `best-profanity==1.1.5` (MIT): its English TF-IDF + calibrated classifier.
- `toxicityclassifier==1.0.1` (MIT): its English TF-IDF + logistic regression over lower-cased,
  punctuation-free Snowball stems without stop words. Its stop-word list is nltk's, which needs
  a download; scikit-learn's English list stands in for it.
- `hatesonar==0.1.0` (MIT): TF-IDF + L1 logistic regression over three classes (hate speech,
  offensive language, neither) trained on Davidson et al. 2017's tweets, shipped as an ONNX
  graph. onnxruntime 1.32 will not load it where the locale en_US.UTF-8 is missing (its
  StringNormalizer names that locale), so its steps are applied here with numpy from the graph's
  own weights, read with `onnx` (lower-case, `[a-zA-Z0-9_]+` tokens, term counts times idf, L2
  norm, linear, softmax; the same probabilities as onnxruntime's, to 1e-7, where it loads).
  Two scores: `hate` (its hate-speech class, the one a hate detector would use) and
  `hate or offensive` (1 - P(neither), a HAP score). Measured where installed:
      pip install --no-deps hatesonar==0.1.0 onnx==1.23.2 ml-dtypes==0.6.0
- `valx==0.2.6` ("MIT License (Modified)"): a decision tree over word counts with Davidson's
  three classes; its leaves are pure, so its score is 0 or 1 (hate speech or offensive).
- `tox-block==0.1.2` (MIT): a bidirectional LSTM over 20,000 words trained on Jigsaw's
  Wikipedia comments, six heads (`toxic`, `insult`, ...); the only neural abuse model with its
  weights in a PyPI wheel that we found. It needs TensorFlow with Keras 2 (`tf-keras`, which it
  was saved with) and `keras-preprocessing` for its pickled tokenizer: far too heavy for the
  project or bench/requirements-quality.txt, so it is measured only where they are installed:
      pip install tensorflow-cpu==2.21.0 tf-keras==2.21.0 keras-preprocessing==1.1.2 pandas
      pip install --no-deps tox-block==0.1.2
  Its `toxic` head is the one a HAP detector would use; its `insult` head is shown too, as it
  is what the insult set labels.

Where a package is not installed its model is skipped (with a line saying so).
"""

from __future__ import annotations

import pickle
import string
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

Scorer = Callable[[list[str]], list[float]]


def _load_pickle(path: Path) -> Any:
    with path.open("rb") as f:
        return pickle.load(f)  # the named packages' own model files


def _cuss_inspect(root: Path) -> Scorer:
    vectorizer = _load_pickle(root / "data" / "vectorizer_v4.lgst")
    model = _load_pickle(root / "data" / "logitclf_v4.lgst")
    tfidf = vectorizer._tfidf
    if not hasattr(tfidf, "idf_") and hasattr(tfidf, "_idf_diag"):
        tfidf.idf_ = tfidf._idf_diag.diagonal().copy()
    col = list(model.classes_).index(1)
    return lambda texts: [
        float(p) for p in model.predict_proba(vectorizer.transform(texts))[:, col]
    ]


def _best_profanity(root: Path) -> Scorer:
    import joblib

    vectorizer = joblib.load(root / "data" / "english-vectorizer.joblib")
    model = joblib.load(root / "data" / "english-model.joblib")
    col = list(model.classes_).index(1)
    return lambda texts: [
        float(p) for p in model.predict_proba(vectorizer.transform(texts))[:, col]
    ]


def _toxicityclassifier(root: Path) -> Scorer:
    from nltk.stem.snowball import SnowballStemmer
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    vectorizer = _load_pickle(root / "models" / "EnglishVectorizer.bf")
    model = _load_pickle(root / "models" / "EnglishModel.bf")
    stem = SnowballStemmer("english").stem
    no_punctuation = str.maketrans("", "", string.punctuation)
    col = list(model.classes_).index(1)

    def prepare(text: str) -> str:
        words = text.strip().lower().translate(no_punctuation).split()
        return " ".join(stem(w) for w in words if w not in ENGLISH_STOP_WORDS)

    def score(texts: list[str]) -> list[float]:
        rows = vectorizer.transform([prepare(t) for t in texts])
        return [float(p) for p in model.predict_proba(rows)[:, col]]

    return score


def _hatesonar(score_class: str) -> Callable[[Path], Scorer]:
    def load(root: Path) -> Scorer:
        import re

        import numpy as np
        import onnx
        from onnx import numpy_helper

        graph = onnx.load(str(root / "model" / "model.onnx")).graph
        attrs = {
            n.op_type: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            for n in graph.node
        }
        tfidf, linear = attrs["TfIdfVectorizer"], attrs["LinearClassifier"]
        token = re.compile(attrs["Tokenizer"]["tokenexp"].decode())
        vocab = {
            w.decode(): int(i)
            for w, i in zip(tfidf["pool_strings"], tfidf["ngram_indexes"], strict=True)
        }
        (idf,) = (numpy_helper.to_array(i) for i in graph.initializer if i.name == "idfcst")
        coef = np.array(linear["coefficients"], np.float32).reshape(3, -1)
        intercept = np.array(linear["intercepts"], np.float32)

        def score(texts: list[str]) -> list[float]:
            out = []
            for text in texts:
                v = np.zeros(len(idf), np.float32)
                for w in token.findall(text.lower()):
                    if (j := vocab.get(w)) is not None:
                        v[j] += 1
                v *= idf
                v /= max(float(np.linalg.norm(v)), 1e-12)
                logits = coef @ v + intercept
                p = np.exp(logits - logits.max())
                p /= p.sum()  # classes: 0 hate speech, 1 offensive language, 2 neither
                out.append(float(p[0] if score_class == "hate" else 1.0 - p[2]))
            return out

        return score

    return load


def _valx(root: Path) -> Scorer:
    tree = _load_pickle(root / "models" / "classifier_upgraded.pkl")
    counts = _load_pickle(root / "models" / "count_vectorizer.sav")
    neither = list(tree.classes_).index("No Hate and Offensive Speech")
    return lambda texts: [
        float(label != tree.classes_[neither])
        for label in tree.predict(counts.transform(texts).toarray())
    ]


def _tox_block(head: str) -> Callable[[Path], Scorer]:
    def load(root: Path) -> Scorer:
        import os

        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # saved with Keras 2
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import pandas as pd
        from tox_block.config import config
        from tox_block.prediction import _encoder, _model  # loaded on import

        col = config.LIST_CLASSES.index(head)

        def score(texts: list[str]) -> list[float]:
            rows = _encoder.transform(pd.DataFrame(texts, columns=["text"]))
            return [float(p) for p in _model(rows, training=False).numpy()[:, col]]

        return score

    return load


# name shown in the bench -> (import name of the package, loader)
ANCHORS: dict[str, tuple[str, Callable[[Path], Scorer]]] = {
    "cuss-inspect 1.0.2b0": ("cuss_inspect", _cuss_inspect),
    "best-profanity 1.1.5 (en)": ("best_profanity", _best_profanity),
    "toxicityclassifier 1.0.1 (en)": ("toxicityclassifier", _toxicityclassifier),
    "hatesonar 0.1.0 (hate)": ("hatesonar", _hatesonar("hate")),
    "hatesonar 0.1.0 (hate or offensive)": ("hatesonar", _hatesonar("hate or offensive")),
    "valx 0.2.6": ("valx", _valx),
    "tox-block 0.1.2 (toxic)": ("tox_block", _tox_block("toxic")),
    "tox-block 0.1.2 (insult)": ("tox_block", _tox_block("insult")),
}


def load_anchors(
    package_dir: Callable[[str], Path | None], names: Collection[str] | None = None
) -> dict[str, Scorer]:
    """The anchors whose packages are installed (of `names`, when given); `package_dir` finds a
    package's folder (None when it is not installed)."""
    out: dict[str, Scorer] = {}
    for name, (package, loader) in ANCHORS.items():
        if names is not None and name not in names:
            continue
        root = package_dir(package)
        if root is None:
            print(f"  {name}: not installed, skipped")
            continue
        try:
            out[name] = loader(root)
        except ImportError as e:  # tox-block without TensorFlow
            print(f"  {name}: {e}, skipped")
    return out
