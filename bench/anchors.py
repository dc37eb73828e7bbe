"""The anchors bench/engine.py puts next to the engine: what a user of this stack would run instead.

- `bench_generate`: transformers' `generate` on a batch of the same chat prompts (left padded),
  exactly `tokens` new tokens per row (min = max), greedy and sampling (T=0.8, top_p=0.95), in
  this process, same weights, dtype and device as the engine.
- `bench_static_step`: one decode step of the same model on a transformers `StaticCache`
  (argmax and the host read of the tokens included): on CUDA captured once in a CUDA graph and
  replayed (what a step costs when nothing is launched from Python); on a CPU the same step
  eagerly. The engine's own step is compared with it.
- `bench_serve`: `transformers serve --continuous-batching` (`--cb-use-cuda-graph` on CUDA), a
  subprocess on a free port (it needs fastapi and uvicorn), driven with `concurrency` streamed
  chat completions of the same prompts; `min_new_tokens` = `max_new_tokens` through its
  `generation_config` field so every stream generates exactly `tokens` tokens.

Each returns plain dicts (JSON-able) and prints one line per figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from bench.stream_clients import client_note, level_figures, read_streams
from orchestrator.clients.managed import free_port

SAMPLING_KWARGS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _left_padded(ids: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
    return input_ids, mask


def bench_generate(
    loaded: Any, prompts: list[list[int]], levels: list[int], tokens: int, decodings: list[str]
) -> list[dict[str, Any]]:
    """`model.generate` on `level` prompts at once, exactly `tokens` new tokens each."""
    model, device = loaded.model, loaded.device
    pad = next(iter(sorted(loaded.eos_token_ids)), 0)
    out = []
    for decoding in decodings:
        extra = SAMPLING_KWARGS if decoding == "sampling" else {"do_sample": False}
        for level in levels:
            batch = [prompts[i % len(prompts)] for i in range(level)]
            input_ids, mask = _left_padded(batch, pad, device)

            def run(
                n: int,
                ids: torch.Tensor = input_ids,
                m: torch.Tensor = mask,
                kwargs: dict[str, Any] = extra,
            ) -> Any:
                return model.generate(
                    input_ids=ids,
                    attention_mask=m,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=pad,
                    **kwargs,
                )

            with torch.inference_mode():
                # first-use costs outside the timing; on CUDA a whole run, because some are per
                # shape and the attention's width changes every step (cuDNN attention, preferred
                # on sm90 by recent torch, builds a graph per new shape: issue 21's greedy gap)
                run(tokens if device.type == "cuda" else 4)
                _sync(device)
                start = time.perf_counter()
                result = run(tokens)
                _sync(device)
                wall = time.perf_counter() - start
            generated = (result.shape[1] - input_ids.shape[1]) * level
            line = {
                "decoding": decoding,
                "concurrency": level,
                "tokens_total": generated,
                "wall_s": wall,
                "aggregate_tokens_per_s": generated / wall,
                "step_ms": 1e3 * wall / tokens,
            }
            print(
                f"  generate {decoding:>8} {level:>3} rows: {line['aggregate_tokens_per_s']:8.1f}"
                f" tok/s aggregate, {line['step_ms']:6.1f} ms per step (prefill included)",
                flush=True,
            )
            out.append(line)
    return out


def bench_static_step(
    loaded: Any, levels: list[int], context: int, repeat: int = 30
) -> dict[int, dict[str, Any]]:
    """One StaticCache decode step at `context` tokens per row: a CUDA graph replay on CUDA (the
    eager step when capture fails, with the reason), the eager step on a CPU."""
    from transformers import StaticCache

    model, device = loaded.model, loaded.device
    results: dict[int, dict[str, Any]] = {}
    for level in levels:
        # room for every call: transformers 5 advances a StaticCache's write position per
        # forward call (its own length counter), whatever `cache_position` says
        cache = StaticCache(config=model.config, max_cache_len=context + repeat + 16)
        prompt = torch.randint(100, 1000, (level, context), device=device)
        ids = torch.zeros((level, 1), dtype=torch.long, device=device)
        position = torch.full((1,), context, dtype=torch.long, device=device)

        step = _static_step(model, ids, position, cache)
        line: dict[str, Any] = {"context": context}
        with torch.inference_mode():
            model(
                input_ids=prompt,
                cache_position=torch.arange(context, device=device),
                past_key_values=cache,
                use_cache=True,
            )
            kind, replay = "eager", step
            if device.type == "cuda":
                try:
                    stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            step()
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    kind, replay = "graph replay", graph.replay
                except Exception as exc:  # report the eager step, and why
                    line["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            for _ in range(3):
                replay()
                ids.view(-1).tolist()
            times = []
            for _ in range(repeat):
                _sync(device)
                start = time.perf_counter()
                replay()
                ids.view(-1).tolist()  # the host read a server needs
                times.append(time.perf_counter() - start)
        line.update({"kind": kind, "step_ms": 1e3 * statistics.median(times)})
        line["tokens_per_s"] = level * 1e3 / line["step_ms"]
        results[level] = line
        print(
            f"  StaticCache step ({kind}), {level:>3} rows at {context} tokens: "
            f"{line['step_ms']:6.2f} ms = {line['tokens_per_s']:8.0f} tok/s"
            + (f" (graph capture failed: {line['graph_error']})" if "graph_error" in line else ""),
            flush=True,
        )
        del cache, step
    return results


def _static_step(model: Any, ids: torch.Tensor, position: torch.Tensor, cache: Any) -> Any:
    """One decode step reading and writing static buffers only: `ids` in, the argmax back
    into `ids` (so a graph replay feeds itself)."""
    rows = ids.shape[0]

    def step() -> None:
        logits = model(
            input_ids=ids,
            cache_position=position,
            position_ids=position.expand(rows)[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits
        ids.copy_(logits[:, -1].argmax(-1, keepdim=True))

    return step


# ----- transformers serve ---------------------------------------------------------------------

SERVE_LAUNCHER = (
    "import sys\n"
    "from transformers.cli.transformers import main\n"
    "sys.argv[0] = 'transformers'\n"
    "sys.exit(main())\n"
)


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    return False


@contextlib.contextmanager
def serve_process(folder: Path, device: str, cuda_graph: bool, start_timeout_s: float = 600.0):
    """`transformers serve FOLDER --continuous-batching` on a free port; yields its URL."""
    port = free_port()
    args = [sys.executable, "-c", SERVE_LAUNCHER, "serve", str(folder), "--continuous-batching"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--device", device]
    args += ["--log-level", "warning"]
    if cuda_graph:
        args.append("--cb-use-cuda-graph")
    log = tempfile.NamedTemporaryFile(prefix="transformers-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"transformers serve did not start ({proc.poll()}): {tail}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()
        os.unlink(log.name)


def _serve_request(
    model: str, question: str, tokens: int, decoding: str
) -> tuple[str, dict[str, Any]]:
    """One streamed chat completion of exactly `tokens` tokens (min = max through its
    `generation_config`)."""
    config: dict[str, Any] = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    config.update(SAMPLING_KWARGS if decoding == "sampling" else {"do_sample": False})
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "max_tokens": tokens,
        "generation_config": json.dumps(config),
    }
    return "/v1/chat/completions", body


def _serve_level(
    url: str,
    model: str,
    questions: list[str],
    level: int,
    tokens: int,
    decoding: str,
    clients: int | None = None,
) -> dict[str, Any]:
    """One level, read by the same client processes as the engine's (bench/stream_clients.py)
    and measured alike, after a warm-up stream."""
    read_streams(url, [_serve_request(model, "Hello!", 4, decoding)], 1, protocol="sse")
    requests = [
        _serve_request(model, questions[i % len(questions)], tokens, decoding) for i in range(level)
    ]
    read = read_streams(url, requests, clients, protocol="sse")
    return level_figures(read, decoding, level)


def bench_serve(
    folder: Path,
    device: torch.device,
    questions: list[str],
    levels: list[int],
    tokens: int,
    decodings: list[str],
    clients: int | None = None,
) -> list[dict[str, Any]]:
    """Aggregate tok/s of `transformers serve --continuous-batching` at each concurrency
    (`clients`: client processes per level, as the engine's)."""
    cuda_graph = device.type == "cuda"
    out = []
    with serve_process(folder, str(device), cuda_graph) as url:
        for decoding in decodings:
            for level in levels:
                r = _serve_level(url, str(folder), questions, level, tokens, decoding, clients)
                r["cuda_graph"] = cuda_graph
                print(
                    f"  transformers serve --continuous-batching"
                    f"{' --cb-use-cuda-graph' if cuda_graph else ''} {decoding:>8} {level:>3} "
                    f"streams: {r['aggregate_tokens_per_s']:8.1f} tok/s aggregate "
                    f"({r['tokens_total']} tokens), TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms"
                    f"{client_note(r)}",
                    flush=True,
                )
                out.append(r)
    return out
