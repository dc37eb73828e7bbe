"""Engine benchmark: the hot loop's parts in-process, then aggregate throughput over HTTP.

    python bench/engine.py [--model smollm2-135m] [--device cpu|cuda|auto] [--tokens 64]
                           [--concurrency 1,16] [--decoding greedy,sampling] [--repeat 1]
                           [--rounds 2] [--threads N]
                           [--skip-micro] [--skip-http] [--url http://HOST:PORT] [--json out.json]
                           [--batch-invariant] [--extra-args "--dtype bfloat16"]
                           [--anchors generate,step,serve|none] [--also-model PATH]
                           [--compile] [--cold] [--clients K]

1. Sampling cost per step for 1, 4, 16 (and 64 on a GPU) sampled rows, on real logits of the
   model (chat prompts' last positions): the batched `sampling.select` next to the previous
   per-row implementation (kept below, verbatim, as the baseline). Target: 16 rows cost within 2x
   of 1 row.
   Then one `prefill pass:` line: the aten ops one prefill of 64 chat prompts dispatches from
   Python (and its host time), eager (into a DynamicCache) against the static prefill replayed
   from its graph (on a CPU the graph is stubbed: its replay dispatches nothing, as a CUDA
   graph's single launch): the host cost a graph removes, measurable without a GPU.
2. KV cache: joining one request to a running batch, one leaving, and one decode step, with the
   previous scheme (left-padded `DynamicCache`: `cat` on join, `index_select` on leave, `cat`
   every step) next to `SlotCache`; time and bytes copied. Then the detokenizers' cost per token
   (Python window vs `tokenizers`' DecodeStream; identical text is asserted).
3. HTTP: starts `python -m generation serve` (unless --url) and drives it like the orchestrator
   does. Each stream is a different chat prompt and generates exactly --tokens tokens
   (min_new_tokens = max_new_tokens), greedy or seeded sampling (T=0.8, top_p=0.95). Aggregate
   throughput = all tokens / wall time from the first request to the last `complete_final`;
   time to first token per stream. The headline is the ratio of 16-stream to 1-stream aggregate
   throughput (target >= 6x on CPU), per round (--rounds, interleaved) and its median.
   `--device cuda` defaults to 1 and 64 streams. `--batch-invariant`: the same levels on an
   engine started with `--batch-invariant` right after the default one, and each level's
   throughput as a ratio of the default's (the mode's cost, generation/batch_invariant.py).
   Each level also prints one `ttft DECODING N streams: p50 .. ms` line (for scripts).
   The streams are read by `--clients` client processes (bench/stream_clients.py; default:
   enough that each reads at most 64 streams, at most the CPUs less 2), started together: one
   asyncio process reading 256 streams spends most of a core on them and its lag would be in
   the figures. Each level's line ends with the clients' CPU share (their CPU seconds over
   clients x wall): near 100%, the clients, not the engine, set the pace.
   `--compile`: the engine runs its decode step through torch.compile (`serve --compile`).
   `--cold`: no warm-up stream first, so the first level's TTFT is a fresh engine's (its
   first-use costs: what warm prefill, `serve --warm-prefill`, removes on CUDA). Each `ttft`
   line ends with the engine's prefill passes during that level: graphs captured / replayed /
   passes run eagerly (`/health` `prefill`: the static prefill, generation/prefill_graphs.py).

4. Side by side (after 3, for --model and each --also-model, e.g. the SmolLM2-1.7B shape from
   bench/random_models.py): the same model under transformers' `generate` at the same batch
   sizes, `transformers serve --continuous-batching` (`--cb-use-cuda-graph` on CUDA) at the same
   concurrency, and one transformers `StaticCache` decode step (a CUDA graph replay on CUDA,
   eager on a CPU; argmax and host read included) next to the engine's step (a client's time
   between two tokens); then one line per decoding and concurrency with each ratio
   engine/anchor (bench/anchors.py). Default anchors: all three on CUDA, generate,step on a CPU.

Random-weight models repeat one token under greedy decoding; whichever decoding runs first on a
fresh engine pays its first-use costs, so decodings alternate and swap order every round.

The CPU may be shared: in-process timings are the best of several calls, HTTP figures are what
one run got; compare numbers within one run, and repeat (--repeat) for ranges. `--threads 1`
makes a busy 2-core machine far less noisy (intra-op thread barriers stall under contention).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicCache, DynamicLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors import bench_generate, bench_serve, bench_static_step
from bench.stream_clients import client_note, level_figures, read_streams
from generation import models
from generation.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_decoder
from generation.jobs import EngineDelta, Job
from generation.kv_cache import SlotCache
from generation.sampling import SamplingParams, default_candidates, select, uniform
from generation.scheduler import PREFILL_CHUNK_TOKENS, Engine
from tests.engine_processes import start_engine_subprocess

QUESTIONS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a bicycle works.",
    "What are the main causes of the seasons on Earth? Please explain in detail.",
    "Describe your ideal weekend.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Tell me about the history of Rome, from its founding to the fall of the western empire.",
    "What is photosynthesis?",
    "Write a poem about the sea.",
    "How do airplanes stay in the air?",
    "List some tips for learning a new language quickly and effectively.",
    "What is the capital of France and what is it famous for?",
    "Explain recursion to a child.",
    "Describe a busy market in the morning.",
    "What makes a good friend?",
    "Summarise the plot of a detective novel you would like to read.",
]
SAMPLING = {"method": "sampling", "seed": 7, "temperature": 0.8, "top_p": 0.95}


# ----- 1. sampling ------------------------------------------------------------------------------


def previous_select(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> list[int]:
    """The per-row implementation this engine used before batched sampling (the baseline)."""
    chosen: list[int] = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].detach().to(device="cpu", dtype=torch.float64) / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        if p.top_p < 1.0:
            target_p = torch.tensor([p.top_p], dtype=torch.float64)
            keep = int(torch.searchsorted(cumulative, target_p).item()) + 1
            cumulative = cumulative[: max(1, min(keep, cumulative.numel()))]
        total = float(cumulative[-1].item())
        target = torch.tensor([uniform(p.seed, positions[i]) * total], dtype=torch.float64)
        index = int(torch.searchsorted(cumulative, target, right=True).item())
        chosen[i] = int(order[min(index, cumulative.numel() - 1)].item())
    return chosen


def chat_ids(loaded: models.LoadedModel, question: str) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[..., object],
    device: torch.device,
    repeat: int = 15,
    setup: Callable[[], object] | None = None,
) -> float:
    """Best seconds of `fn` over `repeat` calls after two warm-ups (the minimum: on a shared CPU
    the other processes only ever add time); `setup()` (untimed) makes each call's argument."""
    times = []
    for i in range(repeat + 2):
        args = () if setup is None else (setup(),)
        _sync(device)
        start = time.perf_counter()
        fn(*args)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return min(times)


