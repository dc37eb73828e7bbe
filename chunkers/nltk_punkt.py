"""NLTK's Punkt module, imported without running `nltk/__init__.py`.

Why: `import nltk.tokenize.punkt` first runs the package's `__init__`, which imports nearly all of
NLTK and, through it, scipy, scikit-learn, numpy and joblib: about 115 MiB of RSS (80 MiB of it
private) and seconds of start-up in every process that chunks sentences, though Punkt needs none
of it (measured: `import orchestrator.app` 176 MiB RSS with the package import, 61 MiB without;
each `server.workers` worker paid it). Punkt itself needs a few plain modules (nltk.probability,
nltk.pathsec, nltk.tokenize.api, ...). So for the duration of this import, `nltk` and
`nltk.tokenize` are bare package objects with the real package paths, and the submodules load
from the real files. Afterwards every `nltk` module loaded here leaves sys.modules again (the
module objects live on, referenced by the sentence chunker), so a later `import nltk` anywhere
runs the real `__init__` and gets a complete, consistent package (with its own copies of the few
modules Punkt needs).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def _import_punkt() -> types.ModuleType:
    if "nltk" in sys.modules:  # the real package is loaded already: nothing to save
        return importlib.import_module("nltk.tokenize.punkt")
    before = set(sys.modules)
    try:
        for name in ("nltk", "nltk.tokenize"):
            spec = importlib.util.find_spec(name)
            if spec is None or spec.submodule_search_locations is None:
                raise ImportError(f"{name} is not installed")
            package = types.ModuleType(name)
            package.__path__ = list(spec.submodule_search_locations)
            package.__file__ = spec.origin
            package.__package__ = name
            sys.modules[name] = package
        return importlib.import_module("nltk.tokenize.punkt")
    finally:
        for name in set(sys.modules) - before:
            if name == "nltk" or name.startswith("nltk."):
                del sys.modules[name]


punkt_module = _import_punkt()
