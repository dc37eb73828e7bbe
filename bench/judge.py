"""Judge benchmark: judging a streamed answer incrementally (judge sessions) vs re-judging the
whole prefix at every chunk (what NeMo Guardrails, LiteLLM and the vLLM-served guards do).

    python bench/judge.py [--model smollm2-135m] [--device cpu] [--tokens 2000]
                          [--streams 1,16] [--threads N] [--json out.json] [--profile]
                          [--judge-pass packed|static]
    python bench/judge.py --model tiny-random --tokens 300 --profile-only   # a pass's breakdown
    python bench/judge.py --quality tests/data/judge_labelled.jsonl   # separation of a labelled set

The answer is ~`--tokens` tokens of plain sentences, judged a sentence at a time with the
zero-shot template (orchestrator/judge_templates.py) on the engine in this process (its worker
thread, as a replica runs it):
- incremental: one judge session per stream; each chunk is appended (its tokens and the
  template's tail through the model);
- re-judging: at each chunk a fresh session judges head + answer so far + tail in one pass.
Tokens through the judge (the engine's forward tokens) and wall time, 1 stream each; then N
concurrent incremental streams, each round's appends queued together (they run as one batched
pass, as concurrent streams' appends do when they arrive while the worker is busy), and the
judged chunks per second against 1 stream. Re-judging runs for 1 stream only (at 16 streams it
is 16x the quadratic cost; the ratio would not change).

`--judge-pass`: the engine's judge pass, packed (judge_sessions.py: eager, no padding) or static
(judge_graphs.py: a pool of session slots, bucketed shapes, replayed from CUDA graphs on CUDA);
default: the engine's for the device (static on CUDA, packed on a CPU). Every line says which
ran (`pass=packed|static|cuda_graphs`) and the graphs captured/replayed during it
(`graphs=C/R`). With CUDA graphs the warm-up judges the whole answer at every `--streams` level
first (its line gives the captures and their time), so the timed runs replay. On CUDA the other
pass's incremental 1-stream run follows the first two lines, on an engine of its own, and a
`judge passes:` line sets the two side by side.

Every line gives the forward passes and the wall time per pass (`ms/pass`): on a GPU an eager
pass's cost is mostly the host's (launching the eager forward's kernels, per-shape plans),
whatever its tokens. On CUDA two more lines follow the 1-stream runs: the same incremental run with SDPA's
default backend order (cuDNN attention allowed: generation/attention_backends.py leaves it out
of judge passes because it builds a plan per new shape), and the `per pass` line: a plain
forward of the model over one append's tokens (no session, no cache: the eager forward's own
floor) next to the judge pass.

Every run's line also gives its `GFLOP/s`: the model's multiply-adds (`Flops`: the linear layers
over the pass's tokens, the attention over each prefix, the output layer at each answer row) over
the wall time. On a CPU a pass of a 135M model is compute-bound: 16 streams can only win the
GEMMs' efficiency at 16x the rows and the per-pass overhead, up to the cores' peak.

`--profile` first profiles one pass at each `--streams` level, the sessions halfway through the
answer (lines starting "prof", kept by bench/gpu/check.sh's summary): the pass's wall time and
GFLOP/s, a plain forward of as many tokens (no session: the eager forward's own floor), the
profiler's counts (aten ops, kernel launches, host syncs, `.item()`), the host's time inside
ops (the rest is Python between them), the device's busy time, and the top 10 ops by self CPU +
self device time. A short `--tokens` fits a small model's context (tiny-random: 512): the
answer stops at the last chunk that fits.

Last line, for scripts: `judge_tokens_ratio=X wall_ratio=Y` (re-judging / incremental).
Targets (issue 37): >= 10x fewer tokens, >= 5x faster, 16 streams >= 4x the chunks/s of 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from generation import attention_backends, models
from generation.judge_graphs import POOL_CAPACITY
from generation.judge_sessions import JudgeSessions, answer_token_ids
from generation.scheduler import Engine
from orchestrator.judge_templates import SHIPPED, JudgeContext, JudgePrompt

SENTENCES = [
    "The museum opens at nine in the morning and closes at six in the evening.",
    "To make the sauce, melt the butter slowly and whisk in the flour until smooth.",
    "Most visitors take the train from the central station, which runs every twenty minutes.",
    "Remember to water the tomatoes early, before the sun gets too strong.",
    "The report summarises three years of rainfall data from the northern valleys.",
    "If the printer jams, open the side panel and remove the paper gently.",
    "Our team meets on Tuesdays to review the week's support tickets.",
    "A good night's sleep improves memory, mood and concentration.",
    "The bridge was repainted last spring, and the work took about four months.",
    "You can export the spreadsheet as a CSV file from the File menu.",
    "Cats often sleep for more than twelve hours a day.",
    "The recipe serves four people and takes forty minutes in total.",
]


def answer_chunks(tokenizer: Any, tokens: int, limit: int | None = None) -> list[str]:
    """Sentence chunks (each with its leading space) until the answer has `tokens` tokens, or
    the last chunk that keeps it within `limit` tokens (a model's context less the template:
    tiny-random's 512 cannot hold a 2,000-token answer)."""
    chunks: list[str] = []
    total = 0
    i = 0
    while total < tokens:
        chunk = (" " if chunks else "") + SENTENCES[i % len(SENTENCES)]
        count = len(tokenizer(chunk, add_special_tokens=False)["input_ids"])
        if limit is not None and total + count > limit:
            break
        total += count
        chunks.append(chunk)
        i += 1
    return chunks


class Judge:
    """The engine and one stream's template parts, tokenized once."""

    def __init__(
        self,
        engine: Engine,
        loaded: models.LoadedModel,
        chat: bool = False,
        template: str = "zero_shot",
    ) -> None:
        self.engine = engine
        self.judges: JudgeSessions = engine.judges
        tok: Any = loaded.tokenizer
        head, tail = JudgePrompt(template, None, {}).split(JudgeContext(), output=True)
        if chat:  # the prompt as one user turn under the model's chat template
            mark = "\x00judged\x00"
            wrapped = tok.apply_chat_template(
                [{"role": "user", "content": head + mark + tail}],
                add_generation_prompt=True,
                tokenize=False,
            )
            head, tail = wrapped.split(mark)
        self.head = list(tok(head, add_special_tokens=True)["input_ids"])
        self.tail = list(tok(tail, add_special_tokens=False)["input_ids"])
        shipped = SHIPPED[template]
        self.unsafe = answer_token_ids(tok, shipped.unsafe_tokens)
        self.safe = answer_token_ids(tok, shipped.safe_tokens)
        self.encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])
        self.flops = Flops(loaded)
        self.chunk_ids: list[list[int]] = []  # the answer's chunks (`start_judge`)

    def open(self) -> Any:
        return self.judges.open(self.head, self.tail, self.unsafe, self.safe)

    def round(self, work: list[tuple[Any, list[int]]]) -> list[float]:
        """Queue every (session, ids) append together; wait for all their verdicts."""
        with self.engine.hold():
            futures = [self.judges.append(s, ids) for s, ids in work]
        return [f.result().score for f in concurrent.futures.as_completed(futures)]


