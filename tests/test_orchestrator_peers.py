"""A remote detector or engine is a peer we do not trust with our clients (DESIGN 6, last
paragraph), black-box over real sockets: its redirects are never followed, its error bodies go
to the operator's log and never to a client, and a detector reply with scores outside [0, 1],
spans outside the content, too many detections or too many bytes is a `detector_error`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchestrator.app import CONTENT_PATH, STREAMING_PATH, UNARY_PATH
from orchestrator.clients.advertised_limits import FIXED_SLACK_TOKENS, MESSAGE_SLACK_TOKENS
from orchestrator.clients.detectors import MAX_DETECTIONS_PER_CONTENT, reply_limit
from orchestrator.clients.migration import (
    MAX_CHARS_PER_TOKEN,
    TEMPLATE_ALLOWANCE_TOKENS,
    TEXT_ALLOWANCE_CHARS,
)
from tests.fakes.clock import manual_detector_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault, GatedEngine
from tests.fakes.openai_server import FakeOpenAI, OpenAIFault
from tests.openai_support import RESPONSES_PATH
from tests.orchestrator_support import (
    MODEL,
    SCRIPT,
    Orchestrator,
    frames,
    generation_body,
    guarded_config,
    native_config,
    remote,
    sse_events,
    stream_through,
    terminal,
)
from tests.wait_support import until

CHAT_PATH = "/v1/chat/completions"
# what a careless service shows its clients: an internal address and a password
SECRET = "db.internal:5432 auth failed for password=hunter2 at /srv/app.py line 3"
CONTENT = "Hello there."


def detector_error(detector_id: str, message: str) -> dict[str, Any]:
    return {
        "code": 502,
        "details": f"detector `{detector_id}`: {message}",
        "type": "detector_error",
    }


@pytest.fixture
async def evil() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    await server.start()
    yield server
    await server.close()


def one_detector(engine: FakeEngine, evil: FakeDetectorServer, **extra: Any) -> dict[str, Any]:
    return native_config(engine.url, detectors={"evil": remote(evil.url, **extra)})


def warnings_of(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# -- detectors: error bodies and redirects -------------------------------------------------------


async def test_a_detectors_error_body_is_logged_never_quoted(engine, evil, caplog) -> None:
    """Repro: `detector `evil`: HTTP 500: db.internal:5432 ... password=hunter2 ...` reached
    the client word for word, on every surface."""
    evil.add("evil", DetectorBehaviour(fail_status=500, error_body=SECRET))
    caplog.set_level(logging.WARNING)
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
        events = await orch.stream(generation_body(output={"evil": {}}))
        unary = await orch.post(UNARY_PATH, generation_body(input={"evil": {}}))
        chat = await orch.post(
            CHAT_PATH,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "detectors": {"output": {"evil": {}}},
            },
        )
        responses = await orch.post(
            RESPONSES_PATH, {"model": MODEL, "input": "Hi", "detectors": {"input": {"evil": {}}}}
        )
    expected = detector_error("evil", "HTTP 500")
    assert content == (502, expected)
    assert terminal(events).data == expected
    assert unary == (502, expected)
    assert chat[0] == 502
    assert chat[1]["error"]["message"] == expected["details"]
    assert responses[0] == 502
    assert responses[1]["error"]["message"] == expected["details"]
    assert SECRET in warnings_of(caplog)  # the operator sees it


async def test_a_detectors_redirect_is_not_followed(engine, evil) -> None:
    """Repro: a 302 was followed with a GET to wherever it pointed, and what that answered was
    judged (or shown) as the detector's reply."""
    evil.add("evil", DetectorBehaviour(redirect_to="/health"))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
    assert content == (502, detector_error("evil", "HTTP 302"))


async def test_a_detector_whose_health_redirects_is_unhealthy(engine, evil) -> None:
    """A redirect is an answer, not a 200 somewhere else: the health check does not follow
    it (to the engine's healthy `/health`, here)."""
    evil.add("evil", DetectorBehaviour())
    evil.health_redirect = engine.url + "/health"
    async with Orchestrator(one_detector(engine, evil)) as orch:
        _, body = await orch.info_until(lambda s, b: b["detectors"]["evil"]["status"] != "UNKNOWN")
    assert body["detectors"]["evil"]["status"] == "UNHEALTHY"


# -- detectors: replies out of range ----------------------------------------------------------


def detection(**fields: Any) -> dict[str, Any]:
    base = {"start": 0, "end": 5, "text": "Hello", "detection": "d", "detection_type": "t"}
    return {**base, "score": 0.5, **fields}


