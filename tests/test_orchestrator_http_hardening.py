"""Attacks on the HTTP layer (issue 20, items 5-8), each reproduced over a raw socket against the
real service: connections that never finish a request, stalled bodies, deeply nested JSON, lone
surrogates, requests aiohttp's parser refuses, and `Expect: 100-continue` over the size limit.
Timeouts are configured small; the tests wait on them only with generous deadlines and never
assert how long anything took."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import logging
import socket
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.app import (
    CHAT_DETECTION_ONLY_PATH,
    CHAT_PATH,
    COMPLETIONS_DETECTION_PATH,
    CONTENT_PATH,
    CONTEXT_DETECTION_PATH,
    RESPONSES_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
)
from orchestrator.handlers import body as body_module
from orchestrator.handlers import stream_content
from orchestrator.handlers.body import MAX_JSON_DEPTH, json_depth
from orchestrator.handlers.serving import FLUSH_GRACE_S
from orchestrator.state import STATE
from tests.fakes.clock import manual_deadline_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.http_support import DEADLINE_S, Reply, exchange_at, post_head
from tests.orchestrator_support import MODEL, NDJSON, Orchestrator, native_config, remote
from tests.wait_support import until, within

DEEP = "[" * 1000 + "]" * 1000


def server_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """ERROR records of the service itself (its loggers and aiohttp's). A client another test
    left unclosed (an SDK's httpx pool) can log from asyncio when it is collected during this
    test: not this test's business."""
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith(("guardstream", "aiohttp"))
    ]


@asynccontextmanager
async def service(engine: FakeEngine, **server: Any) -> AsyncIterator[Orchestrator]:
    dets = FakeDetectorServer()
    dets.add("words", DetectorBehaviour(words={"bad": 0.9}))
    await dets.start()
    config = native_config(
        engine.url, detectors={"words": remote(dets.url)}, server={"host": "127.0.0.1", **server}
    )
    try:
        async with Orchestrator(config) as orch:
            yield orch
    finally:
        await dets.close()


def port_of(orch: Orchestrator) -> int:
    return int(orch.url.rsplit(":", 1)[1])


async def exchange(orch: Orchestrator, data: bytes) -> bytes:
    """Sends `data` and reads until the server closes the connection (within DEADLINE_S)."""
    return await exchange_at(port_of(orch), data)


def error(code: int, details: str, etype: str = "invalid_request") -> dict[str, Any]:
    return {"code": code, "details": details, "type": etype}


# -- 5. every phase of a request is bounded ---------------------------------------------------
# The 0.3 s bounds below are the server settings under test, not windows the test measures: in
# each case the client has already sent everything it will ever send (in one write), so the only
# thing that can happen is the bound firing, and the test waits for that with DEADLINE_S.


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects and says nothing
        b"GET /hea",  # half a request line
        b"GET /health HTTP/1.1\r\nHost: x\r\n",  # headers never finished
    ],
    ids=["idle", "half-request-line", "unfinished-headers"],
)
async def test_a_connection_without_a_complete_request_head_is_closed(engine, sent) -> None:
    """Repro: with request_timeout_s 20 these were all still open after 150 s (aiohttp's
    keep-alive timeout is 3630 s). Closed after header_timeout_s, with nothing sent."""
    async with service(engine, header_timeout_s=0.3, request_timeout_s=60) as orch:
        assert await exchange(orch, sent) == b""