def bench_sampling(loaded: models.LoadedModel, sizes: list[int]) -> dict[str, Any]:
    """Per-step selection cost for `sizes` sampled rows on real next-token logits."""
    device = loaded.device
    with torch.inference_mode():
        rows = []
        for question in QUESTIONS:
            out = loaded.model(input_ids=torch.tensor([chat_ids(loaded, question)], device=device))
            rows.append(out.logits[0, -1].float())
        real = torch.stack(rows)
    settings = {
        "T=0.8 top_p=0.95": SamplingParams(greedy=False, temperature=0.8, top_p=0.95),
        "T=1.0": SamplingParams(greedy=False, temperature=1.0),
        "T=0.7 top_k=50 top_p=0.9": SamplingParams(
            greedy=False, temperature=0.7, top_k=50, top_p=0.9
        ),
    }
    candidates = default_candidates(device)
    results: dict[str, Any] = {"candidates": candidates, "settings": {}}
    for name, base in settings.items():
        line: dict[str, Any] = {}
        for size in sizes:
            logits = real[torch.arange(size, device=device) % real.shape[0]].contiguous()
            params = [
                SamplingParams(False, base.temperature, base.top_k, base.top_p, seed=1000 + r)
                for r in range(size)
            ]
            line[size] = {
                "batched_ms": 1e3 * _time_positions(select, logits, params, device, 30, candidates),
                "previous_ms": 1e3 * _time_positions(previous_select, logits, params, device, 5),
            }
        # one row is one prompt's logits; the mean over the big batch's prompts, each alone, is
        # the fair single-row figure (prompts differ in how many candidates they need)
        alone = [
            1e3
            * _time_positions(
                select,
                real[r % real.shape[0]][None].contiguous(),
                [SamplingParams(False, base.temperature, base.top_k, base.top_p, seed=1000 + r)],
                device,
                10,
                candidates,
            )
            for r in range(sizes[-1])
        ]
        line["alone_mean_ms"] = statistics.fmean(alone)
        first, last = line[sizes[0]], line[sizes[-1]]
        print(
            f"sampling {name:<25}"
            + "".join(
                f" | {s:>2} rows {v['batched_ms']:6.2f} ms (was {v['previous_ms']:6.1f})"
                for s, v in line.items()
                if isinstance(s, int)
            )
            + f" | {sizes[-1]}/{sizes[0]} rows: {last['batched_ms'] / first['batched_ms']:.1f}x"
            f" (was {last['previous_ms'] / first['previous_ms']:.1f}x; target <= 2x); each of "
            f"the {sizes[-1]} rows alone: mean {line['alone_mean_ms']:.2f} ms, "
            f"{last['batched_ms'] / line['alone_mean_ms']:.1f}x",
            flush=True,
        )
        results["settings"][name] = line
    greedy = [SamplingParams()] * sizes[-1]
    logits = real[torch.arange(sizes[-1], device=device) % real.shape[0]].contiguous()
    results["greedy_argmax_ms"] = 1e3 * _time_positions(select, logits, greedy, device, 15)
    print(
        f"  (floor: a greedy argmax over {sizes[-1]} rows costs "
        f"{results['greedy_argmax_ms']:.2f} ms; first tier orders {candidates or 'all'} "
        "candidates)",
        flush=True,
    )
    return results


def _time_positions(
    fn: Callable[..., list[int]],
    logits: torch.Tensor,
    params: list[SamplingParams],
    device: torch.device,
    repeat: int,
    *extra: object,
) -> float:
    """Best seconds of `fn(logits, params, positions, *extra)`, a new position per call
    (which tier resolves a row depends on its draw)."""
    step = iter(range(10**9))
    return timed(lambda: fn(logits, params, [next(step)] * len(params), *extra), device, repeat)


# ----- 2. KV cache ------------------------------------------------------------------------------


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(x, (0, 0, n, 0)) if n else x


def previous_merge(cache: Any, width: int, new: Any, length: int) -> int:
    """The previous scheduler's join: left-pad both sides, `cat` every layer. Returns width."""
    total = max(width, length)
    for old, add in zip(cache.layers, new.layers, strict=True):
        old.keys = torch.cat(
            [_pad_left(old.keys, total - width), _pad_left(add.keys, total - length)]
        )
        old.values = torch.cat(
            [_pad_left(old.values, total - width), _pad_left(add.values, total - length)]
        )
    return total


