"""The configuration reference in the repository (issue 41 item 1): docs/configuration.md is
exactly what the schema renders (it fails here when a key changes and the file was not
regenerated), every key the shipped config.yaml sets is documented, and the README points at it
and at nothing outside the repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.config_reference import render

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def test_the_reference_is_what_the_schema_renders() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is stale: python -m orchestrator.config_reference > "
        "docs/configuration.md"
    )


def _keys(node: Any, ids: frozenset[str]) -> set[str]:
    """Every key in the YAML tree, skipping the ids users choose (models, chunkers, detectors)."""
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in ids:
                out.add(str(key))
            out |= _keys(value, ids)
    elif isinstance(node, list):
        for item in node:
            out |= _keys(item, ids)
    return out


def test_every_key_of_the_shipped_config_is_documented() -> None:
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text(encoding="utf-8"))
    ids = frozenset(
        [*shipped["models"], *shipped["chunkers"], *shipped["detectors"]]
        + [d for m in shipped["models"].values() for g in m["guardrails"].values() for d in g]
    )
    documented = DOC.read_text(encoding="utf-8")
    missing = sorted(k for k in _keys(shipped, ids) if f"| `{k}` |" not in documented)
    assert missing == []


def test_the_readme_links_the_reference_and_nothing_outside_the_repository() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/configuration.md)" in readme
    assert "../shared" not in readme
