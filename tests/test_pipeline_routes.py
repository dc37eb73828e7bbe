"""Engine text takes one route through the guarded pipeline, whatever the output detectors: the
engine reader feeds the detection stage, which passes each chunk straight through without
detectors, releases frames at once without a gating detector, and holds them for the verdicts
with one. What every route must give: the frames' text concatenates to the generated text,
their indices are contiguous, exactly one frame is final (the last, with the finish reason and
the token counts the stream reported), and a handler that stops pulling stops the engine read
(the one backpressure channel, `Inbox.wait_space`). Ordering comes from gates, never from
delays."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import detectors
from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.clients.backends import ReplicatedModelBackend
from orchestrator.clients.detectors import InProcessDetectorClient
from orchestrator.clients.registry import ChunkerRegistry, RequestedDetector
from orchestrator.config import WHOLE_DOC_CHUNKER, DetectorConfig, parse_config
from orchestrator.streaming.events import Event, Frame, Terminal
from orchestrator.streaming.guarded_generation import GuardedGeneration
from tests.fakes.engine import FakeEngine, prompt_ids
from tests.orchestrator_support import MODEL, native_config
from tests.wait_support import until

REGEX = detectors.build("regex")


def pii(chunker: str, detector_id: str = "pii") -> RequestedDetector:
    client = InProcessDetectorClient(detector_id, DetectorConfig(builtin="regex"), REGEX)
    return RequestedDetector(detector_id, client, chunker, 0.5, "annotate", {})


# none: pass-through; gating: frames wait for the sentence verdicts; whole_doc: an annotating
# whole-document detector gates nothing (frames at once, its detections on the final frame)
DETECTOR_SETS = {
    "none": lambda: [],
    "gating": lambda: [pii("sentence")],
    "whole_doc": lambda: [pii(WHOLE_DOC_CHUNKER, "pii_doc")],
    "both": lambda: [pii("sentence"), pii(WHOLE_DOC_CHUNKER, "pii_doc")],
}


@dataclass
class World:
    loop: asyncio.AbstractEventLoop
    backend: ReplicatedModelBackend
    chunkers: ChunkerRegistry


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """One fake engine for every example: the prompt is the script, as JSON."""
    loop = asyncio.new_event_loop()
    engine = FakeEngine(script_for=json.loads)

    async def up() -> tuple[aiohttp.ClientSession, ReplicatedModelBackend]:
        await engine.start()
        config = parse_config(native_config(engine.url))
        session = aiohttp.ClientSession()
        backend = ReplicatedModelBackend(MODEL, config.models[MODEL], session)
        await backend.start()
        return session, backend

    session, backend = loop.run_until_complete(up())
    config = parse_config(native_config(engine.url))
    try:
        yield World(loop, backend, ChunkerRegistry(config.chunkers))
    finally:

        async def down() -> None:
            await backend.close()
            await session.close()
            await engine.close()

        loop.run_until_complete(down())
        loop.close()


def pipeline(
    world: World,
    script: list[str],
    max_new_tokens: int,
    output_detectors: list[RequestedDetector],
    inbox: int,
) -> GuardedGeneration:
    prompt = json.dumps(script)
    return GuardedGeneration(
        backend=world.backend,
        request=GenerationRequest(
            prompt, GenerationParams(max_new_tokens=max_new_tokens), request_id="route"
        ),
        inputs=prompt,
        masks=None,
        input_detectors=[],
        output_detectors=output_detectors,
        chunkers=world.chunkers,
        timeout_s=60,
        max_buffered_chunks=inbox,
    )


async def collect(events: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in events]


TOKENS = st.lists(
    st.sampled_from(["", " Hello", " world", ".", "!", "\n", " a@b.com", " é", "Line"])
    | st.text(max_size=4),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    script=TOKENS,
    max_new_tokens=st.integers(1, 50),
    detector_set=st.sampled_from(sorted(DETECTOR_SETS)),
    inbox=st.integers(1, 8),
)
def test_every_route_releases_the_generated_text_once_in_order(
    world: World, script: list[str], max_new_tokens: int, detector_set: str, inbox: int
) -> None:
    output_detectors = DETECTOR_SETS[detector_set]()
    guarded = pipeline(world, script, max_new_tokens, output_detectors, inbox)
    events = world.loop.run_until_complete(collect(guarded.events()))

    n = min(len(script), max_new_tokens)
    generated = "".join(script[:n])
    finish = "EOS_TOKEN" if n == len(script) else "MAX_TOKENS"
    *frames, terminal = events
    assert all(isinstance(f, Frame) for f in frames), events
    assert isinstance(terminal, Terminal) and terminal.error is None, terminal
    assert frames, "every stream has a final frame"
    position = 0
    for frame in frames:
        assert isinstance(frame, Frame)
        assert (frame.start, frame.end) == (position, position + len(frame.text))
        position = frame.end
        assert frame.judged == bool(output_detectors)
        assert frame.input_token_count == len(prompt_ids(json.dumps(script)))
    assert "".join(f.text for f in frames) == generated  # type: ignore[union-attr]
    *middle, last = frames
    assert isinstance(last, Frame)
    assert last.final and not any(f.final for f in middle)  # type: ignore[union-attr]
    assert (last.finish_reason, last.generated_token_count) == (finish, n)
    assert (terminal.finish_reason, terminal.generated_token_count) == (finish, n)
    assert terminal.processed_index == len(generated)
    if not output_detectors:  # pass-through: each engine chunk is its own frame
        want = [t for t in script[: n - 1] if t] + [script[n - 1]]
        assert [f.text for f in frames] == want  # type: ignore[union-attr]
    else:
        for f in frames:  # a sentence's detections ride on the frame that holds the sentence
            for d in f.detections:  # type: ignore[union-attr]
                if d.detector_id == "pii":
                    assert f.start <= d.start and d.end <= f.end  # type: ignore[union-attr]
        # the whole-document detector judged the whole text, once: on the final frame
        found = world.loop.run_until_complete(REGEX.detect([generated], {}))[0]
        got = sorted(
            (d.start, d.end)
            for f in frames
            for d in f.detections  # type: ignore[union-attr]
            if d.detector_id == "pii_doc"
        )
        spans = sorted((h.start, h.end) for h in found)
        if detector_set != "gating":
            assert got == spans
            assert all(
                d.detector_id != "pii_doc"
                for f in middle
                for d in f.detections  # type: ignore[union-attr]
            )


SENTENCES = 3000
LONG = [piece for i in range(SENTENCES) for piece in (f" Line {i}", " ends", ".")]
INBOX = 16


@pytest.fixture
async def long_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(script=LONG)
    await engine.start()
    yield engine
    await engine.close()


@pytest.mark.parametrize("detector_set", ["none", "whole_doc"])
async def test_a_stalled_handler_stops_the_engine_read_without_gating(
    long_engine: FakeEngine, detector_set: str
) -> None:
    """Frames the stage releases at once wait in the inbox like verdicts do: the reader stops
    while the handler does not pull (tests/test_pipeline_backpressure.py: the gated route)."""
    config = parse_config(native_config(long_engine.url))
    async with aiohttp.ClientSession() as session:
        backend = ReplicatedModelBackend(MODEL, config.models[MODEL], session)
        await backend.start()
        try:
            guarded = GuardedGeneration(
                backend=backend,
                request=GenerationRequest(
                    "go", GenerationParams(max_new_tokens=len(LONG)), request_id="stalled"
                ),
                inputs="go",
                masks=None,
                input_detectors=[],
                output_detectors=DETECTOR_SETS[detector_set](),
                chunkers=ChunkerRegistry(config.chunkers),
                timeout_s=600,
                max_buffered_chunks=INBOX,
            )
            events = guarded.events()
            first = await anext(events)
            assert isinstance(first, Frame) and first.start == 0
            inbox, stream = guarded._inbox, guarded._stream
            assert stream is not None
            await until(lambda: inbox.reader_held, what="the reader held")
            # the reader waits before a read once INBOX frames are untaken: at most one read
            # (INBOX chunks) past that, plus what the consumer took before the handler stopped
            assert len(stream.token_ids) <= 4 * INBOX
            text = first.text
            async for event in events:
                if isinstance(event, Frame):
                    assert event.start == len(text)
                    text += event.text
            assert text == "".join(LONG)
            assert guarded.terminal is not None and guarded.terminal.kind == "completed"
        finally:
            await backend.close()
