"""check.sh's CPU rehearsal: imports limited to what the GPU machine will have.

On PYTHONPATH (bench/gpu/check.sh with CHECK_REHEARSE=1 puts it there, so every step's process
and its subprocesses load it), with GUARDSTREAM_REHEARSE_BUNDLE naming a folder that
`bench/gpu/bundle.sh --offline` made: a module of an installed distribution that is neither in
the GPU image (image.txt, with everything those require) nor among the bundle's wheels
(wheels.txt) raises ModuleNotFoundError saying so, as it would on the GPU machine. The venv here
has every package; without this a wheel missing from bundle.sh passes the rehearsal and fails
the lent session's set-up. A probe (importlib.util.find_spec) sees such a module as absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: set[str]) -> set[str]:
    """NAMES and every distribution they require (extras left out), as installed here."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


class _GpuImageOnly(importlib.abc.MetaPathFinder):
    def __init__(self, allowed: set[str], owners: dict[str, list[str]], bundle: str) -> None:
        self.allowed = allowed
        self.owners = owners
        self.bundle = bundle

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if "." in fullname:
            return None
        dists = self.owners.get(fullname)
        if (ROOT / fullname).is_dir() or (ROOT / f"{fullname}.py").is_file():
            return None  # the project's own (tests/, bench/, generation/ ...)
        if not dists or any(_norm(d) in self.allowed for d in dists):
            return None
        raise ModuleNotFoundError(
            f"{fullname} ({', '.join(dists)}) is neither in the GPU image nor among "
            f"bench/gpu/bundle.sh's wheels ({self.bundle}): the lent machine would not have it",
            name=fullname,
        )


def _install() -> None:
    bundle = os.environ.get("GUARDSTREAM_REHEARSE_BUNDLE")
    if not bundle:
        return
    folder = Path(bundle)
    image = {_norm(n) for n in (folder / "image.txt").read_text().split()}
    wheels = {_norm(n.split("==")[0]) for n in (folder / "wheels.txt").read_text().split()}
    allowed = _closure(image) | wheels | {"guardstream"}
    owners = importlib.metadata.packages_distributions()
    guard = _GpuImageOnly(allowed, owners, bundle)
    sys.meta_path.insert(0, guard)
    probe = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
        """A probe (transformers' is_X_available) finds such a module absent, not an error."""
        try:
            return probe(name, package)
        except ModuleNotFoundError as exc:
            if exc.name == name.partition(".")[0] and not name.startswith("."):
                return None
            raise

    importlib.util.find_spec = find_spec
    every = importlib.metadata.distributions

    def distributions(**kwargs: Any) -> Iterator[importlib.metadata.Distribution]:
        """Only the GPU machine's: pytest loads no plugin of a package it would not have."""
        for dist in every(**kwargs):
            if _norm(dist.metadata["Name"] or "") in allowed:
                yield dist

    importlib.metadata.distributions = distributions


_install()