async def test_an_idle_keep_alive_connection_is_closed_after_its_response(engine) -> None:
    # 5 s: the request itself must be read within header_timeout_s of the connection opening,
    # so a short bound would race the server's own scheduling under load
    async with service(engine, header_timeout_s=5) as orch:
        raw = await exchange(orch, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = Reply(raw)
    assert reply.status == 200 and reply.headers.get("connection") != "close"
    assert json.loads(reply.body)["status"] == "ok"  # answered, then closed while idle


@pytest.mark.parametrize("path", [CONTENT_PATH, UNARY_PATH, STREAMING_PATH, CHAT_PATH])
async def test_a_stalled_body_is_408_and_the_connection_closes(engine, path) -> None:
    """Repro: a Content-Length body that stops after one byte held the connection (and the
    handler) until the client gave up."""
    async with service(engine, body_idle_timeout_s=0.3, request_timeout_s=60) as orch:
        raw = await exchange(orch, post_head(path, 200) + b"{")
    reply = Reply(raw)
    assert reply.status == 408
    assert reply.headers["connection"] == "close"
    body = reply.json()
    stalled = "the request body stalled for longer than body_idle_timeout_s"
    if path == CHAT_PATH:
        assert body["error"]["message"] == stalled and body["error"]["type"] == "timeout"
    else:
        assert body == error(408, stalled, "timeout")


async def test_a_body_dripping_past_request_timeout_s_is_408(engine) -> None:
    """Each byte comes well within the idle bound; the whole body does not come in time."""
    async with service(engine, body_idle_timeout_s=30, request_timeout_s=0.5) as orch:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(orch))
        writer.write(post_head(CONTENT_PATH, 10_000))
        read = asyncio.ensure_future(reader.read())
        async with within(DEADLINE_S):
            while not read.done():
                writer.write(b" ")
                await asyncio.wait([read], timeout=0.05)
        writer.close()
    reply = Reply(read.result())
    assert reply.status == 408
    assert reply.json() == error(
        408, "the request body did not arrive within request_timeout_s", "timeout"
    )


async def test_stalled_stream_content_bodies_end_their_streams_and_free_their_slots(
    engine,
) -> None:
    """Repro: 100 stalled stream-content bodies held all 100 stream slots (every other stream
    got 429 until request_timeout_s, 600 s by default). Each now ends with a 408 error line
    after body_idle_timeout_s, and its slot serves the next stream."""
    first = json.dumps({"detectors": {"words": {}}, "content": "Hi there. "}) + "\n"
    async with service(
        engine, body_idle_timeout_s=0.3, request_timeout_s=60, max_concurrent_streams=2
    ) as orch:
        stalled = []
        for _ in range(2):  # every slot, each body stalled after its first line
            head = (
                f"POST {STREAM_CONTENT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: {NDJSON}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n"
            ).encode()
            chunk = f"{len(first.encode()):x}\r\n{first}\r\n".encode()
            stalled.append(asyncio.ensure_future(exchange(orch, head + chunk)))
        replies = await asyncio.gather(*stalled)
        # the next stream's body in one write: nothing of it can sit idle for the short bound
        whole = first.encode()
        head = (
            f"POST {STREAM_CONTENT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: {NDJSON}\r\n"
            f"Content-Length: {len(whole)}\r\nConnection: close\r\n\r\n"
        ).encode()
        after = Reply(await exchange(orch, head + whole))
        status, body = after.status, after.body.decode()
    for raw in replies:
        reply = Reply(raw)
        assert reply.status == 200
        lines = [json.loads(x) for x in _dechunk(reply.body).splitlines()]
        assert lines[-1] == error(
            408, "the request body stalled for longer than body_idle_timeout_s", "timeout"
        )
    assert status == 200, body  # a slot was free again


