"""`python -m orchestrator stream` as a subprocess against a real orchestrator (fake engine and
detector): the text, highlighted detections, the terminal event line, the exit status of every
outcome, connection errors and API keys."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.terminal_client import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_REJECTED,
    EXIT_UNREACHABLE,
    Style,
    render_frame,
)
from tests.engine_processes import free_port
from tests.fakes.clock import expire_stalls, manual_stall_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import MODEL, SCRIPT, Orchestrator, native_config, remote
from tests.wait_support import finished

ROOT = Path(__file__).resolve().parents[1]
TEXT = "I am great. What about you?"
KEYS_ENV = "GUARDSTREAM_TEST_TERMINAL_KEYS"


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Runs the client; returns (exit status, stdout, stderr). stdout is a pipe, not a TTY."""
    return await finish(await spawn_cli(*args, env=env))


async def spawn_cli(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    child_env = {k: v for k, v in os.environ.items() if k != "GUARDSTREAM_API_KEY"}
    child_env.update(env or {})
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator",
        "stream",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=child_env,
    )


async def finish(proc: asyncio.subprocess.Process, shown: bytes = b"") -> tuple[int, str, str]:
    """(exit status, stdout with `shown` already read from it before, stderr)."""
    out, err = await finished(proc.communicate(), 60, "proc.communicate()")
    assert proc.returncode is not None
    return proc.returncode, (shown + out).decode(), err.decode()


def terminal_line(stdout: str) -> tuple[str, dict[str, Any]]:
    """The last line, `[event] {json}`."""
    last = stdout.rstrip("\n").split("\n")[-1]
    assert last.startswith("["), last
    name, _, data = last.partition("] ")
    return name[1:], json.loads(data)


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add("you", DetectorBehaviour(words={"you": 0.8}, detection="pronoun"))
    server.add("broken", DetectorBehaviour(fail_status=500))
    server.add("blocker", DetectorBehaviour(words={"What": 0.9}, detection="question"))
    await server.start()
    yield server
    await server.close()


def config(engine: FakeEngine, dets: FakeDetectorServer, **kwargs: Any) -> dict[str, Any]:
    detectors = {
        "you": remote(dets.url),
        "broken": remote(dets.url),
        "blocker": remote(dets.url, on_detection="block"),
    }
    return native_config(engine.url, detectors=detectors, **kwargs)


