"""Real OpenAI-compatible servers behind guardstream: two `transformers serve` processes
(transformers' own FastAPI server, tiny-random on CPU, free ports) as `type: openai` backends,
with `api: completions` and `api: chat`, through every surface (FMS, Chat Completions and
Responses via the official openai SDK), output and input detectors, and a kill -9 mid-stream.

What guardstream releases is compared with what the same server produced for the same request
(greedy decoding is deterministic), asked directly. transformers serve differs from vLLM (our
fakes' model) in ways the client must learn, not assume: no `return_token_ids`, no token-id
prompts, no `/tokenize`, no `[DONE]`, usage inside the finish chunk, unknown fields refused with
`422 {"detail": "Unexpected fields in the request: {...}"}`, stop strings sent (see
orchestrator/clients/openai.py).

The migration test kills a server with SIGKILL while a proxy holds the rest of its stream: the
cut point is an exact count of events, not a moment on the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chunkers.sentence import SentenceChunker
from generation import models
from orchestrator.app import STREAMING_PATH
from tests.engine_processes import free_port
from tests.fakes.clock import expire_stalls, manual_stall_clock
from tests.openai_support import sdk
from tests.orchestrator_support import (
    Orchestrator,
    SseEvent,
    assert_contiguous,
    frames,
    terminal,
)
from tests.wait_support import until_sync, within

MODEL = "tiny-serve"
PROMPT = "The quick brown fox"
USER = [{"role": "user", "content": PROMPT}]
TOKENS = 30
START_DEADLINE_S = 120  # generous: two servers import torch and transformers on a loaded CPU
# Every wait in this module is bounded and fails with what it waited for (never pytest-timeout's
# bare hang): a direct request to a server, the stream through guardstream, the launcher.
CALL_DEADLINE_S = 120  # one direct streamed request to a server, on 2 loaded cores
STREAM_DEADLINE_S = 120  # the migrating stream: 30 tokens, a kill, a resume; stall_timeout_s is 30


@dataclass
class Server:
    """One `transformers serve` process and its log."""

    pid: int
    url: str
    log: Path
    killed: bool = False

    def requests_received(self) -> int:
        """Generation requests the server logged (`[Request received]`, one per request)."""
        return self.log.read_text(errors="replace").count("[Request received]")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.killed = True


def alive(servers: list[Server]) -> list[Server]:
    """The first two servers no test has killed (each kill test takes its own pair)."""
    live = [s for s in servers if not s.killed]
    assert len(live) >= 2, "fewer than two live servers: raise SERVERS"
    return live[:2]


def _lines(proc: subprocess.Popen[bytes], count: int, until: float) -> list[bytes]:
    """The first `count` lines the launcher prints, waiting at most until `until` (monotonic):
    a launcher that hangs in its imports fails the fixture instead of blocking it."""
    assert proc.stdout is not None
    fd, buf = proc.stdout.fileno(), b""
    while buf.count(b"\n") < count:
        left = until - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        assert ready, f"the launcher printed {buf!r} of {count} lines in {START_DEADLINE_S} s"
        chunk = os.read(fd, 4096)
        assert chunk, f"the launcher exited ({proc.poll()}) after printing {buf!r}"
        buf += chunk
    return buf.splitlines()[:count]


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    return False


@pytest.fixture(scope="module")
def folder() -> Path:
    return models.prepare("tiny-random")


# Servers the module starts: the first two serve every test; each kill test takes two live ones
# (`alive`), so three kills leave one.
SERVERS = 4


@pytest.fixture(scope="module")
def pair(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """SERVERS servers forked from one launcher (tests/transformers_serve_pair.py: the CLI's
    imports are paid once), each its own process on its own free port."""
    root = tmp_path_factory.mktemp("tfserve")
    ports = [str(free_port()) for _ in range(SERVERS)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    launcher = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "transformers_serve_pair.py"),
            str(folder),
            str(root),
            *ports,
        ],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        deadline_at = time.monotonic() + START_DEADLINE_S
        servers = []
        for line in _lines(launcher, len(ports), deadline_at):
            port, pid = line.split()
            servers.append(
                Server(int(pid), f"http://127.0.0.1:{int(port)}", root / f"serve-{int(port)}.log")
            )
        for s in servers:

            def healthy(s: Server = s) -> bool:
                logs = s.log.read_text(errors="replace") if s.log.exists() else ""
                assert launcher.poll() is None, logs[-2000:]
                return _healthy(s.url)

            until_sync(healthy, max(0.0, deadline_at - time.monotonic()), f"{s.url} healthy", 0.2)
        yield servers
    finally:
        launcher.terminate()
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its SIGTERM handler kills the children first
            launcher.kill()
            launcher.wait()


def config(
    backends: list[dict[str, Any]],
    *,
    detectors: dict[str, dict[str, Any]] | None = None,
    chat: bool = False,
    limit: int = 3,
) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "models": {
            MODEL: {
                "backends": backends,
                "chat": chat,
                "migration": {"limit": limit, "quarantine_s": 60, "stall_timeout_s": 30},
            }
        },
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": detectors or {},
    }


def backend(server: Server, folder: Path, api: str) -> dict[str, Any]:
    return {
        "type": "openai",
        "url": server.url,
        "model": str(folder),
        "api": api,
        "tokenizer": str(folder),
    }


def regex(pattern: str, chunker: str = "whole_doc_chunker", **extra: Any) -> dict[str, Any]:
    """A built-in regex detector that flags one custom pattern (tiny-random writes gibberish:
    the pattern is a piece of what it writes)."""
    return {
        "builtin": "regex",
        "chunker_id": chunker,
        "params": {"kinds": [], "patterns": {"word": pattern}},
        **extra,
    }


async def server_pieces(url: str, path: str, body: dict[str, Any]) -> tuple[list[str], str | None]:
    """The text of each event and the finish_reason the server itself streams for `body` (no
    [DONE] to wait for: transformers serve ends the body after the finish chunk)."""
    pieces: list[str] = []
    finish = None
    async with (
        within(CALL_DEADLINE_S, f"POST {url}{path} (the server directly)"),
        aiohttp.ClientSession() as s,
        s.post(url + path, json=body) as r,
    ):
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text:
                pieces.append(text)
            finish = choice.get("finish_reason") or finish
    return pieces, finish


async def server_text(url: str, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    pieces, finish = await server_pieces(url, path, body)
    return "".join(pieces), finish


def fms_body(**params: Any) -> dict[str, Any]:
    return {
        "model_id": MODEL,
        "inputs": PROMPT,
        "text_gen_parameters": {"max_new_tokens": TOKENS, **params},
    }


# -- completions ----------------------------------------------------------------------------------


async def test_fms_completions_releases_what_the_server_produced(
    pair: list[Server], folder: Path
) -> None:
    """FMS on `api: completions`: the released text is the server's own output for the prompt,
    byte for byte (replacement characters and control characters included); the client learns
    on the first request that the server takes no `return_token_ids` and sends it no more."""
    expected, finish = await server_text(
        pair[0].url,
        "/v1/completions",
        {
            "model": str(folder),
            "prompt": PROMPT,
            "stream": True,
            "max_tokens": TOKENS,
            "temperature": 0,
        },
    )
    assert finish == "length" and expected
    async with Orchestrator(config([backend(pair[0], folder, "completions")])) as orch:
        for _ in range(2):
            events = await orch.stream(fms_body())
            assert assert_contiguous(frames(events)) == expected
            end = terminal(events)
            assert (end.name, end.data) == (
                "incomplete",
                {
                    "finish_reason": "MAX_TOKENS",
                    "generated_token_count": TOKENS,
                    "input_token_count": 4,
                    "processed_index": len(expected),
                    "migrations": 0,
                    "incomplete_details": {"reason": "max_output_tokens"},
                },
            )


async def test_chat_sdk_on_completions_and_chat_apis_equal_the_servers_chat(
    pair: list[Server], folder: Path
) -> None:
    """The same conversation through the official SDK, streamed, with `api: completions` (the
    chat template applied from the backend's `tokenizer` folder, the prompt sent as text) and
    with `api: chat`: both release exactly what the server's own chat endpoint produces."""
    expected, finish = await server_text(
        pair[1].url,
        "/v1/chat/completions",
        {
            "model": str(folder),
            "messages": USER,
            "stream": True,
            "max_tokens": TOKENS,
            "temperature": 0,
        },
    )
    assert finish == "length"
    for api in ("completions", "chat"):
        async with Orchestrator(config([backend(pair[1], folder, api)])) as orch:
            stream = await sdk(orch).chat.completions.create(
                model=MODEL,
                messages=USER,  # type: ignore[arg-type]
                max_tokens=TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == expected, api
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert [f for f in finishes if f] == ["length"]
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == TOKENS
            assert chunks[-1].usage.prompt_tokens == 12  # the templated conversation


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_responses_sdk_streams_the_servers_text(
    pair: list[Server], folder: Path, api: str
) -> None:
    """Responses through the SDK, on both APIs: the output_text deltas are the server's own
    chat answer (on `api: completions` templated by guardstream)."""
    expected, _ = await server_text(
        pair[0].url,
        "/v1/chat/completions",
        {
            "model": str(folder),
            "messages": USER,
            "stream": True,
            "max_tokens": TOKENS,
            "temperature": 0,
        },
    )
    async with Orchestrator(config([backend(pair[0], folder, api)])) as orch:
        stream = await sdk(orch).responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=TOKENS, temperature=0, stream=True
        )
        events = [e async for e in stream]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == expected
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"
        assert events[-1].response.usage.output_tokens == TOKENS


async def test_fms_on_api_chat_sends_the_prompt_as_one_user_message(
    pair: list[Server], folder: Path
) -> None:
    """FMS on `api: chat`: the prompt goes as one user message; the released text is the
    server's chat answer to it, and the counts are the server's usage."""
    expected, _ = await server_text(
        pair[1].url,
        "/v1/chat/completions",
        {"model": str(folder), "messages": USER, "stream": True, "max_tokens": TOKENS,
         "temperature": 0},
    )  # fmt: skip
    async with Orchestrator(config([backend(pair[1], folder, "chat")])) as orch:
        events = await orch.stream(fms_body())
        assert assert_contiguous(frames(events)) == expected
        end = terminal(events)
        assert end.data["generated_token_count"] == TOKENS
        assert end.data["input_token_count"] == 12
        assert end.data["finish_reason"] == "MAX_TOKENS"


# -- detectors ------------------------------------------------------------------------------------


async def test_output_detectors_annotate_and_block(pair: list[Server], folder: Path) -> None:
    """Annotate: the whole text is released with the detections at the spans where the server's
    text has the pattern. Block (whole document): nothing of it is released, a refusal is."""
    expected, _ = await server_text(
        pair[0].url,
        "/v1/chat/completions",
        {
            "model": str(folder),
            "messages": USER,
            "stream": True,
            "max_tokens": TOKENS,
            "temperature": 0,
        },
    )
    word = "東京"
    assert word in expected
    detectors = {"mark": regex(word, "sentence"), "stop": regex(word, on_detection="block")}
    async with Orchestrator(
        config([backend(pair[0], folder, "chat")], detectors=detectors)
    ) as orch:
        stream = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            extra_body={"detectors": {"output": {"mark": {}}}},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        spans = [
            (r["start"], r["end"])
            for c in chunks
            for d in (c.model_extra or {}).get("detections", {}).get("output", [])
            for r in d["results"]
        ]
        at = expected.index(word)
        assert spans == [(at, at + len(word))]

        stream = await sdk(orch).chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            extra_body={"detectors": {"output": {"stop": {}}}},
        )
        chunks = [c async for c in stream]
        assert all(not c.choices or not c.choices[0].delta.content for c in chunks)
        final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.finish_reason for c in final] == ["content_filter"]
        assert final[0].delta.refusal


