"""Issue 20, item 1: one request cannot take a detector away from the others (DESIGN 4.6b).

The attack: `"Hello there friend. " x N` (N well past the detector's max_queue of 1024 items) to
the content endpoint, or as FMS `inputs` with input detection, with the in-process `hap`
(profanity) detector. It used to fill the detector's global queue, so that every other request
using `hap` failed with detector_error "queue full". Here the big request is held in its first
forward pass (a gate in the real model's batch function) while a small request on the content
endpoint, an FMS generation stream and a chat completion stream (the official openai SDK) arrive
behind it; they must all succeed with exact results, and the small content request must ride in
the very next forward pass. Real server on 127.0.0.1, the real profanity model, a fake engine
speaking the native protocol; ordering by gates, never the clock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from orchestrator.app import CONTENT_PATH
from orchestrator.handlers.health import DETECTOR_HEALTH
from orchestrator.state import STATE
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    MODEL,
    SCRIPT,
    Orchestrator,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    terminal,
)
from tests.wait_support import finished, until

BIG = "Hello there friend. " * 5000  # 5000 sentences, 100,000 characters
RUDE = "You are a stupid fucking idiot."


class GatedModel:
    """Wraps the detector's real batch function: the first call waits at `gate` (a busy model)
    and every batch is recorded, so a test knows which items shared which forward pass."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.batches: list[list[str]] = []

    def __call__(self, items: list[str]) -> list[float]:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.batches.append(list(items))
        return self.forward(items)


@pytest.fixture
async def orch() -> AsyncIterator[Orchestrator]:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    # a generous detector timeout: 5000 sentences take many seconds on a loaded machine, and
    # this test is about fairness, not deadlines (the default is 10 s)
    # no kept verdicts (detection_cache): the big request's 5,000 equal sentences would be one
    # content, and the small requests' RUDE a hit, where this test needs them all in the model
    hap = {"builtin": "profanity", "chunker_id": "sentence", "timeout_s": 300, "cache": False}
    detectors = {"hap": hap}
    # no keep-alive comment while the gate holds the big stream, however slow the machine
    server = {"sse_keepalive_s": 3600}
    async with Orchestrator(native_config(engine.url, detectors=detectors, server=server)) as o:
        yield o
    await engine.close()


async def gate_hap(orch: Orchestrator) -> tuple[Any, GatedModel]:
    """The hap detector's batcher, its model gated, once the start-up warm-up call is done."""
    assert orch.runner is not None
    await finished(
        orch.runner.app[DETECTOR_HEALTH].warmed.wait(),
        60,
        "orch.runner.app[DETECTOR_HEALTH].warmed.wait()",
    )
    batcher = orch.runner.app[STATE].detectors.clients()["hap"]._detector.batcher
    model = GatedModel(batcher._fn)
    batcher._fn = model
    return batcher, model


def queued(batcher: Any, text: str) -> bool:
    """`text` waits in the batcher (its caller is admitted, its items not yet in a batch)."""
    return any(text in caller.items for caller in batcher._ring)


async def chat_stream(orch: Orchestrator) -> tuple[str, list[str]]:
    """A streamed chat completion through the official SDK with `hap` on its output."""
    client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi there"}],
        stream=True,
        extra_body={"detectors": {"output": {"hap": {}}}},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]


async def big_request(orch: Orchestrator, surface: str) -> tuple[int, Any]:
    if surface == "content":
        return await orch.post(CONTENT_PATH, {"content": BIG, "detectors": {"hap": {}}})
    events = await orch.stream(generation_body(BIG, input={"hap": {}}))
    return 200, events


@pytest.mark.parametrize("surface", ["content", "fms_input"])
async def test_a_big_request_does_not_take_hap_away_from_small_ones(
    orch: Orchestrator, surface: str
) -> None:
    # the small requests' exact answers, from an idle detector
    status, alone = await orch.post(CONTENT_PATH, {"content": RUDE, "detectors": {"hap": {}}})
    assert status == 200 and len(alone["detections"]) == 1
    batcher, model = await gate_hap(orch)

    big = asyncio.create_task(big_request(orch, surface))
    assert await asyncio.to_thread(model.entered.wait, 30), "the big request never reached hap"
    # all of it accepted, 32 of it in the model: 5,000 sentences, on either surface (a
    # classifier judges its chunks alone: no windows across their boundaries, issue 33; an
    # input had 4,999 more before)
    accepted = 5000
    assert batcher.outstanding == accepted
    small = asyncio.create_task(
        orch.post(CONTENT_PATH, {"content": RUDE, "detectors": {"hap": {}}})
    )
    stream = asyncio.create_task(orch.stream(generation_body(output={"hap": {}})))
    chat = asyncio.create_task(chat_stream(orch))
    # all three queued behind the big one: the sentence, and each stream's first sentence (or
    # both of its sentences in one call, when the engine was faster than the chunker's reader)
    await until(lambda: queued(batcher, RUDE) and batcher.outstanding >= accepted + 3, 60)
    model.gate.set()

    assert await small == (200, alone)
    events = await stream
    assert terminal(events).name == "completed", terminal(events).data
    assert assert_contiguous(frames(events)) == "I am great. What about you?"
    assert [f["start_index"] for f in frames(events)] == [0, 11]
    assert [f["token_classification_results"] for f in frames(events)] == [{"output": []}] * 2
    assert await chat == ("I am great. What about you?", ["stop"])
    # the small content request rode in the pass right after the big request's first one
    assert model.batches[0] == ["Hello there friend."] + [" Hello there friend."] * 31
    assert RUDE in model.batches[1]

    status, body = await big
    assert status == 200
    if surface == "content":
        assert body == {"detections": []}  # "Hello there friend." is clean
    else:
        assert terminal(body).name == "completed"
    assert sum(len(b) for b in model.batches) == accepted + 1 + 2 + 2
    assert batcher.outstanding == 0


async def test_a_request_arriving_into_a_full_detector_gets_429_overloaded() -> None:
    """Overload falls on the request that arrives into a full detector (DESIGN 4: `overloaded`,
    429 with Retry-After), never on the ones already waiting: with max_queue 2, a request while
    two single-sentence requests wait is refused, and both waiting ones succeed."""
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    hap = {
        "builtin": "profanity",
        "chunker_id": "sentence",
        "timeout_s": 300,
        "params": {"max_queue": 2},
    }
    try:
        async with Orchestrator(native_config(engine.url, detectors={"hap": hap})) as orch:
            batcher, model = await gate_hap(orch)
            body = {"content": RUDE, "detectors": {"hap": {}}}
            first = asyncio.create_task(orch.post(CONTENT_PATH, body))
            assert await asyncio.to_thread(model.entered.wait, 30)
            second = asyncio.create_task(orch.post(CONTENT_PATH, body))
            await until(lambda: batcher.admitted == 2, 30)
            assert orch.session is not None
            async with orch.session.post(orch.url + CONTENT_PATH, json=body) as resp:
                assert resp.status == 429, await resp.text()
                assert resp.headers["Retry-After"] == "1"
                assert await resp.json() == {
                    "code": 429,
                    "details": "detector `hap`: profanity: queue full (2 requests waiting, "
                    "2 of 2 queue slots in use)",
                    "type": "overloaded",
                }
            model.gate.set()
            (s1, b1), (s2, b2) = await first, await second
            assert (s1, s2) == (200, 200), (b1, b2)
            assert b1 == b2 and len(b1["detections"]) == 1
    finally:
        await engine.close()
