"""The static decode step (generation/decode_graphs.py), on a CPU where it runs eagerly: the
same step a CUDA graph captures and replays. It decodes every row exactly as the row alone and as
the slot-cache step (greedy, seeded sampling, penalties); padding rows up to a batch bucket and
the attention width up to a width bucket never changes a real row, whatever the free slots and
masked columns hold; rows joining and leaving between steps keep every other row's tokens; the
step reads nothing back to the host and never reallocates its buffers (what capture needs); the
batched = alone, resume-exact and chunked = whole-prefill guarantees hold with it on; the KV
cache's rows x capacity is sized from free memory by a pure function (injected numbers here) and
reported by /health and /metrics. tiny-random in float64 and smollm2-135m."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.engine import AtenOps
from generation.decode_graphs import (
    CachePlan,
    StaticDecoder,
    StaticSlotCache,
    bucket,
    cache_bytes_per_token,
    log_progress,
    plan_cache,
    row_buckets,
    width_buckets,
)
from generation.device_sampling import DeviceSampler
from generation.jobs import EngineDelta, Job, StreamError
from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import GPU_MEMORY_FRACTION, Engine
from generation.server import STATE, create_app
from tests.engine_processes import ThreadedServer
from tests.engine_support import (
    DECODINGS,
    RESUME_PROMPTS,
    Stream,
    batch_bodies,
    check_every_split,
    generate,
    long_prompt,
    make_job,
    run,
    run_alone,
    warm,
)
from tests.wait_support import until, within

Event = EngineDelta | StreamError
GIB = 1 << 30
SMOLLM2_TOKEN_BYTES = 30 * 2 * 3 * 64 * 2  # layers x (k, v) x kv heads x head dim x bf16
SMOLLM2_1P7B_TOKEN_BYTES = 24 * 2 * 32 * 64 * 2


# ----- buckets and the memory plan (pure functions) ------------------------------------------


def test_buckets() -> None:
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 9]
    assert bucket(7, None) == 7
    assert row_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert row_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert row_buckets(74) == (1, 2, 4, 8, 16, 32, 64, 74)  # the plan's rows: no slot wasted
    assert row_buckets(1) == (1,)
    assert width_buckets(8192) == (128, 256, 512, 1024, 2048, 4096, 8192)
    assert width_buckets(4096 + 64) == (128, 256, 512, 1024, 2048, 4096, 4160)
    assert width_buckets(100) == (100,)
    assert width_buckets(64, smallest=16) == (16, 32, 64)


def test_start_up_progress_every_16_of_63_buckets(caplog: pytest.LogCaptureFixture) -> None:
    """The capture's (and warm-ups') progress lines: after every 16 of CUDA's 63 buckets, none
    before the first or after the last (the stage's own summary line says that)."""
    caplog.set_level(logging.INFO, logger="guardstream.engine")
    for done in range(64):
        log_progress("decode graph capture", done, 63, "buckets", started=0.0)
    lines = [r.getMessage().rsplit(", ", 1)[0] for r in caplog.records]
    assert lines == [f"decode graph capture: {n} of 63 buckets" for n in (16, 32, 48)]
    assert all(r.getMessage().endswith(" s") for r in caplog.records)


def test_plan_gives_256_rows_of_the_whole_context_when_they_fit() -> None:
    """smollm2-135m's shape in bf16 on an H100 with 78 GiB free: 256 x 8192 takes 45 GiB."""
    plan = plan_cache(
        free_bytes=78 * GIB, fraction=0.8, bytes_per_token=SMOLLM2_TOKEN_BYTES, max_context=8192
    )
    assert plan == CachePlan(256, 8192, 256 * 8192 * SMOLLM2_TOKEN_BYTES)


def test_plan_shortens_rows_to_the_floor_then_gives_up_rows() -> None:
    """SmolLM2-1.7B's shape (192 KiB per token): 256 rows of 8192 need 384 GiB. Capacity
    shrinks to MIN_CAPACITY (4096) first, then rows go: 62.4 GiB hold 83 rows of 4096."""
    free = 78 * GIB
    plan = plan_cache(
        free_bytes=free, fraction=0.8, bytes_per_token=SMOLLM2_1P7B_TOKEN_BYTES, max_context=8192
    )
    assert plan.capacity == 4096
    assert plan.rows == int(free * 0.8) // (4096 * SMOLLM2_1P7B_TOKEN_BYTES) == 83
    # enough memory for 256 rows of 6,000 columns: rows stay, capacity shrinks to a multiple of 64
    plan = plan_cache(
        free_bytes=256 * 6000 * 1000, fraction=1.0, bytes_per_token=1000, max_context=8192
    )
    assert plan == CachePlan(256, 5952, 256 * 5952 * 1000)
    # a model whose context is below the floor keeps its whole context, with fewer rows
    plan = plan_cache(
        free_bytes=100 * 512 * 1000, fraction=1.0, bytes_per_token=1000, max_context=500
    )
    assert plan == CachePlan(100, 512, 100 * 512 * 1000)


def test_plan_with_little_memory_and_bad_fractions() -> None:
    plan = plan_cache(free_bytes=1000 * 1000, fraction=1.0, bytes_per_token=1000, max_context=8192)
    assert plan == CachePlan(1, 960, 960 * 1000)  # one row of what fits, a multiple of 64
    with pytest.raises(MemoryError):
        plan_cache(free_bytes=60 * 1000, fraction=1.0, bytes_per_token=1000, max_context=8192)
    for fraction in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            plan_cache(free_bytes=GIB, fraction=fraction, bytes_per_token=10, max_context=64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    free=st.integers(64 * 100, 200 * GIB),
    fraction=st.sampled_from([0.1, 0.5, 0.8, 1.0]),
    per_token=st.integers(100, 400_000),
    context=st.integers(1, 131_072),
    max_rows=st.integers(1, 512),
)
def test_plan_invariants(
    free: int, fraction: float, per_token: int, context: int, max_rows: int
) -> None:
    """Within budget; rows only given up once capacity is at the floor; rows and capacity
    never exceed what was asked (the context rounded up to a multiple of 64)."""
    try:
        plan = plan_cache(
            free_bytes=free,
            fraction=fraction,
            bytes_per_token=per_token,
            max_context=context,
            max_rows=max_rows,
        )
    except MemoryError:
        assert int(free * fraction) < 64 * per_token
        return
    assert plan.nbytes == plan.rows * plan.capacity * per_token <= int(free * fraction)
    assert 1 <= plan.rows <= max_rows
    assert plan.capacity % 64 == 0 and 64 <= plan.capacity <= -(-context // 64) * 64
    if plan.rows < max_rows:
        assert plan.capacity <= max(-(-min(context, 4096) // 64) * 64, 64)


# ----- the step itself, at the model level ---------------------------------------------------


def _prefill(model: LoadedModel, prompt: list[int]) -> Any:
    return model.model(input_ids=torch.tensor([prompt], device=model.device), use_cache=True)


def _decoder(
    model: LoadedModel, slots: int, capacity: int, buckets: bool, sampler: bool = False
) -> StaticDecoder:
    template = _prefill(model, [1, 2]).past_key_values
    cache = StaticSlotCache(template, slots, capacity)
    device_sampler = None
    if sampler:
        device_sampler = DeviceSampler(
            slots,
            vocab_size=model.vocab_size,
            logits_width=model.model_vocab_size,
            eos_ids=sorted(model.eos_token_ids),
            device=model.device,
        )
    return StaticDecoder(
        model.model,
        cache,
        rows=row_buckets(slots) if buckets else None,
        widths=width_buckets(capacity, smallest=16) if buckets else None,
        sampler=device_sampler,
    )


def _alone(model: LoadedModel, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """A row decoded by itself with transformers' DynamicCache: logits after each token."""
    out = _prefill(model, prompt)
    logits, cache, length = [out.logits[0, -1]], out.past_key_values, len(prompt)
    for _ in range(steps):
        token = int(logits[-1].argmax())
        out = model.model(
            input_ids=torch.tensor([[token]], device=model.device),
            position_ids=torch.tensor([[length]], device=model.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits.append(out.logits[0, -1])
        length += 1
    return logits


@pytest.mark.parametrize("buckets", [True, False], ids=["padded", "exact"])
@pytest.mark.parametrize("which", ["tiny_model", "smollm2_model"])
def test_static_step_decodes_like_alone_as_rows_join_and_leave(
    which: str, buckets: bool, request: pytest.FixtureRequest
) -> None:
    """Three rows join at different steps, one leaves mid-way (the last row moves into its
    slot), all leave at the end; every step's logits are each row's alone. Padded: 3 rows run
    as 4, widths as 16/32/64. The buffers are never reallocated."""
    model: LoadedModel = request.getfixturevalue(which)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 600) for _ in range(n)] for n in (5, 14, 3)]
    steps = 12  # row 1 crosses the 16-column bucket
    tolerance = 1e-9 if model.dtype == torch.float64 else 1e-3
    with torch.inference_mode():
        alone = [_alone(model, prompt, steps) for prompt in prompts]
        decoder = _decoder(model, slots=8, capacity=64, buckets=buckets)
        cache = decoder.cache
        pointers = [layer.keys.data_ptr() for layer in cache.layers]
        rows: list[list[int]] = []  # [prompt index, tokens generated]
        shapes: set[tuple[int, int, int, int]] = set()  # rows, width needed; rows, width run

        def join(i: int) -> None:
            cache.add_rows(_prefill(model, prompts[i]).past_key_values, [0], [len(prompts[i])])
            rows.append([i, 0])

        join(0)
        join(1)
        for step in range(steps + 3):
            if step == 2:
                join(2)
            if step == 4:  # row 0 leaves: row 2 (the last) moves into slot 0
                assert cache.keep([1, 2]) == [2, 1]
                rows = [rows[2], rows[1]]
            if not rows:
                break
            shapes.add((len(rows), max(cache.lengths) + 1, *decoder.shape(cache.lengths)))
            logits = decoder.step([int(alone[i][n].argmax()) for i, n in rows])
            decoder.advance()
            assert logits.shape[0] == len(rows)
            for j, row in enumerate(rows):
                i, n = row
                expected = alone[i][n + 1]
                assert torch.allclose(logits[j], expected, atol=tolerance, rtol=0), (step, j)
                assert int(logits[j].argmax()) == int(expected.argmax())
                row[1] += 1
            done = [j for j, (_, n) in enumerate(rows) if n >= steps]
            if done:
                order = cache.keep([j for j in range(len(rows)) if j not in done])
                rows = [rows[j] for j in order]
        assert not rows and cache.rows == 0
        assert [layer.keys.data_ptr() for layer in cache.layers] == pointers
    if buckets:  # 3 rows ran as 4, and widths were padded
        assert any(run > rows for rows, _, run, _ in shapes), shapes
        assert any(run > width for _, width, _, run in shapes), shapes
    else:
        assert all(shape[:2] == shape[2:] for shape in shapes), shapes


@pytest.mark.parametrize("which", ["tiny_model", "smollm2_model"])
def test_padding_and_stale_slots_never_change_a_real_row(
    which: str, request: pytest.FixtureRequest
) -> None:
    """The same three rows stepped exactly (3 rows, width = longest + 1) and padded (4 rows,
    widths 16 and 32) over a cache whose free slots and masked columns hold large random values
    (what rows that left leave behind): the same logits up to the last bits that kernel
    blocking moves, and the same tokens from the device sampler, greedy and seeded."""
    model: LoadedModel = request.getfixturevalue(which)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 600) for _ in range(n)] for n in (6, 11, 2)]
    params = [
        SamplingParams(),
        SamplingParams(greedy=False, temperature=1.3, top_k=20, seed=7),
        SamplingParams(greedy=False, temperature=0.9, top_p=0.8, seed=2**63 + 5),
    ]
    # float32: 1e-3, as in the join/leave test above; with one torch thread the padded 4-row,
    # 32-column step differs from the exact one by up to 1.2e-4 (smollm2's logits reach ~20)
    tolerance = 1e-12 if model.dtype == torch.float64 else 1e-3
    head = model.model.get_output_embeddings()
    results = []
    with torch.inference_mode():
        for buckets, dirty in ((False, False), (True, True)):
            decoder = _decoder(model, slots=8, capacity=64, buckets=buckets, sampler=True)
            cache, sampler = decoder.cache, decoder.sampler
            assert sampler is not None
            if dirty:
                generator = torch.Generator().manual_seed(3)
                for layer in cache.layers:
                    for buffer in (layer.keys, layer.values):
                        noise = torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype)
                        buffer.copy_(noise * 100)
            tokens = []
            for slot, prompt in enumerate(prompts):
                out = _prefill(model, prompt)
                cache.add_rows(out.past_key_values, [0], [len(prompt)])
                sampler.set_row(slot, params[slot], min_new_tokens=0, generated=1, seen_ids=prompt)
                tokens.append(int(out.logits[0, -1].argmax()))
            trace = []
            for _ in range(6):
                shape = decoder.shape(cache.lengths)
                seen: list[torch.Tensor] = []
                hook = head.register_forward_hook(
                    lambda m, i, o, seen=seen: seen.append(o[:3, -1].clone())
                )
                try:
                    chosen = decoder.step(tokens).tolist()
                finally:
                    hook.remove()
                decoder.advance()
                trace.append((shape, seen[0], chosen))
                tokens = chosen
            results.append(trace)
    exact, padded = results
    assert [shape for shape, _, _ in exact] == [(3, 12 + i) for i in range(6)]
    assert [shape for shape, _, _ in padded] == [(4, 16)] * 5 + [(4, 32)]
    for (_, a, tokens_a), (_, b, tokens_b) in zip(exact, padded, strict=True):
        assert torch.allclose(a, b, atol=tolerance, rtol=0)
        assert tokens_a == tokens_b


