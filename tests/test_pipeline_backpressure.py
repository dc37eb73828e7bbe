"""The engine reader of a guarded stream feeds the chunkers itself where detectors gate the frames
(one wake-up per engine read, not two), so only verdicts reach the inbox. What that must not
change: a handler that stops pulling still stops the engine read (or a client that stops reading
would let the orchestrator read and judge the whole answer into memory), and a chunker that fails
still ends the stream with a chunker_error terminal. Ordering comes from gates (the reader waiting
for the consumer, every detector answered), never from delays."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

import detectors
from chunkers.base import Pipeline
from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.clients.backends import ReplicatedModelBackend
from orchestrator.clients.detectors import InProcessDetectorClient
from orchestrator.clients.registry import ChunkerRegistry, RequestedDetector
from orchestrator.config import DetectorConfig, parse_config
from orchestrator.streaming.events import Event, Frame, Terminal
from orchestrator.streaming.guarded_generation import MAX_UNJUDGED_CHARS, GuardedGeneration
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import MODEL, native_config
from tests.wait_support import until

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


@pytest.fixture
async def guarded(long_engine: FakeEngine) -> AsyncIterator[GuardedGeneration]:
    """A guarded stream of the whole script: the pii detector gates frames on sentences."""
    config = parse_config(native_config(long_engine.url))
    async with aiohttp.ClientSession() as session:
        backend = ReplicatedModelBackend(MODEL, config.models[MODEL], session)
        await backend.start()
        try:
            yield GuardedGeneration(
                backend=backend,
                request=GenerationRequest(
                    "go", GenerationParams(max_new_tokens=len(SCRIPT)), request_id="guarded"
                ),
                inputs="go",
                masks=None,
                input_detectors=[],
                output_detectors=[pii_detector()],
                chunkers=ChunkerRegistry(config.chunkers),
                timeout_s=600,
                max_buffered_chunks=INBOX,
            )
        finally:
            await backend.close()


async def rest(events: AsyncIterator[Event], text: str) -> str:
    """Pulls the stream to its end; the text of all frames, checked contiguous."""
    async for event in events:
        if isinstance(event, Frame):
            assert event.start == len(text)
            text += event.text
        else:
            assert isinstance(event, Terminal)
    return text


async def test_a_stalled_handler_stops_the_engine_read(guarded: GuardedGeneration) -> None:
    events = guarded.events()
    first = await anext(events)
    assert isinstance(first, Frame) and first.start == 0
    # the handler stops pulling: verdicts pile up until the reader waits for it (the
    # detectors keep up, so their own bound, MAX_UNJUDGED_CHARS, is not what holds it)
    inbox, detection, stream = guarded._inbox, guarded._detection, guarded._stream
    assert detection is not None and stream is not None
    await until(lambda: inbox.reader_held, deadline_s=30)
    read = len(stream.token_ids)
    # a bounded distance: the verdicts the consumer has not taken, plus what was handed to
    # the detector before the reader stopped
    assert detection.length - detection.released <= (INBOX + 1) * 64 + MAX_UNJUDGED_CHARS
    assert read < len(SCRIPT) // 4
    # pulling again resumes the stream, and nothing was lost
    assert await rest(events, first.text) == "".join(SCRIPT)
    assert guarded.terminal is not None and guarded.terminal.kind == "completed"


async def test_a_chunker_failing_in_the_reader_fails_the_stream(
    guarded: GuardedGeneration, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_feed = Pipeline.feed

    def feed(self: Pipeline, delta: str) -> list:  # type: ignore[type-arg]
        if "Line 40" in delta:  # a piece is never split across deltas
            raise ValueError("chunker bug")
        return real_feed(self, delta)

    monkeypatch.setattr(Pipeline, "feed", feed)
    events: list[Event] = []
    async for event in guarded.events():
        events.append(event)
    frames = [e for e in events if isinstance(e, Frame)]
    text = "".join(f.text for f in frames)
    terminal = guarded.terminal
    assert terminal is not None
    # DESIGN 4.7: `error` when no frame went out before it, `failed` after some
    assert terminal.kind == ("failed" if text else "error")
    assert terminal.error is not None and terminal.error.code == 500
    assert terminal.error.type == "chunker_error"
    assert terminal.error.message == "chunker `sentence`: ValueError: chunker bug"
    # only text judged before the failure went out: whole sentences, none from the failed delta
    assert text == "".join(SCRIPT)[: len(text)]
    assert text == "" or text.endswith(".")
    assert "Line 40" not in text
