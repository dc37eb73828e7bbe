"""Chunks must tile the text (DESIGN 5): text a chunker leaves out of its chunks is text its
detectors never judge, so a chunker that drops some (a bug: no chunk for a tail, a gap, an
overlap) ends the request with `chunker_error` before any of that text is released
(DESIGN 4.4: frames never carry text some requested detector has not judged).

The real orchestrator on 127.0.0.1 with a fake native engine and a fake remote detector; the
built-in chunkers tile every text (tests/test_chunkers*.py), so the dropped tail is a chunker
made to lose its flushed chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import chunkers.base
from orchestrator.app import CONTENT_PATH, STREAMING_PATH
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    Orchestrator,
    frames,
    generation_body,
    native_config,
    remote,
    sse_events,
    terminal,
)

# the last sentence has no end: the sentence chunker gives it only at flush
SCRIPT = ["Hello", " there", ".", " My", " secret", " is", " out"]


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add("secrets", DetectorBehaviour(words={"secret": 0.9}, detection="secret"))
    server.add("whole", DetectorBehaviour())
    await server.start()
    yield server
    await server.close()


@pytest.fixture
def flush_loses_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sentence, paragraph and words chunkers' flush gives nothing (it judged the end of
    the text as no chunk)."""
    monkeypatch.setattr(chunkers.base.Pipeline, "flush", lambda self: [])


def config(engine: FakeEngine, dets: FakeDetectorServer) -> dict:
    """`secrets` (sentence chunks) blocks, `whole` (the whole text at the end) blocks too and
    flags nothing: it alone judges the tail the sentence chunker drops."""
    detectors = {
        "secrets": {**remote(dets.url, "sentence"), "on_detection": "block"},
        "whole": {**remote(dets.url, "whole_doc_chunker"), "on_detection": "block"},
    }
    return native_config(
        engine.url,
        detectors=detectors,
        model={"guardrails": {"output": {"secrets": {}, "whole": {}}}},
    )


async def test_a_tail_no_chunk_holds_is_never_released(dets, flush_loses_its_chunks) -> None:
    """Repro: `secrets` finished having judged `Hello there.`; `whole` judged the whole text,
    and the aggregator, which waits for finished detectors no longer, released ` My secret is
    out` past the blocking guardrail that never saw it."""
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    try:
        async with Orchestrator(config(engine, dets)) as orch:
            assert orch.session is not None
            async with orch.session.post(orch.url + STREAMING_PATH, json=generation_body()) as r:
                assert r.status == 200
                raw = await r.read()
    finally:
        await engine.close()
    assert b"secret" not in raw
    events = sse_events(raw.decode())
    # `whole` holds every frame back until it has judged the end: nothing went out
    assert frames(events) == []
    assert terminal(events).name == "error"
    assert terminal(events).data == {
        "code": 500,
        "details": "chunker `sentence`: ChunkGap: its chunks end at 12 of 29 characters",
        "type": "chunker_error",
    }


async def test_an_input_no_chunk_holds_is_refused(dets, flush_loses_its_chunks) -> None:
    """The batch form too: a chunker whose `chunk` leaves text out fails the request."""
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    try:
        async with Orchestrator(config(engine, dets)) as orch:
            status, body = await orch.post(
                CONTENT_PATH, {"content": "My secret is out", "detectors": {"secrets": {}}}
            )
    finally:
        await engine.close()
    assert (status, body) == (
        500,
        {
            "code": 500,
            "details": "chunker `sentence`: ChunkGap: its chunks end at 0 of 16 characters",
            "type": "chunker_error",
        },
    )
