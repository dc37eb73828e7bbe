"""Token selection for a whole batch on the model's device; randomness is a pure function of
(seed, position).

Semantics (per row, whatever else shares the batch). Greedy rows take the argmax. A sampling row
with temperature T, top-k k, top-p p, at generated position i:

1. order the tokens by logit, descending, equal logits by token id (a stable sort);
2. weight token j by `w_j = exp((x_j - x_max) / T)` in float64 (T > 0; no overflow for tiny T);
3. top-k keeps the tokens whose logit is >= the k-th largest (ties at the boundary are kept);
   `S` = their total weight (float64, in that order); without top-k every token is kept and `S`
   is the whole row's weight, computed in the logits' precision and summed in float64 in token-id
   order (the only full-vocabulary pass besides the candidates, so kept cheap);
4. top-p keeps the shortest prefix of that order whose cumulative weight reaches `p * S`;
5. draw `u = uniform(seed, i)` (splitmix64 of seed and position: no generator state, so a stream
   resumed at position i on another replica draws what the uninterrupted one drew) and pick the
   first token whose cumulative weight exceeds `u * total`, total being the kept prefix's weight.

This is inverse-CDF sampling over the descending-probability order, as before the batched
version; only the arithmetic moved (weights relative to the max instead of softmax probabilities),
which changes a draw only when `u` falls within rounding of a boundary.

Cost. Every step is a handful of batched tensor ops for all sampling rows together; only `u`
is computed per row (a few integer operations). A full sort of the vocabulary per row is what
made per-row sampling slow on a CPU, so by default only the top `candidates` logits (`topk`) are
ordered: the draw is resolved among them whenever the chosen token, the top-k boundary and the
top-p boundary all fall within the part of that order the candidates determine exactly (tokens
strictly above the smallest candidate). Rows that are not resolved are retried with 16x more
candidates, then with a full sort. Cumulative weights are prefix sums (`cumsum`, sequential per
row on a CPU), so every tier computes the same numbers and picks the same token: the candidate
count never changes a result, and neither does the batch (every op works row by row; sums use
`cumsum` because a plain `sum` of a row depends on how the batch is split across threads).
On a GPU the default is a full sort at once (`candidates=None`): one tier, no device sync
besides reading the tokens. The CUDA-graph decode step uses device_sampling.py instead: the same
arithmetic (`_candidates`, `row_weight`, `_resolve`) with per-row settings and the uniforms on
the device.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
CPU_CANDIDATES = 256  # first-tier candidates on a CPU (a smollm2 step at T=1 resolves ~96%)
_GROWTH = 16  # candidates multiply by this for rows a tier leaves unresolved


# splitmix64 (Steele, Lea, Flood 2014): the increment, then (shift, multiplier) per mixing round
# and the final shift. Shared with device_sampling.py, which computes the same bits on tensors.
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_ROUNDS = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))
SPLITMIX_FINAL_SHIFT = 31
UNIFORM_BITS = 53  # the top 53 bits of the hash make the float64 in [0, 1)


def _splitmix64(x: int) -> int:
    x = (x + SPLITMIX_GAMMA) & _MASK64
    for shift, multiplier in SPLITMIX_ROUNDS:
        x = ((x ^ (x >> shift)) * multiplier) & _MASK64
    return x ^ (x >> SPLITMIX_FINAL_SHIFT)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) determined by (seed, position) alone."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> (64 - UNIFORM_BITS)) * (1.0 / (1 << UNIFORM_BITS))


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


def default_candidates(device: torch.device) -> int | None:
    """First-tier candidate count for `device`: a partial order on CPUs, a full sort on GPUs."""
    return CPU_CANDIDATES if device.type == "cpu" else None


def apply_repetition_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    seen: Sequence[torch.Tensor],
    penalties: Sequence[float],
) -> None:
    """In place, as in transformers/CTRL: for each row `rows[j]`, divide the positive logits of
    the token ids `seen[j]` (unique) by `penalties[j]` and multiply the negative ones."""
    if not rows:
        return
    device = logits.device
    counts = torch.tensor([t.numel() for t in seen], dtype=torch.long, device=device)
    row_index = torch.repeat_interleave(
        torch.tensor(list(rows), dtype=torch.long, device=device), counts
    )
    column_index = torch.cat([t.to(device) for t in seen])
    penalty = torch.repeat_interleave(
        torch.tensor(list(penalties), dtype=logits.dtype, device=device), counts
    )
    values = logits[row_index, column_index]
    logits[row_index, column_index] = torch.where(values > 0, values / penalty, values * penalty)


def select(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    candidates: int | None = CPU_CANDIDATES,
) -> list[int]:
    """The next token of every row of `logits` `[rows, vocab]` (already penalised and masked):
    one argmax for greedy rows (and temperature 0), `sample_rows` for the others, one read of
    the tokens. `positions[r]` is row r's generated-token count (the index being drawn)."""
    sampled = [i for i, p in enumerate(params) if not p.greedy and p.temperature > 0]
    if not sampled:
        return logits.argmax(dim=-1).tolist()
    draws = [uniform(params[i].seed, positions[i]) for i in sampled]
    if len(sampled) == len(params):
        return sample_rows(logits, params, draws, candidates).tolist()
    index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
    tokens = logits.argmax(dim=-1)
    picked = sample_rows(
        logits.index_select(0, index), [params[i] for i in sampled], draws, candidates
    )
    return tokens.index_copy(0, index, picked).tolist()


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    draws: Sequence[float],
    candidates: int | None = CPU_CANDIDATES,
) -> torch.Tensor:
    """Sample one token per row of `logits` `[rows, vocab]` with uniforms `draws` (module
    docstring); returns a long tensor `[rows]` on the logits' device."""
    rows, vocab = logits.shape
    device = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    table = torch.tensor(
        [[p.temperature, k, p.top_p, u] for p, k, u in zip(params, top_k, draws, strict=True)],
        dtype=torch.float64,
    ).to(device)
    per_row = {
        "temperature": table[:, 0:1],
        "kth_rank": table[:, 1:2].long(),
        "top_p": table[:, 2:3],
        "uniforms": table[:, 3:4],
    }
    out = torch.empty(rows, dtype=torch.long, device=device)
    pending = list(range(rows))
    count = vocab if candidates is None else max(1, candidates)
    while pending:
        count = max([count] + [top_k[r] for r in pending if top_k[r] < vocab])
        if 4 * count >= vocab:
            count = vocab
        index = torch.tensor(pending, dtype=torch.long, device=device)
        everything = len(pending) == rows
        sub = logits if everything else logits.index_select(0, index)
        values, ids, exact = _candidates(sub, count)
        if everything:  # the first tier: the max, and the weight of rows without top-k
            per_row["x_max"] = values[:, :1].to(torch.float64)
            per_row["whole_weight"] = _whole_weight(logits, per_row, top_k, vocab)
        args = {k: v if everything else v.index_select(0, index) for k, v in per_row.items()}
        tokens, resolved = _resolve(values, ids, exact, vocab=vocab, **args)
        if count == vocab:
            out[index] = tokens
            break
        done = resolved.tolist()  # a device sync; only tiers below a full sort need it
        hit = [j for j, ok in enumerate(done) if ok]
        if hit:
            sel = torch.tensor(hit, dtype=torch.long, device=device)
            out[index.index_select(0, sel)] = tokens.index_select(0, sel)
        pending = [r for r, ok in zip(pending, done, strict=True) if not ok]
        count *= _GROWTH
    return out