@pytest.mark.parametrize(
    ("found", "message"),
    [
        (detection(score=math.nan), "detection 0 of content 0: score nan is not in [0, 1]"),
        (detection(score=math.inf), "detection 0 of content 0: score inf is not in [0, 1]"),
        (detection(score=5.0), "detection 0 of content 0: score 5.0 is not in [0, 1]"),
        (detection(score=-1), "detection 0 of content 0: score -1.0 is not in [0, 1]"),
        (
            detection(start=-1),
            "detection 0 of content 0: span [-1, 5) lies outside its content of 12 characters",
        ),
        (
            detection(end=13),
            "detection 0 of content 0: span [0, 13) lies outside its content of 12 characters",
        ),
        (
            detection(start=6, end=5),
            "detection 0 of content 0: span [6, 5) lies outside its content of 12 characters",
        ),
    ],
    ids=["nan", "inf", "5.0", "-1", "start<0", "end>len", "start>end"],
)
async def test_an_out_of_range_detection_is_a_detector_error(engine, evil, found, message) -> None:
    evil.add("evil", DetectorBehaviour(reply=[[found]]))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
        events = await orch.stream(generation_body(output={"evil": {}}))
    assert content == (502, detector_error("evil", message))
    assert terminal(events).name == "error"


@pytest.mark.parametrize(
    ("found", "message"),
    [
        (detection(score="0.9"), "0.0.score: Input should be a valid number"),
        (detection(score=True), "0.0.score: Input should be a valid number"),
        (detection(start="0"), "0.0.start: Input should be a valid integer"),
        (detection(start=True), "0.0.start: Input should be a valid integer"),
        (detection(end=5.0), "0.0.end: Input should be a valid integer"),
    ],
    ids=["score-string", "score-bool", "start-string", "start-bool", "end-float"],
)
async def test_a_reply_of_the_wrong_types_is_a_detector_error(engine, evil, found, message) -> None:
    """The detector API's types are JSON's own (DESIGN 6; the FMS orchestrator's serde refuses
    anything else): a number in a string, or a boolean for a number, is a malformed reply, not
    a value to guess at. Repro: `"score": "0.9"`, `"score": true` (1.0) and `"start": true`
    (1) were taken as numbers."""
    evil.add("evil", DetectorBehaviour(reply=[[found]]))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
    assert content == (502, detector_error("evil", f"malformed reply ({message})"))


async def test_a_reply_for_contents_never_sent_is_a_detector_error(engine, evil) -> None:
    """Detections for a content index that was not sent (a reply longer than the contents):
    the reply is not matched to the contents by guessing, it is refused (DESIGN 4.7); the
    shorter reply is tests/test_orchestrator_streaming.py's `miscount`."""
    evil.add("evil", DetectorBehaviour(reply=[[], [detection()], []]))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
        events = await orch.stream(generation_body(output={"evil": {}}))
    assert content == (502, detector_error("evil", "returned 3 results for 1 contents"))
    # (the stream's first call holds one chunk or, on a loaded machine, both sentences)
    assert terminal(events).data["details"] in [
        f"detector `evil`: returned 3 results for {n} contents" for n in (1, 2)
    ]
    assert frames(events) == []


async def test_a_detections_text_is_its_spans_never_the_replys_own(engine, evil) -> None:
    """A detection's `text` is the text its span covers (DESIGN 6). Repro: the reply's own
    `text` was passed on, so a detector quoting something else there (another part of the
    chunk, which a redaction may have withheld) had it sent to the client as the `word`."""
    evil.add("evil", DetectorBehaviour(reply=[[detection(score=0.9, text=SECRET)]]))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        status, body = await orch.post(
            CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}}
        )
        events = await orch.stream(generation_body(output={"evil": {}}))
    assert status == 200
    assert [(d["start"], d["end"], d["text"]) for d in body["detections"]] == [(0, 5, "Hello")]
    found = [d for f in frames(events) for d in f["token_classification_results"]["output"]]
    assert [(d["start"], d["end"], d["word"]) for d in found] == [
        (0, 5, "I am "),
        (11, 16, " What"),
    ]
    assert SECRET not in json.dumps([e.data for e in events])


async def test_too_many_detections_for_one_content_is_a_detector_error(engine, evil) -> None:
    evil.add("evil", DetectorBehaviour(reply=[[detection()] * (MAX_DETECTIONS_PER_CONTENT + 1)]))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
    message = f"content 0 has {MAX_DETECTIONS_PER_CONTENT + 1} detections (at most "
    message += f"{MAX_DETECTIONS_PER_CONTENT})"
    assert content == (502, detector_error("evil", message))


