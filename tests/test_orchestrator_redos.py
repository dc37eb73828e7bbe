"""A hostile regex through every endpoint (DESIGN 4, 6): refused with 422 before any byte unless
the operator allows request patterns for that detector; then RE2 runs it in linear time, off
the event loop, and a concurrent stream keeps flowing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from orchestrator.app import CONTENT_PATH, STREAM_CONTENT_PATH, STREAMING_PATH, UNARY_PATH
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    frames,
    generation_body,
    native_config,
    terminal,
)
from tests.wait_support import finished

REDOS = "(a+)+$"
HOSTILE = "a" * 30 + "!"


def config(engine_url: str) -> dict[str, Any]:
    return native_config(
        engine_url,
        detectors={
            "pii": {"builtin": "regex", "chunker_id": "sentence"},
            "open": {
                "builtin": "regex",
                "chunker_id": "sentence",
                "params": {"allow_request_patterns": True},
            },
        },
    )


def bodies(detector: str) -> list[tuple[str, Any]]:
    params = {detector: {"patterns": {"r": REDOS}}}
    return [
        (CONTENT_PATH, {"content": HOSTILE, "detectors": params}),
        (STREAMING_PATH, generation_body(HOSTILE, input=params)),
        (UNARY_PATH, generation_body(output=params)),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": HOSTILE}],
                "stream": True,
                "detectors": {"input": params},
            },
        ),
        (STREAM_CONTENT_PATH, json.dumps({"detectors": params, "content": HOSTILE}) + "\n"),
    ]


@pytest.mark.parametrize(("path", "body"), bodies("pii"))
async def test_request_patterns_are_refused_on_every_endpoint(engine, path, body) -> None:
    async with Orchestrator(config(engine.url)) as orch:
        status, reply = await orch.post(path, body)
    assert status == 422, reply
    error = reply["error"] if "error" in reply else reply
    assert "patterns" in (error.get("details") or error.get("message"))
    assert engine.requests == []


async def test_allowed_patterns_run_in_linear_time_while_a_stream_flows(engine) -> None:
    async with Orchestrator(config(engine.url)) as orch:
        long_text = "a" * 99_999 + "!"  # server.max_detection_chars: 100,000 by default
        hostile = orch.post(
            CONTENT_PATH, {"content": long_text, "detectors": {"open": {"patterns": {"r": REDOS}}}}
        )
        stream = orch.stream(generation_body(output={"pii": {}}))
        (status, reply), events = await finished(
            asyncio.gather(hostile, stream), 60, "asyncio.gather(hostile, stream)"
        )
    assert status == 200
    # every match is a run of a's that the pattern really matches (RE2 semantics, per chunk)
    assert reply["detections"]
    for d in reply["detections"]:
        assert d["detection"] == "r" and d["detector_id"] == "open"
        assert long_text[d["start"] : d["end"]] == d["text"] == "a" * (d["end"] - d["start"])
    assert terminal(events).name == "completed"
    assert "".join(f["generated_text"] for f in frames(events)) == "I am great. What about you?"


@pytest.mark.parametrize("path_param", ["model_path", "path"])
async def test_a_request_naming_a_path_is_422_and_touches_no_file(
    engine, monkeypatch, tmp_path, path_param
) -> None:
    """Paths come from the config only: a request's `model_path` is refused before anything could
    open it (every file access under the bait directory would raise)."""
    import builtins
    import os

    bait = tmp_path / "bait"
    real_open, real_stat = builtins.open, os.stat

    def guarded_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert str(bait) not in str(file), f"opened {file}"
        return real_open(file, *args, **kwargs)

    def guarded_stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert str(bait) not in str(path), f"stat {path}"
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "stat", guarded_stat)
    params = {"pii": {path_param: str(bait)}}
    async with Orchestrator(config(engine.url)) as orch:
        for path, body in [
            (CONTENT_PATH, {"content": "hi", "detectors": params}),
            (STREAMING_PATH, generation_body(output=params)),
            (
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "detectors": {"output": params},
                },
            ),
        ]:
            status, reply = await orch.post(path, body)
            assert status == 422, (path, reply)
    assert engine.requests == []
