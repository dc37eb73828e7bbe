"""Token selection: greedy, and sampling whose randomness is a pure function of (seed, position).

Seeded sampling draws one uniform number for generated position i from `uniform(seed, i)`, a
counter-based hash, and inverts the cumulative distribution with it. No generator state is carried
between steps, so a stream resumed at position k on another replica draws exactly what the
uninterrupted stream would have drawn, whatever else shared the batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) determined by (seed, position) alone."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) * (1.0 / (1 << 53))


def random_seed() -> int:
    """A seed for an unseeded sampling request (reported back so the stream can be resumed)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (already validated)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0


def apply_repetition_penalty(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """In place, as in transformers/CTRL: divide positive logits of seen tokens, multiply negative."""
    if penalty == 1.0 or seen.numel() == 0:
        return
    values = row.index_select(0, seen)
    row.index_copy_(0, seen, torch.where(values > 0, values / penalty, values * penalty))


def sample(row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Draw a token from one row of (already penalised/masked) logits, on CPU in float64."""
    logits = row.detach().to(device="cpu", dtype=torch.float64)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # A stable descending sort fixes the order of equal probabilities by token id.
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = (
            int(
                torch.searchsorted(
                    cumulative, torch.tensor([params.top_p], dtype=torch.float64)
                ).item()
            )
            + 1
        )
        keep = max(1, min(keep, cumulative.numel()))
        cumulative = cumulative[:keep]
    total = float(cumulative[-1].item())
    target = torch.tensor([uniform(params.seed, position) * total], dtype=torch.float64)
    index = int(torch.searchsorted(cumulative, target, right=True).item())
    index = min(index, cumulative.numel() - 1)
    return int(order[index].item())
