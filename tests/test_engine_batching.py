"""Continuous batching: 16 concurrent requests share decode steps (one forward pass for all rows),
and each gets exactly the tokens it gets alone (greedy and seeded sampling, tiny-random float64);
rows join a running batch; a model whose cache cannot be slotted (sliding window) runs one
request at a time, exactly; running out of memory while the batch grows fails it migratably."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch

from generation import models
from generation.models import LoadedModel
from generation.scheduler import Engine, prefill_groups
from generation.server import STATE, create_app
from tests.engine_processes import ThreadedServer
from tests.engine_support import (
    Event,
    RecordingQueue,
    Stream,
    batch_bodies,
    generate,
    load_test_model,
    make_job,
    parse,
    run,
    run_alone,
    tokens_of,
    warm,
)
from tests.wait_support import until


def test_sixteen_concurrent_equal_alone(tiny_model: LoadedModel) -> None:
    """The worker is held while the 16 requests arrive, so they provably share decode steps."""
    with ThreadedServer(lambda: create_app(tiny_model)) as server:
        assert server.app is not None
        engine = server.app[STATE].engine
        url = server.url

        async def scenario() -> tuple[list[Stream], list[Stream]]:
            async with aiohttp.ClientSession() as session:
                alone = [await generate(session, url, body) for body in batch_bodies()]
                with engine.hold():
                    tasks = [
                        asyncio.ensure_future(generate(session, url, b)) for b in batch_bodies()
                    ]

                    async def queued() -> bool:
                        return engine.active_requests == len(tasks)

                    await until(queued, what="16 requests queued")
                passes_before = engine.stats.forward_passes
                prefills_before = engine.stats.prefill_passes
                together = await asyncio.gather(*tasks)
                passes = engine.stats.forward_passes - passes_before
                prefills = engine.stats.prefill_passes - prefills_before
            tokens = sum(len(s.token_ids) for s in together)
            assert engine.stats.max_batch_size_seen == 16
            assert passes < tokens / 8, (passes, tokens)  # one forward pass serves many rows
            assert engine.active_requests == 0
            # joiners of different lengths prefill right-padded, in groups (PREFILL_PADDING)
            lengths = [len(s.prompt_token_ids) for s in together]
            assert prefills == len(prefill_groups(lengths)) < len(set(lengths)), lengths
            return alone, list(together)

        alone, together = run(scenario())
    for body, a, b in zip(batch_bodies(), alone, together, strict=True):
        assert a.completed and b.completed
        assert b.token_ids == a.token_ids, body
        assert b.text == a.text, body
        assert b.finish_reason == a.finish_reason


def test_requests_join_a_running_batch(tiny_server: ThreadedServer) -> None:
    """A request arriving mid-generation joins the batch between steps (left-padded merge) and
    still gets its solo tokens; the long-running row is not disturbed either."""
    url = tiny_server.url

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            long_body = {
                "prompt": "The quick brown fox jumps over the lazy dog.",
                "max_new_tokens": 200,
            }
            short_bodies = [
                {"prompt": p, "max_new_tokens": 10}
                for p in ("Hi", "東京 😀 and a longer prompt", "x")
            ]
            long_alone = await generate(session, url, long_body)
            short_alone = [await generate(session, url, b) for b in short_bodies]
            async with session.post(url + "/v1/generate", json=long_body) as resp:
                lines = [await resp.content.readline() for _ in range(5)]  # the long row is running
                shorts = await asyncio.gather(*(generate(session, url, b) for b in short_bodies))
                rest = await resp.read()
            long_together = parse(200, b"".join(lines) + rest)
            long_together.check_framing()
        assert long_together.token_ids == long_alone.token_ids
        for a, b in zip(short_alone, shorts, strict=True):
            assert b.token_ids == a.token_ids

    run(scenario())


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random Mistral with a sliding window of 8: its cache layers are
    `DynamicSlidingWindowLayer`s, which the slot cache cannot hold, so the engine serves it one
    request at a time with the model's own cache."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tiny-mistral-sliding")
    tokenizer = AutoTokenizer.from_pretrained(models.prepare("tiny-random"))
    eos = tokenizer.eos_token_id
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        sliding_window=8,
        initializer_range=0.25,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(5)
        MistralForCausalLM(config).save_pretrained(folder)
    finally:
        torch.random.set_rng_state(state)
    tokenizer.save_pretrained(folder)
    return load_test_model(str(folder), dtype="float64")


def test_unbatchable_cache_is_served_one_at_a_time_exactly(
    sliding_window_model: LoadedModel,
) -> None:
    """Requests queued together on a sliding-window model run one after another (never
    batched) and each gets exactly its solo tokens, past the window's length."""
    bodies = [
        {"prompt": "The quick brown fox jumps over the lazy dog.", "max_new_tokens": 20},
        {"prompt": "東京 😀", "max_new_tokens": 16, "decoding": {"method": "sampling", "seed": 3}},
        {"prompt": "Hello", "max_new_tokens": 12, "stop_sequences": ["\u2603"]},
    ]
    with ThreadedServer(lambda: create_app(sliding_window_model)) as server:
        assert server.app is not None
        engine = server.app[STATE].engine

        async def scenario() -> tuple[list[Stream], list[Stream]]:
            async with aiohttp.ClientSession() as session:
                alone = [await generate(session, server.url, body) for body in bodies]
                with engine.hold():
                    tasks = [
                        asyncio.ensure_future(generate(session, server.url, b)) for b in bodies
                    ]

                    async def queued() -> bool:
                        return engine.active_requests == len(tasks)

                    await until(queued, what="3 requests queued")
                together = await asyncio.gather(*tasks)
            return alone, list(together)

        alone, together = run(scenario())
        assert engine.stats.max_batch_size_seen == 1
    for a, b in zip(alone, together, strict=True):
        assert a.completed and b.completed
        assert len(a.token_ids) > 8  # beyond the sliding window
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_out_of_memory_growing_the_cache_fails_the_batch_migratably(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, static: bool
) -> None:
    """Running out of accelerator memory while a joiner's rows are added (a real OOM cannot be
    had on demand: the cache the engine runs raises torch's OutOfMemoryError for a second row:
    the slot cache growing on a CPU, the static cache copying the joiner's keys on CUDA) ends
    the running row and the joiner with an in-band 503 `generation_unavailable` (the
    orchestrator migrates them), and the engine serves the next request normally."""
    from generation.decode_graphs import StaticSlotCache
    from generation.kv_cache import SlotCache

    message = "CUDA out of memory. Tried to allocate 2.00 GiB"
    if not static:  # the eager step's slot cache grows as rows join
        real_reserve = SlotCache._reserve

        def reserve(self: SlotCache, rows: int, columns: int, template: object = None) -> None:
            if rows > 1:
                raise torch.OutOfMemoryError(message)
            real_reserve(self, rows, columns, template)  # type: ignore[arg-type]

        monkeypatch.setattr(SlotCache, "_reserve", reserve)
    else:  # the static step (CUDA's): fixed buffers, the joiner's rows taken into them (its
        # keys copied from an eager prefill's cache, or, with the static prefill, written in
        # place and moved into consecutive slots)
        real_add_rows, real_take_rows = StaticSlotCache.add_rows, StaticSlotCache.take_rows

        def add_rows(self: StaticSlotCache, prefill: Any, select: Any, lengths: Any) -> None:
            if self.rows + len(select) > 1:
                raise torch.OutOfMemoryError(message)
            real_add_rows(self, prefill, select, lengths)

        def take_rows(self: StaticSlotCache, select: Any, lengths: Any) -> None:
            if self.rows + len(select) > 1:
                raise torch.OutOfMemoryError(message)
            real_take_rows(self, select, lengths)

        monkeypatch.setattr(StaticSlotCache, "add_rows", add_rows)
        monkeypatch.setattr(StaticSlotCache, "take_rows", take_rows)
    with ThreadedServer(lambda: create_app(tiny_model, static_decode=static)) as server:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                long_body = {
                    "prompt": "The quick brown fox",
                    "max_new_tokens": 200,
                    "min_new_tokens": 200,
                }
                async with session.post(server.url + "/v1/generate", json=long_body) as resp:
                    lines = [await resp.content.readline() for _ in range(3)]  # it is running
                    joiner = await generate(session, server.url, {"prompt": "Hi"})
                    running = parse(200, b"".join(lines) + await resp.read())
                for stream in (running, joiner):
                    stream.check_framing()
                    assert stream.error is not None
                    assert stream.error["code"] == 503
                    assert stream.error["type"] == "generation_unavailable"
                    assert "out of memory" in stream.error["message"]
                after = await generate(session, server.url, {"prompt": "Hello"})
                assert after.completed and after.token_ids

        run(scenario())