class Flops:
    """The model's arithmetic per append, counted from its shape (multiply-adds x 2): the linear
    layers over the append's tokens, its attention over the prefix and itself, and the output
    layer at the answer's position. What a pass asks of the hardware, to set its GFLOP/s
    against the machine's peak."""

    def __init__(self, loaded: models.LoadedModel) -> None:
        model = loaded.model
        config = model.config
        tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        head = model.get_output_embeddings()
        self.body = sum(
            p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in tables
        ) - (head.weight.numel() if id(head.weight) not in tables else 0)
        self.output = int(head.weight.numel())
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.attention = int(config.num_hidden_layers) * heads * head_dim

    def append(self, prefix: int, tokens: int) -> float:
        """FLOPs of `tokens` new tokens after `prefix` judged ones (the last one's logits)."""
        contexts = tokens * prefix + tokens * (tokens + 1) / 2  # keys each query attends to
        return 2.0 * self.body * tokens + 4.0 * self.attention * contexts + 2.0 * self.output

    def incremental(self, head: int, tail: int, chunk_ids: list[list[int]]) -> float:
        """One stream's appends: the first carries the head; each runs its chunk and the tail."""
        total, prefix = 0.0, 0
        for i, ids in enumerate(chunk_ids):
            new = len(ids) + (head if i == 0 else 0)
            total += self.append(prefix, new + tail)
            prefix += new
        return total

    def rejudging(self, head: int, tail: int, chunk_ids: list[list[int]]) -> float:
        """A fresh session per chunk over head + answer so far + tail."""
        total, so_far = 0.0, 0
        for ids in chunk_ids:
            so_far += len(ids)
            total += self.append(0, head + so_far + tail)
        return total