async def test_completed_stream_shows_text_detections_and_the_event(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        # no --model: the server's first (only) model
        code, out, err = await cli("--url", orch.url, "--output-detector", "you", "Hi there")
    assert code == EXIT_COMPLETED, err
    lines = out.rstrip("\n").split("\n")
    assert lines[0] == "I am great. What about [[you]]?"
    assert lines[1] == "output detection: you test/pronoun [23:26] 'you' score=0.80"
    name, data = terminal_line(out)
    assert name == "completed"
    assert data["finish_reason"] == "EOS_TOKEN"
    assert data["processed_index"] == len(TEXT)
    assert data["generated_token_count"] == len(SCRIPT)
    assert len(lines) == 3
    assert "\x1b[" not in out  # no ANSI codes into a pipe
    body = engine.requests[0].body
    assert body["prompt"] == "Hi there"


async def test_chat_api_renders_the_same_and_exits_the_same(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    """`--api chat` streams through /v1/chat/completions: same text, detections, exit codes."""
    async with Orchestrator(config(engine, dets)) as orch:
        done, refused = await asyncio.gather(
            cli("--url", orch.url, "--api", "chat", "--output-detector", "you", "Hi there"),
            cli("--url", orch.url, "--api", "chat", "--output-detector", "blocker", "Hi"),
        )
    code, out, err = done
    assert code == EXIT_COMPLETED, err
    lines = out.rstrip("\n").split("\n")
    assert lines[0] == "I am great. What about [[you]]?"
    assert lines[1] == "output detection: you test/pronoun [23:26] 'you' score=0.80"
    name, data = terminal_line(out)
    assert name == "completed"
    assert data["processed_index"] == len(TEXT)
    assert data["generated_token_count"] == len(SCRIPT)
    asked = sorted(r.body["messages"][0]["content"] for r in engine.requests)
    assert asked == ["Hi", "Hi there"]
    code, out, _ = refused
    assert code == EXIT_INCOMPLETE
    assert "What" not in out.split("blocking detection:")[0]
    assert terminal_line(out)[1]["incomplete_details"] == {"reason": "content_filter"}


@pytest.mark.parametrize("api", ["fms", "chat"])
async def test_a_migrated_stream_says_so_on_both_apis(engine: FakeEngine, api: str) -> None:
    """The replica serving the stream breaks after 3 tokens; the other one continues it. The
    terminal line reports one migration on the FMS API (its terminal event) and on chat (the
    finish chunk's `migrations` extension), with the whole text."""
    other = FakeEngine(script=list(SCRIPT))
    await other.start()
    try:
        engine.inject(Fault("close", after_tokens=3))
        cfg = native_config(engine.url)
        cfg["models"][MODEL]["backends"].append({"type": "native", "url": other.url})
        cfg["models"][MODEL]["migration"] = {"limit": 1, "quarantine_s": 30}
        async with Orchestrator(cfg) as orch:
            code, out, err = await cli("--url", orch.url, "--api", api, "Hi")
    finally:
        await other.close()
    assert code == EXIT_COMPLETED, err
    assert out.split("\n")[0] == TEXT
    name, data = terminal_line(out)
    assert (name, data["migrations"], data["processed_index"]) == ("completed", 1, len(TEXT))
    assert len(engine.requests) == 1 and len(other.requests) == 1


async def test_incomplete_refusal_and_input_detection_exit_2(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        budget, refused, input_hit = await asyncio.gather(
            cli("--url", orch.url, "--model", MODEL, "--max-new-tokens", "3", "Hi"),
            cli("--url", orch.url, "--output-detector", "blocker", "Hi"),
            cli("--url", orch.url, "--input-detector", "you", "and you?"),
        )

    code, out, _ = budget
    assert code == EXIT_INCOMPLETE
    assert out.startswith("I am great\n")
    name, data = terminal_line(out)
    assert name == "incomplete"
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}

    code, out, _ = refused
    assert code == EXIT_INCOMPLETE
    assert "[[The response was withheld: detector `blocker` flagged the generated text.]]" in out
    assert "blocking detection: blocker test/question [12:16] '' score=0.90" in out
    name, data = terminal_line(out)
    assert name == "incomplete"
    assert data["incomplete_details"] == {"reason": "content_filter"}
    # no flagged text leaves the service: "What" appears only in the detection listing
    shown = out.split("blocking detection:")[0]
    assert "What" not in shown and shown.startswith(("I am great.\n", "[[The response"))

    code, out, _ = input_hit
    assert code == EXIT_INCOMPLETE
    assert "input detection: you test/pronoun [4:7] 'you' score=0.80" in out
    assert terminal_line(out)[1]["incomplete_details"] == {"reason": "content_filter"}
    assert len(engine.requests) == 2  # the refused input never reached the model


async def test_failed_and_error_events_exit_1(
    dets: FakeDetectorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the engine stalls after "I am great. What about": the first sentence is judged and shown, then
    # the stall timeout (migration off) breaks the stream, declared on a manual clock once the
    # client has shown that sentence
    clock = manual_stall_clock(monkeypatch)
    engine = FakeEngine(script=list(SCRIPT), fail=Fault("stall", after_tokens=6))
    await engine.start()
    try:
        model = {"migration": {"limit": 0, "quarantine_s": 0}}
        async with Orchestrator(config(engine, dets, model=model)) as orch:
            proc = await spawn_cli("--url", orch.url, "--output-detector", "you", "Hi")
            assert proc.stdout is not None
            shown = await finished(
                proc.stdout.readexactly(len("I am great.")),
                60,
                "proc.stdout.readexactly(len('I am great.'))",
            )
            await expire_stalls(clock, lambda: engine.disconnects == 1)
            failed = await finish(proc, shown)
            errored = await cli("--url", orch.url, "--output-detector", "broken", "Hi")
    finally:
        await engine.close()

    code, out, err = failed
    assert code == EXIT_FAILED
    assert out.startswith("I am great.\n")
    name, data = terminal_line(out)
    assert name == "failed"
    assert data["processed_index"] == len("I am great.")
    assert data["error"]["type"] == "generation_unavailable"
    assert "error: generation_unavailable (" in err

    code, out, err = errored
    assert code == EXIT_FAILED
    name, data = terminal_line(out)
    assert name == "error"
    assert data["type"] == "detector_error" and data["code"] == 502
    assert "detector `broken`" in data["details"]
    assert "error: detector_error (502): detector `broken`" in err


async def test_rejected_request_shows_the_error_body_and_exits_3(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    async with Orchestrator(config(engine, dets)) as orch:
        unknown_model, unknown_detector = await asyncio.gather(
            cli("--url", orch.url, "--model", "nope", "Hi"),
            cli("--url", orch.url, "--output-detector", "ghost", "Hi"),
        )
    code, out, err = unknown_model
    assert code == EXIT_REJECTED and out == ""
    assert "error: HTTP 404: " in err
    body = json.loads(err.split("error: HTTP 404: ", 1)[1].split("\n")[0])
    assert body == {
        "code": 404,
        "details": "model `nope` not found (available: fake-model)",
        "type": "not_found",
    }
    code, _, err = unknown_detector
    assert code == EXIT_REJECTED
    assert "detector `ghost` not found" in err
    assert engine.requests == []


async def test_connection_refused_is_a_clear_message() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    # with --model, and when the model would come from /v1/models
    for code, out, err in await asyncio.gather(
        cli("--url", url, "--model", MODEL, "Hi"), cli("--url", url, "Hi")
    ):
        assert code == EXIT_UNREACHABLE
        assert out == ""
        assert f"error: cannot connect to {url}" in err
        assert "Traceback" not in err


async def test_url_without_a_scheme_means_http(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    """`--url localhost:8033` failed with `localhost:8033/info`; it now means http://."""
    async with Orchestrator(config(engine, dets)) as orch:
        bare = orch.url.removeprefix("http://")
        code, out, err = await cli("--url", bare, "Hi")
        bad = await cli("--url", "ftp://" + bare, "Hi")
    assert code == EXIT_COMPLETED, err
    assert out.startswith(TEXT + "\n")
    assert bad == (
        EXIT_REJECTED,
        "",
        f"error: --url ftp://{bare}: only http:// and https:// are supported\n",
    )


async def test_api_key_from_flag_or_environment(
    engine: FakeEngine, dets: FakeDetectorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEYS_ENV, "k-one,k-two")
    async with Orchestrator(config(engine, dets, server={"api_keys_env": KEYS_ENV})) as orch:
        by_flag, by_env, missing, wrong = await asyncio.gather(
            cli("--url", orch.url, "--api-key", "k-two", "Hi"),
            cli("--url", orch.url, "Hi", env={"GUARDSTREAM_API_KEY": "k-one"}),
            cli("--url", orch.url, "Hi"),
            cli("--url", orch.url, "--api-key", "nope", "Hi"),
        )
    assert by_flag[0] == EXIT_COMPLETED and by_flag[1].startswith(TEXT + "\n")
    assert by_env[0] == EXIT_COMPLETED and by_env[1].startswith(TEXT + "\n")
    for code, out, err in (missing, wrong):
        assert code == EXIT_REJECTED and out == ""
        assert "error: HTTP 401: " in err and "missing or invalid API key" in err
    assert len(engine.requests) == 2


async def test_a_frame_longer_than_a_readline_buffer_is_shown_whole(
    dets: FakeDetectorServer,
) -> None:
    long_token = "x" * 300_000
    engine = FakeEngine(script=["a ", long_token, " b"])
    await engine.start()
    try:
        async with Orchestrator(config(engine, dets)) as orch:
            code, out, err = await cli("--url", orch.url, "Hi")
    finally:
        await engine.close()
    assert code == EXIT_COMPLETED, err
    assert out.split("\n")[0] == "a " + long_token + " b"


async def tty_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs the client with stdout on a pseudo-terminal; returns (exit status, what it showed)."""
    master, slave = pty.openpty()
    child_env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    child_env.update(env or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator",
        "stream",
        *args,
        stdout=slave,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=ROOT,
        env=child_env,
    )
    os.close(slave)
    code = await finished(proc.wait(), 60, "proc.wait()")
    shown = b""
    with contextlib.suppress(OSError):  # EIO once the terminal has been drained
        while chunk := os.read(master, 65536):
            shown += chunk
    os.close(master)
    return code, shown.decode().replace("\r\n", "\n")


async def test_a_terminal_gets_colour_unless_told_otherwise(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    args = ("--output-detector", "you", "Hi")
    async with Orchestrator(config(engine, dets)) as orch:
        coloured = await tty_cli("--url", orch.url, *args)
        no_color_env = await tty_cli("--url", orch.url, *args, env={"NO_COLOR": "1"})
        no_color_flag = await tty_cli("--url", orch.url, "--no-color", *args)
    code, shown = coloured
    assert code == EXIT_COMPLETED
    assert shown.startswith("I am great. What about \x1b[1;31;4myou\x1b[0m?\n")
    assert "\x1b[1m[completed]\x1b[0m {" in shown
    for code, shown in (no_color_env, no_color_flag):
        assert code == EXIT_COMPLETED
        assert shown.startswith("I am great. What about [[you]]?\n")
        assert "\x1b[" not in shown


def test_colour_highlight_and_overlapping_spans() -> None:
    frame = {
        "generated_text": " What about you?",
        "start_index": 11,
        "token_classification_results": {
            "output": [
                {"start": 23, "end": 26, "detector_id": "a"},
                {"start": 12, "end": 16, "detector_id": "b"},
                {"start": 13, "end": 15, "detector_id": "c"},  # inside b: highlighted once
                {"start": 0, "end": 3, "detector_id": "whole"},  # text already printed
            ]
        },
    }
    assert render_frame(frame, Style(color=False)) == " [[What]] about [[you]]?"
    red = "\x1b[1;31;4m{}\x1b[0m"
    coloured = f" {red.format('What')} about {red.format('you')}?"
    assert render_frame(frame, Style(color=True)) == coloured
