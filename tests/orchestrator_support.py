"""Black-box helpers for orchestrator tests: a real server on 127.0.0.1 built from a config dict,
an SSE reader, and the request bodies the tests send."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from resource import RLIMIT_NOFILE, setrlimit
from typing import Any, Protocol, Self, TypeVar

import aiohttp
import psutil
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.app import STREAM_CONTENT_PATH, STREAMING_PATH
from orchestrator.config import load_config, parse_config
from orchestrator.server import start_server
from tests.fakes.engine import FakeEngine
from tests.wait_support import finished, until

T = TypeVar("T")

NDJSON = "application/x-ndjson"
MODEL = "fake-model"
# "I am great. What about you?" in eight tokens: two sentences, [0, 11) and [11, 27)
SCRIPT = ["I", " am", " great", ".", " What", " about", " you", "?"]
ROOT = Path(__file__).resolve().parent.parent
# every `type` an error body may carry (DESIGN's error body), the fuzz tests' oracle
ERROR_TYPES = {
    "invalid_request",
    "not_found",
    "unauthorized",
    "detector_error",
    "chunker_error",
    "generation_error",
    "generation_unavailable",
    "timeout",
    "overloaded",
    "server_shutdown",
    "server_error",
}


@dataclass(frozen=True)
class SseEvent:
    name: str | None  # None: a classified frame
    data: dict[str, Any]


def sse_events(body: str, keepalives: bool = False) -> list[SseEvent]:
    """Parses a whole SSE body; fails on anything that is not `event:`/`data:` lines (with
    `keepalives`, a `: keep-alive` comment is skipped: a test whose streams may wait longer than
    `sse_keepalive_s` on a loaded machine, which is the protocol working)."""
    events: list[SseEvent] = []
    for block in body.split("\n\n"):
        if not block.strip() or (keepalives and block == ": keep-alive"):
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        events.append(SseEvent(name, json.loads("\n".join(data))))
    return events


def frames(events: list[SseEvent]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.name is None]


def terminal(events: list[SseEvent]) -> SseEvent:
    """The last event, after checking it is the only terminal one."""
    names = [e.name for e in events if e.name in ("completed", "incomplete", "failed", "error")]
    assert len(names) == 1, f"expected exactly one terminal event, got {names}"
    assert events[-1].name == names[0], "nothing may follow the terminal event"
    return events[-1]


def assert_contiguous(frame_list: list[dict[str, Any]]) -> str:
    """Frames tile the generated text; returns it."""
    at = 0
    text = ""
    for f in frame_list:
        assert f["start_index"] == at, f"frame starts at {f['start_index']}, expected {at}"
        piece = f.get("generated_text", "")
        assert f["processed_index"] == at + len(piece)
        at = f["processed_index"]
        text += piece
    return text


def native_config(
    engine_url: str,
    *,
    detectors: dict[str, dict[str, Any]] | None = None,
    chunkers: dict[str, dict[str, Any]] | None = None,
    server: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A config with one native backend (migration off) and the given detectors."""
    model_cfg: dict[str, Any] = {
        "backends": [{"type": "native", "url": engine_url}],
        "migration": {"limit": 0, "quarantine_s": 0},
    }
    model_cfg.update(model or {})
    return {
        "server": {"host": "127.0.0.1", "port": 0, **(server or {})},
        "models": {MODEL: model_cfg},
        "chunkers": chunkers
        if chunkers is not None
        else {
            "sentence": {"type": "sentence"},
            "paragraph": {"type": "paragraph"},
        },
        "detectors": detectors or {},
    }


def remote(url: str, chunker: str = "sentence", **extra: Any) -> dict[str, Any]:
    return {"type": "text_contents", "url": url, "chunker_id": chunker, **extra}


def regex_pii(**extra: Any) -> dict[str, Any]:
    """The built-in regex PII detector on the sentence chunker, with `extra` settings."""
    return {"type": "text_contents", "builtin": "regex", "chunker_id": "sentence", **extra}


def guarded_config(
    engine_url: str,
    detectors: dict[str, dict[str, Any]],
    directions: Sequence[str] = ("output",),
) -> dict[str, Any]:
    """`native_config` with every one of `detectors` a guardrail of the model (enforced) in
    each of `directions`."""
    guardrails = {direction: {d: {} for d in detectors} for direction in directions}
    return native_config(engine_url, detectors=detectors, model={"guardrails": guardrails})