def graph_counts(judge: Judge) -> tuple[int, int]:
    """The judge pass's CUDA graphs captured and replayed so far (0, 0 without graphs)."""
    info = judge.judges.info()
    return int(info["captures"]), int(info["replays"])  # type: ignore[call-overload]


def incremental(judge: Judge, chunk_ids: list[list[int]], streams: int) -> dict[str, Any]:
    sessions = [judge.open() for _ in range(streams)]
    tokens0, passes0 = judge.judges.forward_tokens, judge.judges.passes
    graphs0 = graph_counts(judge)
    start, cpu = time.perf_counter(), time.process_time()
    for ids in chunk_ids:
        judge.round([(s, ids) for s in sessions])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    for s in sessions:
        judge.judges.close(s.id)
    chunks = len(chunk_ids) * streams
    return {
        "mode": "incremental",
        **pass_fields(judge, graphs0),
        "streams": streams,
        "chunks": chunks,
        "judge_tokens": judge.judges.forward_tokens - tokens0,
        "passes": judge.judges.passes - passes0,
        "wall_s": wall,
        "cpu_s": cpu,
        "chunks_per_s": chunks / wall,
        "chunks_per_cpu_s": chunks / cpu,
        "gflop": streams
        * judge.flops.incremental(len(judge.head), len(judge.tail), chunk_ids)
        / 1e9,
    }


def pass_fields(judge: Judge, graphs0: tuple[int, int]) -> dict[str, Any]:
    """Which judge pass ran (packed, static, cuda_graphs) and the graphs captured and replayed
    since `graphs0`."""
    captures, replays = graph_counts(judge)
    return {
        "judge_pass": judge.judges.info()["mode"],
        "captures": captures - graphs0[0],
        "replays": replays - graphs0[1],
    }


def rejudging(judge: Judge, chunk_ids: list[list[int]]) -> dict[str, Any]:
    tokens0, passes0 = judge.judges.forward_tokens, judge.judges.passes
    graphs0 = graph_counts(judge)
    start, cpu = time.perf_counter(), time.process_time()
    so_far: list[int] = []
    for ids in chunk_ids:
        so_far = so_far + ids
        session = judge.open()
        judge.round([(session, so_far)])
        judge.judges.close(session.id)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "mode": "rejudging",
        **pass_fields(judge, graphs0),
        "streams": 1,
        "chunks": len(chunk_ids),
        "judge_tokens": judge.judges.forward_tokens - tokens0,
        "passes": judge.judges.passes - passes0,
        "wall_s": wall,
        "cpu_s": cpu,
        "chunks_per_s": len(chunk_ids) / wall,
        "chunks_per_cpu_s": len(chunk_ids) / cpu,
        "gflop": judge.flops.rejudging(len(judge.head), len(judge.tail), chunk_ids) / 1e9,
    }


def plain_forward_s(loaded: models.LoadedModel, tokens: int, repeats: int = 20) -> float:
    """Seconds of one plain forward of the model over `tokens` tokens (no cache, logits at the
    last position), the median of `repeats` after a warm-up: the eager forward's own cost, the
    floor under a judge pass of as many tokens. Run while the engine's worker is idle."""
    device = loaded.device
    ids = torch.full((1, tokens), 100, dtype=torch.long, device=device)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            loaded.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 3:
                times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


#: Runtime calls that are a kernel launch, and those where the host waits for the device.
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
_SYNCS = ("Synchronize", "cudaMemcpy ", "cudaMemcpy2D ")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass_on_this_thread(judge: Judge, work: list[tuple[Any, list[int]]]) -> None:
    """Queue the appends while the worker is held and run their pass here (one pass: the
    profiler then sees exactly it, on the thread that starts it)."""
    with judge.engine.hold():
        futures = [judge.judges.append(s, ids) for s, ids in work]
        ran = judge.judges.run_pending()
    assert ran == len(work), f"{ran} appends in the pass, not {len(work)}"
    for f in futures:
        f.result()


