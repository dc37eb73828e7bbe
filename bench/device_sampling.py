"""Token selection cost: the graph path's `DeviceSampler.sample` next to `sampling.select`.

    python bench/device_sampling.py [--device cpu|cuda] [--vocab 49152] [--rows 1,16,64]
                                    [--repeat 20] [--dtype float32|bfloat16] [--clock cpu|wall]

For each batch size, times one selection step (best of --repeat, the candidates interleaved) for
all-greedy rows and for seeded sampling rows (T=0.8, top-p 0.95, every fourth row top-k 50 and
repetition penalty 1.2): `select` with the device's default candidate tiers (what the eager engine
runs), `select` with one full sort (`candidates=None`, the GPU default), and `DeviceSampler.sample`
(which always sorts, and also applies the masks and penalties that `Engine._select` applies before
`select`: its time includes them, `select`'s does not). Logits are smollm2-like: a standard normal
row scaled by 3 with a few peaks. Ratios are against `select` with default candidates in the same
run. Times are process CPU seconds on a CPU by default (all threads; a busy shared machine
disturbs them far less than wall time), wall seconds on CUDA, where they include one
device-to-host read of the tokens, as a step does.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from generation.device_sampling import DeviceSampler
from generation.sampling import SamplingParams, default_candidates, select


def best_of(
    fn: Callable[[], object], repeat: int, device: torch.device, clock: Callable[[], float]
) -> float:
    """Best time of `repeat` calls (seconds); the result is read to the host each time."""
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        result = fn()
        if isinstance(result, torch.Tensor):
            result.tolist()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, clock() - start)
    return best


def step_times(
    logits: torch.Tensor,
    mode: str,
    device: torch.device,
    repeat: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Best time of one selection step for each candidate, interleaved rounds."""
    rows, vocab = logits.shape
    params = [
        SamplingParams()
        if mode == "greedy"
        else SamplingParams(
            greedy=False,
            temperature=0.8,
            top_p=0.95,
            top_k=50 if r % 4 == 0 else 0,
            seed=r,
            repetition_penalty=1.2 if r % 4 == 0 else 1.0,
        )
        for r in range(rows)
    ]
    sampler = DeviceSampler(rows, vocab, vocab, [0], device)
    for r, p in enumerate(params):
        sampler.set_row(r, p, min_new_tokens=0, generated=0, seen_ids=range(0, 400, 3))
    positions = [0] * rows
    as_float = logits.float()
    tiers = default_candidates(device)
    candidates: dict[str, Callable[[], object]] = {
        "select": lambda: select(as_float.clone(), params, positions, tiers),
        "full": lambda: select(as_float.clone(), params, positions, None),
        "device": lambda: sampler.sample(logits),
    }
    times = dict.fromkeys(candidates, float("inf"))
    for _ in range(3):  # interleaved rounds: a busy machine disturbs all alike
        for name, fn in candidates.items():
            times[name] = min(times[name], best_of(fn, repeat // 3 + 1, device, clock))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    wall = (args.clock or ("cpu" if device.type == "cpu" else "wall")) == "wall"
    clock = time.perf_counter if wall else time.process_time
    generator = torch.Generator().manual_seed(0)
    print(
        f"device={device} vocab={args.vocab} dtype={args.dtype}"
        f" threads={torch.get_num_threads()} clock={'wall' if wall else 'cpu'}"
    )
    print(f"{'rows':>5} {'mode':<8} {'select':>10} {'select/full':>12} {'device':>10} {'ratio':>6}")
    for rows in [int(r) for r in args.rows.split(",")]:
        base = torch.randn((rows, args.vocab), generator=generator) * 3
        base[:, torch.randint(0, args.vocab, (8,), generator=generator)] += 8.0
        logits = base.to(getattr(torch, args.dtype)).to(device)
        for mode in ("greedy", "sampling"):
            times = step_times(logits, mode, device, args.repeat, clock)
            print(
                f"{rows:>5} {mode:<8} {times['select'] * 1e3:>8.2f}ms {times['full'] * 1e3:>10.2f}ms"
                f" {times['device'] * 1e3:>8.2f}ms {times['device'] / times['select']:>6.2f}"
            )


if __name__ == "__main__":
    main()