async def test_a_stream_content_client_that_stops_reading_is_cut_off(engine, monkeypatch) -> None:
    """Repro: a client that sent its body and never read the reply held its stream slot for as
    long as it kept the connection open: the serving loop waited on a write the client never
    took, so the pipeline's own deadline (request_timeout_s), an event it posts to the
    consumer, was never seen (with request_timeout_s 2 the slot was still held 15 s later).
    Past request_timeout_s and a short grace to take the rest, the connection is now closed,
    and the slot, the pipeline and its detector calls end as when a client leaves."""
    clock = manual_deadline_clock(monkeypatch)
    detectors = {"pii": {"type": "text_contents", "builtin": "regex", "chunker_id": "sentence"}}
    # ~0.9 MB of phone numbers: ~9 MB of detections, more than any socket buffers hold (past
    # the default max_detection_chars, 100,000: raised for them)
    server = {"request_timeout_s": 5, "max_detection_chars": 1_000_000}
    config = native_config(engine.url, detectors=detectors, server=server)
    lines = [json.dumps({"detectors": {"pii": {}}, "content": "Hi. "})]
    lines += [json.dumps({"content": "555-123-4567 " * 1000}) for _ in range(70)]
    body = ("\n".join(lines) + "\n").encode()
    head = (
        f"POST {STREAM_CONTENT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: {NDJSON}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    async with Orchestrator(config) as orch:
        assert orch.runner is not None and orch.runner.server is not None
        state = orch.runner.app[STATE]
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # it reads nothing anyway
        client.connect(("127.0.0.1", port_of(orch)))
        client.setblocking(False)
        _, writer = await asyncio.open_connection(sock=client)
        writer.write(head + body)  # never read from

        def blocked() -> bool:  # the reply waits in our send buffer: the client takes nothing
            return state.active_streams == 1 and any(
                h.transport is not None and h.transport.get_write_buffer_size() > 0
                for h in orch.runner.server.connections  # type: ignore[union-attr]
            )

        await until(blocked, what="the reply backed up behind a client that does not read")
        clock.advance(5 + FLUSH_GRACE_S + 1)  # request_timeout_s and the grace run out
        await until(lambda: state.active_streams == 0, what="the stream slot given back")
        writer.close()


class _Dripping:
    """A request body (aiohttp's `readany`) arriving `size` bytes at a time, as a client that
    writes a few bytes per packet makes it arrive; it lets the loop run between packets."""

    def __init__(self, data: bytes, size: int) -> None:
        self._data, self._size, self._at = data, size, 0

    async def readany(self) -> bytes:
        if self._at % (4096 * self._size) == 0:
            await asyncio.sleep(0)  # the deadline can fire: the reader is not a busy loop
        chunk = self._data[self._at : self._at + self._size]
        self._at += len(chunk)
        return chunk


async def test_a_long_stream_content_line_dripping_in_costs_linear_work(monkeypatch) -> None:
    """Repro: stream-content's body reader appended each piece to the unfinished line and split
    the whole of it again (`buf += chunk; buf.split(b"\\n")`), so a 1 MiB line arriving a byte at
    a time cost ~10^12 byte copies on the event loop (minutes of CPU; 1.4 s for 100-byte
    pieces). Each piece is now scanned once. (read_chunk's per-read timeout is replaced by a
    plain read: what is measured is the line assembly, not the idle bound.)"""

    async def plain_read(content: _Dripping, timeout_s: float, *, idle: bool) -> bytes:
        return await content.readany()

    monkeypatch.setattr(stream_content, "read_chunk", plain_read)
    line = json.dumps({"content": "a" * (1 << 20)}).encode()
    body = line + b"\n\n  \n" + line[:100] + b"\n" + line  # the last one without its newline
    request = SimpleNamespace(content=_Dripping(body, 1))
    lines = stream_content.BodyLines(request, len(body), deadline=1e12, idle_s=1e9)  # type: ignore[arg-type]
    got = []
    async with within(DEADLINE_S * 3, "reading a 1 MiB line a byte at a time"):
        while (raw := await lines.next()) is not None:
            got.append(raw)
    assert got == [line, line[:100], line]  # blank lines skipped, the unterminated one kept


class _Pieces:
    """A request body (`readany`) arriving in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


@settings(max_examples=60, deadline=None)
@given(
    body=st.lists(st.sampled_from([b"\n", b" ", b"a", b"{}", b"\r"]), max_size=40).map(b"".join),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stream_content_lines_are_the_same_however_the_body_is_cut(body, cuts) -> None:
    """The body's non-blank lines, the last one with or without its newline, whatever pieces
    the body arrives in."""
    at = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    pieces = [body[a:b] for a, b in itertools.pairwise(at) if b > a]
    request = SimpleNamespace(content=_Pieces(pieces))

    async def read() -> list[bytes]:
        lines = stream_content.BodyLines(request, len(body), deadline=1e12, idle_s=1e9)  # type: ignore[arg-type]
        out = []
        while (raw := await lines.next()) is not None:
            out.append(raw)
        return out

    assert asyncio.run(read()) == [line for line in body.split(b"\n") if line.strip()]


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += body[:size]
        body = body[size + 2 :]
    return out


# -- 6. nesting depth ---------------------------------------------------------------------------

TOO_DEEP = error(400, f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")


@pytest.mark.parametrize(
    "path", [CONTENT_PATH, UNARY_PATH, STREAMING_PATH, CHAT_PATH, RESPONSES_PATH]
)
@pytest.mark.parametrize(
    "body",
    [
        DEEP,
        json.dumps({"model_id": MODEL, "inputs": "x", "n": json.loads("[" * 65 + "]" * 65)}),
        json.dumps(
            {"content": "x", "detectors": {"words": {"p": json.loads("[" * 70 + "]" * 70)}}}
        ),
    ],
    ids=["1000-deep", "65-deep-field", "70-deep-params"],
)
async def test_deeply_nested_json_is_400_everywhere(engine, path, body, caplog) -> None:
    """Repro: 500 and an ERROR traceback (Python's parser raised RecursionError)."""
    async with service(engine) as orch:
        with caplog.at_level(logging.INFO):
            status, reply = await orch.post(
                path, body, headers={"Content-Type": "application/json"}
            )
    assert status == 400
    if path in (CHAT_PATH, RESPONSES_PATH):
        assert reply["error"]["message"] == TOO_DEEP["details"]
        assert reply["error"]["type"] == "invalid_request"
    else:
        assert reply == TOO_DEEP
    assert not server_errors(caplog)


async def test_deeply_nested_stream_content_lines(engine, caplog) -> None:
    """Repro: as line 2, an in-stream 500 after a 200. The first line gets a real 400; a later
    one ends the stream with the 400 error line."""
    first = json.dumps({"detectors": {"words": {}}, "content": "Hi there. "})
    async with service(engine) as orch:
        with caplog.at_level(logging.INFO):
            status_first, reply_first = await orch.post(STREAM_CONTENT_PATH, DEEP + "\n")
            status, reply = await orch.post(STREAM_CONTENT_PATH, f"{first}\n{DEEP}\n")
    assert (status_first, reply_first) == (400, TOO_DEEP)
    # the reply is one line, the error: "Hi there. " is no finished sentence while more text
    # may follow, and the deep line ends the stream (two lines would not parse as one document)
    assert (status, reply) == (200, TOO_DEEP)
    assert not server_errors(caplog)


async def test_nesting_up_to_the_bound_is_accepted(engine) -> None:
    params = {"p": json.loads("[" * (MAX_JSON_DEPTH - 3) + "]" * (MAX_JSON_DEPTH - 3))}
    body = {"content": "Hi [there] {ok}.", "detectors": {"words": params}}
    async with service(engine) as orch:
        status, reply = await orch.post(CONTENT_PATH, body)
    assert (status, reply) == (200, {"detections": []})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab,:\u00e9'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\a', max_size=3), inner, max_size=3)
    ),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=0, max_value=70), st.booleans())