def previous_keep(cache: Any, keep: list[int], lengths: list[int], width: int) -> int:
    """The previous scheduler's leave: `index_select` every layer, trim all-padding columns."""
    index = torch.tensor(keep, device=cache.layers[0].keys.device)
    trim = width - max(lengths[i] for i in keep)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, trim:, :]
        layer.values = layer.values.index_select(0, index)[:, :, trim:, :]
    return width - trim


def bench_kv(loaded: models.LoadedModel, rows: int, generated: int) -> dict[str, Any]:
    """Join one row to `rows - 1` running rows, drop a middle row, and one decode step."""
    device = loaded.device
    model = loaded.model
    prompts = [chat_ids(loaded, QUESTIONS[i % len(QUESTIONS)]) for i in range(rows)]
    prompts = [p + [p[-1]] * (generated + 7 * i) for i, p in enumerate(prompts)]  # mid-stream rows

    def prefill(prompt: list[int]) -> Any:
        return model(
            input_ids=torch.tensor([prompt], device=device), use_cache=True
        ).past_key_values

    out: dict[str, Any] = {"rows": rows}
    with torch.inference_mode():
        singles = [prefill(p) for p in prompts]
        lengths = [len(p) for p in prompts]
        bytes_per_token = sum(
            layer.keys[0, :, 0].nbytes + layer.values[0, :, 0].nbytes for layer in singles[0].layers
        )

        # previous scheme: a left-padded DynamicCache of rows - 1 rows, then the last joins
        def build_previous(count: int) -> tuple[Any, int]:
            cache, width = prefill(prompts[0]), lengths[0]
            for i in range(1, count):
                width = previous_merge(cache, width, singles[i], lengths[i])
            return cache, width

        def clone(cache: Any) -> Any:
            copy = DynamicCache()
            for layer in cache.layers:
                twin = DynamicLayer()
                twin.keys, twin.values = layer.keys.clone(), layer.values.clone()
                twin.is_initialized = True
                copy.layers.append(twin)
            return copy

        base, width = build_previous(rows - 1)
        out["previous_join_ms"] = 1e3 * timed(
            lambda c: previous_merge(c, width, singles[-1], lengths[-1]),
            device,
            5,
            setup=lambda: clone(base),
        )
        full, full_width = build_previous(rows)
        out["previous_join_mb"] = full_width * rows * bytes_per_token / 1e6
        keep = [i for i in range(rows) if i != rows // 2]
        out["previous_leave_ms"] = 1e3 * timed(
            lambda c: previous_keep(c, keep, lengths, full_width),
            device,
            5,
            setup=lambda: clone(full),
        )
        out["previous_leave_mb"] = full_width * (rows - 1) * bytes_per_token / 1e6

        def previous_step(full: Any) -> None:
            pads = torch.tensor([full_width - n for n in lengths], device=device)
            mask = (torch.arange(full_width + 1, device=device)[None, :] >= pads[:, None]).long()
            model(
                input_ids=torch.full((rows, 1), 42, device=device),
                attention_mask=mask,
                position_ids=torch.tensor(lengths, device=device)[:, None],
                past_key_values=full,
                use_cache=True,
            )
            _trim_last(full)  # keep the width fixed across repeats

        out["previous_step_ms"] = 1e3 * timed(previous_step, device, 5, setup=lambda: full)
        out["previous_step_mb"] = (full_width + 1) * rows * bytes_per_token / 1e6  # `cat` per step
        full = base = None
        gc.collect()

        # slot cache
        kv = SlotCache(len(singles[0].layers), max(64, rows), loaded.max_context)
        for i in range(rows - 1):
            kv.add_rows(singles[i], [0], [lengths[i]])

        def slot_join() -> None:
            kv.add_rows(singles[-1], [0], [lengths[-1]])
            kv.keep(list(range(rows - 1)))  # undo: the last row leaving moves nothing

        out["slot_join_ms"] = timed(slot_join, device, 5) * 1e3
        out["slot_join_mb"] = lengths[-1] * bytes_per_token / 1e6
        kv.add_rows(singles[-1], [0], [lengths[-1]])
        order_lengths = list(kv.lengths)

        def slot_leave() -> None:
            moved = kv.lengths[-1]
            kv.keep(keep)  # the last row moves into the freed middle slot
            kv.lengths.append(moved)  # undo (the moved row's data is still in its old slot)
            kv._refresh_index()

        out["slot_leave_ms"] = timed(slot_leave, device, 5) * 1e3
        out["slot_leave_mb"] = lengths[-1] * bytes_per_token / 1e6
        kv.lengths = order_lengths

        def slot_step() -> None:
            positions = kv.begin_step()
            model(
                input_ids=torch.full((rows, 1), 42, device=device),
                attention_mask=kv.attention_mask(),
                position_ids=positions[:, None],
                past_key_values=kv,
                use_cache=True,
            )
            kv.step_positions = None  # lengths unchanged: the same width on every repeat

        out["slot_step_ms"] = timed(slot_step, device, 5) * 1e3
        out["slot_step_mb"] = rows * bytes_per_token / 1e6
    print(
        f"kv cache, {rows} rows of {min(lengths)}-{max(lengths)} tokens ({bytes_per_token / 1e3:.0f} kB/token):\n"
        f"  join one row:  previous {out['previous_join_ms']:7.2f} ms ({out['previous_join_mb']:6.1f} MB copied)"
        f"  slot {out['slot_join_ms']:6.2f} ms ({out['slot_join_mb']:5.2f} MB)\n"
        f"  leave one row: previous {out['previous_leave_ms']:7.2f} ms ({out['previous_leave_mb']:6.1f} MB copied)"
        f"  slot {out['slot_leave_ms']:6.2f} ms ({out['slot_leave_mb']:5.2f} MB)\n"
        f"  decode step:   previous {out['previous_step_ms']:7.2f} ms ({out['previous_step_mb']:6.1f} MB `cat`)"
        f"  slot {out['slot_step_ms']:6.2f} ms ({out['slot_step_mb']:5.2f} MB written)",
        flush=True,
    )
    return out


def _trim_last(cache: Any) -> Any:
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :-1], layer.values[:, :, :-1]
    return cache


