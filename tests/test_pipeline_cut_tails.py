"""No tail oracle (DESIGN 4.6a, terminal events): a stream the model did not end itself (a token
budget, a time budget, a stop sequence) never releases the beginning of an entity that an
enforced redacting or blocking PII guardrail masks in the whole answer.

With deterministic decoding a client that sends the same request again with `max_tokens` 1, 2,
..., n gets the answer cut at every point; each cut released its tail raw unless it held enough
evidence of an entity for an open stream (`jo.smith`, `123-45-`, `4111 1111`, `555-`). Over real
sockets: the orchestrator on 127.0.0.1 with the built-in `regex` detector enforced on the model,
a fake native engine streaming a fixed answer (every entity one character per token), and raw
HTTP (FMS), the official `openai` SDK (Chat Completions, Responses) as clients, whose raw bytes
are recorded. A cut point is a hypothesis draw. What any response may show of an entity is its
first group and the character after it (`555`, `4111 `, `jo.`): a bare number or word at the end
of a cut answer is released (`in 2024`, `version 3.11`), which is also measured on benign text
(bench/cut_tails.py). At EOS the model chose the end: its answer is released as judged.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import requests
from hypothesis import example, given, settings
from hypothesis import strategies as st

import detectors
from detectors.regex_pii import open_tail
from orchestrator.clients.registry import RequestedDetector
from orchestrator.streaming.findings import Finding
from orchestrator.streaming.redaction import redact_text
from tests.fakes.engine import FakeEngine, Fault
from tests.openai_support import sdk
from tests.orchestrator_support import MODEL, Orchestrator, ServedStack, native_config, sse_events

EMAIL, PHONE, SSN, CARD = (
    "jo.smith@example.com",
    "555-123-4567",
    "123-45-6789",
    "4111 1111 1111 1111",
)
ENTITIES = [EMAIL, PHONE, SSN, CARD]
ANSWER = f"Mail {EMAIL} or call {PHONE} today. SSN {SSN}, card {CARD} is on file."
REDACTED = "Mail [email] or call [phone] today. SSN [ssn], card [credit_card] is on file."
BLOCKING = "fake-blocking"  # the same engine, its enforced `pii` blocks
STREAMING = "/api/v1/task/server-streaming-classification-with-text-generation"


def tokens(text: str) -> list[str]:
    """Words as tokens, every entity one character per token (a cut can fall anywhere in it)."""
    out: list[str] = []
    pos = 0
    for m in re.finditer("|".join(map(re.escape, ENTITIES)), text):
        out += re.findall(r"\s*\S+|\s+", text[pos : m.start()])
        out += list(m.group())
        pos = m.end()
    return out + re.findall(r"\s*\S+|\s+", text[pos:])


SCRIPT = tokens(ANSWER)


def head(entity: str) -> str:
    """What a cut answer may show of `entity`: its first group of letters or digits, and a
    space or dot after it (a number or word that ended, in prose)."""
    m = re.match(r"[A-Za-z0-9]+[ .]?", entity)
    assert m is not None
    return m.group()


def leaked(raw: str, whole: str) -> list[str]:
    """Pieces of the entities in `raw` longer than their `head`, that `whole` (the raw bytes of
    the whole answer's response on that surface, where the protocol's own words are:
    `chat.completion`, `response.content_part`) does not hold: every substring one character
    longer than the head that holds a separator (digits alone can be in an id)."""
    out = []
    for entity in ENTITIES:
        n = len(head(entity)) + 1
        for i in range(len(entity) - n + 1):
            piece = entity[i : i + n]
            if re.fullmatch("[A-Za-z0-9]+", piece) is None and piece in raw and piece not in whole:
                out.append(piece)
    return out


def cut_of(n: int) -> str:
    """The answer's first `n` tokens."""
    return "".join(SCRIPT[:n])


def expected(text: str) -> str:
    """`text`, a cut answer, as the enforced redactor releases it: its entities, and the
    beginning of one it ends in, replaced."""
    regex = detectors.build("regex")
    [hits] = asyncio.run(regex.detect([text], {}))
    tail = open_tail(text, cut=True)
    found = [Finding(h.start, h.end, h.text, h.detection, "pii", "pii", 1.0) for h in hits]
    if tail is not None and not any(f.start <= tail[0] and f.end >= len(text) for f in found):
        found.append(Finding(tail[0], len(text), text[tail[0] :], tail[1], "pii", "pii", 1.0))
    det = RequestedDetector("pii", None, "sentence", 0.5, "redact", {}, "[{entity}]")  # type: ignore[arg-type]
    return redact_text(text, sorted(found, key=lambda f: f.start), {"pii": det})[0]


