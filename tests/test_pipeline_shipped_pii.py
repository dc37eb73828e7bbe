"""The shipped config.yaml's enforced `pii` guardrail (issue 34: `pii_ner`, PII beyond
patterns) on every surface: the prompt reaches the engine with the names and places masked,
and the answer reaches the client masked (`[person]`, `[location]`, `[phone]`), streamed
token by token across the entities or whole, on FMS, Chat Completions and Responses."""

from __future__ import annotations

import pytest

from tests.fakes.engine import FakeEngine, prompt_text
from tests.openai_support import RESPONSES_PATH, raw_chunks, raw_events
from tests.orchestrator_support import Orchestrator
from tests.test_docs_readme import shipped_config

MODEL = "smollm2-135m"
PROMPT = "I am Angela Merkel from Berlin, what is my number?"
# token cuts inside the name and the number
SCRIPT = [
    "Call",
    " Angela",
    " Mer",
    "kel",
    " in",
    " Berl",
    "in",
    " at",
    " 555-",
    "123-",
    "4567",
    ".",
]
ANSWER = "Call [person] in [location] at [phone]."
MASKED_PROMPT = "I am [person] from [location], what is my number?"


async def answer(orch: Orchestrator, surface: str) -> str:
    """The answer text the client reads on `surface`."""
    messages = [{"role": "user", "content": PROMPT}]
    if surface == "fms":
        body = {"model_id": MODEL, "inputs": PROMPT, "text_gen_parameters": {"max_new_tokens": 60}}
        events = await orch.stream(body)
        return "".join(e.data.get("generated_text", "") for e in events if e.name is None)
    if surface == "chat-stream":
        body = {"model": MODEL, "messages": messages, "stream": True}
        chunks = await raw_chunks(orch, body, "/v1/chat/completions")
        return "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if isinstance(c, dict) and c.get("choices")
        )
    if surface == "chat":
        status, reply = await orch.post(
            "/v1/chat/completions", {"model": MODEL, "messages": messages}
        )
        assert status == 200, reply
        return reply["choices"][0]["message"]["content"]
    if surface == "responses-stream":
        events = await raw_events(orch, {"model": MODEL, "input": PROMPT})
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    status, reply = await orch.post(RESPONSES_PATH, {"model": MODEL, "input": PROMPT})
    assert status == 200, reply
    return "".join(part["text"] for item in reply["output"] for part in item.get("content", []))


async def shipped_answer(engine: FakeEngine, surface: str) -> str:
    """The answer on `surface` of the shipped config in front of `engine`."""
    await engine.start()
    try:
        async with Orchestrator(shipped_config(engine.url)) as orch:
            # ready: the spaCy model loaded and judged once (a request before that waits
            # for the load; on 2 busy cores it can outlast the detector's timeout)
            await orch.info_until(lambda status, _: status == 200)
            return await answer(orch, surface)
    finally:
        await engine.close()


@pytest.mark.parametrize("surface", ["fms", "chat-stream", "chat", "responses-stream", "responses"])
async def test_the_shipped_pii_masks_names_places_and_numbers_on_every_surface(
    surface: str,
) -> None:
    engine = FakeEngine(script=SCRIPT)
    got = await shipped_answer(engine, surface)
    assert got == ANSWER
    prompts = [prompt_text(r.body) for r in engine.requests]
    assert prompts and all(MASKED_PROMPT in p and "Merkel" not in p for p in prompts), prompts


# first names the model alone misses (tests/test_detectors_person_names.py), cut by tokens
CENSUS_SCRIPT = ["Todd", " was", " here,", " ask", " Lo", "gan", "."]


@pytest.mark.parametrize("surface", ["fms", "chat-stream"])
async def test_the_shipped_pii_masks_a_census_first_name_the_model_misses(surface: str) -> None:
    """The gazetteer beside the model (detectors/person_names.py): `Todd` and `Logan`, which
    spaCy's small model reads as no entity, reach the client masked."""
    got = await shipped_answer(FakeEngine(script=CENSUS_SCRIPT), surface)
    assert got == "[person] was here, ask [person]."