def test_graph_replay_equals_the_eager_step(tiny_model: LoadedModel) -> None:
    """CUDA only: a decoder whose steps replay captured graphs gives, step for step, the tokens
    of the same decoder run eagerly, as rows join and leave between replays."""
    if tiny_model.device.type != "cuda":
        pytest.skip("CUDA graphs need GUARDSTREAM_TEST_DEVICE=cuda")
    params = [
        SamplingParams(),
        SamplingParams(greedy=False, temperature=1.3, top_k=20, seed=7),
        SamplingParams(greedy=False, temperature=0.9, top_p=0.8, seed=11),
    ]
    prompts = [[5, 6, 7], long_prompt(20), [42]]
    with torch.inference_mode():
        replayed = _decoder(tiny_model, slots=8, capacity=64, buckets=True, sampler=True)
        replayed.capture()
        eager = _decoder(tiny_model, slots=8, capacity=64, buckets=True, sampler=True)
        traces: list[list[list[int]]] = [[], []]
        for decoder, trace in zip((replayed, eager), traces, strict=True):
            sampler = decoder.sampler
            assert sampler is not None
            tokens: list[int] = []

            def join(i: int, decoder: StaticDecoder = decoder, tokens: list[int] = tokens) -> None:
                out = _prefill(tiny_model, prompts[i])
                slot = decoder.cache.rows
                decoder.cache.add_rows(out.past_key_values, [0], [len(prompts[i])])
                decoder.sampler.set_row(  # type: ignore[union-attr]
                    slot, params[i], min_new_tokens=0, generated=1, seen_ids=prompts[i]
                )
                tokens.append(int(out.logits[0, -1].argmax()))

            join(0)
            join(1)
            for step in range(30):
                if step == 5:
                    join(2)
                if step == 12:  # row 0 leaves; row 2 moves into slot 0
                    order = decoder.cache.keep([1, 2])
                    sampler.move_row(order[0], 0)
                    tokens[:] = [tokens[i] for i in order]
                chosen = decoder.step(tokens).tolist()
                decoder.advance()
                trace.append(chosen)
                tokens[:] = chosen
    assert traces[0] == traces[1]
    assert replayed.replays == 30 and eager.replays == 0 and replayed.graphs == 12


