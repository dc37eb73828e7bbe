"""A value padded past the seam walk's raw bound is never released raw (DESIGN 4.6a, 4.6b).

A redacting span detector's windows carry the unreleased tail of a whitespace-free run forward,
counting characters of the normalised view, but a walk steps over at most SEAM_RAW_CHARS
original characters (each call judges the carry again: an unbounded one is quadratic). On
4bc51b7 a value padded with more than about 8,192 characters of markup or invisible ones
between its visible parts (`jo` + `<b></b>` x 1300 + `@example.com`, the output of a model told
to write it so) had its head released before its tail arrived, and both went out raw: the
client's renderer showed `jo@example.com`. A cut inside such a run (mostly hidden characters,
no whitespace) now redacts the run (`obfuscated`) instead of releasing it as judged.

End to end: the real orchestrator on 127.0.0.1, a fake native engine answering each prompt
with its own script token by token, the shipped `regex` built-in as the enforced redacting
`pii` guardrail; every string of every event the client gets is checked, on the FMS streaming
endpoint and on Chat Completions. The property test drives the pipeline's own machinery
(`run_stream`: chunker, DetectorQueue, aggregator, redactor) over padding kinds, amounts and
token sizes."""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from detectors.normalise import view_text
from orchestrator.streaming.detector_queue import OBFUSCATED, SEAM_RAW_CHARS
from tests.fakes.engine import FakeEngine
from tests.openai_support import raw_chunks
from tests.orchestrator_support import MODEL, Orchestrator, frames, terminal
from tests.test_pipeline_disguised_text import disguised_config, strings
from tests.test_pipeline_redaction_seams import pii, registry, run_stream

# what hides between a value's visible characters: each shows nothing (DESIGN 4.6b)
PADS = {
    "tags": "<b></b>",
    "zero-width": "\u200b",
    "soft-hyphen": "\u00ad",
    "comment": "<!---->",
    # spaces inside a tag are no whitespace, even where a window's walk starts or ends in it
    "attributes": '<span class="x">',
}
RAW_PADDING = 2 * SEAM_RAW_CHARS + 1000  # past both walks' raw bounds (the head is released)

# (head, tail, what the client may see in their place, text no event may hold)
VALUES = {
    "email": ("Mail jo", "@example.com now.", "email", ("jo", "example", "@")),
    "phone": ("Call 555", "-123-4567 now.", "phone", ("555", "123", "4567")),
}


def padded(value: str, pad: str, raw: int = RAW_PADDING) -> str:
    head, tail, _, _ = VALUES[value]
    return head + pad * (raw // len(pad)) + tail


def tokens(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


SCRIPTS = {
    f"{value} {pad} {size}": tokens(padded(value, PADS[pad]), size)
    for value in VALUES
    for pad in PADS
    for size in (1, 4, 7)
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def serve(on_detection: str) -> AsyncIterator[Orchestrator]:
    engine = FakeEngine(script_for=lambda prompt: SCRIPTS[prompt])
    await engine.start()
    config = disguised_config(engine.url)
    config["detectors"]["pii"]["on_detection"] = on_detection
    # `pii` alone on the output: a blocking `hap` would block the padded run as well
    config["models"][MODEL]["guardrails"]["output"] = {"pii": {}}
    config["models"][MODEL]["limits"] = {"max_new_tokens": 16_384}  # 1 character per token
    try:
        async with Orchestrator(config) as orch:
            yield orch
    finally:
        await engine.close()


@pytest.fixture
async def orch() -> AsyncIterator[Orchestrator]:
    async for orch in serve("redact"):
        yield orch


@pytest.fixture
async def blocking() -> AsyncIterator[Orchestrator]:
    async for orch in serve("block"):
        yield orch


def check_hidden(value: str, released: str, sent: str) -> None:
    """The run is redacted as obfuscated, or the value as itself (a window that held all of
    it), and no visible part of the value is in any field."""
    head, _, entity, parts = VALUES[value]
    word = head.split()[0]
    assert released in (f"{word} [obfuscated] now.", f"{word} [{entity}] now."), released[:200]
    for part in parts:
        i = sent.find(part)
        assert i < 0, (part, sent[max(0, i - 200) : i + 100])


@pytest.mark.parametrize("size", [1, 4, 7])
@pytest.mark.parametrize("pad", list(PADS))
@pytest.mark.parametrize("value", list(VALUES))
async def test_a_value_padded_past_the_raw_bound_is_not_released_raw(
    orch: Orchestrator, value: str, pad: str, size: int
) -> None:
    prompt = f"{value} {pad} {size}"
    budget = len(SCRIPTS[prompt])
    events = await orch.stream(
        {"model_id": MODEL, "inputs": prompt, "text_gen_parameters": {"max_new_tokens": budget}}
    )
    assert terminal(events).name == "completed"
    released = "".join(f.get("generated_text") or "" for f in frames(events))
    check_hidden(value, released, "".join(strings([e.data for e in events])))
    found = [d for f in frames(events) for d in f["token_classification_results"].get("output", [])]
    assert found and all(d["redacted"] and d["detector_id"] == "pii" for d in found)

    chunks = await raw_chunks(
        orch,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": budget,
            "stream": True,
        },
        path="/v1/chat/completions",
    )
    assert chunks[-1] == "[DONE]"
    content = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks[:-1]
        if isinstance(c, dict) and c.get("choices")
    )
    # (a chunk's random id and its timestamp may hold any digits)
    fields = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks[:-1]]
    check_hidden(value, content, "".join(strings(fields)))