async def test_exactly_the_bound_of_detections_is_accepted(engine, evil) -> None:
    evil.add("evil", DetectorBehaviour(reply=[[detection()] * MAX_DETECTIONS_PER_CONTENT]))
    async with Orchestrator(one_detector(engine, evil)) as orch:
        status, body = await orch.post(
            CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}}
        )
    assert status == 200
    assert len(body["detections"]) == MAX_DETECTIONS_PER_CONTENT


async def test_an_endless_reply_is_cut_at_its_bound(engine, evil) -> None:
    """Repro: the reply was read whole before it was parsed (300 MB of RSS for a 300 MB
    reply); it is read up to a bound proportional to what was sent, and the detector's
    connection is dropped there, long before its timeout."""
    evil.add("evil", DetectorBehaviour(endless=True))
    async with Orchestrator(one_detector(engine, evil, timeout_s=600)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
        await until(lambda: evil.cancelled == 1, what="the detector's reply abandoned")
    limit = reply_limit([CONTENT])
    assert content == (502, detector_error("evil", f"reply larger than {limit} bytes"))


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_reply_is_bounded_as_inflated(engine, evil, encoding) -> None:
    """A decompression bomb (1 MiB on the wire, 1 GiB inflated) is cut at the reply bound
    counted in inflated bytes, and the rest is never inflated: aiohttp (pinned at >= 3.13.3)
    inflates a body only as fast as it is read, so the orchestrator's peak memory stays far
    below the bomb's size."""
    evil.add("evil", DetectorBehaviour(bomb=encoding))
    tracemalloc.start()
    try:
        async with Orchestrator(one_detector(engine, evil, timeout_s=600)) as orch:
            content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
            await until(lambda: evil.cancelled == 1, what="the detector's reply abandoned")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    limit = reply_limit([CONTENT])
    assert content == (502, detector_error("evil", f"reply larger than {limit} bytes"))
    assert peak < 128 << 20, peak


@pytest.mark.parametrize(
    "behaviour",
    [DetectorBehaviour(bomb="br"), DetectorBehaviour(huge_header=True)],
    ids=["br", "huge-header"],
)
async def test_an_unreadable_reply_is_a_detector_error(engine, evil, behaviour) -> None:
    """A reply aiohttp cannot read (`br` without a brotli decoder, which none is installed; a
    header past aiohttp's 8 KiB bound) is the detector failing, told as such. Repro: it was
    `request failed: HTTP 400`, a status the detector never sent (aiohttp's parse error)."""
    evil.add("evil", behaviour)
    async with Orchestrator(one_detector(engine, evil)) as orch:
        content = await orch.post(CONTENT_PATH, {"content": CONTENT, "detectors": {"evil": {}}})
    assert content == (502, detector_error("evil", "request failed: unreadable HTTP reply"))


# astral (two UTF-16 units, four UTF-8 bytes) and accented (two UTF-8 bytes) characters before
# the entity: a span counted in either unit lands past it in code points
UNITS_SCRIPT = [
    "Caf\u00e9",
    " \U0001f600\U0001f600",
    " mail",
    " secretname@example.com",
    " now",
    " please",
    " write",
    ".",
]


# -- detectors: replies that are no reply --------------------------------------------------------


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        (
            DetectorBehaviour(html=True),
            "malformed reply (reply: Invalid JSON: expected value at line 1 column 1)",
        ),
        (DetectorBehaviour(cut_body=True), "request failed: connection lost mid-stream"),
        (DetectorBehaviour(trickle=True), "timed out after 1 s"),
    ],
    ids=["html", "cut-body", "trickle"],
)
async def test_a_reply_that_is_no_reply_fails_an_enforced_redaction_closed(
    behaviour, message, monkeypatch
) -> None:
    """A 200 that is an HTML page, a body cut mid-write, a body that trickles for ever (each
    byte in time for any idle timeout; the detector's timeout_s bounds the whole call): the
    detector has not judged the text, so an enforced redacting guardrail releases none of it
    and the client is told which detector failed, and how, in the stream's terminal event.
    The timeout runs on a manual clock: it ends the trickle when the test moves it past 1 s
    (and not at half of it), whatever the machine's speed."""
    clock = manual_detector_clock(monkeypatch)
    engine = FakeEngine(script=list(UNITS_SCRIPT))
    dets = FakeDetectorServer()
    dets.add("pii", behaviour)
    await engine.start()
    await dets.start()
    pii = {**remote(dets.url), "on_detection": "redact", "timeout_s": 1}
    config = guarded_config(engine.url, {"pii": pii})
    try:
        async with Orchestrator(config) as orch:
            reading = asyncio.create_task(orch.raw(STREAMING_PATH, generation_body()))
            if behaviour.trickle:
                await until(
                    lambda: dets.trickling >= 1 and clock.armed >= 1,
                    what="the detector trickling its reply",
                )
                armed = clock.armed
                clock.advance(0.5)
                assert clock.armed == armed and dets.cancelled == 0  # within timeout_s
                clock.advance(0.5)
                assert clock.armed < armed  # timeout_s is up: the call's bound fires
            status, raw = await reading
        if behaviour.trickle:  # the call was dropped, not left trickling
            await until(lambda: dets.cancelled >= 1, what="the trickling reply abandoned")
    finally:
        await dets.close()
        await engine.close()
    assert status == 200
    assert b"secretname" not in raw and b"mail" not in raw
    events = sse_events(raw.decode())
    assert frames(events) == []
    assert terminal(events).name == "error"
    assert terminal(events).data == detector_error("pii", message)