def bench_detokenizer(loaded: models.LoadedModel) -> dict[str, float]:
    """Microseconds per token of the Python and the DecodeStream detokenizers (same text)."""
    text = " ".join(QUESTIONS) + " 😀 東京 naïve — " * 20
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    decode = make_decoder(loaded.tokenizer)
    backend = loaded.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    texts = {}
    for name, factory in (
        ("python", lambda: IncrementalDetokenizer(decode)),
        ("decode_stream", lambda: StreamDetokenizer(backend, decode)),
    ):

        def run(factory: Callable[[], Any] = factory, name: str = name) -> None:
            detok = factory()
            texts[name] = "".join(detok.push(t) for t in ids) + detok.flush()

        out[name + "_us_per_token"] = timed(run, torch.device("cpu"), 10) / len(ids) * 1e6
    assert texts["python"] == texts["decode_stream"]
    print(
        f"detokenizer: python {out['python_us_per_token']:.1f} us/token, DecodeStream "
        f"{out['decode_stream_us_per_token']:.1f} us/token (identical text, {len(ids)} tokens)",
        flush=True,
    )
    return out


# ----- 3. HTTP ----------------------------------------------------------------------------------


async def _long_prompt_joins(
    loaded: models.LoadedModel, chunk: int, running: int, prompt_tokens: int, tokens: int
) -> dict[str, float]:
    """`running` streams decode; once each has 4 tokens a `prompt_tokens` prompt joins. Returns
    the longest gap between two tokens of a running stream, and the long prompt's TTFT."""
    engine = Engine(loaded, prefill_chunk_tokens=chunk)
    engine.start()
    loop = asyncio.get_running_loop()

    def job(prompt: list[int], n: int) -> Job:
        return Job(
            prompt_ids=prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            sampling=SamplingParams(),
            loop=loop,
            queue=asyncio.Queue(),
        )

    async def read(j: Job, times: list[float], fourth: asyncio.Event | None = None) -> None:
        while True:
            item = await j.queue.get()
            assert isinstance(item, EngineDelta), item
            times.append(time.perf_counter())
            if fourth is not None and len(times) == 4:
                fourth.set()
            if item.finish_reason is not None:
                return

    try:
        warm = job(chat_ids(loaded, QUESTIONS[0]), 2)  # the engine learns its cache layout
        engine.submit(warm)
        await read(warm, [])
        streams = [
            job(chat_ids(loaded, QUESTIONS[i % len(QUESTIONS)]), tokens) for i in range(running)
        ]
        times: list[list[float]] = [[] for _ in streams]
        fourth = [asyncio.Event() for _ in streams]
        for j in streams:
            engine.submit(j)
        readers = [
            asyncio.ensure_future(read(j, t, e))
            for j, t, e in zip(streams, times, fourth, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in fourth))
        long_job = job([(7 * i) % 20000 + 100 for i in range(prompt_tokens)], 4)
        long_times: list[float] = []
        submitted = time.perf_counter()
        engine.submit(long_job)
        await read(long_job, long_times)
        await asyncio.gather(*readers)
        # the gaps that overlap the long prompt's prefill
        gaps = [
            b - a
            for t in times
            for a, b in itertools.pairwise(t)
            if b > submitted and a < long_times[0]
        ]
        return {"max_gap_s": max(gaps), "long_ttft_s": long_times[0] - submitted}
    finally:
        engine.stop()