def test_json_depth_measures_nesting_whatever_the_strings_hold(value, wrap, ascii_only) -> None:
    """Brackets, quotes and backslashes inside strings never count; `wrap` extra levels push
    the depth past the shortcut (64 openers) so the numpy path runs too."""
    for _ in range(wrap):
        value = [value, "]]}{"]
    text = json.dumps(value, ensure_ascii=ascii_only).encode()
    expected = _depth(value)
    measured = json_depth(text)
    if text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH:
        assert measured == 0 and expected <= MAX_JSON_DEPTH
    else:
        assert measured == expected


# -- validation errors are bounded ---------------------------------------------------------------

MANY = 100_000  # invalid items: 200 KB of `1,`, well within max_request_bytes
USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT_PATH, {"model": MODEL, "messages": [1] * MANY}, "messages.0"),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": [{"role": "user", "content": [1] * MANY}]},
            "messages.0.content",
        ),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [1] * MANY}, *USER]},
            "messages.0.tool_calls.0",
        ),
        (CHAT_PATH, {"model": MODEL, "messages": USER, "stop": [1] * MANY}, "stop.0"),
        (
            CHAT_PATH,
            {
                "model": MODEL,
                "messages": USER,
                "detectors": {"input": dict.fromkeys(map(str, range(MANY // 2)), 1)},
            },
            "detectors.input.0",
        ),
        (RESPONSES_PATH, {"model": MODEL, "input": [1] * MANY}, "input.messages.0.message"),
        (
            RESPONSES_PATH,
            {"model": MODEL, "input": [{"role": "user", "content": [1] * MANY}]},
            "input.messages.0.message.content",
        ),
        (RESPONSES_PATH, {"model": MODEL, "input": "Hi", "tools": [1] * MANY}, "tools.0"),
        (RESPONSES_PATH, {"model": MODEL, "input": "Hi", "include": [1] * MANY}, "include"),
        (
            RESPONSES_PATH,
            {
                "model": MODEL,
                "input": "Hi",
                "metadata": dict.fromkeys(map(str, range(MANY // 2)), 1),
            },
            "metadata.0",
        ),
        (
            COMPLETIONS_DETECTION_PATH,
            {"model": MODEL, "prompt": "Hi", "stop": [1] * MANY},
            "stop.0",
        ),
        (
            UNARY_PATH,
            {
                "model_id": MODEL,
                "inputs": "Hi",
                "guardrail_config": {"input": {"masks": [1] * MANY}},
            },
            "guardrail_config.input.masks.0",
        ),
        (
            UNARY_PATH,
            {
                "model_id": MODEL,
                "inputs": "Hi",
                "text_gen_parameters": {"stop_sequences": [1] * MANY},
            },
            "text_gen_parameters.stop_sequences.0",
        ),
        (
            CHAT_DETECTION_ONLY_PATH,
            {"detectors": {"words": {}}, "messages": [1] * MANY},
            "messages.0",
        ),
        (
            CHAT_DETECTION_ONLY_PATH,
            {"detectors": {"words": {}}, "messages": USER, "tools": [1] * MANY},
            "tools.0",
        ),
        (
            CHAT_DETECTION_ONLY_PATH,
            {
                "detectors": {"words": {}},
                "messages": [{"role": "assistant", "tool_calls": [1] * MANY}],
            },
            "messages.0.tool_calls.0",
        ),
        (
            CONTEXT_DETECTION_PATH,
            {
                "detectors": {"words": {}},
                "content": "Hi",
                "context_type": "docs",
                "context": [1] * MANY,
            },
            "context.0",
        ),
    ],
)
async def test_a_body_of_many_invalid_items_is_one_error(
    engine, monkeypatch, path, body, field
) -> None:
    """Repro: pydantic collected one error per invalid item and the 422 was described from all
    of them, on the event loop: `messages: [1, 1, ...]` in 1 MiB held the loop 7 s (0.9 GB), a
    Responses message of 500,000 invalid parts 18 s (2.5 GB). A collection stops at its first
    invalid item (pydantic's FailFast): the 422 names it, and the work is that of one item."""
    counts: list[int] = []
    describe = body_module.describe_validation_error

    def counting(exc: Any, model: Any = None) -> str:
        counts.append(exc.error_count())
        return describe(exc, model)

    monkeypatch.setattr(body_module, "describe_validation_error", counting)
    async with service(engine) as orch:
        status, reply = await orch.post(path, body)
    assert status == 422, reply
    message = reply["error"]["message"] if "error" in reply else reply["details"]
    assert message.startswith(field), message
    assert counts and max(counts) <= 4, counts
    assert engine.requests == []


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        ('"top_p": 0.5, "x": [1, -1e999]}', 422, "x.1: must be a finite number"),
        (
            '"x": 1e999, "y": ',
            400,
            "invalid JSON body: Expecting value: line 1 column 91 (char 90)",
        ),
    ],
)
async def test_a_number_beyond_a_float_is_a_client_error(engine, raw, status, message) -> None:
    """Infinity is not a JSON value: a literal beyond a float's range is refused naming where it
    is (the request would otherwise forward `Infinity`), and a body that breaks after one is
    the 400 of any broken body, never a 500."""
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}], {raw}'
    async with service(engine) as orch:
        got, reply = await orch.post(CHAT_PATH, body, headers={"Content-Type": "application/json"})
    assert (got, reply["error"]["message"]) == (status, message)
    assert engine.requests == []


# -- 7. lone surrogates -------------------------------------------------------------------------

SURROGATE = "text must be valid Unicode (it contains a lone surrogate)"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (STREAMING_PATH, {"model_id": MODEL, "inputs": "a\ud800b"}, "inputs"),
        (UNARY_PATH, {"model_id": MODEL, "inputs": "a\udfffb"}, "inputs"),
        (CONTENT_PATH, {"content": "x\ud800", "detectors": {"words": {}}}, "content"),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800"}]},
            "messages.0.content",
        ),
        (
            CHAT_PATH,
            {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "\udc00"}]},
            "messages.0.content",
        ),
        (RESPONSES_PATH, {"model": MODEL, "input": "a\ud800", "stream": True}, "input"),
        (
            CONTENT_PATH,
            {"content": "x", "detectors": {"words": {"k\ud800": 1}}},
            "detectors.words",
        ),
    ],
)
async def test_a_lone_surrogate_is_422_before_the_first_byte(engine, path, body, field) -> None:
    """Repro: FMS streaming answered 200 and then `event: error` 422."""
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a `\\udXXX` escape
    async with service(engine) as orch:
        status, reply = await orch.post(path, raw, headers={"Content-Type": "application/json"})
        utf8 = raw.encode().replace(b"\\ud800", "\ud800".encode("utf-8", "surrogatepass"))
        raw_utf8 = await orch.post(path, utf8, headers={"Content-Type": "application/json"})
    assert status == 422, reply
    # raw surrogate bytes (UTF-8 with surrogatepass): the same 422, naming the same field
    assert raw_utf8 == (status, reply)
    if path in (CHAT_PATH, RESPONSES_PATH):
        assert reply["error"]["message"] == f"{field}: {SURROGATE}"
        assert reply["error"]["param"] == field
    else:
        assert reply == error(422, f"{field}: {SURROGATE}")
    assert engine.requests == []