@pytest.mark.parametrize("surface", ["fms", "chat-stream", "responses-stream"])
async def test_as_a_blocking_guardrail_it_releases_nothing_of_a_name(surface: str) -> None:
    """The shipped config with its output `pii` set to block (DESIGN 4.6): the sentence before
    the name goes out, the one that holds it is not sent (nor the number after it), and the
    stream ends for a content filter."""
    script = ["Fine", ".", " Ask", " Angela", " Mer", "kel", ".", " Call", " 555-", "123-", "4567"]
    engine = FakeEngine(script=script)
    await engine.start()
    config = shipped_config(engine.url)
    config["models"][MODEL]["guardrails"]["output"]["pii"]["on_detection"] = "block"
    try:
        async with Orchestrator(config) as orch:
            await orch.info_until(lambda status, _: status == 200)
            if surface == "fms":
                body = {"model_id": MODEL, "inputs": "Hi"}
                events = await orch.stream(body)
                got = "".join(e.data.get("generated_text", "") for e in events if e.name is None)
                assert [e.name for e in events if e.name is not None][-1] == "incomplete"
            elif surface == "chat-stream":
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
                chunks = await raw_chunks(orch, {**body, "stream": True}, "/v1/chat/completions")
                choices = [
                    c["choices"][0] for c in chunks if isinstance(c, dict) and c.get("choices")
                ]
                got = "".join(ch["delta"].get("content") or "" for ch in choices)
                assert choices[-1]["finish_reason"] == "content_filter"
            else:
                events = await raw_events(orch, {"model": MODEL, "input": "Hi"})
                got = "".join(
                    e["delta"] for e in events if e["type"] == "response.output_text.delta"
                )
                assert events[-1]["type"] == "response.incomplete"
    finally:
        await engine.close()
    assert got == "Fine."


# an answer that streams two addresses token by token, cut inside the street, the city and
# the codes
ADDRESS_SCRIPT = [
    "Ship",
    " it",
    " to",
    " 1600",
    " Pennsyl",
    "vania",
    " Avenue",
    " NW,",
    " Washing",
    "ton,",
    " DC",
    " 205",
    "00",
    " or",
    " 221",
    "B",
    " Baker",
    " Street,",
    " London",
    " NW1",
    " 6X",
    "E",
    ".",
]


@pytest.mark.parametrize("surface", ["fms", "chat-stream", "chat", "responses-stream"])
async def test_the_shipped_pii_masks_a_street_address_as_one_span(surface: str) -> None:
    """A street address with its city, state and ZIP code (or postcode) goes as one
    `[address]`: no house number, ZIP code or postcode is left behind, whatever the tokens."""
    got = await shipped_answer(FakeEngine(script=ADDRESS_SCRIPT), surface)
    assert got == "Ship it to [address] or [address]."


# the same answer plain and disguised (DESIGN 4.6b): a tag inside the name, em dashes as the
# number's separators, a character reference for the `@`, a control character in the name
DISGUISES = {
    "plain": ["Call", " John", " Sm", "ith", " at", " 555-", "123-", "4567", " or", " jo@", "example.com", "."],
    "disguised": ["Call", " J<b></b>o", "\x07hn", " Sm", "ith", " at", " 555\u2014", "123\u2014", "4567", " or", " jo&#64;", "example.com", "."],
}  # fmt: skip


@pytest.mark.parametrize("form", list(DISGUISES))
@pytest.mark.parametrize("surface", ["fms", "chat-stream", "responses-stream"])
async def test_the_shipped_pii_masks_disguised_values_like_plain_ones(
    surface: str, form: str
) -> None:
    got = await shipped_answer(FakeEngine(script=DISGUISES[form]), surface)
    assert got == "Call [person] at [phone] or [email]."


# IBANs as a model writes them that the shipped guardrail let through on 7c96083: followed by
# a word in capitals (the candidate ran on into it and failed its check), in lower case, or
# grouped with dashes
IBAN_SCRIPTS = {
    "capitals-after": ["Pay", " DE89", " 3704 0044", " 0532 0130 00", " TODAY", "."],
    "lower-case": ["Pay", " de89 3704", " 0044 0532 0130 00", " today", "."],
    "dashes": ["Pay", " DE89-3704-0044", "-0532-0130-00", " today", "."],
}


@pytest.mark.parametrize("name", list(IBAN_SCRIPTS))
async def test_the_shipped_pii_masks_an_iban_as_a_model_writes_it(name: str) -> None:
    got = await shipped_answer(FakeEngine(script=IBAN_SCRIPTS[name]), "fms")
    assert got == "Pay [iban] " + IBAN_SCRIPTS[name][-2].strip() + "."