async def test_an_empty_span_a_redactor_flags_fails_closed() -> None:
    """A redacting detector's passing detection of no characters (`[0, 0)`: a remote
    classifier that gives its verdict without a place) cannot be redacted. Repro: the whole
    sentence went out raw past the enforced redacting guardrail, with a warning and the
    detection beside it. It is a detector_error: what the detector flagged is not released."""
    dets = FakeDetectorServer()
    flag = detection(start=0, end=0, text="", detection="toxic", score=0.99)
    dets.add("pii", DetectorBehaviour(reply=[[flag]]))
    await dets.start()
    pii = {**remote(dets.url), "on_detection": "redact"}
    try:
        _, raw = await stream_through(
            list(UNITS_SCRIPT), lambda url: guarded_config(url, {"pii": pii}), generation_body()
        )
    finally:
        await dets.close()
    assert b"secretname" not in raw and b"mail" not in raw
    events = sse_events(raw.decode())
    assert frames(events) == []
    message = "detection span [0, 0) covers no text: a redacting detector cannot redact it"
    assert terminal(events).data == detector_error("pii", message)


# -- detectors: spans in another unit ------------------------------------------------------------


@pytest.mark.parametrize("units", ["utf-16", "utf-8"])
async def test_a_span_counted_in_another_unit_still_redacts_the_entity(units) -> None:
    """DESIGN 6: spans count code points. A service that counts UTF-16 code units (JavaScript,
    Java) or UTF-8 bytes (Rust, Go) names a span past its entity in any text with such
    characters before it. Repro: an enforced redacting guardrail replaced the shifted span and
    released the entity's head (`se` of `secretname@example.com` in UTF-16, `secret` in
    bytes). A span whose own `text` the reply holds only when it is read in one of those units
    is read in that unit."""
    dets = FakeDetectorServer()
    email = DetectorBehaviour(words={"secretname@example.com": 0.9}, detection="email", units=units)
    dets.add("pii", email)
    await dets.start()
    pii = {**remote(dets.url), "on_detection": "redact", "redact_with": "[{entity}]"}
    try:
        _, raw = await stream_through(
            list(UNITS_SCRIPT), lambda url: guarded_config(url, {"pii": pii}), generation_body()
        )
    finally:
        await dets.close()
    assert b"secretname" not in raw and b"example.com" not in raw and b"name@" not in raw
    events = sse_events(raw.decode())
    assert terminal(events).name == "completed"
    text = "".join(f["generated_text"] for f in frames(events))
    assert text == "Caf\u00e9 \U0001f600\U0001f600 mail [email] now please write."


def test_the_reply_bound_grows_with_the_contents() -> None:
    one = reply_limit(["x"])
    assert reply_limit(["x", "y"]) > one
    assert reply_limit(["x" * 100_000]) > one + 100_000
    assert one < 16 << 20