async def test_a_lone_surrogate_in_stream_content(engine) -> None:
    first = json.dumps({"detectors": {"words": {}}, "content": "Hi\ud800"})
    later = json.dumps({"content": "a\udbff"})
    ok = json.dumps({"detectors": {"words": {}}, "content": "Hi there. "})
    async with service(engine) as orch:
        first_reply = await orch.post(STREAM_CONTENT_PATH, first + "\n")
        status, reply = await orch.post(STREAM_CONTENT_PATH, f"{ok}\n{later}\n")
    assert first_reply == (422, error(422, f"content: {SURROGATE}"))
    # one line, the error ("Hi there. " is no finished sentence while more text may follow)
    assert (status, reply) == (200, error(422, f"content: {SURROGATE}"))


async def test_surrogate_pairs_and_astral_text_pass(engine) -> None:
    body = json.dumps(
        {"content": "smile \U0001f600 and \U00010348 bad.", "detectors": {"words": {}}}
    )
    assert "\\ud83d\\ude00" in body  # a valid pair, escaped
    async with service(engine) as orch:
        status, reply = await orch.post(
            CONTENT_PATH, body, headers={"Content-Type": "application/json"}
        )
    assert status == 200, reply
    assert [d["text"] for d in reply["detections"]] == ["bad"]


