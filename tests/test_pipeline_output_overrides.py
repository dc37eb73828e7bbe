"""An output stream's chunks are read after the bidi overrides open where they start (DESIGN
4.6b), as an input's are (`open_overrides`, text_judgement.py).

A right-to-left override reverses what follows it up to the paragraph's end, across every chunk
after the one it is in. On 7c96083 each output chunk was judged alone: a model (told to by an
attacker) opened an override in one sentence and wrote `moc.elpmaxe@oj` in the next, which a
reader sees as `jo@example.com`; the chunk holding it had no override, its logical order is no
e-mail, and an enforced blocking (or redacting) `pii` guardrail let it out raw.

End to end: the real orchestrator on 127.0.0.1, a fake native engine streaming the answer one
character per token, the shipped `regex` built-in as the enforced output guardrail, on sentence
chunks (and on `max_chars` cuts inside the value, which a seam window looks across). The engine
waits after the first sentence until its frame reached the client, so the second is judged in a
call of its own (two chunks in one call read as one text, whatever the code does).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chunkers import Span
from detectors.api import Detection
from detectors.normalise import open_overrides, reversed_runs
from orchestrator.clients.detectors import InProcessDetectorClient
from orchestrator.clients.registry import RequestedDetector
from orchestrator.config import DetectorConfig
from orchestrator.streaming import detector_queue
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    Orchestrator,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    terminal,
)
from tests.test_orchestrator_fms import release_after_first_frame
from tests.test_pipeline_redaction_seams import REGEX, registry, run_stream

RLO = "\u202e"
# a reader sees `jo@example.com` (and `jo@first.last.mail.example.com`); in logical order
# neither is an e-mail (the regex detector finds nothing in either, read alone)
SHORT = "moc.elpmaxe@oj"
LONG = "moc.elpmaxe.liam.tsal.tsrif@oj"


# the override, then more text than a seam window looks back over (SEAM_CHARS visible characters
# and the whitespace-free run there): no cut after an override is natural (`chunkers.natural_cut`),
# and a window that reached back to the override read the value as shown before the fix too
OPENING = f"Sure {RLO}here. It is a fine day, and the sun is out over the hills and the old town."


def answer(value: str) -> str:
    """The override in the first sentence, the reversed value two sentences later."""
    return f"{OPENING} Mail {value} now. Bye."


def enforced(on_detection: str, engine: FakeEngine, max_chars: int) -> dict[str, Any]:
    pii = {"builtin": "regex", "chunker_id": "sentence", "on_detection": on_detection}
    return native_config(
        engine.url,
        detectors={"pii": pii},
        chunkers={"sentence": {"type": "sentence", "max_chars": max_chars}},
        model={"guardrails": {"output": {"pii": {}}}},
    )


async def stream(on_detection: str, value: str, max_chars: int) -> list[Any]:
    text = answer(value)
    # the chunker knows the second sentence ended once the next word is whole, and the first
    # sentence's window then reached far enough past its end for its frame to go out
    engine = FakeEngine(script=list(text), hold_after=len(f"{OPENING} Mail "))
    await engine.start()
    try:
        async with Orchestrator(enforced(on_detection, engine, max_chars)) as orch:
            return await orch.stream(
                generation_body(params={"max_new_tokens": len(text)}),
                on_event=release_after_first_frame(engine),
            )
    finally:
        await engine.close()


@pytest.mark.parametrize(("value", "max_chars"), [(SHORT, 500), (LONG, 16)], ids=["chunk", "seam"])
async def test_a_value_reversed_by_an_earlier_chunks_override_is_blocked(
    value: str, max_chars: int
) -> None:
    events = await stream("block", value, max_chars)
    released = assert_contiguous(frames(events))
    text = answer(value)
    at = text.index(value)
    assert released and text.startswith(released) and len(released) <= at, released
    assert [e.name for e in events if e.name][-3:] == [
        "refusal.delta",
        "refusal.done",
        "incomplete",
    ]
    assert terminal(events).data["incomplete_details"] == {"reason": "content_filter"}
    [refusal] = [e for e in events if e.name == "refusal.done"]
    # (a refusal names the detection, not the flagged characters: DESIGN 4.6a)
    found = [(d["start"], d["end"], d["word"], d["entity"]) for d in refusal.data["detections"]]
    assert found == [(at, at + len(value), "", "email")]


@pytest.mark.parametrize(("value", "max_chars"), [(SHORT, 500), (LONG, 16)], ids=["chunk", "seam"])
async def test_a_value_reversed_by_an_earlier_chunks_override_is_redacted(
    value: str, max_chars: int
) -> None:
    events = await stream("redact", value, max_chars)
    assert assert_contiguous(frames(events)) == answer("[email]")
    assert terminal(events).name == "completed"
    found = [
        (d["start"], d["end"], d["word"], d.get("redacted"))
        for f in frames(events)
        for d in f.get("token_classification_results", {}).get("output", [])
    ]
    at = answer("").index(" now")
    assert found == [(at, at + len("[email]"), "[email]", True)]


# -- property: every piece a stream's detector judges reads as it does inside the whole text ----

CONTROLS = [
    "\u202e",
    "\u202d",
    "\u202a",
    "\u202b",
    "\u202c",
    "\u2066",
    "\u2067",
    "\u2068",
    "\u2069",
]
PIECES = [*CONTROLS, "\n", " ", ". ", "ab", "jo@example.com", SHORT, "555-123-4567", "4 1"]
DAY = "It is a fine day, and the sun is out over the hills. "
PIECES.append(DAY)  # windows that start mid-stream


class Echo(type(REGEX)):  # type: ignore[misc]
    """The regex detector (its seams and tails), answering each content with one detection of
    all of it below any threshold: nothing is flagged, and `kept_findings` gets the content
    with the stream span it was judged for."""

    async def detect(self, contents: list[str], params: dict[str, Any] | None = None) -> Any:
        return [
            [
                Detection(
                    start=0, end=len(c), text=c, detection="echo", detection_type="echo", score=0.0
                )
            ]
            for c in contents
        ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(["ab ", RLO, DAY, DAY, DAY], list(range(0, 170, 5)), 16, "s", "block")  # seam windows
@example(["ab ", RLO, DAY, DAY, DAY], list(range(0, 170, 5)), 16, "s", "redact")  # carried ones
@given(
    parts=st.lists(st.sampled_from(PIECES), min_size=1, max_size=14),
    cuts=st.lists(st.integers(0, 200), max_size=12),
    max_chars=st.sampled_from([5, 16, 500]),
    chunker=st.sampled_from(["s", "w"]),
    on_detection=st.sampled_from(["annotate", "redact", "block"]),
)
def test_each_piece_is_read_after_the_controls_open_in_the_whole_stream(
    parts: list[str],
    cuts: list[int],
    max_chars: int,
    chunker: str,
    on_detection: str,
) -> None:
    """Whatever the tokens, chunker and path (a chunk alone, a blocking detector's seam window,
    a redacting detector's carried window): the content judged for stream span `[s, e)` is
    `open_overrides(text, [s])` (what an input's piece at `s` is read after) then `text[s:e]`,
    and it shows the characters of `[s, e)` that the whole text shows reversed, reversed."""
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    seen: list[tuple[int, int, str]] = []
    real = detector_queue.kept_findings

    def spy(detector: Any, span: Span, detections: list[Detection]) -> Any:
        seen.extend((span.start, span.end, d.text) for d in detections if d.detection == "echo")
        return real(detector, span, detections)

    client = InProcessDetectorClient("pii", DetectorConfig(builtin="regex"), Echo())
    det = RequestedDetector("pii", client, chunker, 0.5, on_detection, {})  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(detector_queue, "kept_findings", spy)
        asyncio.run(run_stream(deltas, [det], registry(max_chars), []))
    assert seen
    whole = {i for a, b in reversed_runs(text) for i in range(a, b)}
    for start, end, content in seen:
        opened, piece = (
            content[: len(content) - (end - start)],
            content[len(content) - (end - start) :],
        )
        assert piece == text[start:end]
        assert opened == open_overrides(text, [start])[0], (text, start, content)
        shown = {start + i - len(opened) for a, b in reversed_runs(content) for i in range(a, b)}
        assert shown - set(range(start)) == {i for i in whole if start <= i < end}, (text, start)
