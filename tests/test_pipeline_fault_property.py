"""Fault injection through the whole orchestrator, as a property (issue 32, "Deliver"): for a
random engine fault (mode and cut point), an optional failing detector and any streaming
surface, the client gets exactly one terminal event, frames that tile the text without a gap,
the uninterrupted text when only the engine failed (migration is invisible), and the right
migration count.

The real orchestrator on 127.0.0.1 with one fake native engine (migration resumes on it once
its fault is spent: `quarantine_s` 0) and fake remote detectors, on a loop of their own
(hypothesis is synchronous)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    MODEL,
    ServedStack,
    assert_contiguous,
    frames,
    native_config,
    remote,
    terminal,
)

SCRIPT = ["The", " cat", " sat", ".", " It", " was", " warm", ".", " Then", " it", " slept", "."]
FULL = "".join(SCRIPT)
# faults a replica can show mid-stream that migration must hide (stall and hang need the
# stall clock: tests/test_migration*.py cover them)
MIGRATABLE = ("close", "eof", "error", "blank", "garbage", "nested", "no_data", "http")
SURFACES = ("fms", "chat", "responses")


class Stack(ServedStack):
    """One fake engine (its fault re-armed per example), fake detectors, the orchestrator."""

    def __init__(self) -> None:
        self.engine = FakeEngine(script=SCRIPT)
        dets = FakeDetectorServer()
        dets.add("cat", DetectorBehaviour(words={"cat": 0.9}, detection="animal"))
        for word in ("cat", "warm", "slept"):
            dets.add(f"fails_on_{word}", DetectorBehaviour(fail_status=500, fail_on=word))

        def config() -> dict[str, Any]:
            detectors = {"cat": remote(dets.url)}
            detectors.update({f"fails_on_{w}": remote(dets.url) for w in ("cat", "warm", "slept")})
            return native_config(
                self.engine.url,
                detectors=detectors,
                model={"migration": {"limit": 3, "quarantine_s": 0, "stall_timeout_s": 30}},
            )

        super().__init__("fault-property", config, [self.engine, dets])

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """The raw reply of a streamed request: (status, body text)."""

        async def post() -> tuple[int, str]:
            assert self.orch.session is not None
            async with self.orch.session.post(self.orch.url + path, json=body) as r:
                return r.status, await r.text()

        return self.run(post())

    def arm(self, fault: Fault | None) -> None:
        async def arm() -> None:
            self.engine.faults[:] = [] if fault is None else [fault]
            self.engine.requests.clear()

        self.run(arm())


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack() as s:
        yield s


def outcome(stack: Stack, surface: str, detectors: list[str]) -> tuple[str, str, str | None]:
    """(text the client received, how it ended, the error type if it failed), after checking
    the surface's own framing: one terminal event, contiguous frames."""
    if surface == "fms":
        body: dict[str, Any] = {"model_id": MODEL, "inputs": "Tell me."}
        if detectors:
            body["guardrail_config"] = {"output": {"models": {d: {} for d in detectors}}}
        events = stack.run(stack.orch.stream(body))
        end = terminal(events)  # exactly one, and last
        text = assert_contiguous(frames(events))
        error = end.data.get("error", {}).get("type") or end.data.get("type")
        if end.name == "completed":
            assert end.data["migrations"] == len(stack.engine.requests) - 1
            assert end.data["processed_index"] == len(text)
        # `error` is `failed` before any frame (DESIGN 4.3)
        return text, "failed" if end.name == "error" else end.name, error
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me."}]}
    if detectors:
        chat["detectors"] = {"output": {d: {} for d in detectors}}
    if surface == "chat":
        status, raw = stack.post("/v1/chat/completions", {**chat, "stream": True})
        if status != 200:  # an error before the first byte is a real HTTP error (DESIGN 4.8)
            return "", "failed", json.loads(raw)["error"]["type"]
        chunks = [
            line.removeprefix("data: ") for line in raw.split("\n\n") if line.startswith("data: ")
        ]
        chunks = [c if c == "[DONE]" else json.loads(c) for c in chunks]
        assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]"
        data = chunks[:-1]
        errors = [c["error"] for c in data if "error" in c]
        finishes = [
            ch["finish_reason"] for c in data for ch in c.get("choices", []) if ch["finish_reason"]
        ]
        assert len(errors) + len(finishes) == 1, chunks  # one way to end
        text = "".join(
            ch["delta"].get("content") or "" for c in data for ch in c.get("choices", [])
        )
        if errors:
            return text, "failed", errors[0]["type"]
        return text, "completed" if finishes == ["stop"] else finishes[0], None
    responses: dict[str, Any] = {"model": MODEL, "input": "Tell me.", "stream": True}
    if detectors:
        responses["detectors"] = chat["detectors"]
    status, raw = stack.post("/v1/responses", responses)
    if status != 200:
        return "", "failed", json.loads(raw)["error"]["type"]
    events = [
        json.loads(line.removeprefix("data: "))
        for line in raw.split("\n")
        if line.startswith("data: ")
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    terminals = [
        e["type"]
        for e in events
        if e["type"] in ("response.completed", "response.incomplete", "response.failed", "error")
    ]
    assert len(terminals) == 1 and events[-1]["type"] == terminals[0], terminals
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    last = events[-1]
    if last["type"] == "response.completed":
        assert last["response"]["output"][0]["content"][0]["text"] == text
        return text, "completed", None
    if last["type"] == "error":
        return text, "failed", last.get("code") or last.get("type")
    # a failed response carries OpenAI's code (`server_error`), the detector in its message
    error = last["response"].get("error")
    if error is not None and error["code"] == "server_error" and "detector `" in error["message"]:
        return text, "failed", "detector_error"
    return text, last["type"].removeprefix("response."), error and error["code"]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    mode=st.sampled_from((None, *MIGRATABLE)),
    cut=st.integers(0, len(SCRIPT)),
    failing=st.sampled_from((None, "cat", "warm", "slept")),
    annotating=st.booleans(),
    surface=st.sampled_from(SURFACES),
)
def test_any_engine_fault_is_invisible_and_any_detector_failure_ends_cleanly(
    stack: Stack, mode: str | None, cut: int, failing: str | None, annotating: bool, surface: str
) -> None:
    stack.arm(None if mode is None else Fault(mode, after_tokens=cut))
    detectors = (["cat"] if annotating else []) + ([f"fails_on_{failing}"] if failing else [])
    text, ending, error = outcome(stack, surface, detectors)
    assert FULL.startswith(text)
    if failing is None:
        assert (text, ending, error) == (FULL, "completed", None)
        fired = mode is not None and (mode == "http" or cut < len(SCRIPT))
        assert len(stack.engine.requests) == 1 + fired  # one migration per fault, no more
    else:
        assert ending == "failed", (ending, error)
        assert error == "detector_error"
        # nothing the failing detector did not judge was released
        assert failing not in text
