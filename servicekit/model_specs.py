"""Which model specs an engine accepts, without importing torch: the engine checks a spec with it
before loading, and the orchestrator's config check (`check-config`) rejects a managed `model:`
typo with the same words before any engine process starts (the orchestrator imports nothing from
`generation`, DESIGN 1)."""

from __future__ import annotations

from pathlib import Path

# Folder names carry a version: a change to a builder gets a fresh folder instead of a stale one.
BUILTIN_FOLDERS = {"smollm2-135m": "smollm2-135m-instruct-v1", "tiny-random": "tiny-random-v1"}
BUILTIN_MODELS = tuple(BUILTIN_FOLDERS)


def spec_problem(spec: str) -> str | None:
    """Why `spec` names no model (None when it is a built-in or a folder with a config.json)."""
    if spec in BUILTIN_FOLDERS:
        return None
    if (Path(spec).expanduser() / "config.json").is_file():
        return None
    return (
        f"model spec {spec!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) "
        "nor a folder with a config.json"
    )
