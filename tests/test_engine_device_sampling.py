"""The graph path's token selection (generation/device_sampling.py) equals the eager one.

The reference is the eager path written out step by step: `ModelRunner.select` (model_runner.py:
half-precision logits cast to float32, columns past the vocabulary -inf, EOS ids -inf while a row
has fewer than min_new_tokens, `apply_repetition_penalties` over the ids the row has seen, prompt
and generated) and then `sampling.select(..., candidates=None)`, with the bookkeeping of
`OutputProcessor.accept` (generated count + 1, the token joins the seen set). `DeviceSampler`
keeps that bookkeeping in its own buffers, so every property runs several steps and compares every
token.

Runs on the CPU (exact); GUARDSTREAM_TEST_DEVICE=cuda runs the sampler and the reference on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from generation.device_sampling import DeviceSampler, device_uniform
from generation.sampling import SamplingParams, apply_repetition_penalties, select, uniform
from tests.engine_support import TORCH_DEVICE as DEVICE  # the test device switch

PROPERTY = settings(max_examples=120, deadline=None, derandomize=True)
U64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    value &= U64
    return value - (1 << 64) if value >> 63 else value


@dataclass
class Row:
    """One request as the scheduler holds it (`_Row`): settings, count and seen set."""

    params: SamplingParams
    min_new: int = 0
    generated: int = 0
    seen: set[int] = field(default_factory=set)


def reference_step(
    logits: torch.Tensor, rows: list[Row], vocab_size: int, eos: list[int]
) -> list[int]:
    """`Engine._select` + `select(candidates=None)` + `_accept`'s bookkeeping, for one step."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    else:
        logits = logits.clone()
    if logits.shape[-1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")
    suppress = [i for i, row in enumerate(rows) if row.generated < row.min_new]
    if suppress and eos:
        index = torch.tensor(suppress, dtype=torch.long, device=logits.device)
        eos_tensor = torch.tensor(eos, dtype=torch.long, device=logits.device)
        logits[index[:, None], eos_tensor[None, :]] = float("-inf")
    penalised = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if penalised:
        apply_repetition_penalties(
            logits,
            penalised,
            [torch.tensor(sorted(rows[i].seen), dtype=torch.long) for i in penalised],
            [rows[i].params.repetition_penalty for i in penalised],
        )
    tokens = select(logits, [r.params for r in rows], [r.generated for r in rows], None)
    for row, token in zip(rows, tokens, strict=True):
        row.generated += 1
        row.seen.add(token)
    return tokens


def make_logits(
    kind: str, seed: int, rows: int, width: int, masked: float, dtype: torch.dtype
) -> torch.Tensor:
    """Rows with ties (small integers), wide ranges or one peak, some tokens -inf."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "ties":
        x = torch.randint(-3, 4, (rows, width), generator=generator).double()
    elif kind == "wide":
        x = torch.rand((rows, width), generator=generator, dtype=torch.float64) * 60 - 30
    else:
        x = torch.randn((rows, width), generator=generator, dtype=torch.float64)
        peaks = torch.randint(0, width, (rows,), generator=generator)
        x[torch.arange(rows), peaks] += 12.0
    x[torch.rand((rows, width), generator=generator) < masked] = float("-inf")
    return x.to(dtype).to(DEVICE)


PARAMS = st.builds(
    SamplingParams,
    greedy=st.booleans(),
    temperature=st.sampled_from([0.0, 1e-6, 0.3, 0.7, 1.0, 1.8, 100.0]),
    top_k=st.one_of(st.just(0), st.integers(1, 40), st.just(10**30)),
    top_p=st.one_of(st.just(1.0), st.sampled_from([1e-9, 0.3, 0.9, 0.999999]), st.floats(0.01, 1)),
    seed=st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, U64]), st.integers(0, U64)),
    repetition_penalty=st.sampled_from([1.0, 1.0, 0.7, 1.3, 2.0]),
)


@st.composite
def rows_of(draw: st.DrawFn, count: int, vocab_size: int) -> list[Row]:
    return [
        Row(
            params=draw(PARAMS),
            min_new=draw(st.integers(0, 3)),
            generated=draw(st.sampled_from([0, 1, 2, 7, 10**6, 2**62])),
            seen=draw(st.sets(st.integers(0, vocab_size - 1), max_size=12)),
        )
        for _ in range(count)
    ]


@dataclass
class Scenario:
    width: int
    vocab_size: int
    eos: list[int]
    dtype: torch.dtype
    rows: list[Row]  # the real rows, slots 0..len-1
    padding: list[Row]  # rows of the bucket past the real ones (settings left in those slots)
    steps: list[tuple[str, int, float]]  # make_logits arguments per step


@st.composite
def scenarios(draw: st.DrawFn, max_rows: int = 6) -> Scenario:
    width = draw(st.integers(2, 160))
    vocab_size = draw(st.one_of(st.just(width), st.integers(1, width)))
    eos = sorted(draw(st.sets(st.integers(0, vocab_size - 1), max_size=3)))
    count = draw(st.integers(1, max_rows))
    step = st.tuples(
        st.sampled_from(["ties", "wide", "peaked"]),
        st.integers(0, 2**32),
        st.sampled_from([0.0, 0.0, 0.3, 0.9]),
    )
    return Scenario(
        width=width,
        vocab_size=vocab_size,
        eos=eos,
        dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
        rows=draw(rows_of(count, vocab_size)),
        padding=draw(rows_of(draw(st.integers(0, 3)), vocab_size)),
        steps=draw(st.lists(step, min_size=1, max_size=3)),
    )


def sampler_for(scenario: Scenario, slots: int | None = None) -> DeviceSampler:
    everything = scenario.rows + scenario.padding
    sampler = DeviceSampler(
        slots or len(everything) + 1, scenario.vocab_size, scenario.width, scenario.eos, DEVICE
    )
    for slot, row in enumerate(everything):
        set_row(sampler, slot, row)
    return sampler


def set_row(sampler: DeviceSampler, slot: int, row: Row) -> None:
    sampler.set_row(
        slot, row.params, min_new_tokens=row.min_new, generated=row.generated, seen_ids=row.seen
    )


def state_of(sampler: DeviceSampler, slots: range) -> list[dict[str, object]]:
    return [sampler.state(slot) for slot in slots]


@PROPERTY
@given(scenario=scenarios())
def test_device_sampler_equals_select_step_after_step(scenario: Scenario) -> None:
    """Mixed greedy / temperature 0 / seeded top-k / top-p / penalised / min_new_tokens rows,
    padded to a bucket, over several steps: every real row's token is the eager path's, and the
    sampler's own count and seen set follow the scheduler's."""
    sampler = sampler_for(scenario)
    real = len(scenario.rows)
    bucket = real + len(scenario.padding)
    for kind, seed, masked in scenario.steps:
        logits = make_logits(kind, seed, bucket, scenario.width, masked, scenario.dtype)
        expected = reference_step(logits[:real], scenario.rows, scenario.vocab_size, scenario.eos)
        tokens = sampler.sample(logits)
        assert tokens.dtype == torch.long and tokens.device == logits.device
        assert tokens.shape == (bucket,)
        assert tokens[:real].tolist() == expected
    for slot, row in enumerate(scenario.rows):
        state = sampler.state(slot)
        assert state["generated"] == row.generated
        assert state["seen_ids"] == sorted(row.seen)


@PROPERTY
@given(scenario=scenarios(), extra=st.integers(1, 5), garbage=st.integers(0, 2**32))
def test_padding_rows_never_change_real_rows(scenario: Scenario, extra: int, garbage: int) -> None:
    """The same real rows sampled alone and inside a bucket of padding rows (random settings,
    random logits, cleared or not): the same tokens and the same state afterwards."""
    real = len(scenario.rows)
    alone = sampler_for(Scenario(**{**scenario.__dict__, "padding": []}))
    padded = sampler_for(scenario, slots=real + len(scenario.padding) + extra)
    bucket = real + len(scenario.padding) + extra
    for kind, seed, masked in scenario.steps:
        logits = make_logits(kind, seed, real, scenario.width, masked, scenario.dtype)
        noise = make_logits(
            "wide", garbage + seed, bucket - real, scenario.width, 0.5, logits.dtype
        )
        together = padded.sample(torch.cat([logits, noise]))
        assert together[:real].tolist() == alone.sample(logits).tolist()
    assert state_of(padded, range(real)) == state_of(alone, range(real))


@PROPERTY
@given(
    scenario=scenarios(max_rows=6),
    leaving=st.sets(st.integers(0, 5), max_size=5),
    joining=st.integers(0, 2),
    data=st.data(),
)
def test_rows_leaving_and_joining_keep_every_other_row(
    scenario: Scenario, leaving: set[int], joining: int, data: st.DataObject
) -> None:
    """Between steps rows leave (the cache moves the last rows into the freed slots: the order
    `SlotCache.keep` returns, applied by `move_row` + `clear_row`, or at once by `reorder`) and
    new rows join in the next free slots: every row keeps drawing what the eager path draws."""
    rows = list(scenario.rows)
    slots = len(rows) + joining + 1
    by_move = sampler_for(Scenario(**{**scenario.__dict__, "padding": []}), slots=slots)
    by_reorder = sampler_for(Scenario(**{**scenario.__dict__, "padding": []}), slots=slots)
    first, *rest = scenario.steps
    logits = make_logits(*first[:2], len(rows), scenario.width, first[2], scenario.dtype)
    expected = reference_step(logits, rows, scenario.vocab_size, scenario.eos)
    assert by_move.sample(logits).tolist() == expected == by_reorder.sample(logits).tolist()

    keep = [i for i in range(len(rows)) if i not in leaving]
    count = len(keep)
    holes = [i for i in range(count) if i not in keep]
    movers = [i for i in range(count, len(rows)) if i in keep]
    order = list(range(count))
    for hole, mover in zip(holes, movers, strict=True):  # SlotCache.keep's order
        order[hole] = mover
        by_move.move_row(mover, hole)
    for slot in range(count, len(rows)):
        by_move.clear_row(slot)
    by_reorder.reorder(order, len(rows))
    rows = [rows[i] for i in order]
    newcomers = data.draw(rows_of(joining, scenario.vocab_size))
    for row in newcomers:
        set_row(by_move, len(rows), row)
        set_row(by_reorder, len(rows), row)
        rows.append(row)
    assert state_of(by_move, range(slots)) == state_of(by_reorder, range(slots))
    for kind, seed, masked in rest or [first]:
        logits = make_logits(kind, seed, len(rows), scenario.width, masked, scenario.dtype)
        expected = reference_step(logits, rows, scenario.vocab_size, scenario.eos)
        assert by_move.sample(logits).tolist() == expected
        assert by_reorder.sample(logits).tolist() == expected


@PROPERTY
@given(
    seeds=st.lists(st.integers(0, U64), min_size=1, max_size=20),
    positions=st.lists(st.integers(0, 2**63 - 1), min_size=20, max_size=20),
)
def test_device_uniform_is_sampling_uniform_bit_for_bit(
    seeds: list[int], positions: list[int]
) -> None:
    """splitmix64 on int64 tensors (wrapping + and *, masked shifts) = the Python integers."""
    edges = [0, 1, 2**31, 2**32 - 1, 2**62, 2**63 - 1]
    pairs = [(s, p) for s in [*seeds, 0, 2**63 - 1, 2**63, U64] for p in [*positions[:3], *edges]]
    got = device_uniform(
        torch.tensor([as_int64(s) for s, _ in pairs], device=DEVICE),
        torch.tensor([p for _, p in pairs], device=DEVICE),
    )
    assert got.dtype == torch.float64
    assert got.tolist() == [uniform(s, p) for s, p in pairs]


def test_a_resumed_row_draws_what_the_uninterrupted_row_draws() -> None:
    """A row set at generated=i with seen = prompt + the first i tokens (a migrated stream)
    draws from step i on exactly the tokens the uninterrupted row draws."""
    width, prompt = 300, [5, 17, 17, 250]
    params = SamplingParams(greedy=False, temperature=0.8, top_k=50, top_p=0.95, seed=2**63 - 1)
    params = SamplingParams(**{**params.__dict__, "repetition_penalty": 1.3})
    steps = [make_logits("peaked", s, 1, width, 0.0, torch.float32) for s in range(12)]
    whole = DeviceSampler(1, width, width, [0], DEVICE)
    whole.set_row(0, params, min_new_tokens=4, generated=0, seen_ids=prompt)
    tokens = [int(whole.sample(x)[0]) for x in steps]
    assert len(set(tokens)) > 3  # a real draw, not one token
    for cut in (1, 4, 9):
        resumed = DeviceSampler(3, width, width, [0], DEVICE)
        resumed.set_row(2, params, min_new_tokens=4, generated=cut, seen_ids=prompt + tokens[:cut])
        slot = torch.tensor([2], device=DEVICE)
        assert [int(resumed.sample(x, slot)[0]) for x in steps[cut:]] == tokens[cut:]


def test_eager_step_over_chosen_slots_equals_the_bucket_step() -> None:
    """`rows` picks the slots of an eager step (a prefill's new rows); those slots advance as
    if they had been sampled in a bucket, the other slots do not move."""
    width = 64
    params = [SamplingParams(greedy=False, seed=s, top_k=8) for s in range(4)]
    bucket, chosen = (DeviceSampler(4, width, width, [], DEVICE) for _ in range(2))
    for slot, p in enumerate(params):
        for sampler in (bucket, chosen):
            sampler.set_row(slot, p, min_new_tokens=0, generated=slot, seen_ids=[slot])
    before = state_of(chosen, range(4))
    logits = make_logits("peaked", 3, 4, width, 0.0, torch.float32)
    full = bucket.sample(logits).tolist()
    slots = torch.tensor([3, 1], device=DEVICE)
    assert chosen.sample(logits[[3, 1]], slots).tolist() == [full[3], full[1]]
    after = state_of(chosen, range(4))
    assert [after[1], after[3]] == [bucket.state(1), bucket.state(3)]
    assert [after[0], after[2]] == [before[0], before[2]]


def test_greedy_temperature_zero_min_new_tokens_and_padding_columns() -> None:
    """Greedy and temperature 0 take the argmax (lowest id on ties); EOS is never drawn before
    min_new_tokens and is drawn after it; padding columns of the output layer never are."""
    sampler = DeviceSampler(4, 4, 6, [2], DEVICE)
    sampler.set_row(0, SamplingParams(), min_new_tokens=0, generated=0, seen_ids=[])
    sampler.set_row(
        1, SamplingParams(greedy=False, temperature=0.0), min_new_tokens=0, generated=0, seen_ids=[]
    )
    sampler.set_row(2, SamplingParams(), min_new_tokens=2, generated=0, seen_ids=[])
    sampler.set_row(
        3, SamplingParams(greedy=False, seed=3), min_new_tokens=0, generated=0, seen_ids=[]
    )
    logits = torch.tensor(
        [
            [0.0, 2.0, 1.0, 2.0, 9.0, 9.0],
            [5.0, 1.0, 5.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 9.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 50.0, 50.0],
        ],
        device=DEVICE,
    )
    assert sampler.sample(logits).tolist()[:3] == [1, 0, 1]
    assert sampler.sample(logits).tolist()[2] == 1  # generated 1 < 2: still no EOS
    assert sampler.sample(logits).tolist()[2] == 2  # generated 2: EOS allowed
    draws = {int(sampler.sample(logits)[3]) for _ in range(64)}
    assert draws == {0, 1, 2, 3}  # uniform over the real tokens, never a padding column


def test_repetition_penalty_covers_the_prompt_and_what_was_generated() -> None:
    """Seen ids: the prompt given to set_row and every token sampled since."""
    sampler = DeviceSampler(1, 3, 3, [], DEVICE)
    sampler.set_row(
        0, SamplingParams(repetition_penalty=4.0), min_new_tokens=0, generated=0, seen_ids=[0]
    )
    logits = torch.tensor([[4.0, 3.0, 2.0]], device=DEVICE)
    assert sampler.sample(logits).tolist() == [1]  # 4/4 = 1 < 3
    assert sampler.sample(logits).tolist() == [2]  # 3/4 too
    assert sampler.state(0)["seen_ids"] == [0, 1, 2]
    assert sampler.sample(logits).tolist() == [0]  # 1 > 0.75 > 0.5


def test_set_row_and_constructor_reject_ids_outside_the_logits() -> None:
    with pytest.raises(ValueError):
        DeviceSampler(2, 10, 8, [], DEVICE)
    with pytest.raises(ValueError):
        DeviceSampler(2, 8, 8, [8], DEVICE)
    sampler = DeviceSampler(2, 8, 8, [7], DEVICE)
    with pytest.raises(ValueError):
        sampler.set_row(0, SamplingParams(), min_new_tokens=0, generated=0, seen_ids=[8])
    with pytest.raises(IndexError):
        sampler.clear_row(2)


def test_sample_traces_as_one_graph() -> None:
    """`torch.compile(fullgraph=True)` fails on any graph break (a host read such as .item()
    or .tolist(), Python control flow on tensor data): the proxy on a CPU for a step that a
    CUDA graph can capture. The traced step picks what the eager one picks."""
    width = 97
    eager, traced = (DeviceSampler(8, 90, width, [3, 4], DEVICE) for _ in range(2))
    for slot in range(8):
        params = SamplingParams(
            greedy=slot % 3 == 0,
            temperature=0.5 + slot,
            top_k=slot % 4 * 5,
            top_p=0.5 if slot % 2 else 1.0,
            seed=slot * 2**60,
            repetition_penalty=1.0 + slot % 3 / 4,
        )
        for sampler in (eager, traced):
            sampler.set_row(slot, params, min_new_tokens=slot % 3, generated=slot, seen_ids=[slot])
    step = torch.compile(traced.sample, backend="eager", fullgraph=True)
    for seed, dtype in ((1, torch.float32), (2, torch.float32), (3, torch.bfloat16)):
        logits = make_logits("peaked", seed, 6, width, 0.1, dtype)
        assert step(logits).tolist() == eager.sample(logits).tolist()
    assert state_of(traced, range(8)) == state_of(eager, range(8))


def test_a_sampled_row_with_no_finite_logit_still_gets_a_token() -> None:
    """All -inf (every token masked) or NaN: no positive weight. Both paths return the row's
    first token in order instead of indexing position -1 (an IndexError on a CPU, a device-side
    assert that ends the process on CUDA)."""
    params = SamplingParams(greedy=False, seed=1, top_k=2)
    logits = torch.full((2, 5), float("-inf"), device=DEVICE)
    logits[1] = float("nan")
    expected = select(logits.clone(), [params, params], [0, 0], None)
    sampler = DeviceSampler(2, 5, 5, [], DEVICE)
    for slot in range(2):
        sampler.set_row(slot, params, min_new_tokens=0, generated=0, seen_ids=[])
    assert sampler.sample(logits).tolist() == expected
    assert expected[0] == 0


def test_reset_clears_what_warm_up_advanced() -> None:
    """Warm-up and capture runs advance every slot; `reset` returns them all to cleared."""
    sampler = DeviceSampler(3, 10, 12, [1], DEVICE)
    cleared = state_of(sampler, range(3))
    sampler.set_row(
        1,
        SamplingParams(greedy=False, seed=4, top_k=3),
        min_new_tokens=2,
        generated=5,
        seen_ids=[2],
    )
    sampler.sample(make_logits("wide", 0, 3, 12, 0.0, torch.float32))
    assert state_of(sampler, range(3)) != cleared
    sampler.reset()
    assert state_of(sampler, range(3)) == cleared
    assert cleared[0] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "top_k": 0,
        "seed": 0,
        "generated": 0,
        "min_new_tokens": 0,
        "seen_ids": [],
    }


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need GUARDSTREAM_TEST_DEVICE=cuda")
def test_sample_replays_from_a_cuda_graph() -> None:
    """Captured once over static logits (warm-up advances state, `reset` clears it), then rows
    set, moved and cleared between replays: every replay picks what the eager sampler picks."""
    slots, width = 8, 1000
    eager, graphed = (DeviceSampler(slots, 990, width, [3, 7], DEVICE) for _ in range(2))
    static_logits = torch.zeros(slots, width, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            graphed.sample(static_logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_tokens = graphed.sample(static_logits)
    graphed.reset()
    for slot in range(6):
        params = SamplingParams(
            greedy=slot == 0,
            temperature=0.7 + slot / 3,
            top_k=slot * 7,
            top_p=0.9 if slot % 2 else 1.0,
            seed=2**63 - 1 - slot,
            repetition_penalty=1.0 if slot % 3 else 1.5,
        )
        for sampler in (eager, graphed):
            sampler.set_row(slot, params, min_new_tokens=2, generated=slot, seen_ids=[slot, 9])
    for step in range(6):
        if step == 3:  # row 1 leaves: the last row moves into its slot
            for sampler in (eager, graphed):
                sampler.move_row(5, 1)
                sampler.clear_row(5)
        logits = make_logits("peaked", step, slots, width, 0.2, torch.bfloat16)
        static_logits.copy_(logits.float())
        graph.replay()
        assert static_tokens.tolist()[:5] == eager.sample(logits.float()).tolist()[:5]
    assert state_of(graphed, range(5)) == state_of(eager, range(5))