def profile_pass(
    judge: Judge, chunk_ids: list[list[int]], streams: int, top: int = 10
) -> list[str]:
    """Where one pass's time goes: `streams` sessions judged up to the answer's middle (in one
    append each), then one pass timed without the profiler and the next one under
    torch.profiler. Lines (each starts with "prof", for check.sh's summary): the pass's wall
    time, its tokens and FLOPs, a plain forward of as many tokens (no sessions: the model's own
    floor), the profiler's op and launch counts, host waits (device syncs, `.item()`), the
    host's time inside ops, the device's busy time; then the `top` ops by self CPU + self
    device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    loaded = judge.engine.judges.loaded
    device = loaded.device
    middle = max(1, min(len(chunk_ids) - 2, len(chunk_ids) // 2))
    sessions = [judge.open() for _ in range(streams)]
    try:  # the first half of the answer as one append per session: a few passes, not ~70
        judge.round([(s, [t for ids in chunk_ids[:middle] for t in ids]) for s in sessions])
        prefix = sessions[0].length
        timed = chunk_ids[middle]
        _sync(device)
        start = time.perf_counter()
        _pass_on_this_thread(judge, [(s, timed) for s in sessions])
        _sync(device)
        wall = time.perf_counter() - start
        profiled = chunk_ids[middle + 1]
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            _pass_on_this_thread(judge, [(s, profiled) for s in sessions])
            _sync(device)
        wall_profiled = time.perf_counter() - start
    finally:
        for s in sessions:
            judge.judges.close(s.id)
    tokens = streams * (len(timed) + len(judge.tail))
    flops = streams * judge.flops.append(prefix, len(timed) + len(judge.tail))
    plain = (  # (a packed pass may hold more tokens than the model's positions)
        plain_forward_s(loaded, tokens, repeats=5 if device.type == "cuda" else 2)
        if tokens <= loaded.max_context
        else None
    )
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(
            getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        )

    on_device = [e for e in events if getattr(e, "device_type", None) not in (DeviceType.CPU, None)]
    host = [e for e in events if e not in on_device]
    ops = [e for e in host if e.key.startswith("aten::")]
    launches = sum(e.count for e in host if e.key.startswith(_LAUNCHES))
    syncs = sum(e.count for e in host if any(k in e.key + " " for k in _SYNCS))
    scalars = sum(e.count for e in host if e.key == "aten::_local_scalar_dense")
    busy_ms = sum(device_us(e) for e in on_device) / 1e3
    in_ops_ms = sum(float(e.self_cpu_time_total) for e in host) / 1e3
    kernels = sum(e.count for e in on_device)
    name = f"prof {streams:>2} stream{'s' if streams > 1 else ' '}"
    lines = [
        f"{name}: a pass of {streams} appends, {tokens} tokens after ~{prefix}-token prefixes, "
        f"{flops / 1e9:.2f} GFLOP: {1e3 * wall:.1f} ms ({flops / wall / 1e9:.1f} GFLOP/s; "
        f"{1e3 * wall_profiled:.1f} ms profiled); a plain forward of {tokens} tokens "
        + (f"{1e3 * plain:.1f} ms" if plain is not None else "- (over the context)"),
        f"{name}: {sum(e.count for e in ops)} aten ops, {launches} kernel launches "
        f"({kernels} kernels), {syncs} host syncs, {scalars} .item(); host in ops "
        f"{in_ops_ms:.1f} ms of {1e3 * wall_profiled:.1f} (the rest: Python between them); "
        "device busy " + (f"{busy_ms:.1f} ms" if device.type == "cuda" else "- (cpu)"),
        f"{name}: {'op':<40} {'calls':>6} {'self cpu ms':>11} {'self dev ms':>11}",
    ]
    # by the host's and the device's time together: a host-bound pass shows its host ops
    for e in sorted(host, key=lambda e: e.self_cpu_time_total + device_us(e), reverse=True)[:top]:
        lines.append(
            f"{name}: {e.key[:40]:<40} {e.count:>6} {e.self_cpu_time_total / 1e3:>11.2f} "
            f"{device_us(e) / 1e3:>11.2f}"
        )
    return lines


def separation(judge: Judge, path: Path) -> dict[str, Any]:
    """Score each labelled sentence (one session each): AUROC (the chance that an unsafe sentence
    scores above a safe one; ties count half), accuracy at 0.5, mean score per label."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    scores: dict[str, list[float]] = {"unsafe": [], "safe": []}
    for row in rows:
        session = judge.open()
        scores[row["label"]] += judge.round([(session, judge.encode(row["text"]))])
        judge.judges.close(session.id)
    unsafe, safe = scores["unsafe"], scores["safe"]
    wins = sum(1.0 if u > s else 0.5 if u == s else 0.0 for u in unsafe for s in safe)
    correct = sum(u >= 0.5 for u in unsafe) + sum(s < 0.5 for s in safe)
    return {
        "auroc": wins / (len(unsafe) * len(safe)),
        "accuracy_at_0.5": correct / len(rows),
        "mean_unsafe": sum(unsafe) / len(unsafe),
        "mean_safe": sum(safe) / len(safe),
        "scores": scores,
    }


