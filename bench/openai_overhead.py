"""Chat Completions overhead benchmark: what guardstream's `/v1/chat/completions` costs in front of
an OpenAI-compatible chat upstream (backend `type: openai, api: chat`).

    .venv/bin/python bench/openai_overhead.py [--answers 24] [--words 2000] [--itl10]
        [--scenarios direct,sentence,none] [--workers-compare] [--sdk] [--json out.json]

Three processes share this machine's cores:
  - the fake upstream (`bench/openai_overhead.py _fake`): streams a 2,000-word answer one word per
    chunk, each chunk serialized with json.dumps as an OpenAI server would; the inter-token
    latency comes with each request (`bench_itl_ms`, forwarded untouched by guardstream), token i
    due at t0 + (i + 1) * itl so that pacing never drifts; at ITL 0 concurrent answers advance
    together (8 chunks each in turn), as a batched engine's do;
  - the orchestrator under test: `python -m orchestrator serve --config <tmp>.yaml --port 0`,
    two model ids on the same upstream: `guarded` (the built-in `regex` detector, in-process, on
    the `sentence` chunker, as an enforced output guardrail) and `raw` (no detector: every chunk
    is forwarded as its own frame);
  - the client (this process): raw SSE over aiohttp (or the OpenAI SDK with --sdk), parsing every
    chunk (orjson) and collecting the content.

Scenarios: `direct` (the client talks to the fake), `sentence` (guardstream, model `guarded`),
`redact` (the same detector with `on_detection: redact`: every e-mail is replaced in the answer,
model `redacting`), `none` (guardstream, model `raw`), `tools` (model `guarded`, the request
offers a tool and the fake answers with one tool call whose arguments, `{"story": "<the same
answer>"}`, come one word a fragment: the same number of chunks as the text scenarios, judged
by the same enforced guardrail; its chars are the arguments'). For each: answers/s and CPU per answer at ITL 0 with
concurrency 1 and 8, and with --itl10 at 10 ms per token (concurrency 1 and 8: 20 s per round).
At ITL 10 with 8 streams, each answer first keeps its own clock (token i due at its own t0 +
(i + 1) * itl: arrivals staggered at random), then all share one step clock (t0 rounded up to a
multiple of the ITL, printed as `10s ms`): a batched engine emits every running stream's token in
the same decode step, so the orchestrator sees them arrive together.
CPU is utime + stime from /proc of each process (the orchestrator's whole process tree, so
`server.workers` > 1 is counted whole), divided by the answers of the level.

Burst (ITL 0, concurrency 8): for each answer, t=0 when the request was sent and t=1 when its
`[DONE]` arrived; printed are the time of the first content chunk on that scale (p50 and max over
the answers that ended while every slot was busy, and the max over all, the level's drain
included) and the times by which 25/50/75 % of the answer's characters had arrived (means): a
pipeline that reads the whole engine stream before it releases anything shows values near 1.

--workers-compare: guardstream with `server.workers: 1` and then 2, answers/s at ITL 0 and
concurrency 8 (model `guarded`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
from aiohttp import web

SELF = Path(__file__).resolve()
BENCH = SELF.parent
ROOT = BENCH.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(ROOT))

# the process helpers of bench/orchestrator.py (a file that cannot be imported by its name: it
# would shadow the `orchestrator` package)
_spec = importlib.util.spec_from_file_location("bench_orchestrator", BENCH / "orchestrator.py")
assert _spec is not None and _spec.loader is not None
_orch_bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_orchestrator"] = _orch_bench
_spec.loader.exec_module(_orch_bench)
Proc = _orch_bench.Proc
wait_ready = _orch_bench.wait_ready

UPSTREAM_MODEL = "fake-chat"
# At ITL 0 the fake lets the other answers go on after this many chunks: a batched engine
# advances every running sequence in each step, it never finishes one answer before the next.
YIELD_EVERY = 8
GUARDED = "guarded"
RAW = "raw"
REDACTING = "redacting"  # scenario `redact`: the same detector with on_detection: redact
CHAT_PATH = "/v1/chat/completions"
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def use_uvloop() -> None:
    """uvloop for this process's event loop, as `serve` uses it."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def answer_pieces(words: int) -> list[str]:
    """`words` pieces, one word each: sentences of 8 to 21 words, an e-mail address (which the
    regex detector flags) in every tenth sentence."""
    pieces: list[str] = []
    sentence = 0
    while len(pieces) < words:
        n = 8 + (sentence * 7) % 14
        for i in range(n):
            if i == 0:
                word = f"Sentence{sentence}"
            elif i == 3 and sentence % 10 == 0:
                word = f"user{sentence}@example.com"
            else:
                word = WORDS[(sentence + i) % len(WORDS)]
            pieces.append(word if not pieces else " " + word)
            if len(pieces) == words:
                break
        else:
            pieces[-1] += "."
        sentence += 1
    return pieces