async def test_input_detector_refuses_before_the_server_is_called(
    pair: list[Server], folder: Path
) -> None:
    detectors = {"secret": regex("secret")}
    async with Orchestrator(
        config([backend(pair[1], folder, "completions")], detectors=detectors, chat=True)
    ) as orch:
        before = pair[1].requests_received()
        body = {
            "model_id": MODEL,
            "inputs": "tell me the secret",
            "guardrail_config": {"input": {"models": {"secret": {}}}},
        }
        events = await orch.stream(body)
        assert pair[1].requests_received() == before  # the model was never called
        frame = events[0].data
        assert [r["start"] for r in frame["token_classification_results"]["input"]] == [12]
        assert [w["id"] for w in frame["warnings"]] == ["UNSUITABLE_INPUT"]
        end = terminal(events)
        assert end.name == "incomplete"
        assert end.data["incomplete_details"] == {"reason": "content_filter"}


# -- parameters -----------------------------------------------------------------------------------


async def test_parameter_mapping(pair: list[Server], folder: Path) -> None:
    """max_tokens, temperature, top_p, seed and stop reach the server as it reads them, and what
    guardstream releases equals the server's output for the same parameters; a stop string
    (which transformers serve sends) is cut here, as OpenAI's contract says. min_tokens, which
    the server refuses by name, is the client's 422, never silently dropped."""
    sampled = {"temperature": 1.5, "top_p": 0.95, "seed": 7}
    direct = {"model": str(folder), "prompt": PROMPT, "stream": True, "max_tokens": 12}
    # transformers serve samples only with `do_sample` (guardstream sends it as
    # `generation_config`); without it this model would decode greedily at any temperature
    expected, _ = await server_text(
        pair[0].url,
        "/v1/completions",
        {**direct, **sampled, "generation_config": '{"do_sample": true}'},
    )
    greedy, _ = await server_text(pair[0].url, "/v1/completions", {**direct, "temperature": 0})
    assert expected != greedy
    async with Orchestrator(config([backend(pair[0], folder, "completions")])) as orch:
        events = await orch.stream(
            {
                "model_id": MODEL,
                "inputs": PROMPT,
                "text_gen_parameters": {
                    "max_new_tokens": 12,
                    "decoding_method": "SAMPLING",
                    "temperature": 1.5,
                    "top_p": 0.95,
                    "seed": 7,
                },
            }
        )
        assert assert_contiguous(frames(events)) == expected

        full, _ = await server_text(
            pair[0].url,
            "/v1/completions",
            {
                "model": str(folder),
                "prompt": PROMPT,
                "stream": True,
                "max_tokens": TOKENS,
                "temperature": 0,
            },
        )
        stop = "首都"
        events = await orch.stream(fms_body(stop_sequences=[stop]))
        assert assert_contiguous(frames(events)) == full[: full.index(stop)]
        assert frames(events)[-1]["finish_reason"] == "STOP_SEQUENCE"

        # the first request learns that the server refuses `min_tokens` (its 422 names it):
        # the stream had started, so the 422 is its error event; nothing was generated
        events = await orch.stream(fms_body(min_new_tokens=3))
        end = terminal(events)
        assert (end.name, end.data, frames(events)) == (
            "error",
            {
                "code": 422,
                "details": "replica openai-0 cannot honour `min_new_tokens` (its server "
                "refuses `min_tokens`); leave it unset for this model",
                "type": "invalid_request",
            },
            [],
        )
        # from then on it is a 422 before the first byte
        status, body = await orch.post(STREAMING_PATH, fms_body(min_new_tokens=3))
        assert (status, body) == (
            422,
            {
                "code": 422,
                "details": "min_new_tokens: model `tiny-serve` cannot honour it (the server "
                "of its replica openai-0 refuses it)",
                "type": "invalid_request",
            },
        )