#: Ops that read a device value on the host or size their output by data: a graph cannot hold
#: them (capture fails, or bakes in one step's answer).
HOST_READS = {
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique2",
    "aten.repeat_interleave",
    "aten.equal",
}


@pytest.mark.parametrize("which", ["tiny_model", "smollm2_model"])
def test_the_captured_region_reads_nothing_back_to_the_host(
    which: str, request: pytest.FixtureRequest
) -> None:
    """What `capture` records, run under a dispatch mode: the forward pass and the device
    sampler read no value back and size nothing by data."""
    model: LoadedModel = request.getfixturevalue(which)
    with torch.inference_mode():
        decoder = _decoder(model, slots=4, capacity=64, buckets=True, sampler=True)
        decoder.cache.add_rows(_prefill(model, [5, 6, 7]).past_key_values, [0], [3])
        decoder.cache.positions[:1] = 3
        recorder = AtenOps()
        with recorder:
            tokens = decoder._forward(2, 16)
    assert tokens.shape == (2,) and tokens.dtype == torch.long
    assert "aten.scaled_dot_product_attention" in recorder.ops or "aten.bmm" in recorder.ops
    assert not HOST_READS & set(recorder.ops), recorder.ops


# ----- the engine with the static step on --------------------------------------------------------


def _static_engine(model: LoadedModel, **options: Any) -> Engine:
    return Engine(model, static_decode=True, static_buckets=True, **options)