# -- 8. requests aiohttp's parser refuses -------------------------------------------------------

ECHO = b"ECHOME"


@pytest.mark.parametrize(
    ("request_bytes", "details"),
    [
        (
            b"GET /" + ECHO * 1500 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            "request line or header too long (limit 8190 bytes)",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + ECHO * 1500 + b"\r\n\r\n",
            "request line or header too long (limit 8190 bytes)",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: ECHOME\r\n" % i for i in range(500))
            + b"\r\n",
            "too many headers (limit 128)",
        ),
        (
            post_head(CONTENT_PATH, 0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
            + b"ECHOME\r\nhello\r\n0\r\n\r\n",
            "malformed chunked body",
        ),
        (
            post_head(CONTENT_PATH, 5, extra="Transfer-Encoding: chunked\r\n") + b"0\r\n\r\nECHOME",
            "Content-Length and Transfer-Encoding together",
        ),
        (b"ECHO\x01ME / HTTP/1.1\r\n\r\n", "malformed request line"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nECHO ME: v\r\n\r\n", "malformed header"),
    ],
    ids=["long-url", "long-header", "500-headers", "bad-chunk-size", "cl-and-te", "method", "name"],
)
async def test_parser_rejections_get_the_error_body_without_echo(
    engine, request_bytes, details, caplog
) -> None:
    """Repro: `HTTP/1.0 400` in plain text quoting part of the input, and an ERROR traceback."""
    async with service(engine) as orch:
        with caplog.at_level(logging.INFO):
            raw = await exchange(orch, request_bytes)
    reply = Reply(raw)
    assert reply.status == 400
    assert reply.headers["content-type"].startswith("application/json")
    assert reply.headers["server"] == "guardstream"
    assert reply.json() == error(400, details)
    assert b"ECHO" not in raw
    assert not server_errors(caplog)


async def test_expect_100_continue_over_the_limit_is_413_without_continue(engine) -> None:
    """Repro: `100 Continue` for a 2 MB Content-Length (limit 1 MB), inviting the body."""
    async with service(engine) as orch:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(orch))
        writer.write(post_head(CONTENT_PATH, 2_000_000, extra="Expect: 100-continue\r\n"))
        async with within(DEADLINE_S):
            head = await reader.readuntil(b"\r\n\r\n")
            reply = Reply(head)
            body = await reader.readexactly(int(reply.headers["content-length"]))
        writer.close()
    assert reply.status_line.startswith("HTTP/1.1 413")
    assert reply.headers["connection"] == "close"  # the unread body cannot be skipped
    assert json.loads(body) == error(413, "request body too large (limit 1048576 bytes)")


async def test_expect_100_continue_within_the_limit_continues(engine) -> None:
    payload = json.dumps({"content": "bad.", "detectors": {"words": {}}}).encode()
    async with service(engine) as orch:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(orch))
        writer.write(post_head(CONTENT_PATH, len(payload), extra="Expect: 100-continue\r\n"))
        async with within(DEADLINE_S):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(payload)
            reply = Reply(await reader.readuntil(b"\r\n\r\n"))
            body = await reader.readexactly(int(reply.headers["content-length"]))
        writer.close()
    assert reply.status == 200
    assert [d["text"] for d in json.loads(body)["detections"]] == ["bad"]