@pytest.mark.parametrize("size", [1, 7])
@pytest.mark.parametrize("pad", ["tags", "zero-width", "attributes"])
@pytest.mark.parametrize("value", list(VALUES))
async def test_a_blocking_guardrail_blocks_a_value_padded_past_the_raw_bound(
    blocking: Orchestrator, value: str, pad: str, size: int
) -> None:
    """A blocking detector posts a clean chunk once the text after it filled the boundary's
    window; on 4bc51b7 the raw bound filled it inside the padding, and the value's head went
    out before its tail was judged. A cut there now blocks (`obfuscated`)."""
    prompt = f"{value} {pad} {size}"
    budget = len(SCRIPTS[prompt])
    events = await blocking.stream(
        {"model_id": MODEL, "inputs": prompt, "text_gen_parameters": {"max_new_tokens": budget}}
    )
    end = terminal(events)
    assert end.name == "incomplete" and end.data["incomplete_details"] == {
        "reason": "content_filter"
    }
    sent = "".join(strings([e.data for e in events]))
    for part in VALUES[value][3]:
        assert part not in sent, part
    [done] = [e.data for e in events if e.name == "refusal.done"]
    # the run at the raw bound, or the value itself where one window happened to hold it whole
    # (how much text a window holds depends on how the tokens were batched: not the clock's to
    # decide what this test asserts)
    entity = VALUES[value][2]
    flagged = {d["entity"] for d in done["detections"]}
    assert flagged & {OBFUSCATED, entity}, done


# -- the property, on the pipeline's own machinery ---------------------------------------------


ATTACK = padded("email", "<b></b>")[5:]  # jo<b></b>...@example.com now.


