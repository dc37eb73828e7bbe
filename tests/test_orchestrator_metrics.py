"""GET /metrics of the orchestrator, the engine and the detector service: the exposition parses,
and every series moves by exactly what a request did (counters as deltas between two scrapes)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import detectors
from detectors.service import create_app as create_detector_app
from generation import models
from generation.server import create_app as create_engine_app
from orchestrator.app import CONTENT_PATH, STREAMING_PATH, UNARY_PATH
from orchestrator.state import STATE
from tests.engine_support import generate
from tests.fakes.clock import expire_stalls, manual_stall_clock
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    MODEL,
    SCRIPT,
    Orchestrator,
    frames,
    generation_body,
    native_config,
    remote,
    terminal,
)
from tests.wait_support import finished, until

TEXT = "I am great. What about you?"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition by (name, labels); fails on anything unparsable."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a labelled series that has not been created yet."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def scrape(session: aiohttp.ClientSession, base_url: str) -> Samples:
    async with session.get(base_url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return parse(await r.text())


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    server = FakeDetectorServer()
    server.add("you", DetectorBehaviour(words={"you": 0.8}, detection="pronoun"))
    server.add("clean", DetectorBehaviour())
    server.add("broken", DetectorBehaviour(fail_status=500))
    await server.start()
    yield server
    await server.close()


def config(engine_url: str, dets: FakeDetectorServer, **kwargs: Any) -> dict[str, Any]:
    detectors_cfg = {name: remote(dets.url) for name in ("you", "clean", "broken")}
    return native_config(engine_url, detectors=detectors_cfg, **kwargs)


def calls_of(dets: FakeDetectorServer, detector_id: str) -> int:
    return sum(1 for d, _, _ in dets.calls if d == detector_id)


async def test_a_stream_moves_every_series_by_exactly_what_it_did(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    async with Orchestrator(config(engine.url, dets)) as orch:
        assert orch.session is not None
        before = await scrape(orch.session, orch.url)
        events = await orch.stream(generation_body(output={"you": {}, "clean": {}}))
        after = await scrape(orch.session, orch.url)

    fs = frames(events)
    assert [f["generated_text"] for f in fs] == ["I am great.", " What about you?"]
    assert terminal(events).name == "completed"
    you_calls, clean_calls = calls_of(dets, "you"), calls_of(dets, "clean")
    assert you_calls >= 1 and clean_calls >= 1

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("guardstream_requests_total", endpoint=STREAMING_PATH, status="200") == 1
    assert d("guardstream_frames_total") == 2
    assert d("guardstream_detections_total", detector_id="you") == 1
    assert d("guardstream_detections_total", detector_id="clean") == 0
    assert d("guardstream_terminal_events_total", event="completed") == 1
    assert d("guardstream_terminal_events_total", event="failed") == 0
    assert value(after, "guardstream_active_streams") == 0
    # two frames with text, each held back until both detectors had judged it
    assert d("guardstream_frame_hold_back_seconds_count") == 2
    assert d("guardstream_detector_latency_seconds_count", detector_id="you") == you_calls
    assert d("guardstream_detector_latency_seconds_count", detector_id="clean") == clean_calls
    assert d("guardstream_detector_calls_total", detector_id="you", outcome="ok") == you_calls
    assert d("guardstream_detector_calls_total", detector_id="you", outcome="error") == 0
    assert d("guardstream_detector_latency_seconds_sum", detector_id="you") > 0
    # the bucket series is cumulative: +Inf holds every call
    assert (
        d("guardstream_detector_latency_seconds_bucket", detector_id="you", le="+Inf") == you_calls
    )
    # the first scrape is counted once it has been answered
    assert d("guardstream_requests_total", endpoint="/metrics", status="200") == 1
    # per model: one first frame, one stream, the terminal's own token counts
    end = terminal(events).data
    assert d("guardstream_time_to_first_frame_seconds_count", model=MODEL) == 1
    assert d("guardstream_time_to_first_frame_seconds_bucket", model=MODEL, le="+Inf") == 1
    assert d("guardstream_stream_duration_seconds_count", model=MODEL, event="completed") == 1
    assert d("guardstream_stream_duration_seconds_count", model=MODEL, event="failed") == 0
    assert end["input_token_count"] > 0 and end["generated_token_count"] > 0
    assert d("guardstream_prompt_tokens_total", model=MODEL) == end["input_token_count"]
    assert d("guardstream_generated_tokens_total", model=MODEL) == end["generated_token_count"]


async def test_errors_failures_and_the_unary_and_content_endpoints_are_counted(
    engine: FakeEngine, dets: FakeDetectorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the engine stalls after "I am great. What about": the first sentence is judged and sent, then
    # the stall timeout (migration off) ends the stream with `failed`, declared on a manual clock
    # once that frame has reached the client
    clock = manual_stall_clock(monkeypatch)
    engine.inject(Fault("stall", after_tokens=6))
    cfg = config(engine.url, dets, model={"migration": {"limit": 0, "quarantine_s": 0}})
    async with Orchestrator(cfg) as orch:
        assert orch.session is not None
        before = await scrape(orch.session, orch.url)
        first_frame = asyncio.Event()
        stalled = asyncio.create_task(
            orch.stream(
                generation_body(output={"clean": {}}),
                on_event=lambda events: frames(events) and first_frame.set(),
            )
        )
        await finished(first_frame.wait(), 30, "first_frame.wait()")
        await expire_stalls(clock, stalled.done)
        failed = await stalled
        errored = await orch.stream(generation_body(output={"broken": {}}))
        status, _ = await orch.post(STREAMING_PATH, generation_body(model_id="nope"))
        assert status == 404
        status, _ = await orch.post(
            STREAMING_PATH, b"{not json", headers={"Content-Type": "application/json"}
        )
        assert status == 400
        status, body = await orch.post(UNARY_PATH, generation_body(output={"you": {}}))
        assert status == 200 and body["generated_text"] == TEXT
        status, body = await orch.post(
            CONTENT_PATH, {"content": "you and you", "detectors": {"you": {}}}
        )
        assert status == 200 and len(body["detections"]) == 2
        status, _ = await orch.post("/no/such/route", {})
        assert status == 404
        after = await scrape(orch.session, orch.url)

    assert terminal(failed).name == "failed"
    assert [f["generated_text"] for f in frames(failed)] == ["I am great."]
    assert terminal(errored).name == "error" and frames(errored) == []
    assert terminal(errored).data["type"] == "detector_error"

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("guardstream_requests_total", endpoint=STREAMING_PATH, status="200") == 2
    assert d("guardstream_requests_total", endpoint=STREAMING_PATH, status="404") == 1
    assert d("guardstream_requests_total", endpoint=STREAMING_PATH, status="400") == 1
    assert d("guardstream_requests_total", endpoint=UNARY_PATH, status="200") == 1
    assert d("guardstream_requests_total", endpoint=CONTENT_PATH, status="200") == 1
    assert d("guardstream_requests_total", endpoint="unmatched", status="404") == 1
    assert d("guardstream_terminal_events_total", event="failed") == 1
    assert d("guardstream_terminal_events_total", event="error") == 1
    assert d("guardstream_terminal_events_total", event="completed") == 1  # the unary one
    # the failed stream sent one frame, the unary request produced two
    assert d("guardstream_frames_total") == 3
    # one detection in the unary reply, two from the content endpoint
    assert d("guardstream_detections_total", detector_id="you") == 3
    assert d("guardstream_detector_calls_total", detector_id="broken", outcome="error") == 1
    assert d("guardstream_detector_calls_total", detector_id="broken", outcome="ok") == 0
    assert d("guardstream_detector_latency_seconds_count", detector_id="broken") == 1
    assert value(after, "guardstream_active_streams") == 0


async def test_the_active_streams_gauge_counts_streams_in_flight(
    dets: FakeDetectorServer,
) -> None:
    engine = FakeEngine(script=list(SCRIPT), fail=Fault("stall", after_tokens=2))
    await engine.start()
    try:
        async with Orchestrator(config(engine.url, dets)) as orch:
            assert orch.session is not None

            async def read_stream() -> None:
                assert orch.session is not None
                async with orch.session.post(
                    orch.url + STREAMING_PATH, json=generation_body()
                ) as r:
                    await r.read()

            task = asyncio.create_task(read_stream())
            await finished(engine.first_token.wait(), 10, "engine.first_token.wait()")
            during = await scrape(orch.session, orch.url)
            task.cancel()  # the client goes away: the stream ends without a terminal event
            with pytest.raises(asyncio.CancelledError):
                await task
            await engine.wait_disconnects(1)
            assert orch.runner is not None
            state = orch.runner.app[STATE]
            await until(lambda: state.active_streams == 0)
            registry = state.metrics.registry
            # counted as nginx's 499 "client closed request", as the access log says: a 5xx here
            # would fire every alert on server errors each time a user gives up
            await until(
                lambda: (
                    registry.get_sample_value(
                        "guardstream_requests_total",
                        {"endpoint": STREAMING_PATH, "status": "499"},
                    )
                    == 1
                )
            )
            after = await scrape(orch.session, orch.url)
    finally:
        await engine.close()
    assert value(during, "guardstream_active_streams") == 1
    assert value(after, "guardstream_active_streams") == 0
    assert (
        delta(during, after, "guardstream_requests_total", endpoint=STREAMING_PATH, status="499")
        == 1
    )
    assert value(after, "guardstream_requests_total", endpoint=STREAMING_PATH, status="500") == 0
    # a client that went away gets no terminal event, and none is counted
    events = ("completed", "incomplete", "failed", "error")
    assert [value(after, "guardstream_terminal_events_total", event=e) for e in events] == [0] * 4


async def test_event_loop_stalls_and_collections_are_on_the_page(
    engine: FakeEngine, dets: FakeDetectorServer
) -> None:
    """What stops every stream at once is visible: each garbage collection's time, by
    generation, and how late the loop ran its 100 ms probe. (That a blocked loop makes the
    probe late is test_pipeline_read_pacing's; here a lateness reaches the page.)"""
    async with Orchestrator(config(engine.url, dets)) as orch:
        assert orch.session is not None and orch.runner is not None
        before = await scrape(orch.session, orch.url)
        gc.collect()  # a full collection, timed by the app's gc callback
        orch.runner.app[STATE].loop_lag.record(0.3)  # as the probe records a 0.3 s stall
        after = await scrape(orch.session, orch.url)
    late = delta(before, after, "guardstream_event_loop_lag_seconds_count") - delta(
        before, after, "guardstream_event_loop_lag_seconds_bucket", le="0.25"
    )
    assert late >= 1  # the stall (a loaded machine may add late probes of its own)
    assert delta(before, after, "guardstream_event_loop_lag_seconds_sum") >= 0.3
    assert delta(before, after, "guardstream_gc_pause_seconds_count", generation="2") >= 1
    assert delta(before, after, "guardstream_gc_pause_seconds_sum", generation="2") > 0
    # every generation's series exists from the start, before it first runs
    assert ("guardstream_gc_pause_seconds_count", frozenset({("generation", "1")})) in before


async def test_migrations_are_served_on_the_same_registry(dets: FakeDetectorServer) -> None:
    # both replicas reset their first stream after two tokens: whichever is picked first, the
    # request migrates to the other, which fails too, then back to the first, which finishes
    engines = [FakeEngine(script=list(SCRIPT), fail=Fault("close", after_tokens=2)) for _ in "ab"]
    for e in engines:
        await e.start()
    try:
        cfg = config(engines[0].url, dets)
        cfg["models"][MODEL] = {
            "backends": [{"type": "native", "url": e.url} for e in engines],
            "migration": {"limit": 3, "quarantine_s": 0},
        }
        async with Orchestrator(cfg) as orch:
            assert orch.session is not None
            before = await scrape(orch.session, orch.url)
            events = await orch.stream(generation_body())
            after = await scrape(orch.session, orch.url)
    finally:
        for e in engines:
            await e.close()
    end = terminal(events)
    assert end.name == "completed" and end.data["migrations"] == 2
    assert "".join(f.get("generated_text", "") for f in frames(events)) == TEXT
    assert (
        delta(before, after, "guardstream_migrations_total", model_id=MODEL, kind="mid_stream") == 2
    )
    assert delta(before, after, "guardstream_terminal_events_total", event="completed") == 1


# -- the engine ---------------------------------------------------------------------------------


async def test_engine_metrics_move_with_a_generation(
    aiohttp_client: Any, tiny_model: models.LoadedModel
) -> None:
    client = await aiohttp_client(create_engine_app(tiny_model))

    async def engine_scrape() -> Samples:
        r = await client.get("/metrics")
        assert r.status == 200
        return parse(await r.text())

    before = await engine_scrape()
    stream = await generate(client, "", {"prompt": "a", "max_new_tokens": 5})
    assert stream.completed and len(stream.token_ids) == 5
    after = await engine_scrape()

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("guardstream_engine_tokens_generated_total") == 5
    assert d("guardstream_engine_requests_started_total") == 1
    assert d("guardstream_engine_requests_cancelled_total") == 0
    assert value(after, "guardstream_engine_active_requests") == 0
    # the prefill yields the first token, then one decode step of one row per further token
    assert d("guardstream_engine_decode_batch_size_count") == 4
    assert d("guardstream_engine_decode_batch_size_sum") == 4
    assert d("guardstream_engine_decode_batch_size_bucket", le="1") == 4


# -- the detector service -----------------------------------------------------------------------


async def test_detector_service_metrics_move_with_requests(aiohttp_client: Any) -> None:
    dets: Mapping[str, detectors.Detector] = {
        "pii": detectors.build("regex"),
        "hap": detectors.build("profanity"),
    }
    client = await aiohttp_client(create_detector_app(dict(dets), warmup=False))

    async def service_scrape() -> Samples:
        r = await client.get("/metrics")
        assert r.status == 200
        return parse(await r.text())

    async def post(detector_id: str, body: Any) -> int:
        r = await client.post(
            "/api/v1/text/contents", json=body, headers={"detector-id": detector_id}
        )
        return r.status

    before = await service_scrape()
    assert await post("pii", {"contents": ["mail a@b.com", "nothing", "x"]}) == 200
    assert await post("hap", {"contents": ["you are lovely", "have a nice day"]}) == 200
    assert await post("pii", {"contents": "not a list"}) == 422
    assert await post("nope", {"contents": ["x"]}) == 404
    after = await service_scrape()
    for det in dets.values():
        await det.close()

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("detector_requests_total", detector_id="pii", status="200") == 1
    assert d("detector_requests_total", detector_id="pii", status="422") == 1
    assert d("detector_requests_total", detector_id="hap", status="200") == 1
    assert d("detector_requests_total", detector_id="_unknown", status="404") == 1
    assert d("detector_request_seconds_count", detector_id="pii") == 2
    assert d("detector_request_seconds_count", detector_id="hap") == 1
    assert d("detector_request_contents_count", detector_id="pii") == 1
    assert d("detector_request_contents_sum", detector_id="pii") == 3
    # the model-backed detector micro-batches: one batch of both contents
    assert d("detector_batch_size_count", detector_id="hap") == 1
    assert d("detector_batch_size_sum", detector_id="hap") == 2


def test_a_collection_is_observed_on_the_loop_never_in_the_gc_callback() -> None:
    """prometheus_client's multiprocess values share one lock that cannot be taken twice; a
    collection that starts while it is held (a `labels()` call allocating) and observed from the
    gc callback deadlocked a worker. The callback only notes the time; `flush` observes."""
    from prometheus_client import CollectorRegistry, Histogram

    from orchestrator.metrics import GcPauseTimer

    histogram = Histogram("pauses", "pauses", ["generation"], registry=CollectorRegistry())
    timer = GcPauseTimer(histogram)
    observed: list[float] = []
    series = histogram.labels("2")
    real_observe = series.observe

    def observe(amount: float) -> None:
        observed.append(amount)
        real_observe(amount)

    series.observe = observe  # type: ignore[method-assign]
    timer("start", {"generation": 2})
    timer("stop", {"generation": 2})
    assert observed == []
    timer.flush()
    assert len(observed) == 1 and observed[0] >= 0
    timer.flush()
    assert len(observed) == 1