async def test_an_unknown_expectation_is_417_with_the_error_body(engine) -> None:
    async with service(engine) as orch:
        raw = await exchange(
            orch,
            post_head(CONTENT_PATH, 2, extra="Expect: ECHOME\r\nConnection: close\r\n") + b"{}",
        )
    reply = Reply(raw)
    assert reply.status == 417
    assert reply.json() == error(417, "unsupported Expect header")
    assert b"ECHO" not in raw


# -- Content-Encoding (issue 32, item 9a) -------------------------------------------------------

UNSUPPORTED_ENCODING = (
    "unsupported Content-Encoding (this server accepts gzip, deflate or identity)"
)
NOT_ENCODED = "the request body is not encoded as its Content-Encoding says"


def encoded_request(path: str) -> tuple[bytes, str]:
    """A valid body for `path` and its content type."""
    if path == STREAM_CONTENT_PATH:
        return b'{"content": "bad.", "detectors": {"words": {}}}\n', NDJSON
    if path == CONTENT_PATH:
        return json.dumps(
            {"content": "bad.", "detectors": {"words": {}}}
        ).encode(), "application/json"
    if path in (CHAT_PATH, RESPONSES_PATH):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        if path == RESPONSES_PATH:
            body = {"model": MODEL, "input": "Hi"}
        return json.dumps(body).encode(), "application/json"
    return json.dumps({"model_id": MODEL, "inputs": "Hi"}).encode(), "application/json"


def expected_error(path: str, code: int, details: str) -> dict[str, Any]:
    if path in (CHAT_PATH, RESPONSES_PATH):
        return {
            "error": {"message": details, "type": "invalid_request", "param": None, "code": code}
        }
    return error(code, details)


