"""Batched token selection (generation/sampling.py): one batch of mixed rows equals each row
alone, a row's seeded draw at position i does not depend on what shares its batch or on how many
candidates a tier orders, and top-k / top-p keep exactly the tokens they should.

The oracle is a plain per-row implementation of the documented semantics (a full stable sort of
one row, cumulative weights, searches by Python loops), independent of the batched tiers."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from generation.sampling import (
    SamplingParams,
    apply_repetition_penalties,
    sample_rows,
    select,
    uniform,
)
from tests.engine_support import TORCH_DEVICE

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True)


def oracle(row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The documented semantics for one row, written as directly as possible."""
    if params.greedy or params.temperature <= 0:
        return int(row.argmax())
    vocab = row.numel()
    values, ids = torch.sort(row, descending=True, stable=True)
    x_max = values[0].to(torch.float64)
    weights = torch.exp((values.to(torch.float64) - x_max) / params.temperature).tolist()
    cumulative = torch.cumsum(torch.tensor(weights, dtype=torch.float64), 0).tolist()
    if 0 < params.top_k < vocab:
        kth = float(values[params.top_k - 1])
        kept = sum(1 for v in values.tolist() if v >= kth)
        total = cumulative[kept - 1]
    else:
        kept = vocab  # the whole row, in the logits' precision, summed in float64
        divisor = torch.tensor(max(params.temperature, 1e-30), dtype=torch.float64)
        whole = torch.exp((row - values[0]) / divisor.to(row.dtype))
        total = float(torch.cumsum(whole, 0, dtype=torch.float64)[-1])
    if params.top_p < 1.0:
        bound = params.top_p * total
        end = next((j for j, c in enumerate(cumulative) if c >= bound), vocab - 1)
        kept, total = end + 1, cumulative[end]
    target = uniform(params.seed, position) * total
    chosen = next((j for j, c in enumerate(cumulative) if c > target), vocab)
    positive = sum(1 for w in weights if w > 0)
    return int(ids[min(chosen, min(kept, positive) - 1)])


@st.composite
def logit_rows(draw: st.DrawFn, vocab: int) -> list[float]:
    """Rows with ties (small integers), wide ranges, and masked (-inf) tokens."""
    kind = draw(st.sampled_from(["ties", "wide", "peaked"]))
    if kind == "ties":
        row = [float(v) for v in draw(st.lists(st.integers(-3, 3), min_size=vocab, max_size=vocab))]
    elif kind == "wide":
        row = draw(
            st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=vocab, max_size=vocab)
        )
    else:
        rng = random.Random(draw(st.integers(0, 2**32)))
        row = [rng.gauss(0, 1) for _ in range(vocab)]
        row[rng.randrange(vocab)] += 12.0
    masked = draw(st.sets(st.integers(0, vocab - 1), max_size=vocab - 1))
    return [float("-inf") if i in masked else v for i, v in enumerate(row)]


PARAMS = st.builds(
    SamplingParams,
    greedy=st.booleans(),
    temperature=st.sampled_from([1e-6, 0.3, 0.7, 1.0, 1.8, 100.0]),
    top_k=st.one_of(st.just(0), st.integers(1, 40), st.just(10**9)),
    top_p=st.one_of(st.just(1.0), st.sampled_from([1e-9, 0.3, 0.9, 0.999999]), st.floats(0.01, 1)),
    seed=st.integers(0, 2**63 - 1),
)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    vocab = draw(st.integers(2, 300))
    size = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rows = [draw(logit_rows(vocab)) for _ in range(size)]
    params = [draw(PARAMS) for _ in range(size)]
    positions = [draw(st.integers(0, 10**6)) for _ in range(size)]
    return torch.tensor(rows, dtype=dtype, device=TORCH_DEVICE), params, positions