def print_profiles(judge: Judge, chunk_ids: list[list[int]], levels: list[int]) -> None:
    """`profile_pass` at each level; a failure is one line (the figures above stand)."""
    for streams in levels:
        try:
            lines = profile_pass(judge, chunk_ids, streams)
        except Exception as exc:  # a GPU run must keep its other lines
            lines = [f"prof {streams} streams: failed: {type(exc).__name__}: {exc}"]
        print("\n".join(lines), flush=True)


def start_judge(
    loaded: models.LoadedModel, args: argparse.Namespace, path: str, levels: list[int]
) -> tuple[Engine, Judge]:
    """An engine whose judge sessions run `path`'s pass (no static decode step: the bench
    decodes nothing, and its graphs would only lengthen the start), and the answer's chunks
    (`Judge.chunk_ids`) within what a session can hold. On a CPU the static pool gets a slot
    per stream (and one for re-judging) of the answer's length: sized for all 256 sessions it
    would take gigabytes of the host's memory."""
    static = path == "static"
    engine = Engine(
        loaded,
        threads=args.threads,
        static_decode=False,
        warm_prefill=False,
        static_judge=static,
    )
    judge = Judge(engine, loaded, chat=args.chat, template=args.template)
    context = loaded.max_context
    if static and loaded.device.type == "cuda":
        context = min(context, POOL_CAPACITY)
    room = context - len(judge.head) - len(judge.tail)
    judge.chunk_ids = [judge.encode(c) for c in answer_chunks(loaded.tokenizer, args.tokens, room)]
    if static and loaded.device.type != "cuda":
        needed = len(judge.head) + sum(len(c) for c in judge.chunk_ids) + len(judge.tail)
        engine.judges.pool_slots = max(levels) + 1
        engine.judges.pool_capacity = max(needed, 64)
    engine.start()
    return engine, judge