# -- the fake upstream ---------------------------------------------------------------------------


class FakeChat:
    """`POST /v1/chat/completions` streaming the scripted answer, one word a chunk."""

    def __init__(self, words: int, yield_every: int = YIELD_EVERY) -> None:
        self.pieces = answer_pieces(words)
        self.yield_every = yield_every
        self.requests = 0
        self.sent: dict[str, list[float]] = {}  # bench_tag -> monotonic send time of each piece

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CHAT_PATH, self.chat)
        app.router.add_get("/bench/sent", self.take_sent)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get(
            "/v1/models", lambda r: web.json_response({"data": [{"id": UPSTREAM_MODEL}]})
        )
        return app

    async def take_sent(self, request: web.Request) -> web.Response:
        sent, self.sent = self.sent, {}
        return web.json_response(sent)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        itl = float(body.get("bench_itl_ms", 0)) / 1000
        step_clock = bool(body.get("bench_step_clock"))
        sent: list[float] | None = None
        if itl > 0 and body.get("bench_tag"):
            sent = self.sent[str(body["bench_tag"])] = []
        pieces = self.pieces[: int(body.get("max_tokens") or len(self.pieces))]
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = f"chatcmpl-{self.requests}"
        created = int(time.time())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            obj: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": UPSTREAM_MODEL,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if usage_wanted:
                obj["usage"] = None
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        await resp.write(chunk({"role": "assistant", "content": ""}))
        tools = bool(body.get("tools"))
        if tools:  # one call: its arguments one piece a fragment (OpenAI's shape)
            head = {"index": 0, "id": "call_0", "type": "function"}
            head["function"] = {"name": "tell", "arguments": ""}
            await resp.write(chunk({"tool_calls": [head]}))
            pieces = tool_fragments(pieces)
        t0 = time.monotonic()
        if itl > 0 and step_clock:  # every answer's tokens fall due together, as in a batch
            t0 = math.ceil(t0 / itl) * itl
        for i, piece in enumerate(pieces):
            if itl > 0:
                delay = t0 + (i + 1) * itl - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif self.yield_every and i % self.yield_every == self.yield_every - 1:
                await asyncio.sleep(0)  # concurrent answers progress together, as in a batch
            if tools:
                fragment = {"index": 0, "function": {"arguments": piece}}
                await resp.write(chunk({"tool_calls": [fragment]}))
            else:
                await resp.write(chunk({"content": piece}))
            if sent is not None:
                sent.append(time.monotonic())
        await resp.write(chunk({}, "tool_calls" if tools else "stop"))
        if usage_wanted:
            usage = {"prompt_tokens": 5, "completion_tokens": len(pieces)}
            usage["total_tokens"] = 5 + len(pieces)
            tail = {"id": rid, "object": "chat.completion.chunk", "created": created}
            tail.update(model=UPSTREAM_MODEL, choices=[], usage=usage)
            await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def tool_fragments(pieces: list[str]) -> list[str]:
    """The answer as the arguments `{"story": "<answer>"}`, one piece a fragment (JSON-escaped;
    the first and last carry the structure)."""
    out = [json.dumps(p)[1:-1] for p in pieces]
    out[0] = '{"story": "' + out[0]
    out[-1] += '"}'
    return out