# -- the stack: one engine, the `pii` guardrail enforced redacting on one model, blocking on the
# other; chunks of at most 16 characters (boundaries inside the entities)


def stack_config(engine_url: str) -> dict[str, Any]:
    cfg = native_config(
        engine_url,
        detectors={"pii": {"builtin": "regex", "chunker_id": "sentence"}},
        chunkers={"sentence": {"type": "sentence", "max_chars": 16}},
        model={"guardrails": {"output": {"pii": {"on_detection": "redact"}}}},
    )
    blocking = json.loads(json.dumps(cfg["models"][MODEL]))
    blocking["guardrails"] = {"output": {"pii": {"on_detection": "block"}}}
    cfg["models"][BLOCKING] = blocking
    return cfg


@pytest.fixture(scope="module")
def stack() -> Iterator[ServedStack]:
    engine = FakeEngine(script=SCRIPT)
    with ServedStack("cut-tails", lambda: stack_config(engine.url), [engine]) as s:
        yield s


@pytest.fixture(scope="module")
def wholes(stack: ServedStack) -> dict[str, str]:
    """Per surface, the raw bytes of the whole answer's responses (the model's EOS), redacted
    and refused: what the protocol says of itself, and all a client may know of the entities."""
    out = {}
    for name, surface in SURFACES.items():
        redacted = surface(stack, MODEL, len(SCRIPT))
        refused = surface(stack, BLOCKING, len(SCRIPT))
        assert redacted[1:] == (REDACTED, "stop")
        assert refused[2] == "content_filter"
        out[name] = redacted[0] + refused[0]
    return out


