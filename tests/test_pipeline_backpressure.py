"""A guarded stream whose handler stops pulling stops reading the engine.

The engine reader feeds the chunkers itself where detectors gate the frames, so only verdicts
reach the inbox; the reader must still wait while the consumer has not taken them, or a client
that stops reading would let the orchestrator read (and judge) the whole answer into memory.
Ordering comes from gates (the inbox filling up, every detector answered), never from delays."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

import detectors
from orchestrator.clients.backends import ReplicatedModelBackend
from orchestrator.clients.detectors import InProcessDetectorClient
from orchestrator.clients.generation import GenerationParams, GenerationRequest
from orchestrator.clients.registry import ChunkerRegistry, RequestedDetector
from orchestrator.config import DetectorConfig, parse_config
from orchestrator.streaming.events import Frame, Terminal
from orchestrator.streaming.guarded_generation import MAX_UNJUDGED_CHARS, GuardedGeneration
from tests.fakes.engine import FakeEngine, until
from tests.orchestrator_support import MODEL, native_config

SENTENCES = 3000
SCRIPT = [piece for i in range(SENTENCES) for piece in (f" Line {i}", " ends", ".")]
INBOX = 16  # the pipeline's max_buffered_chunks here


def pii_detector() -> RequestedDetector:
    client = InProcessDetectorClient(
        "pii", DetectorConfig(builtin="regex"), detectors.build("regex")
    )
    return RequestedDetector("pii", client, "sentence", 0.5, "annotate", {})


@pytest.fixture
async def long_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(script=SCRIPT)
    await engine.start()
    yield engine
    await engine.close()


async def test_a_stalled_handler_stops_the_engine_read(long_engine: FakeEngine) -> None:
    config = parse_config(native_config(long_engine.url))
    async with aiohttp.ClientSession() as session:
        backend = ReplicatedModelBackend(MODEL, config.models[MODEL], session)
        await backend.start()
        try:
            generation = GuardedGeneration(
                backend=backend,
                request=GenerationRequest(
                    "go", GenerationParams(max_new_tokens=len(SCRIPT)), request_id="stalled"
                ),
                inputs="go",
                masks=None,
                input_detectors=[],
                output_detectors=[pii_detector()],
                chunkers=ChunkerRegistry(config.chunkers),
                timeout_s=600,
                max_buffered_chunks=INBOX,
            )
            events = generation.events()
            first = await anext(events)
            assert isinstance(first, Frame) and first.start == 0
            # the handler stops pulling: verdicts pile up until the reader waits for it (the
            # detectors keep up, so their own bound, MAX_UNJUDGED_CHARS, is not what holds it)
            inbox = generation._inbox
            detection = generation._detection
            stream = generation._stream
            assert detection is not None and stream is not None
            await until(lambda: inbox.reader_held, timeout_s=30)
            read = len(stream.token_ids)
            # a bounded distance: the verdicts the consumer has not taken, plus what was
            # handed to the detector before the reader stopped
            assert detection.length - detection.released <= (INBOX + 1) * 64 + MAX_UNJUDGED_CHARS
            assert read < len(SCRIPT) // 4
            # pulling again resumes the stream, and nothing was lost
            text = first.text
            async for event in events:
                if isinstance(event, Frame):
                    assert event.start == len(text)
                    text += event.text
                else:
                    assert isinstance(event, Terminal)
            assert text == "".join(SCRIPT)
            assert generation.terminal is not None and generation.terminal.kind == "completed"
        finally:
            await backend.close()