async def stream_through(
    script: list[str], config_for: Callable[[str], dict[str, Any]], body: dict[str, Any]
) -> tuple[int, bytes]:
    """A FakeEngine answering `script` behind an orchestrator of `config_for(engine_url)`:
    the status and raw body of one streamed generation of `body` (for leak checks)."""
    engine = FakeEngine(script=script)
    await engine.start()
    try:
        async with Orchestrator(config_for(engine.url)) as orch:
            return await orch.raw(STREAMING_PATH, body)
    finally:
        await engine.close()


async def stream_cut_answer(
    answer: str, config_for: Callable[[str], dict[str, Any]], max_chars: int, max_new_tokens: int
) -> list[SseEvent]:
    """`answer` streamed one character per token, cut after `max_new_tokens`, through an
    orchestrator of `config_for(engine_url)` with the sentence chunker's `max_chars` set."""
    engine = FakeEngine(script=list(answer))
    await engine.start()
    config = config_for(engine.url)
    config["chunkers"]["sentence"]["max_chars"] = max_chars
    body = {
        "model_id": MODEL,
        "inputs": "anything",
        "text_gen_parameters": {"max_new_tokens": max_new_tokens},
    }
    try:
        async with Orchestrator(config) as orch:
            return await orch.stream(body)
    finally:
        await engine.close()