class Recording(httpx.BaseTransport):
    """An httpx transport that keeps every byte of every response body the SDK reads."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self.raw = bytearray()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        body = response.stream
        raw = self.raw

        class Stream(httpx.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for chunk in body:  # type: ignore[union-attr]
                    raw.extend(chunk)
                    yield chunk

            def close(self) -> None:
                body.close()  # type: ignore[union-attr]

        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=Stream(),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._inner.close()


def client(stack: ServedStack) -> tuple[openai.OpenAI, Recording]:
    recording = Recording()
    client_ = openai.OpenAI(
        base_url=stack.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=recording),
    )
    return client_, recording


def fms(stack: ServedStack, model: str, n: int) -> tuple[str, str, str]:
    """(raw body, released text, `stop`, `length` or `content_filter`) of the FMS stream cut
    after `n` tokens."""
    body = {"model_id": model, "inputs": "hi", "text_gen_parameters": {"max_new_tokens": n}}
    r = requests.post(stack.url + STREAMING, json=body, timeout=30)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    text = "".join(e.data.get("generated_text", "") for e in events if e.name is None)
    last = events[-1]
    if last.name == "completed":
        return r.text, text, "stop"
    assert last.name == "incomplete", last
    return r.text, text, REASONS[last.data["incomplete_details"]["reason"]]


def chat(stack: ServedStack, model: str, n: int) -> tuple[str, str, str]:
    """The same through Chat Completions (the official SDK, streaming)."""
    sdk, recording = client(stack)
    with sdk:
        stream = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=n
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [finish] = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return recording.raw.decode(), text, finish


def responses(stack: ServedStack, model: str, n: int) -> tuple[str, str, str]:
    """The same through the Responses API (the official SDK, streaming)."""
    sdk, recording = client(stack)
    with sdk:
        events = list(
            sdk.responses.create(model=model, input="hi", stream=True, max_output_tokens=n)
        )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    if last.type == "response.completed":
        return recording.raw.decode(), text, "stop"
    assert last.type == "response.incomplete", last
    assert last.response.incomplete_details is not None
    return recording.raw.decode(), text, REASONS[last.response.incomplete_details.reason or ""]


# how a surface says why a stream was cut: the budget, or a guardrail
REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}
SURFACES = {"fms": fms, "chat": chat, "responses": responses}
# the red team's cuts: `jo.smith`, `123-45-`, `4111 1111`, `555-`
RED_TEAM = [
    next(n for n in range(len(SCRIPT)) if cut_of(n) == ANSWER[:end])
    for end in (
        ANSWER.index(EMAIL) + len("jo.smith"),
        ANSWER.index(SSN) + len("123-45-"),
        ANSWER.index(CARD) + len("4111 1111"),
        ANSWER.index(PHONE) + len("555-"),
    )
]


def test_the_red_team_cuts_fall_where_they_said() -> None:
    ends = ["l jo.smith", "SN 123-45-", "4111 1111", "call 555-"]
    assert [cut_of(n)[-len(end) :] for n, end in zip(RED_TEAM, ends, strict=True)] == ends


def test_the_rule_masks_every_cut_of_the_answer_past_each_head() -> None:
    """Every cut point, on the rule alone (what the servers must release, `expected`): the
    hypothesis property below samples them through the servers. (Found by it: a card's first
    twelve digits and a space, `4111 1111 1111 `, a complete run of the digit-run pattern that
    is no card yet, were passed over as a match that ended.)"""
    assert [cut_of(n) for n in range(1, len(SCRIPT)) if leaked(expected(cut_of(n)), "")] == []


@settings(max_examples=120)
@given(
    n=st.integers(1, len(SCRIPT) - 1),
    surface=st.sampled_from(sorted(SURFACES)),
    blocking=st.booleans(),
)
@example(n=RED_TEAM[0], surface="chat", blocking=False)
@example(n=RED_TEAM[1], surface="responses", blocking=False)
@example(n=RED_TEAM[2], surface="fms", blocking=False)
@example(n=RED_TEAM[3], surface="chat", blocking=False)
@example(n=RED_TEAM[0], surface="fms", blocking=True)
@example(n=RED_TEAM[1], surface="chat", blocking=True)
@example(n=RED_TEAM[2], surface="responses", blocking=True)
@example(n=RED_TEAM[3], surface="fms", blocking=True)
def test_no_cut_releases_more_of_an_entity_than_its_head(
    stack: ServedStack, wholes: dict[str, str], n: int, surface: str, blocking: bool
) -> None:
    """Every cut point, every surface: the raw bytes hold no piece of an entity past its head;
    a redacting guardrail releases the cut answer with the entity it ends in replaced (exact
    text), a blocking one the text before it and a refusal."""
    raw, text, reason = SURFACES[surface](stack, BLOCKING if blocking else MODEL, n)
    assert leaked(raw, wholes[surface]) == []
    flagged = expected(cut_of(n)) != cut_of(n)
    assert reason == ("content_filter" if blocking and flagged else "length")
    if blocking:
        assert cut_of(n).startswith(text)
        return
    assert text == expected(cut_of(n))


def test_an_answer_cut_after_its_entities_is_the_redacted_answer(
    stack: ServedStack, wholes: dict[str, str]
) -> None:
    """The budget ends the answer before its last token (` file.`): nothing more is masked
    than in the whole answer."""
    for name, surface in SURFACES.items():
        raw, text, reason = surface(stack, MODEL, len(SCRIPT) - 1)
        assert (text, reason) == (REDACTED[: -len(SCRIPT[-1])], "length")
        assert leaked(raw, wholes[name]) == []


# -- the rule: a cut answer's tail that could be the beginning of an entity ---------------------


@pytest.mark.parametrize(
    ("text", "tail"),
    [
        # the red team's pieces
        ("Mail jo.smith", (5, "email")),
        ("SSN 123-45-", (4, "ssn")),
        ("card 4111 1111", (5, "credit_card")),
        ("call 555-", (5, "phone")),
        # more of the same: two digit groups, a group and a dash, a bracketed area code
        ("call 555 1", (5, "phone")),
        ("call 555.123", (5, "phone")),
        ("it took 117.98", None),  # (a decimal)
        ("from 1841-", None),
        ("call (555)", (5, "phone")),
        ("call (555", None),  # (a bracketed number: a head)
        ("1-2 cups, or 10-15", None),
        ("on 2025-01", None),
        ("from 2009-2011", None),
        ("card 4111-1111", (5, "credit_card")),
        ("card 4111 1111 1111 ", (5, "credit_card")),  # (12 digits: a run, no card yet)
        ("call +44 20", (5, "phone")),
        ("call 1 555", (5, "phone")),
        ("SSN 123-", (4, "phone")),  # (a phone and an SSN begin alike: the first kind names it)
        ("host 192.168", (5, "phone")),  # (a phone's dotted layout begins alike: the first kind)
        ("host 192.168.1", (5, "phone")),
        ("host 10.0.0", None),  # (what a head may show of an IPv4 address: its first groups)
        ("on 22.09.20", None),
        ("Mail jo+tag", (5, "email")),
        ("call promql_parser", None),
        ("see www.example.com", None),
        ("the U.S.", None),
        ("call `client.chat", None),
        ("Mail j.doe", (5, "email")),
        ("call five five five one", (5, "phone")),
        # the open-stream evidence is still reported
        ("Contact jo@", (8, "email")),
        ("Card 4111 1111 1", (5, "credit_card")),
        # released: a number or word that ended (a group alone, a decimal, a version), what
        # a head may show (`jo.`, `4111 `), a match already (the scan reports it)
        ("the answer is 42", None),
        ("in 2024", None),
        ("in 2024.", None),
        ("version 3.11", None),
        ("Python v3.11", None),
        ("it costs 1.5", None),
        ("call 555", None),
        ("card 4111 ", None),
        ("Mail jo", None),
        ("I spoke to jo.", None),
        ("Count: 1 2 3", None),
        ("a well-known", None),
        ("Call 555-123-4567", None),
        ("Contact jo@example.com", None),
        ("", None),
    ],
)
def test_open_tail_of_a_cut_answer(text: str, tail: tuple[int, str] | None) -> None:
    assert open_tail(text, cut=True) == tail


def test_a_kind_the_request_does_not_enable_is_not_withheld() -> None:
    assert open_tail("Mail jo.smith", ["phone"], cut=True) is None
    assert open_tail("call 555-", ["email"], cut=True) is None
    # a phone's first group has three digits at most (`1841-3` could only begin a card)
    assert open_tail("from 1841-3", ["phone"], cut=True) is None
    assert open_tail("from 1841-3", cut=True) == (5, "credit_card")


def test_the_detectors_answer_for_a_cut_answer() -> None:
    """`Detector.open_tail(..., cut=True)`: the regex detector's, and the `pii` detector's for
    its regex kinds (one rule for both)."""
    for builtin in ("regex", "pii_ner"):  # (pii_ner's model is not loaded for it)
        detector = detectors.build(builtin)
        tail = detector.open_tail("Mail jo.smith", cut=True)
        assert tail is not None and (tail.start, tail.end, tail.detection) == (5, 13, "email")
        assert detector.open_tail("Mail jo.smith") is None  # an open stream, or an EOS


@given(st.text(alphabet="0123456789 -.()+@_:/jo.smitexamplcSN\n", max_size=40))
def test_a_cut_answer_never_releases_what_an_open_stream_withholds(text: str) -> None:
    """The cut rule only adds: where the open-stream evidence withholds a tail, a cut answer
    withholds it too, from there or earlier."""
    held = open_tail(text)
    if held is not None:
        cut = open_tail(text, cut=True)
        assert cut is not None and cut[0] <= held[0]


# -- who ended the answer: the model (EOS) or not ------------------------------------------------


@pytest.mark.parametrize(
    ("finish_reason", "want", "finish"),
    [
        ("EOS_TOKEN", "Mail jo.smith", "stop"),  # the model's answer, as it wrote it
        ("MAX_TOKENS", "Mail [email]", "length"),
        ("TIME_LIMIT", "Mail [email]", "length"),
        ("STOP_SEQUENCE", "Mail [email]", "stop"),  # (an engine's own stop: a cut too)
    ],
)
async def test_only_an_answer_the_model_ended_releases_its_tail(
    finish_reason: str, want: str, finish: str
) -> None:
    engine = FakeEngine(script=list("Mail jo.smith"), finish_reason=finish_reason)
    await engine.start()
    try:
        async with Orchestrator(stack_config(engine.url)) as orch:
            client = sdk(orch)
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            chunks = [c async for c in stream]
    finally:
        await engine.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish


@pytest.mark.parametrize("mode", ["close", "error"])
async def test_a_stream_that_fails_inside_an_entity_releases_none_of_its_tail(mode: str) -> None:
    """A replica that dies inside the e-mail, and a migration that gives up (limit 0): the held
    tail is never released, whatever it holds (the failure ends the stream; only what was
    judged with text after it had left)."""
    head = "Hello there. All is fine so far, as you can see. Mail jo.smith"
    answer = head + "@example.com today."
    engine = FakeEngine(script=list(answer), fail=Fault(mode, after_tokens=len(head)))
    await engine.start()
    try:
        async with Orchestrator(stack_config(engine.url)) as orch:
            assert orch.session is not None
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with orch.session.post(orch.url + "/v1/chat/completions", json=body) as r:
                raw = await r.text()
    finally:
        await engine.close()
    # (an error before the first frame is a 503 body, after it an in-band one: either way)
    assert '"generation_unavailable"' in raw
    assert "jo." not in raw and "smith" not in raw