@st.composite
def padded_value(draw: st.DrawFn) -> tuple[str, str]:
    """A value, and it with padding of any kind and amount (up to three times the raw bound)
    between its visible characters."""
    value = draw(st.sampled_from(["jo@example.com", "555-123-4567"]))
    pad = draw(st.sampled_from([*PADS.values(), "\u2060", "&shy;"]))
    chars = list(value)
    for _ in range(draw(st.integers(1, 2))):
        at = draw(st.integers(1, len(chars) - 1))
        chars.insert(at, pad * (draw(st.integers(1, 3 * SEAM_RAW_CHARS)) // len(pad)))
    return value, "".join(chars)


@st.composite
def padded_stream(draw: st.DrawFn) -> tuple[list[str], str, list[str]]:
    """One or two padded values in a sentence (two runs can meet in one window), split into
    tokens of one size."""
    pairs = draw(st.lists(padded_value(), min_size=1, max_size=2))
    text = "Say " + " and ".join(p for _, p in pairs) + draw(st.sampled_from([" now.", ".", ""]))
    size = draw(st.integers(1, 9))
    return [v for v, _ in pairs], text, tokens(text, size)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(case=(["jo@example.com"], ATTACK, tokens(ATTACK, 4)), max_chars=500)
@given(case=padded_stream(), max_chars=st.sampled_from([16, 500]))
def test_a_padded_value_is_redacted_or_its_run_is(
    case: tuple[list[str], str, list[str]], max_chars: int
) -> None:
    """For any padding, amount and token size: what the client's renderer shows of the released
    text never holds a value (the value is redacted, or the run it is in is)."""
    values, _, deltas = case

    async def one() -> None:
        released = "".join(f.text for f in await run_stream(deltas, [pii()], registry(max_chars)))
        shown = view_text(released)
        for value in values:
            assert value not in shown, shown[:200]
            assert value.replace("-", "") not in shown.replace("-", "")

    asyncio.run(one())


# -- what must not trip it: runs that show what they hold --------------------------------------

_RNG = random.Random(7)
PLAIN_RUNS = {
    "base64": base64.b64encode(_RNG.randbytes(9_000)).decode(),
    "percent-escaped URL": "https://example.com/q?" + "%41%2C%5A%7E" * 900,
    "UTF-8 percent-escaped URL": "https://example.com/wiki/" + "caf%C3%A9_%E2%80%93_" * 500,
    "emoji ZWJ sequences": "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466" * 1500,
    "CJK prose": "".join(chr(_RNG.randint(0x4E00, 0x9FFF)) for _ in range(5_000)),
    # markup alone shows nothing, so hides no value's head
    "minified SVG": '<svg viewBox="0 0 24 24">'
    + "".join(f'<path d="M{i} {i}L{i + 3} {i + 5}z" fill="#{i:06x}"/>' for i in range(400)),
    "minified HTML with words": "".join(
        f'<div class="card"><h2>Item {i}</h2><p class="d">A nice thing.</p></div>'
        for i in range(300)
    ),
}


@pytest.mark.parametrize("name", list(PLAIN_RUNS))
def test_a_long_run_that_shows_what_it_holds_is_released_as_it_is(name: str) -> None:
    """base64, URLs of escapes, emoji, CJK prose, markup alone: a whitespace-free run past the
    raw bound whose visible characters are not few, or which shows nothing, is no obfuscated
    value; streamed 16 characters a token, it goes out unredacted."""
    text = f"Here: {PLAIN_RUNS[name]} done."

    async def one() -> list[Any]:
        return await run_stream(tokens(text, 16), [pii()], registry(500), paced=True)

    released = asyncio.run(one())
    assert "".join(f.text for f in released) == text
    assert not [d for f in released for d in f.detections]


# -- inputs: the whole text is there, but a blocking detector still judges chunks and windows --


@pytest.mark.parametrize("pad", ["tags", "zero-width", "attributes"])
@pytest.mark.parametrize("value", list(VALUES))
async def test_a_prompt_padded_past_the_raw_bound_is_refused_by_a_blocking_input_guardrail(
    blocking: Orchestrator, value: str, pad: str
) -> None:
    """A blocking span detector judges an input's chunks and a window across each `max_chars`
    cut; before this, a window cut at the raw bound inside the padding held neither the value's
    head nor its tail whole, and the prompt reached the model. It is refused now, the run
    reported `obfuscated` (and the value found whole in the windows merged across its cuts:
    text_judgement._merged); the content endpoint reports it too."""
    prompt = padded(value, PADS[pad], raw=5 * SEAM_RAW_CHARS)  # cut several times
    events = await blocking.stream({"model_id": MODEL, "inputs": prompt})
    end = terminal(events)
    assert end.name == "incomplete" and end.data["incomplete_details"] == {
        "reason": "content_filter"
    }, end
    assert not any(f.get("generated_text") for f in frames(events))  # the model never asked
    [found] = [f["token_classification_results"]["input"] for f in frames(events)]
    # each blocking input guardrail (`hap` looks across the cuts too: a curse hides alike)
    got = sorted((d["detector_id"], d["entity"], d["start"], d["end"]) for d in found)
    # and the value itself: the windows across its cuts overlap, and merged they read it whole
    kind = VALUES[value][2]
    whole = ("pii", kind, len("Call "), len(prompt) - len(" now."))
    want = sorted([*((i, OBFUSCATED, 0, len(prompt)) for i in ("hap", "pii")), whole])
    assert got == want, got
    status, body = await blocking.post(
        "/api/v2/text/detection/content", {"detectors": {"pii": {}}, "content": prompt}
    )
    assert status == 200, body
    assert OBFUSCATED in {d["detection"] for d in body["detections"]}, body
