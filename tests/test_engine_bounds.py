"""The engine's bounds on work waiting (DESIGN section 7): generate requests past the slots
(`max_waiting_requests`) and characters queued for the tokenizer thread
(`max_tokenizer_chars`) are refused with 429, the engine's error body and Retry-After, before
any byte of a stream; what was admitted still completes, and a freed place admits again."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from typing import Any

import aiohttp
import pytest

from generation import models
from generation.server import STATE, create_app
from tests.engine_processes import start_engine_subprocess
from tests.engine_support import TEST_DEVICE, parse
from tests.wait_support import until

BODY = {"prompt": "Hello", "max_new_tokens": 3}


async def _refused(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """A 429 with Retry-After and the engine's error body; that body."""
    assert resp.status == 429, await resp.text()
    assert resp.headers["Retry-After"] == "1"
    body = await resp.json()
    assert set(body) == {"code", "details", "type"}
    assert (body["code"], body["type"]) == (429, "too_many_requests")
    return body


async def test_requests_past_the_waiting_bound_get_429_before_any_token(
    aiohttp_client: Any, tiny_model: models.LoadedModel
) -> None:
    """One slot and one waiting place: with the worker held, two requests are taken (one to
    run, one to wait) and the third is refused; once they finish, a request is taken again."""
    client = await aiohttp_client(create_app(tiny_model, max_batch_size=1, max_waiting_requests=1))
    engine = client.server.app[STATE].engine
    with engine.hold():
        first = await client.post("/v1/generate", json=BODY)
        second = await client.post("/v1/generate", json=BODY)
        assert (first.status, second.status) == (200, 200)
        await until(lambda: engine.queued_requests == 2, what="both requests queued")
        body = await _refused(await client.post("/v1/generate", json=BODY))
        assert body["details"] == (
            "the engine holds 2 generate requests, its 1 slots and 1 waiting places "
            "(--max-waiting-requests): retry later"
        )
    for resp in (first, second):
        stream = parse(resp.status, await resp.read())
        stream.check_framing()
        assert stream.completed
    await until(lambda: not client.server.app[STATE].streams, what="the streams ended")
    again = await client.post("/v1/generate", json=BODY)
    assert again.status == 200 and parse(200, await again.read()).completed


def _size(body: dict[str, Any]) -> int:
    """A body's bytes as aiohttp's `json=` sends it: what the tokenizer bound counts."""
    return len(json.dumps(body).encode())


async def test_characters_queued_for_the_tokenizer_are_bounded(
    aiohttp_client: Any, tiny_model: models.LoadedModel
) -> None:
    """The tokenizer thread busy (a gate): a request within the bound queues, one that would
    take the queue past it is refused (429) for generate and tokenize alike; the gate opened,
    the queued one is answered and the queue takes work again."""
    queued_body = {"prompt": "abcdefgh"}
    more = {**BODY, "prompt": "xyz"}
    bound = _size(queued_body) + _size(more) - 1
    app = create_app(tiny_model, max_tokenizer_chars=bound)
    client = await aiohttp_client(app)
    state = app[STATE]
    gate = threading.Event()
    busy = state.tokenizer_pool.submit(gate.wait)
    try:
        queued = asyncio.ensure_future(client.post("/v1/tokenize", json=queued_body))
        await until(lambda: state.tokenizer_chars == _size(queued_body), what="the prompt queued")
        body = await _refused(await client.post("/v1/generate", json=more))
        assert body["details"] == (
            f"the tokenizer has {_size(queued_body)} characters queued: {_size(more)} more "
            f"would pass its {bound} (--max-tokenizer-chars): retry later"
        )
        long_enough = {"prompt": "x" * bound}
        assert _size(queued_body) + _size(long_enough) > bound
        await _refused(await client.post("/v1/tokenize", json=long_enough))
        assert state.generating == 0  # the refused generate request holds no place
    finally:
        gate.set()
    await asyncio.wrap_future(busy)
    resp = await queued
    assert resp.status == 200 and (await resp.json())["count"] > 0
    assert state.tokenizer_chars == 0
    resp = await client.post("/v1/generate", json=more)
    assert resp.status == 200 and parse(200, await resp.read()).completed


async def test_a_prompt_longer_than_the_tokenizer_bound_is_taken_when_nothing_waits(
    aiohttp_client: Any, tiny_model: models.LoadedModel
) -> None:
    """The bound is on the queue, not on one prompt (the body size bounds that): a long
    prompt on an idle tokenizer is served."""
    client = await aiohttp_client(create_app(tiny_model, max_tokenizer_chars=4))
    resp = await client.post("/v1/generate", json={**BODY, "prompt": "Hello there, world"})
    assert resp.status == 200 and parse(200, await resp.read()).completed


def test_serve_help_documents_the_bounds() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "generation", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    squeezed = " ".join(out.split())
    assert "--max-waiting-requests" in squeezed and "(default 4096" in squeezed
    assert "--max-tokenizer-chars" in squeezed and "(default 67108864" in squeezed


@pytest.mark.parametrize("flags", [(), ("--no-api-process",)])
async def test_a_replica_process_bounds_waiting_requests(flags: tuple[str, ...]) -> None:
    """Both layouts of `python -m generation serve` (the API process knows its core's slots):
    one slot and no waiting place, the slot held by a stalled stream (a fault: the gate), the
    next request is refused with 429 before any byte."""
    args = ("--max-batch-size", "1", "--max-waiting-requests", "0", *flags)
    with start_engine_subprocess(device=TEST_DEVICE, fault_injection=True, extra_args=args) as e:
        async with aiohttp.ClientSession() as session:
            armed = await session.post(
                f"{e.url}/admin/faults", json={"after_tokens": 1, "mode": "stall"}
            )
            assert armed.status == 200
            stalled = await session.post(f"{e.url}/v1/generate", json=BODY)
            assert stalled.status == 200
            await stalled.content.readline()  # its first token: it holds the slot
            body = await _refused(await session.post(f"{e.url}/v1/generate", json=BODY))
            assert body["details"].startswith("the engine holds 1 generate requests, its 1 slots")
            stalled.close()