def generation_body(
    inputs: str = "Hi there",
    *,
    output: dict[str, Any] | None = None,
    input: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    model_id: str = MODEL,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model_id": model_id, "inputs": inputs}
    guardrails: dict[str, Any] = {}
    if input is not None:
        guardrails["input"] = {"models": input}
    if output is not None:
        guardrails["output"] = {"models": output}
    if guardrails:
        body["guardrail_config"] = guardrails
    if params:
        body["text_gen_parameters"] = params
    return body


class BackgroundLoop:
    """An event loop in its own thread, for synchronous tests (hypothesis, schemathesis) that
    talk to servers running on it; `run` waits for a coroutine under a generous deadline."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def start_loop(self) -> None:
        self.thread.start()

    def stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Upstream(Protocol):
    """A fake server a stack starts before the orchestrator (engine, detector service)."""

    async def start(self) -> str: ...

    async def close(self) -> None: ...


class ServedStack(BackgroundLoop):
    """Fake upstreams and the orchestrator, served from a loop in its own thread, for
    synchronous tests (hypothesis, schemathesis): `config()` is called once the upstreams are
    up, so it can read their URLs. Subclasses add the requests their tests make."""

    def __init__(
        self, name: str, config: Callable[[], dict[str, Any]], upstreams: Sequence[Upstream] = ()
    ) -> None:
        super().__init__(name)
        self._config = config
        self.upstreams = list(upstreams)
        self.url = ""

    def start(self) -> Self:
        self.start_loop()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        for upstream in self.upstreams:
            await upstream.start()
        self.orch = Orchestrator(self._config())
        await self.orch.__aenter__()
        self.url = self.orch.url

    def stop(self) -> None:
        async def stop() -> None:
            await self.orch.__aexit__(None, None, None)
            for upstream in reversed(self.upstreams):
                await upstream.close()

        self.run(stop())
        self.stop_loop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Orchestrator:
    """The real service on a free port: `async with Orchestrator(cfg) as orch: orch.url`."""

    def __init__(self, config: dict[str, Any] | Path, *, device: str = "cpu") -> None:
        """`config`: a dict, or a file (which SIGHUP and /admin/reload read again)."""
        self.config = load_config(config) if isinstance(config, Path) else parse_config(config)
        self.device = device
        self.url = ""
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None
        # clients a test made for this service (SDKs): closed with it, not left to the
        # garbage collector, whose late close logs errors into whatever test runs then
        self.closers: list[Callable[[], Awaitable[object]]] = []

    async def __aenter__(self) -> Orchestrator:
        self.runner, port = await start_server(self.config, "127.0.0.1", 0, device=self.device)
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for close in self.closers:
            await close()
        if self.session is not None:
            await self.session.close()
        if self.runner is not None:
            await self.runner.cleanup()

    async def stream(
        self,
        body: dict[str, Any],
        *,
        headers: dict[str, str] | None = None,
        on_event: Callable[[list[SseEvent]], object] | None = None,
    ) -> list[SseEvent]:
        """POSTs to the streaming endpoint; asserts a 200 event stream and returns its events.
        With `on_event`, it is called with the events so far as each one arrives (a test opens an
        engine's gate once a frame has reached the client: ordering without timing)."""
        assert self.session is not None
        async with self.session.post(self.url + STREAMING_PATH, json=body, headers=headers) as r:
            if on_event is not None and r.status == 200:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                return await read_sse(r, on_event)
            text = await r.text()
            assert r.status == 200, f"{r.status}: {text}"
            assert r.headers["Content-Type"].startswith("text/event-stream")
        return sse_events(text)

    async def raw(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POSTs JSON; the status and the body as it came off the socket (a leak check reads
        the bytes, not a parse of them)."""
        assert self.session is not None
        async with self.session.post(self.url + path, json=body) as r:
            return r.status, await r.read()

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of /metrics samples `name` with these labels (the service's registry is its
        own: no other test's counts)."""
        assert self.session is not None
        async with self.session.get(self.url + "/metrics") as r:
            page = await r.text()
        return sum(
            s.value
            for family in text_string_to_metric_families(page)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    async def info(self, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """GET /info: (status, body)."""
        assert self.session is not None
        async with self.session.get(self.url + "/info", headers=headers) as r:
            return r.status, await r.json()

    async def info_until(
        self, done: Callable[[int, dict[str, Any]], bool], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Polls /info until `done(status, body)`; that reply."""

        async def poll() -> tuple[int, dict[str, Any]] | None:
            reply = await self.info(headers)
            return reply if done(*reply) else None

        return await until(poll, what="/info answering as awaited", poll_s=0.05)

    async def post(
        self, path: str, body: Any, *, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """POSTs JSON (or raw bytes/str) and returns (status, parsed JSON or text); raw bodies to
        stream-content go as NDJSON unless the test sets a content type."""
        assert self.session is not None
        if path == STREAM_CONTENT_PATH and isinstance(body, bytes | str):
            headers = {"Content-Type": NDJSON, **(headers or {})}
        kwargs: dict[str, Any] = {"headers": headers}
        if isinstance(body, bytes | str):
            kwargs["data"] = body
        else:
            kwargs["json"] = body
        async with self.session.post(self.url + path, **kwargs) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


async def read_sse(
    resp: aiohttp.ClientResponse, on_event: Callable[[list[SseEvent]], object]
) -> list[SseEvent]:
    """The events of an SSE response, parsed as they arrive; `on_event(events so far)` after
    each one. Comments (keep-alives) are skipped."""
    events: list[SseEvent] = []
    buf = ""
    async for raw in resp.content:
        buf += raw.decode()
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            lines = [line for line in block.split("\n") if not line.startswith(":")]
            if lines:
                events.extend(sse_events("\n".join(lines) + "\n\n"))
                on_event(events)
    assert not buf.strip(), f"unterminated SSE event {buf!r}"
    return events


class Served:
    """A `serve` subprocess and the JSON log lines it wrote so far."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, stderr: Path) -> None:
        self.proc = proc
        self.url = url
        self.stderr = stderr

    def messages(self) -> list[str]:
        out = []
        for line in self.stderr.read_text().splitlines():
            try:
                out.append(json.loads(line)["message"])
            except (ValueError, KeyError):
                out.append(line)
        return out

    async def wait_logged(self, prefix: str, timeout_s: float = 20.0) -> None:
        await until(
            lambda: any(m.startswith(prefix) for m in self.messages()),
            timeout_s,
            f"the log line {prefix!r}",
        )

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def workers(self) -> list[psutil.Process]:
        """The worker processes of a `server.workers` supervisor."""
        return [c for c in self.children() if "worker_main" in " ".join(c.cmdline())]

    def engines(self) -> list[psutil.Process]:
        """The managed engine processes it started."""
        return [c for c in self.children() if "generation" in c.cmdline()]


@asynccontextmanager
async def serve(
    tmp_path: Path,
    config: dict[str, Any],
    *args: str,
    nofile: tuple[int, int] | None = None,
    start_s: float = 30.0,
) -> AsyncIterator[Served]:
    """Starts `python -m orchestrator serve` on a free port and waits (up to `start_s`) for its
    "listening on" line; the child gets this interpreter's PYTHONPATH plus the repository root,
    and with `nofile` the open-file limits (soft, hard) a container or systemd would give it.
    Whatever is left of it at the end (workers, engines included) is killed."""
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    stderr = tmp_path / "stderr.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "orchestrator", "serve", "--config", str(path), "--port", "0", *args),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            preexec_fn=None if nofile is None else lambda: setrlimit(RLIMIT_NOFILE, nofile),
        )
    try:
        assert proc.stdout is not None
        line = await finished(proc.stdout.readline(), start_s, "proc.stdout.readline()")
        assert line.startswith(b"guardstream listening on http://"), (line, stderr.read_text())
        yield Served(proc, line.decode().split()[-1], stderr)
    finally:
        if proc.returncode is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            await proc.wait()