async def _tokens(queue: asyncio.Queue[Event]) -> list[int]:
    out: list[int] = []
    async with within(120):  # a guard, not a window
        while True:
            item = await queue.get()
            assert isinstance(item, EngineDelta), item
            out.extend(item.token_ids)
            if item.finish_reason is not None:
                return out


JOBS = [
    ([11, 12, 13, 14, 15], 30, SamplingParams()),
    ([300, 7], 9, SamplingParams(greedy=False, temperature=1.3, top_k=20, seed=1001)),
    (long_prompt(40), 22, SamplingParams(greedy=False, temperature=0.8, top_p=0.7, seed=5)),
    ([42], 17, SamplingParams(greedy=False, temperature=1.0, seed=9, repetition_penalty=1.3)),
    (long_prompt(23, 5), 26, SamplingParams(repetition_penalty=1.2)),
    ([5, 6, 7, 8, 9, 10, 11], 5, SamplingParams(greedy=False, temperature=2.0, seed=2**62)),
]


async def _waves(engine: Engine) -> list[list[int]]:
    """Jobs in two waves: the second joins a running batch after its rows' first tokens; rows
    leave at different steps (different budgets)."""
    loop = asyncio.get_running_loop()
    jobs = [
        Job(
            prompt_ids=prompt,
            max_new_tokens=n,
            min_new_tokens=n // 2,
            sampling=sampling,
            loop=loop,
            queue=asyncio.Queue(),
        )
        for prompt, n, sampling in JOBS
    ]
    with engine.hold():
        for job in jobs[:3]:
            engine.submit(job)
    first = await jobs[0].queue.get()  # the first wave runs
    assert isinstance(first, EngineDelta)
    for job in jobs[3:]:
        engine.submit(job)
    rest = await asyncio.gather(*(_tokens(job.queue) for job in jobs))
    return [first.token_ids + rest[0], *rest[1:]]