# what the `tools` scenario offers (the fake answers any offer with its one call)
BENCH_TOOL = {
    "type": "function",
    "function": {"name": "tell", "parameters": {"type": "object"}},
}


def serve_fake(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/openai_overhead.py _fake")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--words", type=int, default=2000)
    parser.add_argument("--yield-every", type=int, default=YIELD_EVERY)
    args = parser.parse_args(argv)
    use_uvloop()

    async def serve() -> None:
        runner = web.AppRunner(FakeChat(args.words, args.yield_every).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024).start()
        print(f"fake listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


# -- processes -----------------------------------------------------------------------------------


def tree_cpu_s(pid: int, *, children: bool = True) -> float:
    """utime + stime of a process and its live descendants (the workers of `server.workers`)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if children else [root]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def orchestrator_config(fake_url: str, workers: int = 1, redact: bool = False) -> dict[str, Any]:
    backend = {"type": "openai", "url": fake_url, "model": UPSTREAM_MODEL, "api": "chat"}
    model = {
        "backends": [backend],
        "migration": {"limit": 0},
        "limits": {"max_new_tokens": 8192, "max_input_chars": 100_000},
    }
    return {
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "max_concurrent_streams": 4096,
            "workers": workers,
        },
        "models": {
            GUARDED: {**model, "guardrails": {"output": {"pii": {}}}},
            RAW: model,
            **(
                {
                    REDACTING: {
                        **model,
                        "guardrails": {"output": {"pii": {"on_detection": "redact"}}},
                    }
                }
                if redact
                else {}
            ),
        },
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {"pii": {"builtin": PII_BUILTIN[0], "chunker_id": "sentence"}},
    }


#: `--pii-builtin`: the built-in behind `pii` in the orchestrator under test;
#: `--before-pii-builtin`: --before's (e.g. pii_ner before and after a change to it)
PII_BUILTIN = ["regex"]
BEFORE_PII_BUILTIN = ["regex"]


#: `--server KEY=VALUE`: server settings of the orchestrator under test (e.g. read_coalesce_tokens)
SERVER_OVERRIDES: dict[str, Any] = {}


def tenant_keys(tenants: int, keys: int) -> dict[str, str]:
    """--tenants: the environment of `tenants` tenants with `keys` keys each (BENCH_TENANT_<i>)."""
    return {
        f"BENCH_TENANT_{i}_KEYS": ",".join(f"bench-key-{i}-{j}-{'x' * 24}" for j in range(keys))
        for i in range(tenants)
    }


def bench_key(tenants: int, keys: int) -> str:
    """The key the `@tenants` scenarios send: the last tenant's last key (every key is
    compared whichever it is; the last one also makes an early exit, were there one, show)."""
    return f"bench-key-{tenants - 1}-{keys - 1}-{'x' * 24}"


def start_orchestrator(
    tmp: Path,
    fake_url: str,
    workers: int,
    profile: str | None = None,
    root: Path = ROOT,
    tenants: tuple[int, int] | None = None,
) -> Any:
    """`python -m orchestrator serve` from the checkout at `root` (--before: another one);
    `tenants`: with (tenants, keys each) configured (--tenants), every model for each."""
    import yaml

    # (a checkout given with --before may predate on_detection: redact)
    cfg = orchestrator_config(fake_url, workers, redact=root == ROOT)
    if root != ROOT:
        cfg["detectors"]["pii"]["builtin"] = BEFORE_PII_BUILTIN[0]
    cfg["server"].update(SERVER_OVERRIDES)
    if workers == 1:
        cfg["server"].pop("workers")  # also runs against a tree without `server.workers`
    if tenants is not None:
        os.environ.update(tenant_keys(*tenants))  # the child inherits them
        cfg["tenants"] = {
            f"t{i}": {"keys_env": f"BENCH_TENANT_{i}_KEYS"} for i in range(tenants[0])
        }
    tag = ("" if root == ROOT else "-before") + ("-tenants" if tenants else "")
    path = tmp / f"config-{workers}{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    prof = [str(SELF), "_profiled", profile] if profile else ["-m"]
    cmd = [sys.executable, *prof, "orchestrator", "serve", "--config", str(path)]
    cmd += ["--port", "0"]
    cmd += ["--log-level", "warning"]
    return Proc(cmd, tmp / f"orchestrator-{workers}{tag}.log", cwd=root)


# -- the client ----------------------------------------------------------------------------------


@dataclass
class Answer:
    started: float
    done: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # receive time, characters
    text_len: int = 0
    finish: str | None = None
    tag: str = ""

    def fraction(self, t: float) -> float:
        total = self.done - self.started
        return (t - self.started) / total if total > 0 else math.nan

    def share_at(self, q: float) -> float:
        """The time (0..1 of the answer) by which a share `q` of its characters had arrived."""
        need = q * self.text_len
        got = 0
        for t, n in self.chunks:
            got += n
            if got >= need:
                return self.fraction(t)
        return math.nan


def request_body(
    model: str, words: int, itl_ms: float, step_clock: bool = False, tools: bool = False
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": words + 16,
        "temperature": 0,
        "bench_itl_ms": itl_ms,
        "bench_step_clock": step_clock,
    }
    if tools:
        body["tools"] = [BENCH_TOOL]
    return body


async def raw_answer(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    """One streamed answer over raw SSE: every chunk parsed, its content collected."""
    answer = Answer(time.monotonic())
    buf = b""
    async with session.post(url + CHAT_PATH, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for data in resp.content.iter_any():
            now = time.monotonic()
            buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    answer.done = now
                    continue
                obj = orjson.loads(payload)
                if "error" in obj:
                    raise RuntimeError(f"in-band error: {obj['error']}")
                choices = obj.get("choices")
                if not choices:
                    continue
                choice = choices[0]
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                for call in delta.get("tool_calls") or ():  # counted as the text is
                    text += call["function"]["arguments"]
                if text:
                    answer.chunks.append((now, len(text)))
                    answer.text_len += len(text)
                if choice.get("finish_reason"):
                    answer.finish = choice["finish_reason"]
    if not answer.done:
        raise RuntimeError("the stream ended without [DONE]")
    return answer


def sdk_client(url: str, key: str | None = None) -> Callable[[dict[str, Any]], Any]:
    """The OpenAI SDK, for --sdk (its parsing costs the client far more CPU than raw SSE)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0)

    async def run(body: dict[str, Any]) -> Answer:
        body = dict(body)
        extra = {
            key: body.pop(key)
            for key in ("bench_itl_ms", "bench_tag", "bench_step_clock")
            if key in body
        }
        answer = Answer(time.monotonic())
        stream = await client.chat.completions.create(**body, extra_body=extra)
        async for chunk in stream:
            now = time.monotonic()
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text = delta.content or ""
            for call in delta.tool_calls or ():  # counted as the text is
                text += call.function.arguments if call.function else ""
            if text:
                answer.chunks.append((now, len(text)))
                answer.text_len += len(text)
            if chunk.choices[0].finish_reason:
                answer.finish = chunk.choices[0].finish_reason
        answer.done = time.monotonic()
        return answer

    return run


