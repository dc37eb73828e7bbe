"""What the FMS orchestrator does not handle, black-box over real sockets: mixed chunkers with a
whole-document detector, thresholds, blocking, budgets, unreachable engines, client disconnects,
wrong reply counts, and many concurrent streams that must never mix."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from orchestrator.app import STREAMING_PATH
from orchestrator.state import STATE
from tests.fakes.clock import manual_deadline_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    SCRIPT,
    Orchestrator,
    SseEvent,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    remote,
    sse_events,
    terminal,
)
from tests.wait_support import until

TEXT = "I am great. What about you?"
PARAGRAPHS = ["First", " one", ".", " Second", " great", ".", "\n\n", "Third", " you", "?"]
PARAGRAPH_TEXT = "First one. Second great.\n\nThird you?"


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add("clean", DetectorBehaviour())
    server.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    server.add("you", DetectorBehaviour(words={"you": 0.8, "What": 0.7}, detection="pronoun"))
    server.add("first", DetectorBehaviour(words={"First": 0.6, "Third": 0.65}, detection="ord"))
    server.add("slow", DetectorBehaviour(gate=asyncio.Event()))  # never answers
    server.add("miscount", DetectorBehaviour(drop_one=True))
    server.add("malformed", DetectorBehaviour(malformed=True))
    # the same behaviours under the ids of differently configured detectors (the detector-id
    # header carries the configured id)
    for alias, name in [
        ("great_para", "great"),
        ("great_block", "great"),
        ("first_whole", "first"),
        ("you_strict", "you"),
    ]:
        server.add(alias, server.detectors[name])
    await server.start()
    yield server
    await server.close()


async def start_engine(script: list[str], **kwargs) -> FakeEngine:
    engine = FakeEngine(script=list(script), **kwargs)
    await engine.start()
    return engine


def cfg(engine: FakeEngine, dets: FakeDetectorServer, **overrides) -> dict:
    detectors = {
        "clean": remote(dets.url),
        "great": remote(dets.url),
        "you": remote(dets.url),
        "slow": remote(dets.url),
        "miscount": remote(dets.url),
        "malformed": remote(dets.url),
        "great_para": remote(dets.url, "paragraph"),
        "first_whole": remote(dets.url, "whole_doc_chunker"),
        "great_block": remote(dets.url, on_detection="block"),
        "you_strict": remote(dets.url, default_threshold=0.85),
    }
    server = overrides.pop("server", None)
    return native_config(engine.url, detectors=detectors, server=server, **overrides)


def outputs(frame_list: list[dict]) -> list[tuple[int, int, str, str]]:
    return [
        (d["start"], d["end"], d["word"], d["detector_id"])
        for f in frame_list
        for d in f["token_classification_results"].get("output", [])
    ]


async def test_sentence_paragraph_and_whole_doc_detectors_in_one_request(dets) -> None:
    engine = await start_engine(PARAGRAPHS)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(
                generation_body(output={"you": {}, "great_para": {}, "first_whole": {}})
            )
    finally:
        await engine.close()
    fs = frames(events)
    assert assert_contiguous(fs) == PARAGRAPH_TEXT
    # the paragraph detector holds text back until its paragraph is judged
    assert [f["generated_text"] for f in fs] == [
        "First one. Second great.",
        "\n\nThird you?",
    ]
    # every result exactly once, stream-relative; whole-doc results ride on the final frame
    assert outputs(fs[:1]) == [(18, 23, "great", "great_para")]
    assert outputs(fs[1:]) == [
        (0, 5, "First", "first_whole"),
        (26, 31, "Third", "first_whole"),
        (32, 35, "you", "you"),
    ]
    assert fs[-1]["finish_reason"] == "EOS_TOKEN"
    assert terminal(events).name == "completed"
    by_detector: dict[str, list[str]] = {}
    for detector_id, contents, _ in dets.calls:
        by_detector.setdefault(detector_id, []).extend(contents)
    assert by_detector == {
        "you": ["First one.", " Second great.", "\n\nThird you?"],
        "great_para": ["First one. Second great.", "\n\nThird you?"],
        "first_whole": [PARAGRAPH_TEXT],
    }


async def test_request_threshold_filters_detections(dets) -> None:
    engine = await start_engine(SCRIPT)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            low = await orch.stream(generation_body(output={"you": {"threshold": 0.5}}))
            high = await orch.stream(generation_body(output={"you": {"threshold": 0.75}}))
            default = await orch.stream(generation_body(output={"you_strict": {}}))
            override = await orch.stream(generation_body(output={"you_strict": {"threshold": 0.8}}))
    finally:
        await engine.close()
    assert outputs(frames(low)) == [(12, 16, "What", "you"), (23, 26, "you", "you")]
    assert outputs(frames(high)) == [(23, 26, "you", "you")]
    assert outputs(frames(default)) == []  # default_threshold 0.85 keeps nothing
    assert all("warnings" not in f for f in frames(default))
    assert outputs(frames(override)) == [(23, 26, "you", "you_strict")]  # score >= threshold


async def test_detector_params_are_forwarded_without_orchestrator_keys(dets) -> None:
    engine = await start_engine(SCRIPT)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            await orch.stream(
                generation_body(
                    output={"clean": {"threshold": 0.1, "on_detection": "annotate", "lang": "en"}}
                )
            )
    finally:
        await engine.close()
    assert {c[0] for c in dets.calls} == {"clean"}
    assert all(c[2] == {"lang": "en"} for c in dets.calls)


async def test_blocking_detector_withholds_the_offending_text(dets) -> None:
    # the engine goes silent after the two sentences: only the block can end this stream
    engine = await start_engine(
        SCRIPT + [" Great", " again", "."] * 20, fail=Fault("stall", after_tokens=len(SCRIPT))
    )
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(generation_body(output={"great_block": {}, "you": {}}))
            await engine.wait_disconnects(1)  # generation was cancelled
    finally:
        await engine.close()
    assert frames(events) == []  # "great" is in the first sentence: nothing is released
    assert [e.name for e in events] == ["refusal.delta", "refusal.done", "incomplete"]
    assert "great_block" in events[0].data["delta"]
    assert events[1].data["detections"] == [
        {
            "start": 5,
            "end": 10,
            "word": "",  # the flagged text never leaves the service, not even in the refusal
            "entity": "positive",
            "entity_group": "test",
            "detector_id": "great_block",
            "score": 0.9,
        }
    ]
    assert events[2].data["incomplete_details"] == {"reason": "content_filter"}
    assert events[2].data["finish_reason"] == "CANCELLED"


async def test_a_block_after_the_model_finished_keeps_its_finish_reason(dets) -> None:
    """A whole-document block judges after the end: the model ended with EOS, and the terminal
    event says so (it said CANCELLED, as if generation had been cut)."""
    engine = await start_engine(["First", " things", " first", "."])
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(
                generation_body(output={"first_whole": {"on_detection": "block"}})
            )
    finally:
        await engine.close()
    assert frames(events) == []
    assert [e.name for e in events] == ["refusal.delta", "refusal.done", "incomplete"]
    assert events[2].data == {
        "finish_reason": "EOS_TOKEN",
        "generated_token_count": 4,
        "input_token_count": events[2].data["input_token_count"],
        "processed_index": 0,
        "migrations": 0,
        "incomplete_details": {"reason": "content_filter"},
    }


async def test_blocking_later_in_the_stream_keeps_earlier_frames(dets) -> None:
    script = ["All", " fine", ".", " Truly", " great", ".", " More", " text", "."]
    engine = await start_engine(script)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(generation_body(output={"great": {"on_detection": "block"}}))
    finally:
        await engine.close()
    assert [f["generated_text"] for f in frames(events)] == ["All fine."]
    sent = "".join(f["generated_text"] for f in frames(events))
    assert "great" not in sent
    assert [e.name for e in events[1:]] == ["refusal.delta", "refusal.done", "incomplete"]
    assert [(d["start"], d["end"]) for d in events[2].data["detections"]] == [(16, 21)]


async def test_max_new_tokens_reached_is_incomplete(dets) -> None:
    engine = await start_engine(SCRIPT)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(
                generation_body(output={"clean": {}}, params={"max_new_tokens": 5})
            )
    finally:
        await engine.close()
    fs = frames(events)
    assert [f["generated_text"] for f in fs] == ["I am great.", " What"]
    assert fs[-1]["finish_reason"] == "MAX_TOKENS"
    assert fs[-1]["generated_token_count"] == 5
    end = terminal(events)
    assert end.name == "incomplete"
    assert end.data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert end.data["processed_index"] == 16
    assert engine.requests[0].body["max_new_tokens"] == 5


async def test_stop_sequence_completes(dets) -> None:
    engine = await start_engine(SCRIPT)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(generation_body(params={"stop_sequences": ["great"]}))
    finally:
        await engine.close()
    assert frames(events)[-1]["finish_reason"] == "STOP_SEQUENCE"
    assert terminal(events).name == "completed"
    assert engine.requests[0].body["stop_sequences"] == ["great"]


async def test_engine_unreachable_is_an_error_event(dets) -> None:
    engine = await start_engine(SCRIPT)
    await engine.close()  # its port is now closed
    async with Orchestrator(cfg(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"clean": {}}))
    assert len(events) == 1
    end = terminal(events)
    assert end.name == "error"
    assert end.data["type"] == "generation_unavailable"
    assert end.data["code"] == 503


async def test_client_disconnect_cancels_engine_and_detector_calls(dets) -> None:
    # the engine goes silent after three tokens (the first sentence is complete once the next
    # word is) and the detector never answers: both are still busy when the client goes away
    engine = await start_engine(
        ["word.", " more", " text", " here"], fail=Fault("stall", after_tokens=3)
    )
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            assert orch.session is not None
            resp = await orch.session.post(
                orch.url + STREAMING_PATH, json=generation_body(output={"slow": {}})
            )
            assert resp.status == 200
            await until(lambda: dets.in_flight >= 1)
            await engine.wait_requests(1)
            resp.close()  # the client goes away
            await engine.wait_disconnects(1)
            await until(lambda: dets.cancelled >= 1 and dets.in_flight == 0)
            await until(lambda: orch.runner.app[STATE].active_streams == 0)
    finally:
        await engine.close()


@pytest.mark.parametrize("detector", ["miscount", "malformed"])
async def test_bad_detector_reply_ends_the_stream_naming_the_detector(dets, detector) -> None:
    engine = await start_engine(SCRIPT)
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            events = await orch.stream(generation_body(output={detector: {}}))
    finally:
        await engine.close()
    end = terminal(events)
    assert end.name == "error"
    assert end.data["type"] == "detector_error"
    assert detector in end.data["details"]


async def test_request_timeout_ends_with_incomplete_time_limit(dets, monkeypatch) -> None:
    # the engine goes silent after two tokens (for longer than the stall timeout of 30 s): only
    # the request timeout ends the stream, on a manual clock moved once both frames are out
    clock = manual_deadline_clock(monkeypatch)
    engine = await start_engine(["word.", " more", " text"], fail=Fault("stall", after_tokens=2))

    moved: list[bool] = []

    def on_event(events: list[SseEvent]) -> None:
        if len(frames(events)) == 2 and clock.armed and not moved:
            moved.append(True)  # once: the serving loop's cut-off (a grace later) stays armed
            clock.advance(60)  # past request_timeout_s: the deadline fires now, not before

    try:
        async with Orchestrator(cfg(engine, dets, server={"request_timeout_s": 60})) as orch:
            events = await orch.stream(generation_body(), on_event=on_event)
            await engine.wait_disconnects(1)
    finally:
        await engine.close()
    assert [f["generated_text"] for f in frames(events)] == ["word.", " more"]
    end = terminal(events)
    assert end.name == "incomplete"
    assert end.data["incomplete_details"] == {"reason": "time_limit"}
    assert end.data["finish_reason"] == "TIME_LIMIT"


async def test_200_concurrent_streams_never_mix(dets) -> None:
    def echo(prompt: str) -> list[str]:
        words = prompt.split(" ")
        return [words[0], *(" " + w for w in words[1:])]

    engine = await start_engine([], script_for=echo, token_delay_s=0.002)
    prompts = [
        f"Stream {i} starts here. It says {i * 7919 % 1000} twice, {i} times. The end of {i}."
        for i in range(200)
    ]
    try:
        async with Orchestrator(cfg(engine, dets)) as orch:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one(prompt: str) -> list:
                    body = generation_body(
                        prompt,
                        output={"clean": {}, "great_para": {}},
                        params={"max_new_tokens": 64},
                    )
                    async with session.post(orch.url + STREAMING_PATH, json=body) as r:
                        assert r.status == 200
                        # 200 streams on 2 loaded cores may wait past sse_keepalive_s
                        return sse_events(await r.text(), keepalives=True)

                results = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await engine.close()
    for prompt, events in zip(prompts, results, strict=True):
        assert terminal(events).name == "completed"
        fs = frames(events)
        assert assert_contiguous(fs) == prompt
        assert [f["generated_text"] for f in fs] == [prompt]  # one paragraph: one frame
    assert len(engine.requests) == 200


async def test_a_phrase_split_by_a_replica_death_is_judged_whole_even_where_replicas_differ() -> (
    None
):
    """Each replica resets its first stream after three tokens, one cut inside an e-mail
    address: the request moves to the other replica, whose continuation is its own (a server
    that is not deterministic: `mple.org` where the first would have said `mple.com`), then
    back. What the detectors judge is the text the client gets, joined across both deaths:
    the address is redacted whole, and no byte of it leaves."""
    head = ["Write", " to", " jo@exa"]
    tail = [" and", " more", " words", " now", "."]
    engines = [
        await start_engine([*head, domain, *tail], fail=Fault("close", after_tokens=3))
        for domain in ("mple.com", "mple.org")
    ]
    try:
        config = native_config(
            engines[0].url,
            detectors={"pii": {"builtin": "regex", "chunker_id": "sentence"}},
            model={
                "backends": [{"type": "native", "url": e.url} for e in engines],
                "migration": {"limit": 3, "quarantine_s": 0},
            },
        )
        async with Orchestrator(config) as orch:
            assert orch.session is not None
            body = generation_body(output={"pii": {"on_detection": "redact"}})
            async with orch.session.post(orch.url + STREAMING_PATH, json=body) as r:
                raw = await r.read()
    finally:
        for e in engines:
            await e.close()
    events = sse_events(raw.decode())
    got = frames(events)
    assert assert_contiguous(got) == "Write to [email] and more words now."
    [found] = [d for f in got for d in f["token_classification_results"].get("output", [])]
    assert (found["start"], found["end"], found["word"], found["redacted"]) == (
        9,
        16,
        "[email]",
        True,
    )
    end = terminal(events)
    assert (end.name, end.data["migrations"], end.data["processed_index"]) == ("completed", 2, 36)
    for leaked in (b"jo@", b"exa", b"mple."):
        assert leaked not in raw
