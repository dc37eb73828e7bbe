"""Judge benchmark: judging a streamed answer incrementally (judge sessions) vs re-judging the
whole prefix at every chunk (what NeMo Guardrails, LiteLLM and the vLLM-served guards do).

    python bench/judge.py [--model smollm2-135m] [--device cpu] [--tokens 2000]
                          [--streams 1,16] [--threads N] [--json out.json]
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

Every line gives the forward passes and the wall time per pass (`ms/pass`): on a GPU a pass's
cost is mostly the host's (launching the eager forward's kernels, per-shape plans), whatever its
tokens. On CUDA two more lines follow the 1-stream runs: the same incremental run with SDPA's
default backend order (cuDNN attention allowed: generation/attention_backends.py leaves it out
of judge passes because it builds a plan per new shape), and the `per pass` line: a plain
forward of the model over one append's tokens (no session, no cache: the eager forward's own
floor) next to the judge pass.

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


def answer_chunks(tokenizer: Any, tokens: int) -> list[str]:
    """Sentence chunks (each with its leading space) until the answer has `tokens` tokens."""
    chunks: list[str] = []
    total = 0
    i = 0
    while total < tokens:
        chunk = (" " if chunks else "") + SENTENCES[i % len(SENTENCES)]
        total += len(tokenizer(chunk, add_special_tokens=False)["input_ids"])
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

    def open(self) -> Any:
        return self.judges.open(self.head, self.tail, self.unsafe, self.safe)

    def round(self, work: list[tuple[Any, list[int]]]) -> list[float]:
        """Queue every (session, ids) append together; wait for all their verdicts."""
        with self.engine.hold():
            futures = [self.judges.append(s, ids) for s, ids in work]
        return [f.result().score for f in concurrent.futures.as_completed(futures)]


def incremental(judge: Judge, chunk_ids: list[list[int]], streams: int) -> dict[str, Any]:
    sessions = [judge.open() for _ in range(streams)]
    tokens0, passes0 = judge.judges.forward_tokens, judge.judges.passes
    start, cpu = time.perf_counter(), time.process_time()
    for ids in chunk_ids:
        judge.round([(s, ids) for s in sessions])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    for s in sessions:
        judge.judges.close(s.id)
    chunks = len(chunk_ids) * streams
    return {
        "mode": "incremental",
        "streams": streams,
        "chunks": chunks,
        "judge_tokens": judge.judges.forward_tokens - tokens0,
        "passes": judge.judges.passes - passes0,
        "wall_s": wall,
        "cpu_s": cpu,
        "chunks_per_s": chunks / wall,
        "chunks_per_cpu_s": chunks / cpu,
    }


def rejudging(judge: Judge, chunk_ids: list[list[int]]) -> dict[str, Any]:
    tokens0, passes0 = judge.judges.forward_tokens, judge.judges.passes
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
        "streams": 1,
        "chunks": len(chunk_ids),
        "judge_tokens": judge.judges.forward_tokens - tokens0,
        "passes": judge.judges.passes - passes0,
        "wall_s": wall,
        "cpu_s": cpu,
        "chunks_per_s": len(chunk_ids) / wall,
        "chunks_per_cpu_s": len(chunk_ids) / cpu,
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
    args = parser.parse_args()
    loaded = models.load(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(loaded, threads=args.threads)
    engine.start()
    judge = Judge(engine, loaded, chat=args.chat, template=args.template)
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
    chunk_ids = [judge.encode(c) for c in answer_chunks(loaded.tokenizer, args.tokens)]
    answer_tokens = sum(len(c) for c in chunk_ids)
    print(
        f"{loaded.name} on {loaded.device} ({loaded.dtype}), {platform.processor() or 'cpu'}; "
        f"answer {answer_tokens} tokens in {len(chunk_ids)} sentence chunks; "
        f"template head {len(judge.head)} + tail {len(judge.tail)} tokens",
        flush=True,
    )
    incremental(judge, chunk_ids[:3], 1)  # warm-up (first-use costs)
    results = []
    levels = [int(s) for s in args.streams.split(",")]

    def report(r: dict[str, Any], note: str = "", keep: bool = True) -> dict[str, Any]:
        if keep:
            results.append(r)
        print(
            f"{r['mode']:>11} streams={r['streams']:>2} chunks={r['chunks']:>5} "
            f"judge_tokens={r['judge_tokens']:>8} wall={r['wall_s']:8.2f}s "
            f"cpu={r['cpu_s']:8.2f}s chunks/s={r['chunks_per_s']:8.2f} "
            f"chunks/cpu-s={r['chunks_per_cpu_s']:8.2f} passes={r['passes']:>4} "
            f"ms/pass={1e3 * r['wall_s'] / r['passes']:7.1f}{note}",
            flush=True,
        )
        return r

    inc1 = report(incremental(judge, chunk_ids, 1))
    rej = report(rejudging(judge, chunk_ids))
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
    for r in results[2:]:
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