# -- migration (last: it kills a server) ------------------------------------------------------------


@dataclass
class Cut:
    """Where the first generation stream through any of the proxies is held: after `after`
    text events; `holder` is the proxy that holds it."""

    after: int
    # the held stream's client side stays open even when the server's side closes: the replica
    # goes silent instead of failing (a proxy or a network that holds a dead connection)
    keep_open: bool = False
    marker: bytes = b'"text"'  # what a text event carries: completions' `text`, chat's `content`
    held: asyncio.Event = field(default_factory=asyncio.Event)
    holder: HoldingProxy | None = None


@dataclass
class HoldingProxy:
    """A TCP proxy in front of one server. The first response stream (of any proxy sharing the
    `cut`) that carries `cut.after` text events is held there: the rest is read and dropped,
    nothing more is forwarded; when the server's side closes (it was killed), the client's side
    is reset. Every other connection (health checks, the resumed stream) passes through. The cut
    point is a count of events, not a moment."""

    upstream: str
    cut: Cut
    url: str = ""
    posts: int = 0  # requests other than GET (generation, /tokenize) that went through
    released: asyncio.Event = field(default_factory=asyncio.Event)  # close(): let go of all

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        self.released.set()
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.removeprefix("http://").split(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pump_up() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    if data.startswith(b"POST "):
                        self.posts += 1
                    up_writer.write(data)
                    await up_writer.drain()

        task = asyncio.create_task(pump_up())
        events = 0
        holding = False
        tail = b""  # the start of an event the last read cut off: counted when it is whole
        try:
            while data := await up_reader.read(65536):
                if holding:
                    continue  # read on (to see the close), forward nothing
                out = data
                if not self.cut.held.is_set():
                    seen, at = tail + data, 0
                    while (end := seen.find(b"\n\n", at)) != -1:
                        if self.cut.marker in seen[at:end]:
                            events += 1
                            if events == self.cut.after:
                                holding = True
                                self.cut.holder = self
                                self.cut.held.set()
                                out = data[: end + 2 - len(tail)]  # through this event
                                break
                        at = end + 2
                    tail = seen[at:]
                writer.write(out)
                await writer.drain()
            if holding and self.cut.keep_open:
                await self.released.wait()
        except OSError:
            pass
        finally:
            task.cancel()
            writer.transport.abort()  # a reset, as a killed server's connection
            up_writer.transport.abort()


@contextlib.asynccontextmanager
async def proxied(
    servers: list[Server], folder: Path, api: str, cut: Cut
) -> AsyncIterator[tuple[list[HoldingProxy], list[dict[str, Any]]]]:
    """A HoldingProxy sharing `cut` in front of each server, and backends that reach the servers
    through them (whichever the orchestrator picks is the one held)."""
    proxies = [HoldingProxy(s.url, cut) for s in servers]
    for proxy in proxies:
        await proxy.start()
    try:
        yield (
            proxies,
            [
                {**backend(s, folder, api), "url": p.url}
                for s, p in zip(servers, proxies, strict=True)
            ],
        )
    finally:
        for proxy in proxies:
            await proxy.close()


async def test_a_held_stream_whose_replica_goes_silent_migrates_on_the_stall_timeout(
    pair: list[Server], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's connection stays open but nothing more comes through it (a proxy or a
    network holds it): guardstream declares the stream stalled (stall_timeout_s; on a manual
    clock, so the test says when) and resumes it on the other server, as after a kill. Nothing
    is killed: the silent server is healthy, only its stream is lost."""
    clock = manual_stall_clock(monkeypatch)  # no stream stalls but when the test declares it
    cut = Cut(after=3, keep_open=True)
    body = {"model": str(folder), "stream": True, "temperature": 0}
    pieces, _ = await server_pieces(
        pair[1].url, "/v1/completions", {**body, "prompt": PROMPT, "max_tokens": TOKENS}
    )
    delivered = "".join(pieces[: cut.after])
    reached = asyncio.Event()  # the client has every event the proxy let through

    def on_event(events: list[SseEvent]) -> None:
        if assert_contiguous(frames(events)) == delivered:
            reached.set()

    async with proxied(pair[:2], folder, "completions", cut) as (proxies, backends):
        async with Orchestrator(config(backends)) as orch:
            stream = asyncio.create_task(orch.stream(fms_body(), on_event=on_event))
            try:
                async with within(STREAM_DEADLINE_S, "the stream reaching the cut"):
                    await reached.wait()
                assert cut.held.is_set() and cut.holder is not None
                other = next(p for p in proxies if p is not cut.holder)
                posts = other.posts
                # the held replica is silent now, the other one not dispatched to: a stall
                # declared until the stream moves there can only be the held one's
                await expire_stalls(clock, lambda: other.posts > posts or stream.done())
                async with within(STREAM_DEADLINE_S, "the resumed stream"):
                    events = await stream
            finally:
                stream.cancel()
            text = assert_contiguous(frames(events))
            end = terminal(events)
            assert (end.data["migrations"], end.data["finish_reason"]) == (1, "MAX_TOKENS")
            assert end.data["generated_token_count"] == TOKENS
            assert text == "".join(pieces)  # exact: the delivered text has no U+FFFD


async def test_kill_9_mid_stream_migrates_by_text(pair: list[Server], folder: Path) -> None:
    """api: completions on a server without token ids: the serving process gets SIGKILL after
    its proxy let `cut` events through; the stream resumes on the other server from the prompt
    text plus the delivered text, with the rest of the budget. The client sees one stream
    without gap or repeat: its text is the delivered part plus exactly what a server produces
    for prompt + delivered part, and `migrations: 1`; here it is also the uninterrupted text
    (exact while the delivered text has no U+FFFD, DESIGN section 7). Both servers sit behind
    proxies: whichever the orchestrator picks is the one killed."""
    cut = Cut(after=3)  # after '首', ' quick', '首': no U+FFFD yet, so the resume is also exact
    pair = alive(pair)
    body = {"model": str(folder), "stream": True, "temperature": 0}
    pieces, _ = await server_pieces(
        pair[1].url, "/v1/completions", {**body, "prompt": PROMPT, "max_tokens": TOKENS}
    )
    delivered = "".join(pieces[: cut.after])
    rest, _ = await server_text(
        pair[1].url,
        "/v1/completions",
        {**body, "prompt": PROMPT + delivered, "max_tokens": TOKENS - cut.after},
    )
    async with proxied(pair, folder, "completions", cut) as (proxies, backends):
        async with Orchestrator(config(backends)) as orch:

            async def killer() -> None:
                await cut.held.wait()
                victim = pair[proxies.index(cut.holder)]  # type: ignore[arg-type]
                victim.kill()

            task = asyncio.create_task(killer())
            try:
                async with within(STREAM_DEADLINE_S, "the stream through guardstream"):
                    events = await orch.stream(fms_body())
                # never `await task` before this: a stream that was not held leaves the killer
                # waiting for ever (the pool may pick either replica; both are held alike)
                assert cut.held.is_set(), "no stream reached the cut: nothing was held or killed"
                await task
            finally:
                task.cancel()
            text = assert_contiguous(frames(events))
            end = terminal(events)
            assert end.data["migrations"] == 1
            assert end.data["finish_reason"] == "MAX_TOKENS"
            assert end.data["generated_token_count"] == TOKENS
            assert text == delivered + rest
            assert "\ufffd" not in delivered and text == "".join(pieces)


# -- migration over `api: chat`: transformers serve cannot continue a partial answer -------------


async def chat_pieces(url: str, folder: Path) -> list[str]:
    """The server's own greedy chat answer to USER, event by event."""
    body = {"model": str(folder), "messages": USER, "stream": True, "max_tokens": TOKENS}
    pieces, finish = await server_pieces(url, "/v1/chat/completions", {**body, "temperature": 0})
    assert finish == "length"
    return pieces


async def test_api_chat_kill_before_the_first_released_byte_gives_one_clean_answer(
    pair: list[Server], folder: Path
) -> None:
    """The reported failure (it was a 503 before any byte): `api: chat` on transformers serve,
    which refuses `continue_final_message`; a sentence-chunked detector still holds the text the
    pipeline received when the serving server gets SIGKILL (after 3 content events). The other
    server regenerates the greedy answer, the 3 events the pipeline had are checked against it
    and skipped, and the client gets one clean answer: the server's own text, one finish, the
    server's usage."""
    live = alive(pair)
    pieces = await chat_pieces(live[1].url, folder)
    expected = "".join(pieces)
    # one sentence: nothing of the answer is released before its end
    assert [(s.start, s.end) for s in SentenceChunker().chunk(expected)] == [(0, len(expected))]
    cut = Cut(after=3, marker=b'"content"')
    got: list[Any] = []
    released_at_kill: list[str] = []
    async with proxied(live, folder, "chat", cut) as (proxies, backends):
        async with Orchestrator(
            config(backends, detectors={"mark": regex("東京", "sentence")})
        ) as orch:

            async def killer() -> None:
                await cut.held.wait()
                released_at_kill.extend(c.choices[0].delta.content or "" for c in got if c.choices)
                live[proxies.index(cut.holder)].kill()  # type: ignore[arg-type]

            task = asyncio.create_task(killer())
            try:
                async with within(STREAM_DEADLINE_S, "the stream through guardstream"):
                    stream = await sdk(orch).chat.completions.create(
                        model=MODEL,
                        messages=USER,  # type: ignore[arg-type]
                        max_tokens=TOKENS,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"detectors": {"output": {"mark": {}}}},
                    )
                    async for chunk in stream:
                        got.append(chunk)
                assert cut.held.is_set(), "no stream reached the cut: nothing was held or killed"
                await task
            finally:
                task.cancel()
            assert "".join(released_at_kill) == ""
            text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
            assert text == expected
            finishes = [c.choices[0].finish_reason for c in got if c.choices]
            assert [f for f in finishes if f] == ["length"]
            assert got[-1].usage is not None
            assert (got[-1].usage.completion_tokens, got[-1].usage.prompt_tokens) == (TOKENS, 12)
            replays = "guardstream_migration_replays_total"
            assert await orch.metric(replays, outcome="matched") == 1
            assert await orch.metric("guardstream_migrations_total", kind="mid_stream") == 1


