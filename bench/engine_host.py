"""The engine's host cost per row per step, with a null model: what a CPU can measure of issue 35.

    python bench/engine_host.py [--rows 1,64,256] [--tokens 128] [--device cpu|cuda]
                                [--device-ms 4] [--paths inproc,http] [--decoding greedy,sampling]
                                [--clients 2] [--repeat 1] [--eager] [--json out.json]
                                [--overlap on,off] [--ttft 64,256] [--ttft-tokens 16]

    # the issue's figure at 256 rows, on 2 shared cores (about 4 minutes):
    python bench/engine_host.py --rows 256 --paths http-api --repeat 5

The model is `NullModel`: one forward pass writes one tiny key per row into the KV cache it is
given (so the engine's caches, joins and leaves are exercised) and returns fixed logits over
tiny-random's vocabulary (1,024 tokens, its real tokenizer: detokenization and stop checks are
real). The logits peak on one text token, so greedy repeats it as random weights do; seeded
sampling (T=0.8, top-p 0.95) draws among the rest, byte tokens included (held-back U+FFFD text).
`min_new_tokens` = `max_new_tokens`: every stream runs exactly `--tokens` steps.

The engine runs its static decode step (CUDA's path; eager on a CPU) with `NullSampler`: the
device sampler's per-slot bookkeeping with a draw that costs nothing (greedy: the peak token;
sampling: fixed draws keyed by seed and position), so what is measured is the host's work, not a
CPU doing the GPU's sort. `--eager`: the CPU's default path instead (eager step, the real batched
sampler over the fixed logits; its sampling figure then includes that sampler's compute).

Two paths, each at every row count and decoding:
- inproc: the `Engine` in this process, its queues read by an asyncio loop here;
- http: the engine's own server (`generation.server.create_app`) in a subprocess, driven by
  `--clients` client processes (bench/stream_clients.py: aiohttp, NDJSON read line by line,
  the processes started together), as the orchestrator would.
Both hold the engine until every stream is queued (`Engine.hold`, for the http path through a
bench-only route of the server subprocess), so all rows prefill together and every step runs at
the full row count.

A step's time is measured from the streams' own token arrival times: from the first stream's
first token to the last stream's last token, divided by the steps in between (a client that falls
behind adds its lag: what a reader of the streams sees). Host microseconds per row per step = that
step time / rows with the null model (its forward costs microseconds); the fastest of `--repeat`
runs counts (on a shared machine other processes only ever add time).

Then the same with a simulated device step of `--device-ms`, overlapped steps off and on
(`--overlap`, the engine's option). Synchronous steps take device + host, overlapped ones
max(device, host), so the share of the host's per-step work that overlap hides is
(step off - step on) / (step off - device), each repeat's two runs paired. Here the step is the
typical one (`median_step`: the median stream's arrival of token k, the median over k of windows
of 16 steps), which a burst of another tenant's load or a straggler moves little; the summary gives
the median over repeats and their range. Every setting's server (host only, overlap on, overlap
off) runs at once and their runs alternate, so load falls on all of them alike. (Until
2026-11-27 the share was 1 - (step on - device) / the host-only step, of end-to-end means and of
servers run minutes apart: at 256 rows over HTTP the host-only step is 1-4 ms, so 0.5 ms of
noise in one run moved it by 15-50 points, and the same configuration read 12% to 92%.)

On CUDA the null model spins the GPU with `torch.cuda._sleep` inside the step (its graph). On a
CPU a device clock stands in for the GPU: each forward pass takes `--device-ms` of it, one after
another; a static decode step is only queued on it (the host goes on, as after a CUDA graph
launch) and the step's tokens are ready when the clock has run it (`ClockEvent`, in place of the
CUDA event the engine records; the wait sleeps, releasing the GIL and the core, as a GPU sync
that yields does); any other pass (prefill, an eager step) is waited for at once, as the host
read of its result would. The clock also records how long the device sat idle before each step
was queued (`GET /bench/device` reads it over http): the host's exposed time per step, with no
client's reading in the measure. Device step = device + idle, so the share hidden is
1 - idle on / idle off, of the median over the level's steps (`device`) and of the mean
(`device_mean`).

On 2 shared cores the clients, the API process and the engine core compete for CPU: a host-only
step at 256 rows is the whole pipeline's CPU time over the cores left (the worker thread's own
work is a fifth of it), and under a load average of 4-5 a woken worker now and then waits
several milliseconds for a core, which no overlap hides: the steps' windows of 16 and the mean
idle count those stalls, the median idle does not (with overlap on it was 0 in every run here;
synchronous, 1-4.5 ms). Read the spread and the load average the summary prints.

TTFT (http paths, `--ttft 64,256`, `--ttft-tokens 16`): bursts of that many new streams, not
held: the clients connect (and warm) first, then send every request at once, and each stream's
time to first token is from its request sent to its first NDJSON line read; the requests reach
the engine as the server admits them, as a burst of real clients' do. Run on every server (host
only, and with the device step, overlap on), before the step levels; printed per burst
(`ttft ...`), per setting (`... ttft_ms_N p50= p90= max=`, the repeat with the lowest p50), and
as the next-to-last line `ttft_ms_256 p50=.. p90=.. max=.. device=Xms (path, decoding)` (the
served layout, the most streams, with the device step when there is one).

Both paths freeze the start-up heap once the engine has started, as `python -m generation serve`
does (`generation.server.freeze_startup_heap`): the engine is measured as it is served.

CPU time too (Linux /proc): the engine process's CPU seconds per row per step, all threads, and
over http the worker thread's share; on a shared machine these are steadier than wall time, and
they say how much of the host's work is the worker's own (accept, detokenize, stop checks, emit)
and how much the server's delivery, which shares the worker's GIL in the same process. The
client processes report theirs (first token to last): on a machine with few cores the clients'
reading competes with the engine, so the wall-clock step can be no shorter than (engine +
clients) CPU / cores.

Last line, for scripts (the served layout, most rows): `host_us_per_row_256 greedy=X sampling=Y
overlap_hidden=Z% steps_hidden=S% device_mean_hidden=M%`: each the smaller of the two decodings'
medians over repeats (`hidden_shares`); Z of the typical step where the device runs it (a CPU's
device clock; on CUDA, which has none, Z is S), S as the streams see it, M of the device's mean
idle time (every stall counted). It is printed even when a level fails (its figures then `na`).

The CPU may be shared (2 cores here): compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stream_clients import Streams, read_streams
from generation import model_runner, models
from generation.__main__ import LISTEN_BACKLOG
from generation.decode_graphs import StaticSlotCache
from generation.device_sampling import DeviceSampler
from generation.jobs import Job, StreamError
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from generation.server import freeze_startup_heap
from tests.engine_processes import child_environment

SAMPLING = {"method": "sampling", "seed": 7, "temperature": 0.8, "top_p": 0.95}
GREEDY_TEXT = " the"  # the token greedy repeats (its first token under tiny-random's tokenizer)
MAX_CONTEXT = 4096  # the null model has no positions: the engine's limit only
PROMPT_TOKENS = 16  # 256 prompts fill the engine's prefill token budget (4,096) exactly


class NullModel(torch.nn.Module):
    """A causal LM in microseconds: one key per row into the cache, fixed logits out.

    Speaks what the engine asks of a transformers model: `input_ids`, `attention_mask`,
    `position_ids`, `past_key_values` (a `DynamicCache` from prefill; the engine's slot caches
    in decode steps), `logits_to_keep`; returns `.logits` and `.past_key_values`."""

    def __init__(
        self, logits: torch.Tensor, device: torch.device, dtype: torch.dtype, device_ms: float
    ) -> None:
        super().__init__()
        self.fixed = logits.to(device=device, dtype=dtype)
        self.kv_dtype = dtype
        self.device_ms = device_ms
        self.config = SimpleNamespace(_attn_implementation="sdpa")
        self._cycles = _cuda_cycles(device_ms) if device.type == "cuda" and device_ms else 0
        self.busy_until = 0.0  # CPU: the simulated device's clock (time.monotonic)
        # CPU: how long the device sat idle before each static decode step was queued (the
        # host's exposed time per step: what overlapped steps exist to shrink); read and reset
        # by `take_idle`
        self.idle: list[float] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        **_: Any,
    ) -> SimpleNamespace:
        from transformers.cache_utils import DynamicCache

        rows, width = input_ids.shape
        kv = torch.zeros((rows, 1, width, 1), dtype=self.kv_dtype, device=input_ids.device)
        if past_key_values is None:
            past_key_values = DynamicCache()
        past_key_values.update(kv, kv, 0)
        if isinstance(logits_to_keep, torch.Tensor):
            kept = logits_to_keep.numel()
        else:
            kept = width if logits_to_keep == 0 else min(int(logits_to_keep), width)
        if self._cycles:
            torch.cuda._sleep(self._cycles)  # capturable: the "device step" inside the graph
        elif self.device_ms:
            self._device_pass(queued=isinstance(past_key_values, StaticSlotCache))
        # a copy, not an expanded view: the engine writes into logits (EOS suppression)
        logits = self.fixed.repeat(rows, kept, 1)
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)

    def _device_pass(self, queued: bool) -> None:
        """One pass on the simulated device's clock, after those before it. A static decode
        step is only queued (its tokens' `ClockEvent` waits for it); any other pass is waited
        for now (sleeping releases the GIL, as waiting on a GPU does)."""
        now = time.monotonic()
        if queued:
            self.idle.append(max(now - self.busy_until, 0.0))
        self.busy_until = max(now, self.busy_until) + self.device_ms / 1000
        if not queued:
            time.sleep(max(self.busy_until - now, 0.0))

    def take_idle(self) -> list[float]:
        """The device's idle seconds before each static step queued since the last call."""
        idle, self.idle = self.idle, []
        return idle


REAL_STEP_EVENT = model_runner.record_step_event


class ClockEvent:
    """The simulated device's event: complete when its clock reaches the step's end."""

    __slots__ = ("until",)

    def __init__(self, until: float) -> None:
        self.until = until

    def synchronize(self) -> None:
        delay = self.until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def use_clock_events(loaded: models.LoadedModel) -> None:
    """Make the engine's static steps record `ClockEvent`s of the null model's clock (a CPU
    with a simulated device step; a bench-only patch of generation.model_runner)."""
    model = loaded.model
    assert isinstance(model, NullModel)
    if loaded.device.type == "cpu" and model.device_ms:
        model_runner.record_step_event = lambda device: ClockEvent(model.busy_until)
    else:
        model_runner.record_step_event = REAL_STEP_EVENT


def _cuda_cycles(ms: float) -> int:
    """GPU clock cycles of `ms`, calibrated with events (torch.cuda._sleep spins cycles)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm-up
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-6))


def load_null(device: str, device_ms: float) -> models.LoadedModel:
    """A `LoadedModel` of `NullModel` with tiny-random's tokenizer."""
    from transformers import AutoTokenizer

    torch_device = models.resolve_device(device)
    path = models.prepare("tiny-random")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    frontend = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(1234)
    logits = torch.randn(vocab, generator=generator, dtype=torch.float64) * 0.5
    logits[greedy_token(tokenizer)] = 4.0
    dtype = torch.float32 if torch_device.type == "cpu" else torch.bfloat16
    model = NullModel(logits, torch_device, dtype, device_ms)
    return models.LoadedModel(
        name="null",
        path=path,
        model=model,
        tokenizer=tokenizer,
        frontend_tokenizer=frontend,
        device=torch_device,
        dtype=dtype,
        max_context=MAX_CONTEXT,
        eos_token_ids=frozenset({int(tokenizer.eos_token_id)}),
        vocab_size=vocab,
        model_vocab_size=vocab,
        has_chat_template=True,
        threads=1,
    )


def greedy_token(tokenizer: Any) -> int:
    """The first token of `GREEDY_TEXT` (env GUARDSTREAM_BENCH_GREEDY_TEXT overrides it, for the
    server subprocess too: "<|im_start|>" repeats a special token, whose text is skipped)."""
    text = os.environ.get("GUARDSTREAM_BENCH_GREEDY_TEXT", GREEDY_TEXT)
    return int(tokenizer(text, add_special_tokens=False)["input_ids"][0])


def prompts(rows: int) -> list[list[int]]:
    """A different prompt per stream (ids 3..258: tiny-random's byte tokens and merges)."""
    return [[3 + (i * 7 + j * 13) % 256 for j in range(PROMPT_TOKENS)] for i in range(rows)]


class NullSampler(DeviceSampler):
    """The device sampler's bookkeeping (per-slot settings, generated counts) with a draw that
    costs nothing: greedy rows take the logits' peak token (what argmax gives), sampling rows a
    token from a fixed table of draws from the null model's distribution, keyed by (seed,
    position). Capturable like `DeviceSampler.sample` (device ops only, static shapes).

    Why: on a CPU the real sampler's sort of the vocabulary is the "device" work, which a GPU
    does; the host's work around it (settings, moves, the one read of the tokens) stays."""

    def __init__(self, *args: Any, table: torch.Tensor, peak: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._table = table.to(self.device)
        self._peak = torch.tensor(peak, dtype=torch.long, device=self.device)

    def sample(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        n = logits.shape[0]
        slots = self._slot_index[:n] if rows is None else rows
        floats = self._floats.index_select(0, slots)
        ints = self._ints.index_select(0, slots)
        key = (ints[:, 1] * 7919 + ints[:, 2] * 104729).remainder(self._table.numel())
        tokens = torch.where(floats[:, 0] > 0, self._table[key], self._peak)
        self._ints[:, 2].index_add_(0, slots, self._ones[:n])
        return tokens


def use_null_sampler(loaded: models.LoadedModel) -> None:
    """Make the engine's static step build a `NullSampler` (the engine builds its sampler inside
    its start-up, from the name `DeviceSampler` in generation.model_runner: a bench-only patch)."""
    from generation import model_runner

    model = loaded.model
    assert isinstance(model, NullModel)
    weights = torch.softmax(model.fixed.double().cpu() / SAMPLING["temperature"], dim=-1)
    generator = torch.Generator().manual_seed(99)
    table = torch.multinomial(weights, 4096, replacement=True, generator=generator)
    peak = int(model.fixed.argmax())
    model_runner.DeviceSampler = functools.partial(NullSampler, table=table, peak=peak)  # type: ignore[misc]


def make_engine(loaded: models.LoadedModel, rows: int, eager: bool, overlap: bool) -> Engine:
    """The static step (CUDA's path, eager on a CPU) with the null sampler, or (`eager`) the
    CPU's default path with the real sampler over the fixed logits."""
    return Engine(loaded, max_batch_size=max(rows, 1), static_decode=not eager, overlap=overlap)


# ----- measurement ------------------------------------------------------------------------------


@dataclass
class Level:
    path: str
    decoding: str
    rows: int
    device_ms: float
    step_ms: float
    steps: float
    overlap: bool = True
    cpu_s: float = 0.0  # CPU seconds the worker's process used (all threads) for the level
    worker_cpu_s: float = 0.0  # of which the worker thread (http paths)
    api_cpu_s: float = 0.0  # http-api: the API process's CPU seconds (the HTTP side)
    client_cpu_s: float = 0.0  # the client processes' CPU seconds, first token to last (http)
    median_step_ms: float = 0.0  # the typical step: median over windows of steps (`median_step`)
    idle_ms: list[float] = field(default_factory=list)  # CPU: the device's idle before each step
    repeat: int = 0  # which of `--repeat` runs

    @property
    def device_idle_ms(self) -> float:
        """CPU with a device step: the device's mean idle time per decode step (the host's
        exposed time), the level's first step (after prefill and joins) left out."""
        idle = self.idle_ms[1:]
        return sum(idle) / len(idle) if idle else 0.0

    @property
    def host_us_per_row(self) -> float:
        """Host time per row per step: the step less the simulated device time."""
        return max(self.step_ms - self.device_ms, 0.0) * 1000 / self.rows

    @property
    def cpu_us_per_row(self) -> float:
        """The engine process's CPU time per row per step (prefill included; the clients'
        processes excluded): what the host spends, whatever else the machine runs."""
        return self.cpu_s * 1e6 / (self.rows * max(self.steps + 1, 1))

    @property
    def worker_us_per_row(self) -> float:
        return self.worker_cpu_s * 1e6 / (self.rows * max(self.steps + 1, 1))

    @property
    def api_us_per_row(self) -> float:
        return self.api_cpu_s * 1e6 / (self.rows * max(self.steps + 1, 1))

    @property
    def total_us_per_row(self) -> float:
        """Both processes of the split server (the one process's figure otherwise)."""
        return self.cpu_us_per_row + self.api_us_per_row

    @property
    def client_us_per_row(self) -> float:
        """The clients' CPU time per row per step: on a machine with few cores they compete
        with the engine for it (what the wall-clock figure includes)."""
        return self.client_cpu_s * 1e6 / (self.rows * max(self.steps, 1))


@dataclass
class TtftLevel:
    """A burst of new streams over http: each stream's time to first token (ms, sorted)."""

    path: str
    decoding: str
    rows: int
    device_ms: float
    overlap: bool
    ttft_ms: list[float]
    repeat: int = 0

    def quantile(self, q: float) -> float:
        ordered = self.ttft_ms
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    def describe(self) -> str:
        return (
            f"p50={self.quantile(0.5):.0f} p90={self.quantile(0.9):.0f} max={self.ttft_ms[-1]:.0f}"
        )


def step_time(arrivals: list[list[tuple[float, int]]]) -> tuple[float, float]:
    """(seconds per step, steps) from each stream's (arrival time, tokens so far): from the
    first stream's first token to the last stream's last token, over the steps in between.
    Conservative: a client that falls behind, or rows that start a step late, add time."""
    start = min(stream[0][0] for stream in arrivals)
    end = max(stream[-1][0] for stream in arrivals)
    steps = max(stream[-1][1] - stream[0][1] for stream in arrivals)
    return (end - start) / max(steps, 1), float(steps)


#: Steps per window of `median_step`: several, as a client behind reads a few tokens at once
#: (a reader so far behind that it takes more than a window per read reads near-zero steps: the
#: clients run at the engine's priority, as on a machine of their own they would keep up).
STEP_WINDOW = 16


def median_step(arrivals: list[list[tuple[float, int]]], window: int = STEP_WINDOW) -> float:
    """The typical step in seconds: when the median stream received its k-th token, and the
    median over k of (that time at k + `window` - at k) / `window`. Unlike `step_time`, a burst
    of another process's load on a shared machine, or a straggler, moves it little."""
    times: dict[int, list[float]] = {}
    for stream in arrivals:
        for at, count in stream:
            times.setdefault(count, []).append(at)
    half = len(arrivals) / 2
    at = {k: statistics.median(v) for k, v in times.items() if len(v) >= half}
    slopes = [(at[k + window] - at[k]) / window for k in at if k + window in at]
    return statistics.median(slopes) if slopes else 0.0


def decoding_params(decoding: str, index: int) -> SamplingParams:
    if decoding == "greedy":
        return SamplingParams(greedy=True)
    return SamplingParams(
        greedy=False, temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"], seed=7 + index
    )


async def run_inproc(engine: Engine, rows: int, decoding: str, tokens: int) -> Level:
    loop = asyncio.get_running_loop()
    jobs = [
        Job(
            prompt_ids=ids,
            max_new_tokens=tokens,
            sampling=decoding_params(decoding, i),
            loop=loop,
            queue=asyncio.Queue(),
            min_new_tokens=tokens,
        )
        for i, ids in enumerate(prompts(rows))
    ]

    async def read(job: Job) -> list[tuple[float, int]]:
        seen: list[tuple[float, int]] = []
        while True:
            event = await job.queue.get()
            if isinstance(event, StreamError):
                raise RuntimeError(event.message)
            seen.append((time.monotonic(), event.generated_token_count))
            if event.finish_reason is not None:
                return seen

    cpu = time.process_time()
    with engine.hold():
        for job in jobs:
            engine.submit(job)
    arrivals = await asyncio.gather(*(read(job) for job in jobs))
    cpu = time.process_time() - cpu
    seconds, steps = step_time(arrivals)
    level = Level("inproc", decoding, rows, 0.0, seconds * 1000, steps, engine.overlap, cpu)
    level.median_step_ms = median_step(arrivals) * 1000
    model = engine.model
    if isinstance(model, NullModel):
        level.idle_ms = [x * 1000 for x in model.take_idle()]
    return level


# ----- the http path: a server subprocess and client subprocesses -------------------------------


def bench_app(device: str, device_ms: float, rows: int, eager: bool, overlap: bool) -> Any:
    """The engine's own app over the null model, plus `POST /bench/hold` ({"rows": n}: hold the
    engine until n requests are queued, then let them join at once) and `GET /bench/worker`
    (the worker's process and thread ids, for their CPU time)."""
    from aiohttp import web

    from generation.server import STATE, create_app

    loaded = load_null(device, device_ms)
    if not eager:
        use_null_sampler(loaded)
    use_clock_events(loaded)
    app = create_app(
        loaded, max_batch_size=rows, threads=1, static_decode=not eager, overlap=overlap
    )

    engine = app[STATE].engine
    submit = engine.submit
    holding: list[Any] = []  # while held: [rows wanted, the hold's context manager]

    def submit_and_release(job: Job) -> None:
        """The engine's `submit`, releasing the hold at the wanted row count: no poll (its
        wake-ups would count as the server's CPU time while the clients start)."""
        submit(job)
        if holding and engine.queued_requests >= holding[0]:
            _, held = holding
            holding.clear()
            held.__exit__(None, None, None)

    engine.submit = submit_and_release  # type: ignore[method-assign]

    async def hold(request: web.Request) -> web.Response:
        wanted = int((await request.json())["rows"])
        held = engine.hold()
        held.__enter__()
        holding[:] = [wanted, held]
        return web.json_response({"held": wanted})

    async def worker(request: web.Request) -> web.Response:
        thread = request.app[STATE].engine._thread  # the worker's OS thread id, for its CPU time
        tid = thread.native_id if thread is not None else None
        return web.json_response({"pid": os.getpid(), "tid": tid})

    async def device(request: web.Request) -> web.Response:
        model = request.app[STATE].engine.model  # the device's idle before each step, reset
        idle = model.take_idle() if isinstance(model, NullModel) else []
        return web.json_response({"idle_ms": [x * 1000 for x in idle]})

    app.router.add_post("/bench/hold", hold)
    app.router.add_get("/bench/worker", worker)
    app.router.add_get("/bench/device", device)
    return app


def serve(port: int, device: str, device_ms: float, rows: int, eager: bool, overlap: bool) -> None:
    """The one-process server subprocess: `bench_app` on a TCP port."""
    from aiohttp import web

    app = bench_app(device, device_ms, rows, eager, overlap)

    async def freeze(app: web.Application) -> None:
        freeze_startup_heap()  # after the engine's start-up, as `python -m generation serve`

    app.on_startup.append(freeze)  # after create_app's own (the engine's start)
    print(f"listening on {port}", flush=True)
    web.run_app(
        app,
        host="127.0.0.1",
        port=port,
        print=None,
        handle_signals=True,
        backlog=LISTEN_BACKLOG,  # as `python -m generation serve`: a burst's connections queue
    )


def serve_core(
    fd: int,
    steps_fd: int,
    socket_path: str,
    device: str,
    device_ms: float,
    rows: int,
    eager: bool,
    overlap: bool,
) -> None:
    """The engine-core child of `python -m generation serve --api-process --core-command ...`
    (the split server): `bench_app` served by `generation.engine_core.run_core`."""
    from generation.engine_core import run_core

    async def main() -> int:
        app = bench_app(device, device_ms, rows, eager, overlap)
        return await run_core(app, fd, socket_path, steps_fd)

    sys.exit(asyncio.run(main()))


class HttpBench:
    """One server subprocess per device-ms setting; client subprocesses per level."""

    def __init__(
        self, args: argparse.Namespace, device_ms: float, overlap: bool, api: bool = False
    ) -> None:
        """`api`: the split server (`python -m generation serve --api-process`, its engine core
        this script's `--serve-core`); otherwise one process (`--serve`)."""
        from tests.engine_processes import free_port

        self.args = args
        self.device_ms = device_ms
        self.overlap = overlap
        self.api = api
        self.path = "http-api" if api else "http"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        engine = ["--device", args.device, "--device-ms", str(device_ms)]
        engine += [
            "--max-rows",
            str(max(args.rows + args.ttft)),
            "--overlap",
            "on" if overlap else "off",
        ]
        if args.eager:
            engine.append("--eager")
        if api:
            core = [sys.executable, __file__, "--serve-core", *engine]
            command = [sys.executable, "-m", "generation", "serve", "--api-process"]
            command += ["--log-level", "warning"]  # no access line per stream
            command += ["--port", str(self.port), "--core-command", json.dumps(core)]
        else:
            command = [sys.executable, __file__, "--serve", str(self.port), *engine]
        self.process = subprocess.Popen(command, env=child_environment())
        self._wait_ready()
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/bench/worker", timeout=10) as resp:
            ids = json.loads(resp.read())
        self.worker_pid: int = ids["pid"]  # the engine core's with `api`
        self.worker_tid: int | None = ids["tid"]

    def _wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the bench server exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the bench server did not become healthy in 120 s")

    def level(self, rows: int, decoding: str) -> Level:
        import urllib.request

        request = urllib.request.Request(
            f"{self.url}/bench/hold",
            data=json.dumps({"rows": rows}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10).read()
        self._take_idle()  # what an earlier level left
        cpu = _process_cpu(self.worker_pid)
        api = _process_cpu(self.process.pid) if self.api else 0.0
        worker = _worker_cpu(self.worker_pid, self.worker_tid)
        read = self._read(rows, decoding, self.args.tokens)
        arrivals = [[(at, count) for at, count in s["arrivals"]] for s in read.streams]
        client_cpu = read.cpu_from_first_token_s
        cpu = _process_cpu(self.worker_pid) - cpu
        api = _process_cpu(self.process.pid) - api if self.api else 0.0
        worker = _worker_cpu(self.worker_pid, self.worker_tid) - worker
        seconds, steps = step_time(arrivals)
        return Level(
            self.path,
            decoding,
            rows,
            self.device_ms,
            seconds * 1000,
            steps,
            self.overlap,
            cpu,
            worker,
            api,
            client_cpu,
            median_step(arrivals) * 1000,
            self._take_idle(),
        )

    def _read(self, rows: int, decoding: str, tokens: int) -> Streams:
        """`rows` streams of `tokens` tokens (a different prompt each) from `--clients` client
        processes (bench/stream_clients.py), all sent at once."""
        requests = [
            (
                "/v1/generate",
                {
                    "input_ids": ids,
                    "max_new_tokens": tokens,
                    "min_new_tokens": tokens,
                    "decoding": {"method": "greedy"}
                    if decoding == "greedy"
                    else {**SAMPLING, "seed": 7 + index},
                },
            )
            for index, ids in enumerate(prompts(rows))
        ]
        return read_streams(self.url, requests, self.args.clients)

    def ttft(self, rows: int, decoding: str, tokens: int) -> TtftLevel:
        """`rows` new streams sent at once (no hold: they reach the engine as they arrive, as a
        burst of clients does), `tokens` each: every stream's time to first token, from its
        request sent to its first token line read."""
        read = self._read(rows, decoding, tokens)
        ttfts = [(s["arrivals"][0][0] - s["sent"]) * 1000 for s in read.streams]
        self._take_idle()
        return TtftLevel(self.path, decoding, rows, self.device_ms, self.overlap, sorted(ttfts))

    def _take_idle(self) -> list[float]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/bench/device", timeout=10) as resp:
            return list(json.loads(resp.read())["idle_ms"])

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_cpu(pid: int, tid: int | None) -> float:
    """CPU seconds of one thread of a process (Linux /proc), 0 when unknown."""
    if tid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----- the report -------------------------------------------------------------------------------


def settings_of(args: argparse.Namespace) -> list[tuple[float, bool]]:
    """(device ms, overlap) per setting: the host alone (overlap on), then the device step with
    each overlap setting asked for."""
    out = [(0.0, True)]
    if args.device_ms:
        out += [(args.device_ms, overlap) for overlap in args.overlap]
    return out


def run(args: argparse.Namespace, levels: list[Level], ttfts: list[TtftLevel]) -> None:
    """Every level, each of its `--repeat` runs appended to `levels` (the TTFT bursts of the
    http paths to `ttfts`) as it completes (a failure leaves the earlier ones)."""
    if "inproc" in args.paths:
        for device_ms, overlap in settings_of(args):
            loaded = load_null(args.device, device_ms)
            if not args.eager:
                use_null_sampler(loaded)
            use_clock_events(loaded)
            if loaded.device.type == "cpu":
                torch.set_num_threads(1)
            for rows in args.rows:
                engine = make_engine(loaded, rows, args.eager, overlap)
                engine.start()
                freeze_startup_heap()  # as a serving process does after its start-up
                try:
                    for decoding in args.decoding:
                        for repeat in range(args.repeat):
                            level = asyncio.run(run_inproc(engine, rows, decoding, args.tokens))
                            level.device_ms, level.repeat = device_ms, repeat
                            levels.append(level)
                            report(level)
                finally:
                    engine.stop()
    layouts = [api for path, api in (("http", False), ("http-api", True)) if path in args.paths]
    if layouts:
        # every setting's and layout's server at once, their runs interleaved (host only,
        # overlap on, overlap off, A, B, ..., then again): on a shared, noisy machine a burst of
        # load then falls on all of them, not on one setting's figures
        benches: list[HttpBench] = []
        try:
            for device_ms, overlap in settings_of(args):
                for api in layouts:
                    benches.append(HttpBench(args, device_ms, overlap, api))
            # TTFT first: bursts of new streams, interleaved as the step levels are
            for rows in args.ttft:
                for repeat in range(args.repeat):
                    for bench in benches:
                        if bench.device_ms and not bench.overlap:
                            continue  # the default engine (overlap on) only
                        burst = bench.ttft(rows, args.decoding[0], args.ttft_tokens)
                        burst.repeat = repeat
                        ttfts.append(burst)
                        print(
                            f"ttft     {burst.path:8} {burst.decoding:8} rows {rows:4}  device "
                            f"{burst.device_ms:4.1f} ms  {burst.describe()} ms",
                            flush=True,
                        )
            for rows in args.rows:
                for decoding in args.decoding:
                    for repeat in range(args.repeat):
                        for bench in benches:
                            level = bench.level(rows, decoding)
                            level.repeat = repeat
                            levels.append(level)
                            report(level)
        finally:
            for bench in benches:
                bench.close()


def runs_of(
    levels: list[Level], path: str, decoding: str, rows: int, device_ms: float, overlap: bool
) -> dict[int, Level]:
    """A level's runs by repeat (the host-only level: any overlap setting)."""
    return {
        lv.repeat: lv
        for lv in levels
        if (lv.path, lv.decoding, lv.rows, lv.device_ms) == (path, decoding, rows, device_ms)
        and (lv.overlap == overlap or not device_ms)
    }


def best(runs: Iterable[Level]) -> Level | None:
    """The fastest of repeated runs, with the least CPU any of them used: on a shared machine
    other processes only ever add time."""
    levels = list(runs)
    if not levels:
        return None
    fastest = min(levels, key=lambda lv: lv.step_ms)
    return Level(
        fastest.path,
        fastest.decoding,
        fastest.rows,
        fastest.device_ms,
        fastest.step_ms,
        fastest.steps,
        fastest.overlap,
        min(lv.cpu_s for lv in levels),
        min(lv.worker_cpu_s for lv in levels),
        min(lv.api_cpu_s for lv in levels),
        min(lv.client_cpu_s for lv in levels),
        fastest.median_step_ms,
    )


def report(level: Level) -> None:
    print(
        f"{level.path:8} {level.decoding:8} rows {level.rows:4}  device {level.device_ms:4.1f} ms"
        f" overlap {'on ' if level.overlap else 'off'}"
        f"  step {level.step_ms:8.3f} ms (median {level.median_step_ms:.3f})"
        + (
            f" device idle {level.device_idle_ms:.3f} ms (p50 {_quantile(level.idle_ms, 0.5):.3f}"
            f" p90 {_quantile(level.idle_ms, 0.9):.3f})"
            if level.idle_ms
            else ""
        )
        + f"  host {level.host_us_per_row:8.2f} us/row/step"
        f"  cpu {level.cpu_us_per_row:7.2f} us/row/step"
        + (f" (worker {level.worker_us_per_row:.2f})" if level.worker_cpu_s else "")
        + (
            f"  api {level.api_us_per_row:.2f} total {level.total_us_per_row:.2f}"
            if level.api_cpu_s
            else ""
        )
        + (f"  clients {level.client_us_per_row:.2f}" if level.client_cpu_s else ""),
        flush=True,
    )


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of a level's per-step values, its first step left out (as
    `device_idle_ms`)."""
    ordered = sorted(values[1:])
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def hidden_shares(
    levels: list[Level], path: str, decoding: str, rows: int, device_ms: float
) -> dict[str, list[float]]:
    """The share of the host's per-step time that overlapped steps hide, per repeat (each
    repeat's overlap-on run against its overlap-off run, run back to back). A synchronous step
    is device + host, an overlapped one max(device, host), so the share is
    (off - on) / (off - device) of:

    - `steps`: the typical step as the streams see it (`median_step_ms`);
    - `device` (CPU simulation): the typical step as the device runs it, device + its median idle
      time before a step: 1 - idle on / idle off of the medians over the level's steps;
    - `device_mean`: the same of the mean idle time, which counts every stall (a worker that
      waited for a core on a loaded machine included).
    """
    on = runs_of(levels, path, decoding, rows, device_ms, True)
    off = runs_of(levels, path, decoding, rows, device_ms, False)
    shares: dict[str, list[float]] = {"steps": [], "device": [], "device_mean": []}

    def share(on_: float, off_: float) -> float:
        return min(max(1 - on_ / off_, 0.0), 1.0)

    for repeat in sorted(on.keys() & off.keys()):
        a, b = on[repeat], off[repeat]
        if b.median_step_ms > device_ms:
            shares["steps"].append(
                share(a.median_step_ms - device_ms, b.median_step_ms - device_ms)
            )
        if a.idle_ms and _quantile(b.idle_ms, 0.5) > 0:
            shares["device"].append(share(_quantile(a.idle_ms, 0.5), _quantile(b.idle_ms, 0.5)))
        if a.idle_ms and b.device_idle_ms > 0:
            shares["device_mean"].append(share(a.device_idle_ms, b.device_idle_ms))
    return shares


def spread(shares: list[float]) -> str:
    """Median (min-max over repeats) in percent."""
    if not shares:
        return "na"
    low, high = min(shares) * 100, max(shares) * 100
    return f"{statistics.median(shares) * 100:.0f}% ({low:.0f}-{high:.0f}%, {len(shares)} runs)"


def ttft_line(ttfts: list[TtftLevel], path: str, rows: int, device_ms: float) -> str | None:
    """`ttft_ms_N p50=.. p90=.. max=..` of one path and device setting: the repeat with the
    lowest p50 (on a shared machine other processes only ever add time), None without runs."""
    runs = [t for t in ttfts if (t.path, t.rows, t.device_ms) == (path, rows, device_ms)]
    if not runs:
        return None
    fastest = min(runs, key=lambda t: t.quantile(0.5))
    return f"ttft_ms_{rows} {fastest.describe()}"


def ttft_summary(ttfts: list[TtftLevel], args: argparse.Namespace) -> str | None:
    """The TTFT lines of every path and setting; returns the headline's (the served layout,
    the most rows, with the simulated device step when there is one)."""
    headline = None
    for path in dict.fromkeys(t.path for t in ttfts):
        for device_ms in dict.fromkeys(t.device_ms for t in ttfts):
            for rows in args.ttft:
                line = ttft_line(ttfts, path, rows, device_ms)
                if line is not None:
                    print(f"{path:8} device {device_ms:4.1f} ms {line}")
    http = [p for p in ("http-api", "http") if p in args.paths]
    if http and args.ttft:
        for device_ms in (args.device_ms, 0.0):
            headline = ttft_line(ttfts, http[0], max(args.ttft), device_ms)
            if headline is not None:
                return f"{headline} device={device_ms:g}ms ({http[0]}, {args.decoding[0]})"
    return headline


def summary(levels: list[Level], args: argparse.Namespace) -> str:
    rows = max(args.rows)
    http = [p for p in ("http-api", "http") if p in args.paths]  # the served layout first
    for other in http[1:]:
        line = host_line(levels, other, rows, args)
        print(f"{other} (one process, `serve --no-api-process`): {line}")
    return host_line(levels, http[0] if http else "inproc", rows, args, full=True)


def host_line(
    levels: list[Level], path: str, rows: int, args: argparse.Namespace, full: bool = False
) -> str:
    """The `host_us_per_row_N` line of one path (with `full`: the hidden shares of every path
    and the CPU lines before it)."""
    device_ms = args.device_ms
    for lv_path in dict.fromkeys(lv.path for lv in levels) if full else ():
        for rows_ in args.rows:
            for decoding in args.decoding:
                shares = hidden_shares(levels, lv_path, decoding, rows_, device_ms)
                if any(shares.values()):
                    print(
                        f"{lv_path:8} {decoding:8} rows {rows_:4}  hidden behind a {device_ms} ms"
                        " device step by overlap: "
                        + "; ".join(f"{name} {spread(v)}" for name, v in shares.items() if v)
                    )
    figures: dict[str, str] = {}
    medians: dict[str, list[float]] = {}
    for decoding in ("greedy", "sampling"):
        base = best(runs_of(levels, path, decoding, rows, 0.0, True).values())
        figures[decoding] = f"{base.host_us_per_row:.1f}" if base else "na"
        for name, values in hidden_shares(levels, path, decoding, rows, device_ms).items():
            if values:
                medians.setdefault(name, []).append(statistics.median(values))
    # the figure: the typical step where the device runs it (CPU), else as streams see it
    headline = medians.get("device") or medians.get("steps")
    share = f"{min(headline) * 100:.0f}" if headline else "na"
    line = (
        f"host_us_per_row_{rows} greedy={figures['greedy']} sampling={figures['sampling']} "
        f"overlap_hidden={share}%"
    )
    for name in ("steps", "device_mean"):
        if name in medians:
            line += f" {name}_hidden={min(medians[name]) * 100:.0f}%"
    if not full:
        return line
    for lv_path in dict.fromkeys(lv.path for lv in levels):
        at = [
            b
            for decoding in args.decoding
            if (b := best(runs_of(levels, lv_path, decoding, rows, 0.0, True).values()))
        ]
        cpu = {lv.decoding: f"{lv.cpu_us_per_row:.1f}" for lv in at}
        worker = {lv.decoding: f"{lv.worker_us_per_row:.1f}" for lv in at if lv.worker_cpu_s}
        total = {lv.decoding: f"{lv.total_us_per_row:.1f}" for lv in at}
        print(
            f"{lv_path:8} cpu_us_per_row_{rows} greedy={cpu.get('greedy', 'na')} "
            f"sampling={cpu.get('sampling', 'na')} (the worker's process; worker thread "
            f"greedy={worker.get('greedy', 'na')} sampling={worker.get('sampling', 'na')}); "
            f"all engine processes greedy={total.get('greedy', 'na')} "
            f"sampling={total.get('sampling', 'na')}"
        )
    clients = {
        b.decoding: f"{b.client_us_per_row:.1f}"
        for decoding in args.decoding
        if (b := best(runs_of(levels, path, decoding, rows, 0.0, True).values())) and b.client_cpu_s
    }
    if clients:
        print(
            f"client_cpu_us_per_row_{rows} greedy={clients.get('greedy', 'na')} "
            f"sampling={clients.get('sampling', 'na')}  (the client processes', first token to "
            "last: with the engine's, what the machine's cores must run per step)"
        )
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return line


class Terminated(Exception):
    """SIGTERM (a time limit) arrived: the levels so far are reported."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--device-ms", type=float, default=4.0)
    parser.add_argument("--paths", default="inproc,http,http-api")
    parser.add_argument("--decoding", default="greedy,sampling")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="runs per level; the best counts")
    parser.add_argument(
        "--greedy-text", default=None, help=f"greedy repeats its first token ({GREEDY_TEXT!r})"
    )
    parser.add_argument(
        "--eager", action="store_true", help="the CPU's eager step and real sampler instead"
    )
    parser.add_argument(
        "--ttft",
        default="64,256",
        help="http paths: bursts of this many new streams, each stream's time to first token "
        "(empty: none)",
    )
    parser.add_argument("--ttft-tokens", type=int, default=16, help="tokens per TTFT stream")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--overlap",
        default="on,off",
        help="overlapped steps for the device-step levels: on, off or both (the host-only "
        "levels run with the engine's default, on)",
    )
    # subprocess roles
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-core", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--core-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--core-steps-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--core-socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-rows", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    engine = (args.device, args.device_ms, args.max_rows, args.eager)
    if args.serve is not None:
        serve(args.serve, *engine, args.overlap.split(",")[0] == "on")
        return
    if args.serve_core:
        overlap = args.overlap.split(",")[0] == "on"
        serve_core(args.core_fd, args.core_steps_fd, args.core_socket, *engine, overlap)
        return
    if args.greedy_text is not None:  # read by this process and the server subprocess
        os.environ["GUARDSTREAM_BENCH_GREEDY_TEXT"] = args.greedy_text
    args.rows = [int(x) for x in args.rows.split(",")]
    args.ttft = [int(x) for x in args.ttft.split(",") if x]
    args.paths = args.paths.split(",")
    args.decoding = args.decoding.split(",")
    args.overlap = [choice == "on" for choice in args.overlap.split(",")]
    print(
        f"# engine_host: null model, {args.tokens} tokens, device {args.device}, "
        f"{os.cpu_count()} cpus, {platform.python_version()}, torch {torch.__version__}",
        flush=True,
    )
    levels: list[Level] = []
    ttfts: list[TtftLevel] = []
    failed = False
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` cuts a run: still print the summary
    try:
        run(args, levels, ttfts)
    except Exception:  # the summary line still comes, from the levels that completed
        traceback.print_exc()
        failed = True
    ttft = ttft_summary(ttfts, args)
    line = summary(levels, args)
    if ttft is not None:  # the next-to-last line: the last stays `host_us_per_row_N ...`
        print(ttft, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(lv) for lv in levels], indent=1))
    print(line, flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