async def test_static_engine_equals_the_eager_engine_and_each_row_alone(
    tiny_model: LoadedModel,
) -> None:
    """Greedy, seeded top-k / top-p, penalties and min_new_tokens; rows joining a running batch
    and leaving at different steps: the static step (padded to buckets, device sampling) gives
    every row the eager engine's tokens and its own tokens alone."""
    eager = Engine(tiny_model)
    static = _static_engine(tiny_model)
    eager.start()
    static.start()
    try:
        expected = await _waves(eager)
        got = await _waves(static)
        loop = asyncio.get_running_loop()
        alone = []
        for prompt, n, sampling in JOBS:
            job = Job(prompt, n, sampling, loop, asyncio.Queue(), min_new_tokens=n // 2)
            alone.append(await run_alone(static, job))
    finally:
        eager.stop()
        static.stop()
    assert got == expected
    assert alone == expected
    assert [len(tokens) for tokens in got] == [n for _, n, _ in JOBS]
    assert static.stats.max_batch_size_seen == len(JOBS)
    info = static.cache_info()
    assert info["rows_used"] == 0
    if tiny_model.device.type == "cuda":
        assert info["mode"] == "cuda_graphs" and info["graphs"] > 0
    else:
        assert info["mode"] == "static" and info["graphs"] == 0


async def test_chunked_prefill_with_the_static_step_gives_a_whole_prefills_tokens(
    tiny_model: LoadedModel,
) -> None:
    """Chunked = whole prefill, and resumed exactly, with the static step on."""
    whole = Engine(tiny_model, prefill_chunk_tokens=10_000)
    chunked = _static_engine(tiny_model, prefill_chunk_tokens=16)
    whole.start()
    chunked.start()
    try:
        await warm(whole)
        await warm(chunked)
        for sampling in (SamplingParams(), SamplingParams(greedy=False, top_k=20, seed=77)):
            prompt = long_prompt(150, offset=3)
            expected = await run_alone(
                whole, make_job(prompt, 30, asyncio.Queue(), sampling=sampling)
            )
            got = await run_alone(chunked, make_job(prompt, 30, asyncio.Queue(), sampling=sampling))
            assert got == expected
            resumed = make_job(
                prompt, 30, asyncio.Queue(), sampling=sampling, resume_ids=expected[:12]
            )
            assert await run_alone(chunked, resumed) == expected[12:]
        assert chunked.stats.prefill_chunks > 0
    finally:
        whole.stop()
        chunked.stop()


@pytest.fixture(scope="module")
def static_server(tiny_model: LoadedModel) -> Any:
    """A real engine server with the static step on (padded to buckets)."""
    with ThreadedServer(
        lambda: create_app(tiny_model, static_decode=True, static_buckets=True)
    ) as server:
        yield server


def test_sixteen_concurrent_equal_alone_with_the_static_step(
    tiny_server: ThreadedServer, static_server: ThreadedServer
) -> None:
    """test_engine_batching's 16 requests (stop sequences, sampling, different budgets): alone
    on the eager server = together on the static one."""
    assert static_server.app is not None
    engine = static_server.app[STATE].engine

    async def scenario() -> tuple[list[Stream], list[Stream]]:
        async with aiohttp.ClientSession() as session:
            alone = [await generate(session, tiny_server.url, body) for body in batch_bodies()]
            with engine.hold():
                tasks = [
                    asyncio.ensure_future(generate(session, static_server.url, b))
                    for b in batch_bodies()
                ]

                async def queued() -> bool:
                    return engine.active_requests == len(tasks)

                await until(queued, what="16 requests queued")
            together = await asyncio.gather(*tasks)
        return alone, list(together)

    alone, together = run(scenario())
    assert engine.stats.max_batch_size_seen == 16
    for body, a, b in zip(batch_bodies(), alone, together, strict=True):
        assert a.completed and b.completed
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), (
            body
        )


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(prompt=RESUME_PROMPTS, n=st.integers(1, 16), decoding=DECODINGS)
def test_resume_is_exact_with_the_static_step(
    static_server: ThreadedServer, prompt: str, n: int, decoding: dict[str, Any]
) -> None:
    """test_engine_resume's property (every split point resumes exactly) on the static step:
    the resumed rows join and leave a batch of all the other splits."""
    body = {"prompt": prompt, "max_new_tokens": n, "decoding": decoding}
    run(check_every_split(static_server.url, body))


