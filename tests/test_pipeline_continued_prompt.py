"""An answer that continues the prompt's text is judged with the prompt's tail before it (DESIGN
4.6a): a raw prompt (the FMS task endpoints and generation-detection without the chat template,
completions-detection) is text the model goes on writing, so an entity the prompt starts and the model finishes is one
entity. On 82d0c00 an enforced output `pii` guardrail judged the answer alone: the prompt
`... is john.smith@` got `example.com is the address.` back, raw, whether the guardrail
redacted or blocked (the domain alone is no e-mail), and `Charge card 4111 1111 1111` got the
card's last group. What lies wholly in the prompt is the client's own text: it changes nothing
in the answer's verdicts.

The real orchestrator on 127.0.0.1, a fake native engine answering each prompt with its own
script (entities one character per token), the in-process `regex` detector as the model's
enforced output guardrail; raw bytes are checked for the model's part of the entity."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.app import (
    COMPLETIONS_DETECTION_PATH,
    GENERATION_DETECTION_PATH,
    STREAMING_PATH,
    UNARY_PATH,
)
from orchestrator.clients.backend import GenerationParams, GenerationRequest
from orchestrator.streaming.findings import Finding
from orchestrator.streaming.guarded_generation import continued_tail
from orchestrator.streaming.inbox import Inbox
from orchestrator.streaming.redaction import redact_text
from orchestrator.streaming.stream_judgement import Release, StreamJudge
from tests.fakes.engine import FakeEngine, prompt_text
from tests.fakes.openai_server import FakeOpenAI
from tests.openai_support import sdk
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    guarded_config,
    regex_pii,
    sse_events,
)
from tests.test_detectors_regex import GLUED
from tests.test_pipeline_redaction_seams import hits_and_tail, hostile, pii, registry

EMAIL_PROMPT = "The e-mail of John Smith is john.smith@"
CARD_PROMPT = "Charge card 4111 1111 1111"
CLEAN_PROMPT = "Write to jo@example.com and call 555-123-4567"
ANSWERS = {
    EMAIL_PROMPT: [*"example.com", " is", " the", " address", "."],
    CARD_PROMPT: [" ", *"1111", " today", "."],
    CLEAN_PROMPT: [" and", " ask", " nicely", "."],
}
# (prompt, what of the answer must never leave, the released text where `pii` redacts)
CASES = [
    (EMAIL_PROMPT, "example", "[email] is the address."),
    (CARD_PROMPT, "1111", "[credit_card] today."),
]


def config(engine_url: str, on_detection: str) -> dict[str, Any]:
    return guarded_config(engine_url, {"pii": regex_pii(on_detection=on_detection)})


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(script_for=lambda prompt: list(ANSWERS[prompt]))
    await fake.start()
    yield fake
    await fake.close()


async def raw(orch: Orchestrator, path: str, body: dict[str, Any]) -> str:
    assert orch.session is not None
    async with orch.session.post(orch.url + path, json=body) as r:
        text = await r.text()
        assert r.status == 200, text
        return text


async def released(orch: Orchestrator, surface: str, prompt: str, **params: Any) -> tuple[str, str]:
    """The raw reply and the answer text it released, on one surface."""
    if surface == "generation-detection":
        detect: dict[str, Any] = {"model_id": MODEL, "prompt": prompt, "detectors": {"pii": {}}}
        reply = await raw(orch, GENERATION_DETECTION_PATH, detect)
        return reply, json.loads(reply).get("generated_text") or ""
    if surface.startswith("fms"):
        body: dict[str, Any] = {"model_id": MODEL, "inputs": prompt}
        if params:
            body["text_gen_parameters"] = params
        if surface == "fms-stream":
            reply = await raw(orch, STREAMING_PATH, body)
            events = sse_events(reply)
            return reply, "".join(e.data.get("generated_text", "") for e in events if not e.name)
        reply = await raw(orch, UNARY_PATH, body)
        return reply, json.loads(reply).get("generated_text") or ""
    body = {"model": MODEL, "prompt": prompt}
    if "max_new_tokens" in params:
        body["max_tokens"] = params["max_new_tokens"]
    if surface == "completions-stream":
        reply = await raw(orch, COMPLETIONS_DETECTION_PATH, {**body, "stream": True})
        chunks = [
            json.loads(m.removeprefix("data: "))
            for m in reply.split("\n\n")
            if m.startswith("data: {")
        ]
        return reply, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reply = await raw(orch, COMPLETIONS_DETECTION_PATH, body)
    return reply, json.loads(reply)["choices"][0]["text"]


SURFACES = [
    "fms-stream",
    "fms-unary",
    "generation-detection",
    "completions-stream",
    "completions-unary",
]


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(("prompt", "secret", "redacted"), CASES, ids=["email", "card"])
async def test_an_entity_the_prompt_starts_and_the_answer_finishes_is_redacted(
    engine: FakeEngine, surface: str, prompt: str, secret: str, redacted: str
) -> None:
    async with Orchestrator(config(engine.url, "redact")) as orch:
        reply, text = await released(orch, surface, prompt)
    assert secret not in reply
    assert text == redacted
    assert prompt_text(engine.requests[-1].body) == prompt  # the engine continued it as sent


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(("prompt", "secret", "redacted"), CASES, ids=["email", "card"])
async def test_an_entity_the_prompt_starts_and_the_answer_finishes_is_blocked(
    engine: FakeEngine, surface: str, prompt: str, secret: str, redacted: str
) -> None:
    async with Orchestrator(config(engine.url, "block")) as orch:
        reply, text = await released(orch, surface, prompt)
    assert secret not in reply
    assert text == ""
    if surface == "fms-stream":
        events = sse_events(reply)
        [done] = [e.data for e in events if e.name == "refusal.done"]
        kind = "email" if prompt == EMAIL_PROMPT else "credit_card"
        # the span is the answer's part of the entity (the answer's text starts at 0)
        assert [(d["start"], d["entity"], d["word"]) for d in done["detections"]] == [(0, kind, "")]
        assert (events[-1].name, events[-1].data["incomplete_details"]) == (
            "incomplete",
            {"reason": "content_filter"},
        )
    elif surface == "completions-unary":
        assert json.loads(reply)["choices"][0]["finish_reason"] == "content_filter"


@pytest.mark.parametrize("on_detection", ["redact", "block"])
@pytest.mark.parametrize("surface", ["fms-stream", "completions-unary"])
async def test_an_entity_the_token_budget_leaves_open_after_the_prompt_is_withheld(
    engine: FakeEngine, on_detection: str, surface: str
) -> None:
    """` 11` ends the answer (max_new_tokens 3): with the prompt's `4111 1111 1111` before it,
    a card number that could still grow (DESIGN 4.6a: a tail that could grow into a match is
    redacted or withheld, never released raw)."""
    async with Orchestrator(config(engine.url, on_detection)) as orch:
        reply, text = await released(orch, surface, CARD_PROMPT, max_new_tokens=3)
    assert ' 11"' not in reply  # the answer's text, ` 11`, ending a JSON string
    assert text == ("[credit_card]" if on_detection == "redact" else "")


@pytest.mark.parametrize("on_detection", ["redact", "block"])
@pytest.mark.parametrize("surface", SURFACES)
async def test_an_entity_wholly_in_the_prompt_changes_nothing_in_the_answer(
    engine: FakeEngine, on_detection: str, surface: str
) -> None:
    """The e-mail and phone number before the answer are the client's own text: no detection,
    no redaction, no block of an answer that only follows them."""
    async with Orchestrator(config(engine.url, on_detection)) as orch:
        reply, text = await released(orch, surface, CLEAN_PROMPT)
    assert text == " and ask nicely."
    assert '"pii"' not in reply and "content_filter" not in reply


# -- a final assistant message the server continues (an operator forwards the field) ----------

CONTINUED = "Sure, his e-mail is john.smith@"


@pytest.fixture
async def continuing() -> AsyncIterator[tuple[FakeOpenAI, Orchestrator]]:
    """An `openai` chat backend (vLLM's traits) whose operator forwards `continue_final_message`,
    with `pii` enforced as redact on the answer."""
    server = FakeOpenAI(scripts={"Mail?": [CONTINUED, *"example.com", " then", "."]})
    await server.start()
    cfg = config(server.url, "redact")
    cfg["models"][MODEL]["backends"] = [
        {
            "type": "openai",
            "url": server.url,
            "model": MODEL,
            "api": "chat",
            "forward_fields": ["continue_final_message", "add_generation_prompt"],
        }
    ]
    try:
        async with Orchestrator(cfg) as orch:
            yield server, orch
    finally:
        await server.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_a_continued_assistant_message_is_judged_with_the_answer(
    continuing: tuple[FakeOpenAI, Orchestrator], stream: bool
) -> None:
    server, orch = continuing
    messages: Any = [
        {"role": "user", "content": "Mail?"},
        {"role": "assistant", "content": CONTINUED},
    ]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    client = sdk(orch)
    if stream:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=MODEL, messages=messages, stream=True, extra_body=extra
            )
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        raw = json.dumps([c.model_dump() for c in chunks])
    else:
        reply = await client.chat.completions.create(
            model=MODEL, messages=messages, extra_body=extra
        )
        text = reply.choices[0].message.content or ""
        raw = reply.model_dump_json()
    assert server.requests[-1]["continue_final_message"] is True  # the server continued it
    assert text == "[email] then."
    assert "example" not in raw


# -- property: the stage with a lead releases the answer's part of the whole text's redaction ---


def run_with_lead(
    prompt: str, deltas: list[str], on_detection: str, max_chars: int
) -> tuple[list[Release], list[list[Finding]]]:
    """StreamJudge with the lead the pipeline takes from `prompt` (`continued_tail`), driven as
    tests/test_pipeline_redaction_seams.py drives it; the releases and any block."""

    async def one() -> tuple[list[Release], list[list[Finding]]]:
        inbox = Inbox(10_000)
        lead = continued_tail(GenerationRequest(prompt=prompt, params=GenerationParams()))
        stage = StreamJudge([pii(on_detection)], registry(max_chars), inbox, lead=lead)
        tasks: list[asyncio.Task[None]] = []
        stage.start(lambda coro: tasks.append(asyncio.create_task(coro)))
        frames: list[Release] = []
        blocked: list[list[Finding]] = []

        def take(messages: list[Any]) -> None:
            for m in messages:
                if blocked:
                    return
                verdict = stage.accept(m)
                frames.extend(verdict.releases)
                if verdict.blocked is not None:
                    blocked.append(verdict.blocked)

        try:
            for delta in deltas:
                frames.extend(stage.feed(delta))
                await asyncio.sleep(0)
                if inbox._items:
                    take(await inbox.take_all())
            stage.end()
            while not stage.done and not blocked:
                take(await inbox.take_all())
            if not blocked:
                frames.extend(stage.final_releases())
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return frames, blocked

    return asyncio.run(one())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=hostile,
    data=st.data(),
    max_chars=st.sampled_from([7, 16, 500]),
    on_detection=st.sampled_from(["redact", "block"]),
)
def test_the_answer_after_a_prompt_is_judged_as_the_whole_text_is(
    text: str, data: st.DataObject, max_chars: int, on_detection: str
) -> None:
    """Any text, cut anywhere into a prompt and an answer (itself split into any tokens): what
    the enforced `regex` detector finds in the whole text (its matches and the tail that could
    still grow into one), cut to the answer, is what is redacted in the answer, or blocks it
    before any of it leaves; matches wholly in the prompt change nothing."""
    k = data.draw(st.integers(0, len(text)), label="cut")
    prompt, answer = text[:k], text[k:]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(answer)), max_size=12), label="tokens"))
    bounds = [0, *cuts, len(answer)]
    deltas = [answer[a:b] for a, b in itertools.pairwise(bounds)]
    frames, blocked = run_with_lead(prompt, deltas, on_detection, max_chars)
    hits = [h for h in asyncio.run(hits_and_tail(text)) if h.end > k]
    released = "".join(f.text for f in frames)
    if on_detection == "block":
        assert answer.startswith(released)
        if hits:
            assert blocked, (prompt, answer, hits)
            assert len(released) <= max(0, min(h.start for h in hits) - k)
        elif not blocked:  # (a chunk can cut an entity loose from what hid it in the whole:
            # `555-123-4567123-45-6789` holds none, its chunk `123-45-6789` an SSN; a block
            # there fails closed, as tests/test_pipeline_redaction_seams.py allows)
            assert released == answer, (prompt, answer)
        return
    det = pii()
    findings = [
        Finding(max(h.start, k) - k, h.end - k, "", h.detection, h.detection_type, "pii", 1.0)
        for h in hits
    ]
    want, _ = redact_text(answer, findings, {"pii": det})
    assert released == want, (prompt, answer)


def test_a_span_two_labels_cover_takes_the_same_label_whatever_came_first() -> None:
    """`0@` then `555-123-4567`: the answer is a phone number and, after the prompt's tail, an
    e-mail that could still grow; both cover the whole answer, found in different orders by the
    stream and by the whole text, and the replacement must not depend on that order (hypothesis
    found `[phone]` streamed against `[email]` whole)."""
    frames, blocked = run_with_lead("0@", ["555-123-4567"], "redact", 7)
    assert not blocked
    assert "".join(f.text for f in frames) == "[email]"


# an e-mail in a whitespace-free run longer than a window's run bound (SEAM_RUN_CHARS): a
# 64-character local part `y_y_ ... jo` and a 183-character domain whose top-level label comes last
LONG_RUN = "y_" * 500 + "jo@" + "x1." * 60 + "com is it"


@pytest.mark.parametrize("token", [5, 40])
def test_an_email_a_long_run_cuts_is_redacted_whole(token: int) -> None:
    """On a38d58c a window of a run past its bound was cut 64 characters before its end,
    inside the e-mail, whose top-level label had not come yet: all of it left raw."""
    deltas = [LONG_RUN[i : i + token] for i in range(0, len(LONG_RUN), token)]
    frames, blocked = run_with_lead("", deltas, "redact", 16)
    assert not blocked
    assert "".join(f.text for f in frames) == LONG_RUN[:938] + "[email] is it"


def test_glued_addresses_past_the_domain_bound_are_redacted_as_the_whole_text_is() -> None:
    """Hypothesis's case: three addresses glued together, one delta, max_chars 16. On a38d58c
    the stream released everything after the first one raw, the whole text's third address
    (544, 1092) included."""
    frames, blocked = run_with_lead("", [GLUED], "redact", 16)
    assert not blocked
    assert "".join(f.text for f in frames) == "[email]" + GLUED[864:]


@pytest.mark.parametrize("surface", ["fms-stream", "completions-stream", "completions-unary"])
async def test_glued_addresses_never_leave_the_server_raw(
    glued_engine: FakeEngine, surface: str
) -> None:
    async with Orchestrator(config(glued_engine.url, "redact")) as orch:
        reply, text = await released(orch, surface, GLUED_PROMPT)
    assert text == " [email]" + GLUED[864:]
    assert "@" not in reply and "comjo" not in reply and "jo" not in text


GLUED_PROMPT = "The list:"


@pytest.fixture
async def glued_engine() -> AsyncIterator[FakeEngine]:
    """The glued addresses in 7-character tokens after a space."""
    tokens = [" ", *(GLUED[i : i + 7] for i in range(0, len(GLUED), 7))]
    fake = FakeEngine(script_for=lambda prompt: list(tokens))
    await fake.start()
    yield fake
    await fake.close()