@pytest.mark.parametrize(
    "path",
    [
        pytest.param({}, id="default"),
        pytest.param({"static_decode": True, "overlap": True}, id="static-overlapped"),
    ],
)
async def test_a_request_arriving_during_a_prefill_joins_before_the_next_decode_step(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, path: dict[str, Any]
) -> None:
    """A burst of new streams reaches the engine over tens of milliseconds. B, submitted while
    A's prefill runs, is prefilled right after it, in the same iteration, before the decode step
    (a decode step between the two prefills would add itself to B's time to first token). Both
    still get exactly their solo tokens."""
    engine = Engine(tiny_model, **path)
    engine.start()
    try:
        await warm(engine)
        a_prompt, b_prompt = [11, 12, 13, 14, 15], [21, 22, 23]
        alone_a = await run_alone(engine, make_job(a_prompt, 6, asyncio.Queue()))
        alone_b = await run_alone(engine, make_job(b_prompt, 6, asyncio.Queue()))
        log: list[tuple[str, Event]] = []
        a = make_job(a_prompt, 6, RecordingQueue("A", log))
        b = make_job(b_prompt, 6, RecordingQueue("B", log))
        runner = engine._runner
        passes: list[str] = []
        prefill, launch = runner.prefill, runner.launch

        def prefill_and_submit(rows: list[Any], lengths: list[int]) -> Any:
            passes.append(f"prefill {len(rows)}")
            if len(passes) == 1:
                engine.submit(b)  # arrives while A's prefill runs
            return prefill(rows, lengths)

        def counted_launch(rows: list[Any]) -> Any:
            passes.append(f"decode {len(rows)}")
            return launch(rows)

        monkeypatch.setattr(runner, "prefill", prefill_and_submit)
        monkeypatch.setattr(runner, "launch", counted_launch)
        engine.submit(a)
        together = await asyncio.gather(tokens_of(a.queue), tokens_of(b.queue))
    finally:
        engine.stop()
    assert passes[:3] == ["prefill 1", "prefill 1", "decode 2"], passes
    assert [name for name, _ in log[:2]] == ["A", "B"]  # both first tokens before any other
    assert together == [alone_a, alone_b]
