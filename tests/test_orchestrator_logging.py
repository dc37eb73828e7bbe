"""Structured logs: one JSON object per line, and every line written on behalf of a request,
in whichever task, carries that request's id."""

from __future__ import annotations

import io
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from orchestrator import logs
from orchestrator.app import STREAMING_PATH
from orchestrator.logs import REQUEST_ID, JsonFormatter, make_handler
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    Orchestrator,
    generation_body,
    native_config,
    serve,
    terminal,
)
from tests.wait_support import finished


def record(msg: str, *args: object, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("guardstream.test", logging.WARNING, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_line_has_the_fields_and_the_current_request_id() -> None:
    token = REQUEST_ID.set("rid-1")
    try:
        line = JsonFormatter().format(record("%d streams", 3, tenant="t", obj=object()))
    finally:
        REQUEST_ID.reset(token)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry.pop("ts").endswith("+00:00")
    assert entry.pop("obj").startswith("<object object")  # not JSON: written as str
    assert entry == {
        "level": "WARNING",
        "logger": "guardstream.test",
        "message": "3 streams",
        "request_id": "rid-1",
        "tenant": "t",
    }


def test_json_line_outside_a_request_has_no_request_id_and_keeps_tracebacks() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = logging.LogRecord(
            "guardstream", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(rec)
    assert "\n" not in line  # a traceback stays inside its one line
    entry = json.loads(line)
    assert "request_id" not in entry
    assert entry["message"] == "failed"
    assert entry["exc"].startswith("Traceback") and "ValueError: boom\nsecond line" in entry["exc"]


@pytest.mark.parametrize(("rid", "shown"), [("rid-2", "[rid-2]"), (None, "[-]")])
def test_text_format_shows_the_request_id(rid: str | None, shown: str) -> None:
    out = io.StringIO()
    handler = make_handler("text", out)
    token = REQUEST_ID.set(rid)
    try:
        rec = record("hello")
        handler.handle(rec)
    finally:
        REQUEST_ID.reset(token)
    assert out.getvalue().rstrip().endswith(f"WARNING guardstream.test {shown} hello")


def test_text_format_shows_the_trace_id_inside_a_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tracing on, the current span's trace id follows the request id (outside any span
    the line is as without tracing)."""
    ids: list[tuple[str, str] | None] = [("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")]
    monkeypatch.setattr(logs, "TRACE_IDS", lambda: ids[0])
    out = io.StringIO()
    handler = make_handler("text", out)
    token = REQUEST_ID.set("rid-3")
    try:
        handler.handle(record("in a span"))
        ids[0] = None
        handler.handle(record("outside"))
    finally:
        REQUEST_ID.reset(token)
    first, second = out.getvalue().splitlines()
    assert first.endswith(
        "WARNING guardstream.test [rid-3 trace=4bf92f3577b34da6a3ce929d0e0e4736] in a span"
    )
    assert second.endswith("WARNING guardstream.test [rid-3] outside")


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """JSON lines of every `guardstream*` logger, as the serve command writes them."""
    out = io.StringIO()
    handler = make_handler("json", out)
    logger = logging.getLogger("guardstream")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.fixture
async def failing_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(fail=Fault("http", status=503, times=-1))
    await engine.start()
    yield engine
    await engine.close()


async def test_lines_written_during_a_request_carry_its_id(captured, failing_engine) -> None:
    async with Orchestrator(native_config(failing_engine.url)) as orch:
        events = await orch.stream(generation_body(), headers={"x-request-id": "log-test-1"})
        await orch.stream(generation_body(), headers={"x-request-id": "log-test-2"})
        assert orch.session is not None
        async with orch.session.get(orch.url + "/health") as r:  # probes: not access-logged
            assert r.status == 200
    assert terminal(events).name == "error"
    entries = lines(captured)
    # the engine failure is logged by the migration layer, inside the stream's own task
    failures = [e for e in entries if e["logger"] == "guardstream.migration"]
    assert [e["request_id"] for e in failures] == ["log-test-1", "log-test-2"]
    assert all(e["level"] == "WARNING" for e in failures)
    access = [e for e in entries if e["logger"] == "guardstream.access"]
    assert [(e["request_id"], e["method"], e["path"], e["status"]) for e in access] == [
        ("log-test-1", "POST", STREAMING_PATH, 200),
        ("log-test-2", "POST", STREAMING_PATH, 200),
    ]
    assert all(isinstance(e["duration_ms"], float) for e in access)
    # so does the replica's quarantine, caused by that request's failure
    quarantines = [e for e in entries if "quarantined" in e["message"]]
    assert [e["request_id"] for e in quarantines] == ["log-test-1", "log-test-2"]
    assert {e.get("request_id") for e in entries} <= {None, "log-test-1", "log-test-2"}


# a path as a client can send it: percent-encoded line breaks, a terminal escape, U+2028
FORGING_PATH = (
    "/a%0D%0A2026-11-28 INFO guardstream.access [x] GET /v1/models 200%1B[2K%C2%85%E2%80%A8z"
)
FORGING_PATH_DECODED = (
    "/a\r\n2026-11-28 INFO guardstream.access [x] GET /v1/models 200\x1b[2K\x85\u2028z"
)


@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_a_path_cannot_write_a_log_line(fmt: str) -> None:
    """Repro: the access line quotes the URL-decoded path, so `GET /a%0A<a forged line>` wrote
    that line into the text log, and in the JSON log U+2028 and U+0085 stayed raw (JSON allows
    them), which readers that split lines on them (Python's str.splitlines, some terminals
    and shippers) cut into two lines that are not JSON. A record is now one line for every
    reader, with the path as it was sent."""
    out = io.StringIO()
    handler = make_handler(fmt, out)  # type: ignore[arg-type]
    access = logging.getLogger("guardstream.access")
    old_level = access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    engine = FakeEngine()
    await engine.start()
    try:
        async with Orchestrator(native_config(engine.url)) as orch:
            assert orch.session is not None
            url = URL(orch.url + FORGING_PATH.replace(" ", "%20"), encoded=True)
            async with orch.session.get(url, headers={"x-request-id": "forger"}) as r:
                assert r.status == 404
    finally:
        access.removeHandler(handler)
        access.setLevel(old_level)
        await engine.close()
    written = out.getvalue()
    assert written.endswith("\n") and len(written.splitlines()) == 1, written
    if fmt == "json":
        entry = json.loads(written)
        assert (entry["path"], entry["status"]) == (FORGING_PATH_DECODED, 404)
        assert entry["message"] == f"GET {FORGING_PATH_DECODED} 404"
    else:
        assert written.rstrip("\n").endswith(
            "INFO guardstream.access [forger] GET /a\\x0d\\x0a2026-11-28 INFO "
            "guardstream.access [x] GET /v1/models 200\\x1b[2K\\x85\\u2028z 404"
        )


async def test_serve_writes_json_lines(tmp_path: Path) -> None:
    """`python -m orchestrator serve` logs JSON by default, request ids included; SIGTERM with
    nothing running exits 0 at once."""
    engine = FakeEngine()
    await engine.start()
    try:
        async with serve(tmp_path, native_config(engine.url)) as served:
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    served.url + STREAMING_PATH,
                    json=generation_body(),
                    headers={"x-request-id": "cli-1"},
                ) as r:
                    assert r.status == 200
                    await r.read()
            served.proc.send_signal(signal.SIGTERM)
            assert await finished(served.proc.wait(), 30, "served.proc.wait()") == 0
            stderr = served.stderr
    finally:
        await engine.close()
    text = stderr.read_text()
    entries = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    assert {"ts", "level", "logger", "message"} <= set(entries[0])
    access = [e for e in entries if e["logger"] == "guardstream.access"]
    assert [(e["request_id"], e["status"]) for e in access] == [("cli-1", 200)]
    messages = [e["message"] for e in entries]
    assert any(m.startswith("guardstream listening on http://") for m in messages)
    # the objects made at start-up are out of the collector's reach (its full passes stall
    # the loop for as long as they take to walk): over 10,000 of them, in practice ~150,000
    frozen = [m for m in messages if m.startswith("start-up heap frozen: ")]
    assert len(frozen) == 1 and int(frozen[0].split()[3]) > 10_000, frozen
    # and again once the in-process detectors' warm-up (their models) is over
    (again,) = [m for m in messages if m.startswith("heap frozen after the detectors' warm-up: ")]
    assert int(again.split()[-2]) >= int(frozen[0].split()[3])
    assert "SIGTERM: shutting down" in messages
    assert messages[-1] == "stopped"