class AtenOps(TorchDispatchMode):
    """Every aten op a region dispatches, by name (a host-bound pass pays for each)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _Replay:
    """A captured graph's stand-in where there are no CUDA graphs: its replay dispatches
    nothing (a CUDA graph's replay is one launch), its output the static logits buffer."""

    def replay(self) -> None:
        return None


def stub_prefill_graph(engine: Engine, lengths: list[int]) -> None:
    """The static prefill's key for contexts of `lengths` replayed by `_Replay`, as if captured
    (a CPU: the host side of a replayed pass, without the forward)."""
    static = engine._runner.prefill_pass
    assert static is not None
    rows, width = static.shape(lengths)
    key = (rows, width, width)
    vocab = engine._runner.loaded.model_vocab_size
    static.runner._graphs[key] = _Replay()  # type: ignore[assignment]
    static.runner._outputs[key] = torch.zeros((rows, vocab), device=engine.device)


def prefill_ops(engine: Engine, prompts: list[list[int]]) -> tuple[int, float]:
    """aten ops dispatched by one whole prefill of `prompts` (inputs, the pass, the first tokens'
    selection) and its wall milliseconds; the rows are dropped after."""
    runner = engine._runner
    rows = [
        engine._output.new_row(
            Job(
                prompt_ids=p,
                max_new_tokens=1,
                sampling=SamplingParams(),
                loop=None,  # type: ignore[arg-type]  # rows prefilled by hand emit nothing
                queue=None,  # type: ignore[arg-type]
            )
        )
        for p in prompts
    ]
    recorder = AtenOps()
    with torch.inference_mode():
        _sync(engine.device)
        started = time.perf_counter()
        with recorder:
            runner.prefill(rows, [len(p) for p in prompts])
        _sync(engine.device)
        elapsed = time.perf_counter() - started
        runner.clear()
    return sum(recorder.ops.values()), 1e3 * elapsed


def bench_prefill_ops(loaded: models.LoadedModel, rows: int = 64) -> dict[str, Any]:
    """One prefill of `rows` chat prompts: aten ops and host time, eager (a DynamicCache) against
    the static prefill run eagerly and replayed from its graph (stubbed where there are no CUDA
    graphs). Engines with the static decode step and bucketed prefill, as on CUDA."""
    prompts = [chat_ids(loaded, QUESTIONS[i % len(QUESTIONS)]) for i in range(rows)]
    lengths = [len(p) for p in prompts]
    out: dict[str, Any] = {}
    for name, static_prefill in (("eager", False), ("static", True)):
        engine = Engine(
            loaded,
            max_batch_size=rows,
            static_decode=True,
            static_buckets=True,
            static_capacity=256,
            gpu_memory_fraction=0.05,
            prefill_buckets=True,
            warm_prefill=False,
            static_prefill=static_prefill,
        )
        with torch.inference_mode():
            engine._start_up()
        out[name] = prefill_ops(engine, prompts)  # the first use of its shape (CUDA: a capture)
        out[name] = prefill_ops(engine, prompts)
        if static_prefill:
            out["shape"] = engine._runner.prefill_pass.shape(lengths)  # type: ignore[union-attr]
            stubbed = not engine._runner.prefill_pass.runner.graphs  # type: ignore[union-attr]
            if stubbed:
                stub_prefill_graph(engine, lengths)
            out["replayed"] = prefill_ops(engine, prompts)
            out["stubbed"] = stubbed
        del engine
        gc.collect()
    (eager_ops, eager_ms), (static_ops, static_ms) = out["eager"], out["static"]
    replayed_ops, replayed_ms = out["replayed"]
    print(
        f"prefill pass: {rows} chat prompts of {min(lengths)}-{max(lengths)} tokens as "
        f"{out['shape'][0]} x {out['shape'][1]}: eager {eager_ops} aten ops {eager_ms:.1f} ms, "
        f"static pass {static_ops} aten ops {static_ms:.1f} ms, replayed {replayed_ops} aten ops "
        f"{replayed_ms:.2f} ms{' (graph stubbed: no CUDA graphs here)' if out['stubbed'] else ''}",
        flush=True,
    )
    return out


def bench_chunked_prefill(
    loaded: models.LoadedModel, running: int = 4, prompt_tokens: int = 2048, tokens: int = 48
) -> dict[str, Any]:
    """Running streams while a long prompt joins: prefilled whole against in chunks."""
    default = PREFILL_CHUNK_TOKENS.get(loaded.device.type, 2048)
    out: dict[str, Any] = {}
    for name, chunk in (("whole", prompt_tokens + 1), (f"chunks of {default}", default)):
        r = asyncio.run(_long_prompt_joins(loaded, chunk, running, prompt_tokens, tokens))
        out[name] = r
        print(
            f"  a {prompt_tokens}-token prompt joins {running} running streams, prefilled "
            f"{name:>14}: running streams' longest gap between tokens {r['max_gap_s']:.2f} s, "
            f"the long prompt's first token after {r['long_ttft_s']:.2f} s",
            flush=True,
        )
    return out


def generate_request(prompt: str, tokens: int, decoding: str) -> tuple[str, dict[str, Any]]:
    """One stream as the orchestrator asks for it: a chat prompt, exactly `tokens` tokens."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "chat": True,
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
    }
    if decoding == "sampling":
        body["decoding"] = SAMPLING
    return "/v1/generate", body


async def run_level(
    url: str, concurrency: int, tokens: int, decoding: str, clients: int | None = None
) -> dict[str, Any]:
    """`concurrency` streams started together from `clients` client processes (default: the
    `bench/stream_clients.py` rule), each exactly `tokens` tokens."""
    requests = [
        generate_request(QUESTIONS[i % len(QUESTIONS)], tokens, decoding)
        for i in range(concurrency)
    ]
    read = await asyncio.to_thread(read_streams, url, requests, clients)
    for stream in read.streams:
        if stream["tokens"] != tokens:
            raise RuntimeError(f"a stream generated {stream['tokens']} tokens, not {tokens}")
    return level_figures(read, decoding, concurrency)


async def bench_http(
    url: str,
    levels: list[int],
    tokens: int,
    decodings: list[str],
    target: float | None,
    rounds: int,
    cold: bool = False,
    clients: int | None = None,
) -> list[dict[str, Any]]:
    """Every level once per round, rounds interleaved: each round's ratio compares runs made
    minutes apart at most, so a busy neighbour skews one round, not the comparison. Decodings
    alternate within a round and swap order every round: whichever runs first on a fresh engine
    pays its first-use costs (allocator growth, lazily loaded kernels), so with one order only a
    greedy/sampling difference could be an order effect (issue 21's greedy/sampling gap).

    `cold`: no warm-up stream, so the first level's TTFT is what the first clients of a fresh
    engine get (first-use costs included: what warm prefill is for). `clients`: client processes
    per level (default: bench/stream_clients.py's rule, per level)."""
    if not cold:  # warm-up: first-call allocations, caches
        await asyncio.to_thread(read_streams, url, [generate_request("Hello!", 4, "greedy")], 1)
    out = []
    ratios: dict[str, list[float]] = {d: [] for d in decodings}
    for round_ in range(rounds):
        order = decodings if round_ % 2 == 0 else decodings[::-1]
        for decoding in order:
            by_level = {}
            for level in levels:
                before, worker_before = await _prefill_counts(url), await _worker(url)
                r = await run_level(url, level, tokens, decoding, clients)
                after, worker_after = await _prefill_counts(url), await _worker(url)
                r["prefill"] = {
                    "mode": after["mode"],
                    **{k: after[k] - before[k] for k in ("captures", "replays", "eager_passes")},
                }
                r["round"] = round_
                print(
                    f"{decoding:>8} {level:>3} streams: {r['aggregate_tokens_per_s']:8.1f} tok/s "
                    f"aggregate, {r['per_stream_tokens_per_s']:6.1f} tok/s per stream, TTFT mean "
                    f"{r['ttft_mean_s'] * 1000:6.0f} ms (p50 {r['ttft_p50_s'] * 1000:.0f}, max "
                    f"{r['ttft_max_s'] * 1000:.0f}), wall {r['wall_s']:.1f} s (round {round_ + 1})"
                    f"{client_note(r)}",
                    flush=True,
                )
                p = r["prefill"]
                print(
                    f"ttft {decoding} {level} streams: p50 {r['ttft_p50_s'] * 1000:.0f} ms, mean "
                    f"{r['ttft_mean_s'] * 1000:.0f} ms, max {r['ttft_max_s'] * 1000:.0f} ms (round "
                    f"{round_ + 1}{', cold engine' if cold and not out else ''}); prefill "
                    f"{p['mode']}: {p['captures']} graphs captured, {p['replays']} passes "
                    f"replayed, {p['eager_passes']} eager",
                    flush=True,
                )
                if worker_before and worker_after:
                    r["worker"] = worker_split(worker_before, worker_after)
                    print(worker_line(decoding, level, r["worker"]), flush=True)
                by_level[level] = r
                out.append(r)
            if 1 in by_level and max(by_level) > 1:
                top = max(by_level)
                ratio = (
                    by_level[top]["aggregate_tokens_per_s"] / by_level[1]["aggregate_tokens_per_s"]
                )
                by_level[top]["ratio_to_1"] = ratio
                ratios[decoding].append(ratio)
    for decoding in decodings:
        if ratios[decoding]:
            got = ratios[decoding]
            goal = f" (target >= {target:g}x)" if target else ""
            spread = f"{min(got):.2f}-{max(got):.2f}x" if len(got) > 1 else ""
            print(
                f"{decoding:>8} aggregate {max(levels)} streams / 1 stream: "
                f"{statistics.median(got):.2f}x{goal} {spread}".rstrip(),
                flush=True,
            )
    return out


async def _health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        return await resp.json()


async def _prefill_counts(url: str) -> dict[str, Any]:
    """The engine's prefill passes so far (`/health` `prefill`; an engine without it: none)."""
    info = (await _health(url)).get("prefill") or {}
    return {
        "mode": info.get("mode", "eager"),
        **{k: int(info.get(k, 0)) for k in ("captures", "replays", "eager_passes")},
    }


async def _worker(url: str) -> dict[str, Any]:
    """The engine's `/health` `worker` (jobs.WorkerTimes; an engine without it: {})."""
    return (await _health(url)).get("worker") or {}


def worker_split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the worker did between two `/health` `worker` reads: decode steps, rows per step,
    milliseconds per step in each part, and the loop's deliveries (posts per delivery above 1:
    the loop fell behind the worker)."""
    steps = after["decode_steps"] - before["decode_steps"]
    per_step = max(steps, 1)
    deliveries = after["deliveries"] - before["deliveries"]
    return {
        "decode_steps": steps,
        "rows_per_step": (after["rows_stepped"] - before["rows_stepped"]) / per_step,
        "ms_per_step": {
            part: 1e3 * (after["seconds"][part] - before["seconds"][part]) / per_step
            for part in after["seconds"]
        },
        "deliveries": deliveries,
        "posts_per_delivery": (after["delivered_posts"] - before["delivered_posts"])
        / max(deliveries, 1),
        "delivery_ms_per_step": 1e3
        * (after["delivery_seconds"] - before["delivery_seconds"])
        / per_step,
    }


def worker_line(decoding: str, level: int, split: dict[str, Any]) -> str:
    """One line per level: where a decode step's time went in the worker thread (device_wait
    near 0 on a GPU: host-bound) and the event loop's delivery per step, which shares the GIL."""
    parts = " ".join(f"{k} {v:.2f}" for k, v in split["ms_per_step"].items())
    if split["deliveries"] == 0:  # a split replica's core: the worker sends its own frames
        loop = "no loop delivery (the worker sends each step's frame: `deliver` is that)"
    else:
        loop = (
            f"loop delivery {split['delivery_ms_per_step']:.2f} ms per step, "
            f"{split['posts_per_delivery']:.2f} posts per delivery"
        )
    return (
        f"worker {decoding} {level} streams: {split['decode_steps']} steps of "
        f"{split['rows_per_step']:.0f} rows, ms per step: {parts}; {loop}"
    )


def hold_freed_memory() -> bool:
    """glibc's malloc settings of a process whose heap has grown, set from the start.

    A fresh process's glibc hands large frees back to the kernel (trim, munmap) and page-faults
    them in again on the next step: 16 sampled rows took 6.5 ms in a fresh process, 2.8 ms
    once the heap had grown (after the KV-cache part, or with these settings); 4 rows 0.8 ms
    either way. A serving engine's heap grows in its first forward passes (16 streams: the same
    tokens/s with and without these settings, measured over HTTP), so without them the sampling
    figures here would be a fresh process's, not the engine's."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 256 << 20))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--concurrency", default=None, help="default 1,16 (CPU) or 1,64 (GPU)")
    parser.add_argument("--decoding", default="greedy,sampling")
    parser.add_argument("--repeat", type=int, default=1, help="run everything this many times")
    parser.add_argument("--rounds", type=int, default=2, help="HTTP: rounds of every level")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads, here and in the engine (default: torch's)",
    )
    parser.add_argument("--skip-micro", action="store_true", help="only the HTTP benchmark")
    parser.add_argument("--skip-http", action="store_true", help="only the in-process parts")
    parser.add_argument("--url", default=None, help="benchmark an engine that is already running")
    parser.add_argument("--extra-args", default="", help="extra `generation serve` arguments")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="HTTP: also run an engine in --batch-invariant mode and print its cost",
    )
    parser.add_argument(
        "--anchors",
        default=None,
        help="anchors run next to the engine: generate, step, serve or none (default: all three "
        "on CUDA; generate,step on a CPU)",
    )
    parser.add_argument(
        "--also-model",
        action="append",
        default=[],
        help="another model (e.g. the 1.7B shape, bench/random_models.py): the engine and the "
        "anchors again, after the first model's (repeatable)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="start the engine with --compile (its decode step through torch.compile)",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=None,
        help="HTTP: client processes per level, the engine's and the serve anchor's (default: "
        "enough that each reads at most 64 streams, at most the CPUs less 2)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="HTTP: no warm-up stream before the first level: its TTFT is a fresh engine's",
    )
    args = parser.parse_args()
    if args.compile:
        args.extra_args = f"{args.extra_args} --compile"
    held = hold_freed_memory()
    device = models.resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        args.extra_args = f"{args.extra_args} --threads {args.threads}"
    gpu = device.type == "cuda"
    levels = [int(x) for x in (args.concurrency or ("1,64" if gpu else "1,16")).split(",") if x]
    top = max(levels)
    decodings = [d for d in args.decoding.split(",") if d]
    sizes = [1, 4, 16, 64] if gpu else [1, 4, 16]
    print(
        f"{args.model} on {device}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}"
        + (f", {torch.cuda.get_device_name(device)}" if gpu else "")
        + ("; freed memory held as in a serving engine (glibc)" if held else ""),
        flush=True,
    )
    summary: dict[str, Any] = {"model": args.model, "device": str(device), "runs": []}
    for run in range(args.repeat):
        if args.repeat > 1:
            print(f"--- run {run + 1} of {args.repeat}", flush=True)
        result: dict[str, Any] = {}
        if not args.skip_micro:
            loaded = models.load(args.model, device=str(device))
            result["sampling"] = bench_sampling(loaded, sizes)
            result["kv"] = bench_kv(loaded, top, args.tokens // 2)
            result["detokenizer"] = bench_detokenizer(loaded)
            print("chunked prefill (in-process engine, greedy):", flush=True)
            result["chunked_prefill"] = bench_chunked_prefill(loaded)
            result["prefill_ops"] = bench_prefill_ops(loaded)
            del loaded
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        if not args.skip_http:
            result["http"] = _run_http(args, str(device), levels, decodings, None if gpu else 6.0)
            if args.batch_invariant and args.url is None:
                print("--- the same engine with --batch-invariant", flush=True)
                result["http_batch_invariant"] = _run_http(
                    args, str(device), levels, decodings, None, ("--batch-invariant",)
                )
                _print_cost(result["http"]["results"], result["http_batch_invariant"]["results"])
        anchors = _anchor_names(args.anchors, gpu)
        if not args.skip_http and args.url is None and (anchors or args.also_model):
            side = [_side_by_side(args, args.model, device, levels, decodings, anchors, result)]
            for extra in args.also_model:
                print(f"--- {extra}", flush=True)
                side.append(_side_by_side(args, extra, device, levels, decodings, anchors, None))
            result["side_by_side"] = side
            for entry in side:
                _print_side_by_side(entry)
        summary["runs"].append(result)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 0


def _anchor_names(option: str | None, gpu: bool) -> list[str]:
    names = (option or ("generate,step,serve" if gpu else "generate,step")).split(",")
    names = [n.strip() for n in names if n.strip() and n.strip() != "none"]
    unknown = set(names) - {"generate", "step", "serve"}
    if unknown:
        raise SystemExit(f"--anchors: unknown {sorted(unknown)} (generate, step, serve, none)")
    return names


def _median_by(results: list[dict[str, Any]], key: str) -> dict[tuple[str, int], float]:
    """Median of `key` per (decoding, concurrency) over rounds."""
    groups: dict[tuple[str, int], list[float]] = {}
    for r in results:
        groups.setdefault((r["decoding"], r["concurrency"]), []).append(r[key])
    return {k: statistics.median(v) for k, v in groups.items()}


def _side_by_side(
    args: argparse.Namespace,
    spec: str,
    device: torch.device,
    levels: list[int],
    decodings: list[str],
    anchors: list[str],
    result: dict[str, Any] | None,
) -> dict[str, Any]:
    """The engine (over HTTP, already measured for the first model) and the anchors
    (bench/anchors.py), one after the other so that each has the device to itself."""
    gpu = device.type == "cuda"
    if result is not None and "http" in result:
        http = result["http"]
    else:
        http = _run_http(args, str(device), levels, decodings, None if gpu else 6.0, model=spec)
    entry: dict[str, Any] = {"model": spec, "engine": http["results"]}
    if "generate" in anchors or "step" in anchors:
        loaded = models.load(spec, device=str(device))
        prompts = [chat_ids(loaded, q) for q in QUESTIONS]
        if "generate" in anchors:
            print(f"transformers generate ({loaded.dtype}):", flush=True)
            entry["generate"] = bench_generate(loaded, prompts, levels, args.tokens, decodings)
        if "step" in anchors:
            context = round(statistics.fmean(len(p) for p in prompts)) + args.tokens // 2
            print(f"transformers StaticCache decode step ({loaded.dtype}):", flush=True)
            entry["step"] = bench_static_step(loaded, levels, context)
        del loaded
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    if "serve" in anchors:
        print("transformers serve:", flush=True)
        try:
            entry["serve"] = bench_serve(
                models.prepare(spec),
                device,
                QUESTIONS,
                levels,
                args.tokens,
                decodings,
                args.clients,
            )
        except (RuntimeError, OSError) as exc:  # e.g. no fastapi/uvicorn: the rest stands
            print(f"  transformers serve failed: {exc}", flush=True)
            entry["serve_error"] = str(exc)[:2000]
    return entry


def _print_side_by_side(entry: dict[str, Any]) -> None:
    """One line per decoding and concurrency: tok/s of each, the engine's ratio to each anchor,
    and the engine's decode step (a client's time between tokens) against the StaticCache
    step."""
    engine = _median_by(entry["engine"], "aggregate_tokens_per_s")
    per_stream = _median_by(entry["engine"], "per_stream_tokens_per_s")
    generate = _median_by(entry.get("generate", []), "aggregate_tokens_per_s")
    serve = _median_by(entry.get("serve", []), "aggregate_tokens_per_s")
    step = entry.get("step", {})
    print(f"side by side, {entry['model']} (aggregate tok/s; ratios engine/anchor):", flush=True)
    for (decoding, level), tps in engine.items():
        parts = [f"{decoding:>8} {level:>3} streams: engine {tps:8.1f}"]
        if (decoding, level) in generate:
            g = generate[(decoding, level)]
            parts.append(f"generate {g:8.1f} ({tps / g:.2f}x)")
        if (decoding, level) in serve:
            v = serve[(decoding, level)]
            parts.append(f"serve {v:8.1f} ({tps / v:.2f}x)")
        if level in step and per_stream.get((decoding, level)):
            engine_ms = 1e3 / per_stream[(decoding, level)]
            anchor_ms = step[level]["step_ms"]
            parts.append(
                f"step {engine_ms:6.1f} ms vs {step[level]['kind']} {anchor_ms:6.2f} ms "
                f"({engine_ms / anchor_ms:.1f}x)"
            )
        print(" | ".join(parts), flush=True)


def _print_cost(default: list[dict[str, Any]], invariant: list[dict[str, Any]]) -> None:
    """Per decoding and level: the batch-invariant engine's throughput over the default's
    (medians over rounds)."""
    for decoding in dict.fromkeys(r["decoding"] for r in default):
        for level in dict.fromkeys(r["concurrency"] for r in default):

            def median(rs: list[dict[str, Any]], d: str = decoding, n: int = level) -> float:
                return statistics.median(
                    r["aggregate_tokens_per_s"]
                    for r in rs
                    if r["decoding"] == d and r["concurrency"] == n
                )

            a, b = median(default), median(invariant)
            print(
                f"{decoding:>8} {level:>3} streams: default {a:8.1f} tok/s, batch-invariant "
                f"{b:8.1f} tok/s = {b / a:.2f}x",
                flush=True,
            )


def _run_http(
    args: argparse.Namespace,
    device: str,
    levels: list[int],
    decodings: list[str],
    target: float | None,
    more_args: tuple[str, ...] = (),
    model: str | None = None,
) -> dict[str, Any]:
    engine = None
    url = args.url
    if url is None:
        started = time.monotonic()

        def echo(line: str) -> None:  # live: a start-up cut by a time limit shows how far it got
            if line.strip():
                print(
                    f"engine log: {line.strip()} [+{time.monotonic() - started:.1f} s]", flush=True
                )

        engine = start_engine_subprocess(
            model or args.model,
            port=0,
            device=device,
            extra_args=(*args.extra_args.split(), *more_args),
            on_start_line=echo,
        )
        url = engine.url
    try:
        info = asyncio.run(_health(url))
        print(
            f"engine {info['model']} on {info['device']} ({info['dtype']}"
            f"{', batch-invariant' if info.get('batch_invariant') else ''}), {args.tokens} tokens "
            f"per stream, load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        results = asyncio.run(
            bench_http(
                url, levels, args.tokens, decodings, target, args.rounds, args.cold, args.clients
            )
        )
        after = asyncio.run(_health(url))
        print(
            f"max batch size seen: {after['max_batch_size_seen']}, "
            f"forward passes: {after['forward_passes']}",
            flush=True,
        )
        cache = after.get("kv_cache", {})  # after the run: a CPU compiles at the first step
        if cache.get("compile_error"):  # --compile was given up: these figures are uncompiled
            print(f"engine log: decode step NOT compiled: {cache['compile_error']}", flush=True)
        elif "--compile" in args.extra_args.split():
            print(f"engine log: decode step compiled: {bool(cache.get('compiled'))}", flush=True)
        return {"engine": info, "results": results}
    finally:
        if engine is not None:
            engine.stop()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a `timeout` in bench/gpu/check.sh) unwinds like Ctrl-C, so that the finally blocks
    stop the engine and the `transformers serve` anchor (its own process session, which a signal
    to this process group misses): a server left running holds most of the GPU's memory and the
    next step's engine sizes its cache from what is left (seen: 1.7B shape batched 19 of 64)."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