@PROPERTY
@given(batch=batches(), candidates=st.sampled_from([None, 1, 2, 5, 16, 256]))
def test_batched_equals_per_row_and_the_oracle(
    batch: tuple[torch.Tensor, list[SamplingParams], list[int]], candidates: int | None
) -> None:
    """Mixed greedy/sampling rows with different temperatures, top-k, top-p and seeds: one
    batched call = each row alone = the oracle, whatever the first tier's candidate count."""
    logits, params, positions = batch
    together = select(logits.clone(), params, positions, candidates)
    alone = [
        select(logits[i : i + 1].clone(), [params[i]], [positions[i]], candidates)[0]
        for i in range(len(params))
    ]
    expected = [oracle(logits[i], params[i], positions[i]) for i in range(len(params))]
    assert together == alone == expected
    full_sort = select(logits.clone(), params, positions, None)
    assert full_sort == expected


@PROPERTY
@given(
    batch=batches(),
    companions=st.lists(st.integers(0, 2**32), max_size=6),
    order_seed=st.integers(0, 2**32),
)
def test_seeded_draw_is_independent_of_batch_composition(
    batch: tuple[torch.Tensor, list[SamplingParams], list[int]],
    companions: list[int],
    order_seed: int,
) -> None:
    """Row 0, re-run inside a shuffled batch of other random rows, draws the same token."""
    logits, params, positions = batch
    vocab = logits.shape[1]
    target = select(logits[:1].clone(), params[:1], positions[:1])[0]
    extra_logits = [
        torch.randn(vocab, generator=torch.Generator().manual_seed(c)) for c in companions
    ]
    rows = [logits[0]] + [x.to(logits.device, logits.dtype) for x in extra_logits]
    row_params = [params[0]] + [
        SamplingParams(greedy=c % 3 == 0, temperature=0.5 + c % 7, top_k=c % 5, seed=c)
        for c in companions
    ]
    row_positions = [positions[0]] + [c % 1000 for c in companions]
    order = list(range(len(rows)))
    random.Random(order_seed).shuffle(order)
    mixed = select(
        torch.stack([rows[i] for i in order]),
        [row_params[i] for i in order],
        [row_positions[i] for i in order],
    )
    assert mixed[order.index(0)] == target


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    """The same (seed, position) gives the same token in any batch; other positions differ."""
    logits = torch.zeros(
        4, 1000, device=TORCH_DEVICE
    )  # uniform: the token is a direct function of u
    params = [SamplingParams(greedy=False, seed=42)] * 4
    tokens = select(logits, params, [7, 7, 8, 9])
    assert tokens[0] == tokens[1] != tokens[2]
    assert tokens[0] == select(logits[:1], params[:1], [7])[0]
    assert tokens[0] == int(uniform(42, 7) * 1000)  # equal weights: the u-quantile, by token id


@pytest.mark.parametrize("candidates", [None, 1, 3])
def test_top_k_keeps_the_k_largest_and_their_ties(candidates: int | None) -> None:
    logits = [0.0, 3.0, 1.0, 2.0, 2.0, -1.0]
    row = torch.tensor([logits], device=TORCH_DEVICE)

    def kept(top_k: int) -> set[int]:
        params = SamplingParams(greedy=False, top_k=top_k, seed=5)
        return {select(row, [params], [i], candidates)[0] for i in range(400)}

    assert kept(1) == {1}
    assert kept(2) == {1, 3, 4}  # the 2nd largest is 2.0: both tokens with 2.0 stay
    assert kept(3) == {1, 3, 4}
    assert kept(4) == {1, 3, 4, 2}
    assert kept(0) == kept(6) == kept(10**9) == set(range(6))


