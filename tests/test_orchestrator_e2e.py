"""End to end with nothing faked: the orchestrator starts two real engine processes
(`tiny-random`), runs the real built-in detectors (`regex`, `profanity`) in-process, and a client
reads the SSE stream over a real socket. The serving replica is SIGKILLed mid-stream and the
client's frames must still concatenate to exactly the text of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from orchestrator.app import STREAMING_PATH
from tests.e2e_support import MODEL, all_healthy, e2e_config, faults, replicas
from tests.orchestrator_support import (
    Orchestrator,
    SseEvent,
    assert_contiguous,
    frames,
    generation_body,
    sse_events,
    terminal,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"max_new_tokens": 40}
SEEDED = {
    "max_new_tokens": 40,
    "decoding_method": "SAMPLING",
    "temperature": 0.9,
    "top_k": 50,
    "seed": 77,
}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def orch() -> AsyncIterator[Orchestrator]:
    async with Orchestrator(e2e_config()) as o:
        yield o


async def read_events(resp: aiohttp.ClientResponse) -> AsyncIterator[SseEvent]:
    buf = ""
    async for raw in resp.content:
        buf += raw.decode()
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            yield from_block(block)


def from_block(block: str) -> SseEvent:
    return sse_events(block + "\n\n")[0]


async def test_builtin_detectors_refuse_unsuitable_input(orch: Orchestrator) -> None:
    await all_healthy(orch)
    events = await orch.stream(
        generation_body(
            "Mail jo@example.com, you stupid fucking idiot.",
            input={"pii": {}, "hap": {}},
            model_id=MODEL,
        )
    )
    found = events[0].data["token_classification_results"]["input"]
    assert [(d["start"], d["end"], d["detector_id"], d["entity"]) for d in found] == [
        (0, 46, "hap", "profanity"),
        (5, 19, "pii", "email"),
    ]
    assert found[0]["score"] > 0.5
    assert terminal(events).name == "incomplete"


async def test_clean_input_streams_real_generation_through_real_detectors(
    orch: Orchestrator,
) -> None:
    await all_healthy(orch)
    events = await orch.stream(
        generation_body(
            "Hello there. How are you?",
            input={"pii": {}, "hap": {}},
            output={"pii": {}, "hap": {}},
            params=GREEDY,
            model_id=MODEL,
        )
    )
    fs = frames(events)
    text = assert_contiguous(fs)
    assert text
    assert all("output" in f["token_classification_results"] for f in fs)
    end = terminal(events)
    assert end.name in ("completed", "incomplete")
    assert end.data["processed_index"] == len(text)
    assert end.data["generated_token_count"] == fs[-1]["generated_token_count"]


async def stream_text(orch: Orchestrator, params: dict[str, Any]) -> tuple[str, SseEvent]:
    events = await orch.stream(
        generation_body("The quick brown fox", params=params, model_id=MODEL)
    )
    return assert_contiguous(frames(events)), terminal(events)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_sigkill_of_the_serving_replica_mid_stream_is_seamless(
    orch: Orchestrator, params: dict[str, Any]
) -> None:
    await all_healthy(orch)
    expected, end = await stream_text(orch, params)
    assert end.name in ("completed", "incomplete") and end.data["migrations"] == 0
    assert end.data["generated_token_count"] >= 12  # long enough to cut in the middle

    # Every replica stalls after 8 tokens, so the kill lands mid-stream whichever serves.
    for rep in await replicas(orch):
        await faults(orch, rep, {"after_tokens": 8, "mode": "stall", "times": 1})
    assert orch.session is not None
    body = generation_body("The quick brown fox", params=params, model_id=MODEL)
    got: list[SseEvent] = []
    async with orch.session.post(orch.url + STREAMING_PATH, json=body) as resp:
        assert resp.status == 200
        killed = False
        async for event in read_events(resp):
            got.append(event)
            if not killed and len(frames(got)) >= 3:
                reps = await replicas(orch)
                serving = next(r for r in reps if r["active"] == 1)
                for other in reps:
                    if other is not serving:
                        await faults(orch, other, None)  # the survivor must not stall too
                os.kill(serving["pid"], signal.SIGKILL)
                killed = True
    assert killed
    assert assert_contiguous(frames(got)) == expected
    final = terminal(got)
    assert final.name == end.name
    assert final.data["migrations"] == 1
    assert final.data["generated_token_count"] == end.data["generated_token_count"]
    assert json.dumps(final.data["finish_reason"]) == json.dumps(end.data["finish_reason"])