def _candidates(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """The top `count` logits of each row in the documented order (logit descending, then token
    id), their ids, and how many of them are known to be in that order exactly."""
    rows, vocab = logits.shape
    if count >= vocab:
        values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        exact = torch.full((rows, 1), vocab, dtype=torch.long, device=logits.device)
        return values, ids, exact
    values, ids = torch.topk(logits, count, dim=-1, sorted=False)
    ids, order = torch.sort(ids, dim=-1)  # equal logits: ascending token id ...
    values = values.gather(-1, order)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    # ... known exactly for logits above the smallest candidate (ties there may be missing)
    exact = (values > values[:, -1:]).sum(dim=-1, keepdim=True)
    return values, ids, exact


def _whole_weight(
    logits: torch.Tensor, per_row: dict[str, torch.Tensor], top_k: list[int], vocab: int
) -> torch.Tensor:
    """`S` of rows without top-k: the weight of the whole row, summed in token-id order.

    The one pass over the whole vocabulary besides the candidates, so it runs in the logits'
    precision (float32: half the memory traffic of float64) and accumulates in float64 by
    `cumsum`, whose per-row result does not depend on the batch."""
    rows = logits.shape[0]
    total = torch.zeros((rows, 1), dtype=torch.float64, device=logits.device)
    whole = [r for r in range(rows) if top_k[r] == vocab]
    if not whole:
        return total
    index = torch.tensor(whole, dtype=torch.long, device=logits.device)
    everything = len(whole) == rows
    pick = (lambda t: t) if everything else (lambda t: t.index_select(0, index))
    total[index] = row_weight(pick(logits), pick(per_row["x_max"]), pick(per_row["temperature"]))
    return total


def row_weight(
    logits: torch.Tensor, x_max: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """`S` of every row of `logits` `[rows, vocab]` as if it had no top-k (`_whole_weight`),
    float64 `[rows, 1]`; shared with the device sampler so both compute the same bits."""
    scaled = torch.sub(logits, x_max.to(logits.dtype))
    scaled.div_(temperature.clamp(min=1e-30).to(logits.dtype))  # (T below 1e-30 is argmax)
    return torch.cumsum(scaled.exp_(), dim=-1, dtype=torch.float64)[:, -1:]


def _resolve(
    values: torch.Tensor,
    ids: torch.Tensor,
    exact: torch.Tensor,
    *,
    vocab: int,
    x_max: torch.Tensor,
    temperature: torch.Tensor,
    kth_rank: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    whole_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tier: the draw among the ordered candidates of each row, and whether it is exact."""
    count = values.shape[-1]
    last = count - 1
    weights = torch.exp((values.to(torch.float64) - x_max) / temperature)
    cumulative = torch.cumsum(weights, dim=-1)
    has_k = kth_rank < vocab
    kth = values.gather(-1, kth_rank.clamp(max=count) - 1)
    kept = torch.where(has_k, (values >= kth).sum(dim=-1, keepdim=True), vocab)
    cut_exact = ~has_k | (kept <= exact)
    total = torch.where(has_k, cumulative.gather(-1, kept.clamp(1, count) - 1), whole_weight)
    has_p = top_p < 1.0
    nucleus_end = torch.searchsorted(cumulative, top_p * total)  # first j: cumulative >= p*S
    cut_exact &= ~has_p | (nucleus_end < exact)
    kept = torch.where(has_p, nucleus_end + 1, kept)
    total = torch.where(has_p, cumulative.gather(-1, nucleus_end.clamp(max=last)), total)
    chosen = torch.searchsorted(cumulative, uniforms * total, right=True)
    # rounding (u * total == total): the last kept token of positive weight
    positive = (weights > 0).sum(dim=-1, keepdim=True)
    chosen = torch.minimum(chosen, torch.minimum(kept, positive) - 1)
    resolved = cut_exact & (chosen < exact)
    # a row with no finite logit (all -inf, NaN) has no positive weight: its first in order
    tokens = ids.gather(-1, chosen.clamp(0, last))
    return tokens.squeeze(-1), resolved.squeeze(-1)