@dataclass
class Level:
    scenario: str
    itl_ms: float
    concurrency: int
    answers: int
    wall_s: float
    server_cpu_ms: float  # per answer: the orchestrator's tree (0 for direct)
    fake_cpu_ms: float
    client_cpu_ms: float
    chars: int
    first_frac_p50: float = math.nan
    first_frac_max: float = math.nan
    first_frac_max_drain: float = math.nan  # the same over every answer, the drain's included
    steady_answers: int = 0  # answers that ended while every slot was still busy
    share25: float = math.nan
    share50: float = math.nan
    share75: float = math.nan
    release_p50_ms: float = math.nan  # paced levels: frame received - its text judgeable
    release_p99_ms: float = math.nan
    release_max_ms: float = math.nan
    step_clock: bool = False  # paced levels: every answer's tokens fall due at the same times
    worker_share: list[float] = field(default_factory=list)  # workers > 1: each one's requests

    @property
    def per_s(self) -> float:
        return self.answers / self.wall_s


async def run_level(
    scenario: str,
    url: str,
    model: str,
    server_pid: int | None,
    fake_pid: int,
    *,
    itl_ms: float,
    concurrency: int,
    answers: int,
    words: int,
    sdk: bool,
    fake_url: str,
    step_clock: bool = False,
    key: str | None = None,
) -> Level:
    tools = scenario.startswith("tools")
    body = request_body(model, words, itl_ms, step_clock, tools)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    auth = {"Authorization": f"Bearer {key}"} if key else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth) as session:
        one = sdk_client(url, key) if sdk else (lambda b: raw_answer(session, url, b))
        await one(body if itl_ms == 0 else request_body(model, words, 0, tools=tools))  # warm-up
        results: list[Answer] = []
        left = answers
        drained_at = math.inf  # when the first slot found no answer left to ask for

        async def slot() -> None:
            nonlocal left, drained_at
            while left > 0:
                left -= 1
                tag = f"{scenario}-{left}-{time.monotonic_ns()}"
                answer = await one({**body, "bench_tag": tag})
                answer.tag = tag
                results.append(answer)
            drained_at = min(drained_at, time.monotonic())

        me = os.getpid()
        cpu0 = (tree_cpu_s(server_pid) if server_pid else 0.0, tree_cpu_s(fake_pid))
        client0 = tree_cpu_s(me, children=False)
        t0 = time.monotonic()
        await asyncio.gather(*(slot() for _ in range(concurrency)))
        wall = time.monotonic() - t0
        server = (tree_cpu_s(server_pid) - cpu0[0]) if server_pid else 0.0
        fake = tree_cpu_s(fake_pid) - cpu0[1]
        client = tree_cpu_s(me, children=False) - client0
    n = len(results)
    level = Level(
        scenario,
        itl_ms,
        concurrency,
        n,
        wall,
        server / n * 1000,
        fake / n * 1000,
        client / n * 1000,
        results[0].text_len,
        step_clock=step_clock,
    )
    finish = "tool_calls" if tools else "stop"
    bad = [a for a in results if a.finish != finish or a.text_len != level.chars]
    if bad:
        raise RuntimeError(f"{scenario}: {len(bad)} answers ended wrong ({bad[0].finish})")
    # Burst figures over the answers that ended while all `concurrency` slots were busy: in the
    # drain at the end of a level, an answer's first frame came under full load, but its total
    # time shrinks as the other slots finish, which inflates its fraction (the last answer of an
    # 8-stream level: first frame at 49 ms like the others, of 142 ms instead of ~200).
    steady = [a for a in results if a.done <= drained_at] or results
    firsts = sorted(a.fraction(a.chunks[0][0]) for a in steady)
    level.steady_answers = len(steady)
    level.first_frac_p50 = statistics.median(firsts)
    level.first_frac_max = firsts[-1]
    level.first_frac_max_drain = max(a.fraction(a.chunks[0][0]) for a in results)
    level.share25 = statistics.fmean(a.share_at(0.25) for a in results)
    level.share50 = statistics.fmean(a.share_at(0.5) for a in results)
    level.share75 = statistics.fmean(a.share_at(0.75) for a in results)
    if itl_ms > 0:
        async with aiohttp.ClientSession() as session, session.get(fake_url + "/bench/sent") as r:
            sent = await r.json()
        delays = sorted(
            release_delays(results, sent, words, wait_next_word=scenario.startswith("sentence"))
        )
        if delays:
            level.release_p50_ms = delays[len(delays) // 2] * 1000
            level.release_p99_ms = delays[min(len(delays) - 1, len(delays) * 99 // 100)] * 1000
            level.release_max_ms = delays[-1] * 1000
    return level


def release_delays(
    answers: list[Answer], sent: dict[str, list[float]], words: int, *, wait_next_word: bool
) -> list[float]:
    """For each frame of a paced answer: the time the client got it minus the time its text
    became judgeable, from the fake's send time of each piece. A sentence frame ending at piece k
    is judgeable once piece k + 2 was sent: Punkt decides a break from the next word whole, and
    that word's end is known from the space that starts piece k + 2 (or at the end of the
    answer). A per-token frame (`none`) is judgeable when its piece was sent."""
    import bisect
    import itertools

    ends = list(itertools.accumulate(len(p) for p in answer_pieces(words)))
    out: list[float] = []
    for answer in answers:
        times = sent.get(answer.tag)
        if not times:
            continue
        last = len(times) - 1
        upto = 0
        for received, n in answer.chunks:
            upto += n
            k = bisect.bisect_left(ends, upto)
            ready = times[min(k + 2, last) if wait_next_word else min(k, last)]
            out.append(received - ready)
    return out


def print_level(lv: Level) -> None:
    print(
        f"  {lv.scenario:>15} itl {lv.itl_ms:>4g}{'s' if lv.step_clock else ' '}ms c{lv.concurrency:<2}: "
        f"{lv.answers:>3} answers, "
        f"{lv.per_s:6.2f} answers/s; CPU ms/answer: server {lv.server_cpu_ms:7.1f}, "
        f"fake {lv.fake_cpu_ms:6.1f}, client {lv.client_cpu_ms:6.1f}; first chunk at "
        f"{lv.first_frac_p50:.3f} (max {lv.first_frac_max:.3f} over {lv.steady_answers}; "
        f"with the drain {lv.first_frac_max_drain:.3f}) of the answer, 25/50/75% of "
        f"text by {lv.share25:.2f}/{lv.share50:.2f}/{lv.share75:.2f}"
        + (
            f"; release after judgeable p50 {lv.release_p50_ms:.1f} / p99 "
            f"{lv.release_p99_ms:.1f} / max {lv.release_max_ms:.1f} ms"
            if not math.isnan(lv.release_p50_ms)
            else ""
        )
        + (
            "; requests per worker " + "/".join(f"{n:g}" for n in lv.worker_share)
            if lv.worker_share
            else ""
        ),
        flush=True,
    )


async def worker_shares(url: str) -> list[float]:
    """How many requests each live worker served (`guardstream_worker_requests`, by pid): the
    kernel, not load, spreads connections over SO_REUSEPORT workers."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as r:
            page = await r.text()
    return sorted(
        (
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("guardstream_worker_requests{")
        ),
        reverse=True,
    )


async def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    fake = Proc(
        [
            *(sys.executable, str(SELF), "_fake", "--words", str(args.words)),
            *("--yield-every", str(args.fake_yield_every)),
        ],
        tmp / "fake.log",
    )
    orch = before = tenanted = None
    levels: list[Level] = []
    workers: dict[int, float] = {}
    try:
        scenarios = [s for s in args.scenarios.split(",") if s]
        if any(s != "direct" for s in scenarios):
            orch = start_orchestrator(tmp, fake.url, args.workers, args.profile)
            await wait_ready(orch.url)
        if args.before:
            # the same guarded scenarios on another checkout, level by level, interleaved with
            # these: a busy shared machine changes every cost over minutes, not within a level
            before = start_orchestrator(tmp, fake.url, 1, root=args.before)
            await wait_ready(before.url)
            # (`tools`: a checkout from before tool calls refuses them)
            scenarios += [
                f"{s}@before" for s in scenarios if s not in ("direct", "redact", "tools")
            ]
        if args.tenants:
            # the same scenarios with N tenants of K keys each configured, interleaved
            tenanted = start_orchestrator(tmp, fake.url, args.workers, tenants=args.tenants)
            await wait_ready(tenanted.url)
            scenarios += [f"{s}@tenants" for s in scenarios if "@" not in s and s != "direct"]
        print(
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
            f"{args.words}-word answers, one word a chunk; client: "
            f"{'OpenAI SDK' if args.sdk else 'raw SSE'}; orchestrator workers: {args.workers}",
            flush=True,
        )
        plan = [(0.0, 1, args.answers, False), (0.0, 8, args.answers * 2, False)]
        if args.itl10:
            plan += [(10.0, 1, 1, False), (10.0, 8, 8, False), (10.0, 8, 8, True)]
        if args.plan:
            plan = [
                (float(itl), int(c), int(n), bool(rest) and rest[0] == "step")
                for itl, c, n, *rest in (step.split(":") for step in args.plan.split(","))
            ]
        for itl, c, n, step_clock in plan:
            for scenario in scenarios:
                if scenario == "direct":
                    url, model, pid = fake.url, UPSTREAM_MODEL, None
                else:
                    server = (
                        before
                        if scenario.endswith("@before")
                        else tenanted
                        if scenario.endswith("@tenants")
                        else orch
                    )
                    assert server is not None
                    url, pid = server.url, server.pid
                    model = (
                        GUARDED
                        if scenario.startswith(("sentence", "tools"))
                        else REDACTING
                        if scenario.startswith("redact")
                        else RAW
                    )
                lv = await run_level(
                    scenario,
                    url,
                    model,
                    pid,
                    fake.pid,
                    itl_ms=itl,
                    concurrency=c,
                    answers=n,
                    words=args.words,
                    sdk=args.sdk,
                    fake_url=fake.url,
                    step_clock=step_clock,
                    key=bench_key(*args.tenants) if scenario.endswith("@tenants") else None,
                )
                levels.append(lv)
                print_level(lv)
        for server in (orch, before, tenanted):
            if server is not None:
                server.stop()
        orch = before = tenanted = None
        if args.workers_compare:
            for w in (1, 2):
                proc = start_orchestrator(tmp, fake.url, w)
                try:
                    await wait_ready(proc.url)
                    lv = await run_level(
                        f"workers{w}",
                        proc.url,
                        GUARDED,
                        proc.pid,
                        fake.pid,
                        itl_ms=0,
                        concurrency=8,
                        answers=args.answers * 2,
                        words=args.words,
                        sdk=args.sdk,
                        fake_url=fake.url,
                    )
                    if w > 1:
                        lv.worker_share = await worker_shares(proc.url)
                finally:
                    proc.stop()
                workers[w] = lv.per_s
                levels.append(lv)
                print_level(lv)
    finally:
        for server in (orch, before, tenanted):
            if server is not None:
                server.stop()
        fake.stop()
    summary(levels, workers)
    return {
        "cpus": os.cpu_count(),
        "words": args.words,
        "levels": [{**lv.__dict__, "per_s": lv.per_s} for lv in levels],
        "workers_answers_per_s": workers,
    }


def summary(levels: list[Level], workers: dict[int, float]) -> None:
    by = {(lv.scenario, lv.itl_ms, lv.concurrency): lv for lv in levels if not lv.step_clock}
    stepped = {(lv.scenario, lv.itl_ms, lv.concurrency): lv for lv in levels if lv.step_clock}
    print()

    def check(name: str, ok: bool | None, detail: str) -> None:
        status = "not measured" if ok is None else "MET" if ok else "NOT MET"
        print(f"target: {name}: {status} ({detail})")

    s = by.get(("sentence", 0.0, 1))
    check(
        "server CPU per answer at ITL 0 with a sentence detector <= 30 ms",
        None if s is None else s.server_cpu_ms <= 30,
        "-" if s is None else f"{s.server_cpu_ms:.1f} ms",
    )
    r = by.get(("none", 0.0, 1))
    check(
        "server CPU per answer at ITL 0 without detectors <= 60 ms",
        None if r is None else r.server_cpu_ms <= 60,
        "-" if r is None else f"{r.server_cpu_ms:.1f} ms",
    )
    d = by.get(("direct", 0.0, 8))
    guarded = [
        by[k] for k in by if k[0] in ("sentence", "workers1", "workers2") and k[1:] == (0.0, 8)
    ]
    for g in guarded or [None]:
        check(
            f"answers/s at ITL 0, c8 >= 80% of the direct fake's ({g and g.scenario})",
            None if d is None or g is None else g.per_s >= 0.8 * d.per_s,
            "-"
            if d is None or g is None
            else f"{g.per_s:.1f} vs {d.per_s:.1f}/s, {g.per_s / d.per_s * 100:.0f}%",
        )
    for clock, levels_by in (("own clocks", by), ("one step clock", stepped)):
        i8 = levels_by.get(("sentence", 10.0, 8))
        check(
            f"server CPU per answer at ITL 10 ms, c8 <= 250 ms (streams on {clock})",
            None if i8 is None else i8.server_cpu_ms <= 250,
            "-" if i8 is None else f"{i8.server_cpu_ms:.1f} ms",
        )
    for g in guarded or [None]:
        check(
            "under a burst (ITL 0, c8) the first frame comes within the first quarter "
            f"({g and g.scenario})",
            None if g is None else g.first_frac_max <= 0.25,
            "-"
            if g is None
            else f"p50 {g.first_frac_p50:.3f}, max {g.first_frac_max:.3f} over the "
            f"{g.steady_answers} answers at full concurrency (with the drain: "
            f"{g.first_frac_max_drain:.3f}); "
            f"25/50/75% of text by {g.share25:.2f}/{g.share50:.2f}/{g.share75:.2f}",
        )
    if workers:
        check(
            "workers: 2 serves more answers/s than workers: 1",
            workers.get(2, 0) > workers.get(1, math.inf),
            ", ".join(f"{w} worker(s): {v:.2f}/s" for w, v in sorted(workers.items())),
        )


def serve_profiled(out: str, argv: list[str]) -> int:
    """`python -m <argv>` under cProfile with a CPU-time clock: a wall-clock profile charges the
    time a process waits to be scheduled (2 busy cores) to whatever call it was in, such as
    socket.send."""
    import cProfile
    import runpy

    prof = cProfile.Profile(time.process_time)
    sys.argv = argv
    prof.enable()
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.disable()
        prof.dump_stats(out)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_fake":
        return serve_fake(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_profiled":
        return serve_profiled(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--answers", type=int, default=24, help="answers at ITL 0, c1 (c8: x2)")
    parser.add_argument("--words", type=int, default=2000)
    parser.add_argument(
        "--fake-yield-every",
        type=int,
        default=YIELD_EVERY,
        help="at ITL 0 the fake lets other answers go on after this many chunks; 0: it writes "
        "each answer whole before the next (answers then queue at the fake)",
    )
    parser.add_argument("--scenarios", default="direct,sentence,none")
    parser.add_argument("--itl10", action="store_true", help="also 10 ms per token (c1 and c8)")
    parser.add_argument(
        "--plan",
        default=None,
        help="levels as itl_ms:concurrency:answers[:step],... (overrides; step: one step clock)",
    )
    parser.add_argument("--workers", type=int, default=1, help="server.workers of the scenarios")
    parser.add_argument("--workers-compare", action="store_true")
    parser.add_argument("--sdk", action="store_true", help="the OpenAI SDK as the client")
    parser.add_argument(
        "--before",
        default=None,
        metavar="PATH",
        help="another checkout (e.g. `git archive <commit>` unpacked): its orchestrator runs "
        "the same guarded levels, interleaved, as `<scenario>@before`",
    )
    parser.add_argument(
        "--pii-builtin",
        default="regex",
        help="the built-in behind the `pii` guardrail (e.g. pii_ner); see --before-pii-builtin",
    )
    parser.add_argument(
        "--before-pii-builtin",
        default="regex",
        help="the built-in behind --before's `pii` guardrail (default regex: a tree from before "
        "pii_ner has none)",
    )
    parser.add_argument(
        "--tenants",
        default=None,
        metavar="N:K",
        help="also an orchestrator with N tenants of K keys each configured: the same levels, "
        "interleaved, as `<scenario>@tenants` (requests carry the last tenant's last key)",
    )
    parser.add_argument("--json", default=None)
    _orch_bench.add_server_option(parser)
    parser.add_argument("--profile", default=None, help="run the orchestrator under cProfile")
    args = parser.parse_args()
    SERVER_OVERRIDES.update(_orch_bench.server_overrides(args.server))
    PII_BUILTIN[0] = args.pii_builtin
    BEFORE_PII_BUILTIN[0] = args.before_pii_builtin
    if args.before:
        args.before = Path(args.before).resolve()
    if args.tenants:
        n, k = (int(x) for x in args.tenants.split(":"))
        args.tenants = (n, k)
    use_uvloop()
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        out = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
