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

from typing import Any

import pytest

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
