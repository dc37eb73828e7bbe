"""End to end with nothing faked: the orchestrator starts two real engine processes
(`tiny-random`), runs the real built-in detectors (`regex`, `profanity`) in-process, and a client
reads the SSE stream over a real socket. The serving replica is SIGKILLed mid-stream and the
client's frames must still concatenate to exactly the text of an uninterrupted run."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from orchestrator.app import STREAMING_PATH
from tests.e2e_support import (
    MODEL,
    all_healthy,
    engine_answer,
    kill_the_serving_replica,
    stall_every_replica,
)
from tests.orchestrator_support import (
    Orchestrator,
    SseEvent,
    assert_contiguous,
    frames,
    generation_body,
    sse_events,
    terminal,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"max_new_tokens": 40}
SEEDED = {
    "max_new_tokens": 40,
    "decoding_method": "SAMPLING",
    "temperature": 0.9,
    "top_k": 50,
    "seed": 77,
}


@pytest.fixture
def orch(e2e_orch: Orchestrator) -> Orchestrator:
    """The session's end-to-end deployment (conftest)."""
    return e2e_orch


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
    text = "Mail jo@example.com, you stupid fucking idiot."
    events = await orch.stream(generation_body(text, input={"pii": {}, "hap": {}}, model_id=MODEL))
    first, end = events
    found = first.data["token_classification_results"]["input"]
    # profanity's score is its classifier's probability: a float from sklearn, compared closely
    assert found[0]["score"] == pytest.approx(0.9999990818906392, rel=1e-6)
    assert first.data == {
        "token_classification_results": {
            "input": [
                {
                    "start": 0,
                    "end": 46,
                    "word": text,
                    "entity": "profanity",
                    "entity_group": "hap",
                    "detector_id": "hap",
                    "score": found[0]["score"],
                },
                {
                    "start": 5,
                    "end": 19,
                    "word": "jo@example.com",
                    "entity": "email",
                    "entity_group": "pii",
                    "detector_id": "pii",
                    "score": 1.0,
                },
            ]
        },
        "start_index": 0,
        "processed_index": 0,
        "input_token_count": 26,
        "warnings": [
            {
                "id": "UNSUITABLE_INPUT",
                "message": "Unsuitable input detected. Please check the detected entities on "
                "your input.",
            }
        ],
    }
    assert (end.name, end.data) == (
        "incomplete",
        {
            "generated_token_count": 0,
            "input_token_count": 26,
            "processed_index": 0,
            "migrations": 0,
            "incomplete_details": {"reason": "content_filter"},
        },
    )


async def test_clean_input_streams_real_generation_through_real_detectors(
    orch: Orchestrator,
) -> None:
    await all_healthy(orch)
    prompt = "Hello there. How are you?"
    events = await orch.stream(
        generation_body(
            prompt,
            input={"pii": {}, "hap": {}},
            output={"pii": {}, "hap": {}},
            params=GREEDY,
            model_id=MODEL,
        )
    )
    # the oracle: the engine's own greedy answer to the same prompt, without the orchestrator
    engine = await engine_answer(orch, MODEL, {"prompt": prompt, **GREEDY})
    # greedy tiny-random never samples EOS: it runs to its budget
    assert (engine["finish_reason"], engine["generated_token_count"]) == ("MAX_TOKENS", 40)
    fs = frames(events)
    assert assert_contiguous(fs) == engine["text"]
    # random text: nothing for the detectors to find, and every frame says so
    assert [f["token_classification_results"] for f in fs] == [{"output": []}] * len(fs)
    assert fs[-1]["generated_token_count"] == engine["generated_token_count"]
    end = terminal(events)
    assert (end.name, end.data) == (
        "incomplete",
        {
            "finish_reason": "MAX_TOKENS",
            "generated_token_count": engine["generated_token_count"],
            "input_token_count": engine["input_token_count"],
            "processed_index": len(engine["text"]),
            "migrations": 0,
            "incomplete_details": {"reason": "max_output_tokens"},
        },
    )


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
    await stall_every_replica(orch)
    assert orch.session is not None
    body = generation_body("The quick brown fox", params=params, model_id=MODEL)
    got: list[SseEvent] = []
    async with orch.session.post(orch.url + STREAMING_PATH, json=body) as resp:
        assert resp.status == 200
        killed = False
        async for event in read_events(resp):
            got.append(event)
            if not killed and len(frames(got)) >= 3:
                await kill_the_serving_replica(orch)
                killed = True
    assert killed
    assert assert_contiguous(frames(got)) == expected
    final = terminal(got)
    assert final.name == end.name
    assert final.data["migrations"] == 1
    assert final.data["generated_token_count"] == end.data["generated_token_count"]
    assert json.dumps(final.data["finish_reason"]) == json.dumps(end.data["finish_reason"])
