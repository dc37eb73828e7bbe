"""Continuous batching: 16 concurrent requests share decode steps (one forward pass for all rows),
and each gets exactly the tokens it gets alone (greedy and seeded sampling, tiny-random float64)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from generation.models import LoadedModel
from generation.server import STATE, create_app
from generation.testing import ThreadedServer
from tests.engine_support import Stream, generate, parse, run, wait_until

PROMPTS = [
    "Hello",
    "The capital of France is",
    "東京は日本の首都です。",
    "a",
    "Tell me about cats 😀",
    "x" * 30,
    "Numbers: 1 2 3",
    "Émilie a mangé une crème brûlée",
    "def hello(name):",
    "서울은 한국의 수도입니다.",
    "Contact me at jo@example.com",
    "🚀🚀🚀",
    "Dogs are loyal companions. Cats",
    "The quick brown fox jumps over the lazy dog.",
    "?",
    "Streaming guardrails hold text back",
]


def bodies() -> list[dict[str, Any]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        # different lengths and budgets: rows join with padding and leave at different steps
        body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": 24 + 3 * i}
        if i % 4 == 3:
            body["decoding"] = {
                "method": "sampling",
                "seed": 1000 + i,
                "top_k": 20,
                "temperature": 1.3,
            }
        if i % 5 == 2:
            body["stop_sequences"] = ["\u2603"]
        out.append(body)
    return out


def test_sixteen_concurrent_equal_alone(tiny_model: LoadedModel) -> None:
    """The worker is held while the 16 requests arrive, so they provably share decode steps."""
    with ThreadedServer(lambda: create_app(tiny_model)) as server:
        assert server.app is not None
        engine = server.app[STATE].engine
        url = server.url

        async def scenario() -> tuple[list[Stream], list[Stream]]:
            async with aiohttp.ClientSession() as session:
                alone = [await generate(session, url, body) for body in bodies()]
                with engine.hold():
                    tasks = [asyncio.ensure_future(generate(session, url, b)) for b in bodies()]

                    async def queued() -> bool:
                        return engine.active_requests == len(tasks)

                    await wait_until(queued, what="16 requests queued")
                passes_before = engine.stats.forward_passes
                together = await asyncio.gather(*tasks)
                passes = engine.stats.forward_passes - passes_before
            tokens = sum(len(s.token_ids) for s in together)
            assert engine.stats.max_batch_size_seen == 16
            assert passes < tokens / 8, (passes, tokens)  # one forward pass serves many rows
            assert engine.active_requests == 0
            return alone, list(together)

        alone, together = run(scenario())
    for body, a, b in zip(bodies(), alone, together, strict=True):
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