def test_health_and_metrics_report_the_kv_cache(
    tiny_model: LoadedModel, static_server: ThreadedServer
) -> None:
    async def scenario() -> tuple[dict[str, Any], str]:
        async with aiohttp.ClientSession() as session:
            async with session.get(static_server.url + "/health") as resp:
                health = await resp.json()
            async with session.get(static_server.url + "/metrics") as resp:
                metrics = await resp.text()
        return health, metrics

    health, metrics = run(scenario())
    rows, capacity, graphs = 64, 512, 0  # a CPU's default rows; tiny-random's whole context
    mode = "static"
    assert static_server.app is not None
    engine = static_server.app[STATE].engine
    prefill_graphs = 0
    if tiny_model.device.type == "cuda":  # rows from free memory; a graph per bucket pair
        rows = engine.max_batch_size
        graphs = len(row_buckets(rows)) * len(width_buckets(capacity))
        mode = "cuda_graphs"
        prefill_graphs = len(engine._runner.warm_shapes)  # captured at start
    with torch.inference_mode():
        template = _prefill(tiny_model, [1]).past_key_values
    # each slot's columns and the reserved one (a static prefill's padding writes)
    nbytes = rows * (capacity + 1) * cache_bytes_per_token(template)
    assert health["max_batch_size"] == rows
    assert health["kv_cache"] == {
        "mode": mode,
        "rows": rows,
        "capacity": capacity,
        "rows_used": 0,
        "tokens_used": 0,
        "bytes": nbytes,
        "graphs": graphs,
        "compiled": False,
        "compile_error": None,
    }
    values = {
        name: float(value)
        for name, value in (line.split(" ") for line in metrics.splitlines() if line[:1] != "#")
    }
    assert {
        name: values[f"guardstream_engine_{name}"]
        for name in (
            "kv_cache_rows",
            "kv_cache_capacity_tokens",
            "kv_cache_rows_used",
            "kv_cache_tokens_used",
            "kv_cache_bytes",
            "decode_graphs",
            "decode_compiled",
            "decode_compile_failed",
        )
    } == {
        "kv_cache_rows": rows,
        "kv_cache_capacity_tokens": capacity,
        "kv_cache_rows_used": 0,
        "kv_cache_tokens_used": 0,
        "kv_cache_bytes": nbytes,
        "decode_graphs": graphs,
        "decode_compiled": 0,
        "decode_compile_failed": 0,
    }
    # prefill: the static pass into the decode slots (prefill_graphs.py); whatever ran before
    prefill = health["prefill"]
    assert prefill["mode"] == mode and prefill["graph_error"] is None
    assert prefill["graphs"] == prefill["captures"] == prefill_graphs
    assert {
        name: values[f"guardstream_engine_{name}"]
        for name in (
            "prefill_graphs",
            "prefill_graph_captures_total",
            "prefill_graph_replays_total",
        )
    } == {
        "prefill_graphs": prefill_graphs,
        "prefill_graph_captures_total": prefill_graphs,
        "prefill_graph_replays_total": prefill["replays"],
    }
    passes = values["guardstream_engine_prefill_eager_passes_total"]
    assert passes == prefill["eager_passes"] == engine._runner.prefill_pass.runner.eager_passes