async def test_api_chat_kill_after_released_text_replays_the_greedy_answer(
    pair: list[Server], folder: Path
) -> None:
    """`api: chat` on transformers serve, greedy: the client has the first 3 events' text when
    the serving server gets SIGKILL. The other server cannot continue the partial answer; it
    regenerates it, the regenerated prefix is checked against the released text and skipped,
    and the client's text is exactly the uninterrupted run's, with the server's counts."""
    live = alive(pair)
    pieces = await chat_pieces(live[1].url, folder)
    cut = Cut(after=3, marker=b'"content"')
    delivered = "".join(pieces[: cut.after])
    reached = asyncio.Event()  # the client has every event the proxy let through

    def on_event(events: list[SseEvent]) -> None:
        if assert_contiguous(frames(events)) == delivered:
            reached.set()

    async with proxied(live, folder, "chat", cut) as (proxies, backends):
        async with Orchestrator(config(backends)) as orch:

            async def killer() -> None:
                await reached.wait()
                live[proxies.index(cut.holder)].kill()  # type: ignore[arg-type]

            task = asyncio.create_task(killer())
            try:
                async with within(STREAM_DEADLINE_S, "the stream through guardstream"):
                    events = await orch.stream(fms_body(), on_event=on_event)
                assert reached.is_set(), "the client never had the text before the cut"
                await task
            finally:
                task.cancel()
            assert assert_contiguous(frames(events)) == "".join(pieces)
            end = terminal(events)
            assert end.data["migrations"] == 1
            assert end.data["finish_reason"] == "MAX_TOKENS"
            assert end.data["generated_token_count"] == TOKENS
            assert end.data["input_token_count"] == 12
            replays = "guardstream_migration_replays_total"
            assert await orch.metric(replays, outcome="matched") == 1