ENCODED_PATHS = [CONTENT_PATH, STREAM_CONTENT_PATH, UNARY_PATH, STREAMING_PATH, CHAT_PATH]
ENCODED_PATHS.append(RESPONSES_PATH)


@pytest.mark.parametrize("path", ENCODED_PATHS)
@pytest.mark.parametrize(
    ("encoding", "encode", "code", "details"),
    [
        ("gzip", lambda b: b, 400, NOT_ENCODED),
        ("deflate", lambda b: b, 400, NOT_ENCODED),
        ("x-unknown", lambda b: b, 415, UNSUPPORTED_ENCODING),
        ("gzip, identity", lambda b: b, 415, UNSUPPORTED_ENCODING),
    ],
    ids=["not-gzip", "not-deflate", "unknown", "a-list"],
)
async def test_a_body_that_is_not_what_its_content_encoding_says_is_a_4xx(
    engine, path, encoding, encode, code, details, caplog
) -> None:
    """Repro: `Content-Encoding: gzip` over a plain body was a 500 (and an ERROR traceback);
    an unknown encoding was ignored and the body read as if it were plain. The connection
    closes after the answer: the rest of the body is never read."""
    payload, ctype = encoded_request(path)
    data = encode(payload)
    head = post_head(path, len(data), ctype, extra=f"Content-Encoding: {encoding}\r\n")
    async with service(engine) as orch:
        raw = await exchange(orch, head + data)
    reply = Reply(raw)
    assert reply.status == code
    assert reply.headers["connection"] == "close"
    assert reply.json() == expected_error(path, code, details)
    assert not server_errors(caplog)


@pytest.mark.parametrize("encoding", ["br", "zstd"])
async def test_an_encoding_the_parser_cannot_decode_is_415(engine, encoding, caplog) -> None:
    """aiohttp refuses these before the request reaches a route (no brotli or zstandard here),
    so the answer has the service's own error body whatever the path."""
    payload, ctype = encoded_request(CONTENT_PATH)
    head = post_head(CONTENT_PATH, len(payload), ctype, extra=f"Content-Encoding: {encoding}\r\n")
    async with service(engine) as orch:
        raw = await exchange(orch, head + payload)
    reply = Reply(raw)
    assert reply.status == 415
    assert reply.json() == error(415, UNSUPPORTED_ENCODING)
    assert not server_errors(caplog)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "identity"])
async def test_a_body_in_a_supported_encoding_is_served(engine, encoding) -> None:
    payload, ctype = encoded_request(CONTENT_PATH)
    data = {"gzip": gzip.compress, "deflate": zlib.compress, "identity": bytes}[encoding](payload)
    extra = f"Content-Encoding: {encoding}\r\nConnection: close\r\n"
    async with service(engine) as orch:
        raw = await exchange(orch, post_head(CONTENT_PATH, len(data), ctype, extra=extra) + data)
    reply = Reply(raw)
    assert reply.status == 200
    assert [d["text"] for d in reply.json()["detections"]] == ["bad"]


# -- a refused body closes its connection at once (issue 32, item 9d) ----------------------------

PROMPT_CLOSE_S = 5.0  # aiohttp's lingering read of an unread body lasts 10 s


@pytest.mark.parametrize("path", [CONTENT_PATH, CHAT_PATH, STREAM_CONTENT_PATH])
async def test_a_413_closes_the_connection_at_once(engine, path) -> None:
    """Repro: after `413` with `Connection: close` the socket stayed open ~11 s (aiohttp went on
    reading the body it would throw away). The client has sent part of its body and waits."""
    ctype = NDJSON if path == STREAM_CONTENT_PATH else "application/json"
    async with service(engine) as orch:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(orch))
        writer.write(post_head(path, 2_000_000, ctype) + b"{" * 1000)
        try:
            async with within(PROMPT_CLOSE_S):
                raw = await reader.read()  # to EOF: the server closes
        finally:
            writer.close()
    reply = Reply(raw)
    assert reply.status == 413
    assert reply.headers["connection"] == "close"
    details = "request body too large (limit 1048576 bytes)"
    assert reply.json() == expected_error(path, 413, details)