def test_a_cache_shorter_than_the_context_lowers_the_advertised_context(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A static cache of 128 columns makes the engine's context 128: /v1/models says so, a
    longer request is a 422 before any byte, and a request that fits runs to its budget. On a
    CPU `static_capacity` sizes the cache; on CUDA free memory does: the device reports a GPU
    nearly full (free memory for one row of 160 tokens: plan_cache gives 1 row of 128)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=tiny_model.device)
    with torch.inference_mode():
        template = tiny_model.model(input_ids=ids, use_cache=True).past_key_values
    per_token = cache_bytes_per_token(template)
    free = int(160 * per_token / GPU_MEMORY_FRACTION)
    plan = plan_cache(
        free_bytes=free,
        fraction=GPU_MEMORY_FRACTION,
        bytes_per_token=per_token,
        max_context=tiny_model.max_context,
    )
    assert (plan.rows, plan.capacity) == (1, 128)
    if tiny_model.device.type == "cuda":
        total = torch.cuda.mem_get_info(tiny_model.device)[1]
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))

    def app() -> Any:
        application = create_app(tiny_model, static_decode=True)
        application[STATE].engine.static_capacity = 128  # read when the engine starts (a CPU)
        return application

    with ThreadedServer(app) as server:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                async with session.get(server.url + "/v1/models") as resp:
                    listed = (await resp.json())["data"][0]
                assert listed["max_model_len"] == listed["max_context"] == 128
                too_long = await generate(
                    session, server.url, {"input_ids": [5] * 100, "max_new_tokens": 40}
                )
                assert too_long.status == 422
                assert "context of 128 tokens" in too_long.lines[0]["details"]
                fits = await generate(
                    session,
                    server.url,
                    {"input_ids": [5] * 100, "max_new_tokens": 28, "min_new_tokens": 28},
                )
                assert fits.completed and len(fits.token_ids) == 28

        run(scenario())
    assert tiny_model.max_context == 512  # the shared model is untouched