@pytest.mark.parametrize("candidates", [None, 1, 2])
def test_top_p_keeps_the_smallest_prefix_reaching_p(candidates: int | None) -> None:
    logits = [math.log(p) for p in (0.1, 0.5, 0.05, 0.3, 0.05)]
    row = torch.tensor([logits], dtype=torch.float64, device=TORCH_DEVICE)

    def kept(top_p: float, top_k: int = 0, temperature: float = 1.0) -> set[int]:
        params = SamplingParams(
            greedy=False, top_p=top_p, top_k=top_k, temperature=temperature, seed=11
        )
        return {select(row, [params], [i], candidates)[0] for i in range(600)}

    assert kept(1e-9) == {1}
    assert kept(0.45) == {1}
    assert kept(0.55) == {1, 3}
    assert kept(0.75) == {1, 3}
    assert kept(0.85) == {1, 3, 0}
    assert kept(0.92) == {1, 3, 0, 2}  # equal probabilities: the lower token id comes first
    assert kept(0.97) == set(range(5))
    # top-p applies to the top-k set, renormalised: of {0.5, 0.3}, 0.5/0.8 = 0.625 < 0.7
    assert kept(0.6, top_k=2) == {1}
    assert kept(0.7, top_k=2) == {1, 3}
    # temperature flattens before the nucleus is taken: at T=100 the weights are nearly equal
    assert kept(0.5, temperature=100.0) == {1, 3, 0}


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64, device=TORCH_DEVICE))
    params = [SamplingParams(greedy=False, seed=9)]
    counts = [0, 0, 0]
    for position in range(6000):
        counts[select(logits, params, [position])[0]] += 1
    assert [round(c / 6000, 1) for c in counts] == [0.5, 0.3, 0.2]


def test_tail_draws_resolve_through_every_tier() -> None:
    """A flat 5000-token row: most draws fall beyond the first 4 candidates, some beyond 64;
    with 1, 4 or all candidates first, every draw is the full sort's."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 5000, generator=generator).to(TORCH_DEVICE) * 0.1
    params = [SamplingParams(greedy=False, seed=s, top_p=0.99 if s % 2 else 1.0) for s in range(16)]
    for positions in ([0] * 16, list(range(100, 116))):
        reference = sample_rows(
            logits,
            params,
            [uniform(p.seed, i) for p, i in zip(params, positions, strict=True)],
            None,
        )
        for candidates in (1, 4, 64):
            tiers = sample_rows(
                logits,
                params,
                [uniform(p.seed, i) for p, i in zip(params, positions, strict=True)],
                candidates,
            )
            assert torch.equal(tiers, reference)


def test_greedy_rows_take_the_argmax_and_temperature_zero_is_greedy() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 1.0, 5.0], [0.0, 0.0, 9.0]], device=TORCH_DEVICE)
    params = [
        SamplingParams(),
        SamplingParams(),
        SamplingParams(greedy=False, temperature=0.0, seed=1),
    ]
    assert select(logits, params, [0, 0, 0]) == [1, 0, 2]  # ties: the lowest id


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    vocab=st.integers(1, 50),
    rows=st.lists(
        st.tuples(
            st.sets(st.integers(0, 49), min_size=1, max_size=20),
            st.sampled_from([0.5, 1.2, 3.0]),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 1000),
)
def test_repetition_penalties_batched_equal_per_row(
    vocab: int, rows: list[tuple[set[int], float]], seed: int
) -> None:
    """CTRL rule per row: positive logits of seen ids / penalty, negative ones x penalty."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), vocab, generator=generator).to(TORCH_DEVICE)
    expected = logits.clone()
    seen = [
        torch.tensor(sorted(i for i in ids if i < vocab), dtype=torch.long, device=TORCH_DEVICE)
        for ids, _ in rows
    ]
    for r, ((_, penalty), ids) in enumerate(zip(rows, seen, strict=True)):
        values = expected[r].index_select(0, ids)  # the previous per-row implementation
        # the penalty as a tensor: CUDA divides by a Python float as a product with its
        # reciprocal (last bits differ), by a tensor truly, as a CPU does either way
        factor = torch.tensor(penalty, dtype=logits.dtype, device=TORCH_DEVICE)
        expected[r].index_copy_(0, ids, torch.where(values > 0, values / factor, values * factor))
    apply_repetition_penalties(logits, list(range(len(rows))), seen, [p for _, p in rows])
    assert torch.equal(logits, expected)