# -- engines: error bodies and redirects ---------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "code", "etype", "details"),
    [
        (
            Fault("http", status=500, message=SECRET),
            503,
            "generation_unavailable",
            "replica native-0 answered HTTP 500 (not migrated: migration limit 0 reached)",
        ),
        (
            Fault("http", status=422, message=SECRET),
            422,
            "invalid_request",
            "replica native-0 rejected the request (HTTP 422)",
        ),
        (
            Fault("http", status=401, message=SECRET),
            502,
            "generation_error",
            "replica native-0 rejected the request (HTTP 401) (check the backend's api_key_env)",
        ),
        (
            Fault("redirect"),
            502,
            "generation_error",
            "replica native-0 rejected the request (HTTP 302)",
        ),
        (
            Fault("error", error_type="generation_error", message=SECRET),
            502,
            "generation_error",
            "replica native-0 reported an error",
        ),
    ],
    ids=["500", "422", "401", "redirect", "in-band"],
)
async def test_a_native_engines_error_is_named_never_quoted(
    fault, code, etype, details, caplog
) -> None:
    engine = FakeEngine(script=list(SCRIPT), fail=fault)
    await engine.start()
    caplog.set_level(logging.WARNING)
    try:
        async with Orchestrator(native_config(engine.url)) as orch:
            events = await orch.stream(generation_body())
    finally:
        await engine.close()
    assert terminal(events).data == {"code": code, "details": details, "type": etype}
    if fault.mode != "redirect":
        assert SECRET in warnings_of(caplog)


def openai_config(url: str) -> dict[str, Any]:
    config = native_config(url)
    config["models"][MODEL]["backends"] = [
        {"type": "openai", "url": url, "model": "fake-model", "api": "chat"}
    ]
    return config


@pytest.mark.parametrize(
    ("fault", "code", "details"),
    [
        (
            OpenAIFault("http", status=500, message=SECRET),
            503,
            "answered HTTP 500 (not migrated: migration limit 0 reached)",
        ),
        (
            OpenAIFault("http", status=403, message=SECRET),
            502,
            "rejected the request (HTTP 403) (check the backend's api_key_env)",
        ),
        (OpenAIFault("redirect"), 502, "rejected the request (HTTP 302)"),
    ],
    ids=["500", "403", "redirect"],
)
async def test_an_openai_engines_error_is_named_never_quoted(fault, code, details, caplog) -> None:
    server = FakeOpenAI(fail=fault)
    await server.start()
    caplog.set_level(logging.WARNING)
    try:
        async with Orchestrator(openai_config(server.url)) as orch:
            status, body = await orch.post(
                CHAT_PATH, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            )
    finally:
        await server.close()
    assert status == code
    assert body["error"]["message"] == f"replica openai-0 {details}"
    if fault.mode != "redirect":
        assert SECRET in warnings_of(caplog)


async def _usage_told_by_a_lying_upstream(field: str, stream: bool) -> tuple[dict, str]:
    """The usage a client gets, and the metrics, when the upstream claims 10**12 `field`
    tokens for a two-character message and a budget of 10."""
    server = FakeOpenAI(usage_override={field: 10**12})
    await server.start()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 10,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    try:
        async with Orchestrator(openai_config(server.url)) as orch:
            assert orch.session is not None
            async with orch.session.post(orch.url + CHAT_PATH, json=body) as resp:
                assert resp.status == 200
                raw = await resp.read()
            metrics = await (await orch.session.get(orch.url + "/metrics")).text()
    finally:
        await server.close()
    return json.loads(raw.split(b"data: ")[-2] if stream else raw)["usage"], metrics


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_an_upstreams_token_count_is_capped_at_what_was_asked(stream) -> None:
    """Repro: a server claiming `completion_tokens: 10**12` for a 10-token request had it
    reported to the client, counted in the metrics and charged to the tenant's token budget
    (rate limits: one lying upstream emptied every tenant's budget). No replica generates more
    than the budget it was asked for: the count is capped there."""
    usage, metrics = await _usage_told_by_a_lying_upstream("completion_tokens", stream)
    assert usage["completion_tokens"] == 10
    assert f'guardstream_generated_tokens_total{{model="{MODEL}"}} 10.0' in metrics


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_an_upstreams_prompt_count_is_capped_at_what_the_prompt_can_hold(stream) -> None:
    """Repro: a server claiming `prompt_tokens: 10**12` for a two-character message had it
    reported to the client, counted in the metrics and charged to the tenant's token budget,
    as completion_tokens was before it was capped. No prompt has more tokens than its UTF-8
    bytes plus what a chat template adds (advertised_limits.token_upper_bound, with room for
    a template's own text): the count is capped there."""
    usage, metrics = await _usage_told_by_a_lying_upstream("prompt_tokens", stream)
    bound = FIXED_SLACK_TOKENS + MESSAGE_SLACK_TOKENS + len(b"userHi") + TEMPLATE_ALLOWANCE_TOKENS
    assert usage["prompt_tokens"] == bound
    assert usage["total_tokens"] == bound + usage["completion_tokens"]
    assert f'guardstream_prompt_tokens_total{{model="{MODEL}"}} {bound}.0' in metrics