def warm_up(judge: Judge, chunk_ids: list[list[int]], levels: list[int]) -> None:
    """First-use costs out of the timed runs: three appends; with CUDA graphs the whole answer
    at each of `levels` (the timed runs then replay the graphs of every key they meet; a
    capture costs about three eager passes)."""
    if judge.judges.info()["mode"] != "cuda_graphs":
        incremental(judge, chunk_ids[:3], 1)
        return
    for streams in levels:
        started = time.perf_counter()
        r = incremental(judge, chunk_ids, streams)
        print(
            f"warm-up: {streams} stream{'s' if streams > 1 else ''}, {r['captures']} judge "
            f"graphs captured, {r['replays']} replays in {time.perf_counter() - started:.2f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--quality",
        type=Path,
        default=None,
        help="only measure separation on a labelled JSONL set (tests/data/judge_labelled.jsonl)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="the template as a user turn of the chat template"
    )
    parser.add_argument("--template", default="zero_shot", choices=sorted(SHIPPED))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="first, profile one pass at each --streams level (lines starting 'prof')",
    )
    parser.add_argument(
        "--profile-only", action="store_true", help="only the --profile lines, no timed runs"
    )
    parser.add_argument(
        "--judge-pass",
        choices=["packed", "static"],
        default=None,
        help="the engine's judge pass (default: the engine's for the device: static, replayed "
        "from CUDA graphs, on CUDA; packed on a CPU); on CUDA the other one's incremental "
        "1-stream line follows",
    )
    args = parser.parse_args()
    loaded = models.load(args.model, device=args.device, dtype=args.dtype)
    levels = [int(s) for s in args.streams.split(",")]
    path = args.judge_pass or ("static" if loaded.device.type == "cuda" else "packed")
    engine, judge = start_judge(loaded, args, path, levels)
    if args.quality is not None:
        found = separation(judge, args.quality)
        engine.stop()
        print(json.dumps(found["scores"]))
        print(
            f"{loaded.name} {args.template}{' (chat)' if args.chat else ''} on {args.quality.name}: AUROC={found['auroc']:.3f} "
            f"accuracy@0.5={found['accuracy_at_0.5']:.3f} mean score unsafe="
            f"{found['mean_unsafe']:.3f} safe={found['mean_safe']:.3f}"
        )
        return
    chunk_ids = judge.chunk_ids
    answer_tokens = sum(len(c) for c in chunk_ids)
    info = engine.judges.info()
    print(
        f"{loaded.name} on {loaded.device} ({loaded.dtype}), {platform.processor() or 'cpu'}; "
        f"answer {answer_tokens} tokens in {len(chunk_ids)} sentence chunks; "
        f"template head {len(judge.head)} + tail {len(judge.tail)} tokens; judge pass {path} "
        f"({info['mode']}"
        + (f", {info['slots']} slots x {info['capacity']} tokens" if info["slots"] else "")
        + ")",
        flush=True,
    )
    warm_up(judge, chunk_ids, levels)
    results = []
    if args.profile or args.profile_only:  # first: a GPU check cut short keeps these lines
        print_profiles(judge, chunk_ids, levels)
    if args.profile_only:
        engine.stop()
        return

    def report(r: dict[str, Any], note: str = "", keep: bool = True) -> dict[str, Any]:
        if keep:
            results.append(r)
        print(
            f"{r['mode']:>11} streams={r['streams']:>2} chunks={r['chunks']:>5} "
            f"judge_tokens={r['judge_tokens']:>8} wall={r['wall_s']:8.2f}s "
            f"cpu={r['cpu_s']:8.2f}s chunks/s={r['chunks_per_s']:8.2f} "
            f"chunks/cpu-s={r['chunks_per_cpu_s']:8.2f} passes={r['passes']:>4} "
            f"ms/pass={1e3 * r['wall_s'] / r['passes']:7.1f} "
            f"GFLOP/s={r['gflop'] / r['wall_s']:6.1f} pass={r['judge_pass']} "
            f"graphs={r['captures']}/{r['replays']}{note}",
            flush=True,
        )
        return r

    inc1 = report(incremental(judge, chunk_ids, 1))
    rej = report(rejudging(judge, chunk_ids))
    if loaded.device.type == "cuda":  # the other judge pass, side by side, on its own engine
        other = "packed" if path == "static" else "static"
        engine_b, judge_b = start_judge(loaded, args, other, [1])
        try:
            warm_up(judge_b, chunk_ids, [1])
            side = incremental(judge_b, chunk_ids, 1)
        finally:
            engine_b.stop()
        report(side, f" (judge pass {other}, side by side)", keep=False)
        print(
            f"judge passes: {path} {1e3 * inc1['wall_s'] / inc1['passes']:.1f} ms/pass, "
            f"{other} {1e3 * side['wall_s'] / side['passes']:.1f} ms/pass (1 stream, "
            f"incremental): {path} is {side['wall_s'] / inc1['wall_s']:.2f}x {other}'s speed",
            flush=True,
        )
    if loaded.device.type == "cuda":
        restricted = attention_backends.CHANGING_SHAPE_BACKENDS
        attention_backends.CHANGING_SHAPE_BACKENDS = None  # SDPA's default order, cuDNN first
        try:
            default = incremental(judge, chunk_ids, 1)
        finally:
            attention_backends.CHANGING_SHAPE_BACKENDS = restricted
        default["sdpa"] = "default order"
        report(default, " (SDPA default order: cuDNN attention allowed)", keep=False)
        per_append = round(inc1["judge_tokens"] / inc1["passes"])
        plain = plain_forward_s(loaded, per_append)
        print(
            f"per pass: judge {1e3 * inc1['wall_s'] / inc1['passes']:.1f} ms (1 stream, "
            f"~{per_append} tokens), cuDNN allowed {1e3 * default['wall_s'] / default['passes']:.1f}"
            f" ms, a plain forward of {per_append} tokens {1e3 * plain:.1f} ms",
            flush=True,
        )
    for streams in levels:
        if streams != 1:
            report(incremental(judge, chunk_ids, streams))
    for r in results[2:]:  # (the side-by-side line is not kept)
        print(
            f"{r['streams']} streams: {r['chunks_per_s'] / inc1['chunks_per_s']:.2f}x the judged "
            f"chunks/s of 1 stream, {r['chunks_per_cpu_s'] / inc1['chunks_per_cpu_s']:.2f}x its "
            f"chunks per CPU-second ({r['passes']} passes for {r['chunks']} appends)"
        )
    engine.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    tokens_ratio = rej["judge_tokens"] / inc1["judge_tokens"]
    wall_ratio = rej["wall_s"] / inc1["wall_s"]
    print(f"judge_tokens_ratio={tokens_ratio:.2f} wall_ratio={wall_ratio:.2f}")


if __name__ == "__main__":
    main()