async def test_more_text_than_a_budget_can_carry_fails_the_replica() -> None:
    """Repro: text per token was unbounded (only each line was), so a replica sending 60 MiB
    with every token filled the orchestrator's memory within any token budget. Past
    MAX_CHARS_PER_TOKEN for every token of the budget (plus an allowance) the replica failed:
    the client gets no byte of that text and an error naming the replica."""
    budget = 5
    flood = "x" * (TEXT_ALLOWANCE_CHARS + MAX_CHARS_PER_TOKEN * budget)
    engine = FakeEngine(script=["Hi.", " There.", flood, " Bye."])
    await engine.start()
    try:
        async with Orchestrator(native_config(engine.url)) as orch:
            events = await orch.stream(generation_body(params={"max_new_tokens": budget}))
    finally:
        await engine.close()
    limit = TEXT_ALLOWANCE_CHARS + MAX_CHARS_PER_TOKEN * budget
    assert "".join(f["generated_text"] for f in frames(events)) == "Hi. There."
    assert terminal(events).data["error"] == {
        "code": 503,
        "type": "generation_unavailable",
        "message": f"replica native-0 sent more than {limit} characters for a budget of "
        f"{budget} tokens (not migrated: migration limit 0 reached)",
    }


# -- every 429 says when to retry (issue 32, extra e) --------------------------------------------

OPENAI_SURFACES = [
    (CHAT_PATH, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    (RESPONSES_PATH, {"model": MODEL, "input": "Hi"}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("path", "body"), OPENAI_SURFACES, ids=["chat", "responses"])
@pytest.mark.parametrize("direction", ["input", "output"])
async def test_a_detector_overload_is_429_with_retry_after(
    engine, evil, path, body, stream, direction
) -> None:
    """A remote detector's 429 (its queue is full) before the first byte: the client is told
    `overloaded` with Retry-After on Chat Completions and Responses, streaming or not."""
    evil.add("evil", DetectorBehaviour(fail_status=429, error_body=SECRET))
    request = {**body, "stream": stream, "detectors": {direction: {"evil": {}}}}
    async with Orchestrator(one_detector(engine, evil)) as orch:
        assert orch.session is not None
        async with orch.session.post(orch.url + path, json=request) as r:
            status, headers, reply = r.status, r.headers, await r.json()
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert reply["error"]["type"] == "overloaded"
    assert reply["error"]["message"] == "detector `evil`: HTTP 429"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("path", "body"), OPENAI_SURFACES, ids=["chat", "responses"])
async def test_too_many_streams_is_429_with_retry_after(path, body, stream) -> None:
    engine = GatedEngine(script=list(SCRIPT))
    await engine.start()
    config = native_config(engine.url, server={"max_concurrent_streams": 1})
    try:
        async with Orchestrator(config) as orch:
            assert orch.session is not None
            held = await orch.session.post(orch.url + STREAMING_PATH, json=generation_body())
            await until(lambda: engine.held == 1)
            async with orch.session.post(orch.url + path, json={**body, "stream": stream}) as r:
                status, headers, reply = r.status, r.headers, await r.json()
            engine.gate.set()
            await held.read()
            held.release()
    finally:
        await engine.close()
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert reply["error"] == {
        "message": "too many concurrent streams (limit 1)",
        "type": "overloaded",
        "param": None,
        "code": 429,
    }


async def test_an_unknown_finish_reason_is_named_never_quoted(caplog) -> None:
    """The engine's `finish_reason` is its own words: an unknown one is a failure of the
    replica, described without them."""
    engine = FakeEngine(script=list(SCRIPT), finish_reason=SECRET)
    await engine.start()
    caplog.set_level(logging.WARNING)
    try:
        async with Orchestrator(native_config(engine.url)) as orch:
            status, body = await orch.post(UNARY_PATH, generation_body())
    finally:
        await engine.close()
    assert (status, body) == (
        503,
        {
            "code": 503,
            "details": "replica native-0 sent an unknown finish_reason (not migrated: migration "
            "limit 0 reached)",
            "type": "generation_unavailable",
        },
    )
    assert SECRET in warnings_of(caplog)
