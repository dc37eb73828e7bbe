"""OpenTelemetry traces across orchestrator → engine → detector service (README "Tracing").

The end-to-end test runs real processes on 127.0.0.1: the orchestrator in this process with the
SDK's InMemorySpanExporter, two managed `tiny-random` engines (they inherit the tracing settings
through their environment) and a `python -m detectors serve` subprocess, both exporting over
OTLP/HTTP to a fake collector that decodes the real protobuf. One streamed request with an input
detector, two output detectors and one migration (an in-band fault on the first replica) must
make one trace whose spans are parented across the three services. Exporters are flushed
explicitly (force_flush here, a graceful shutdown in the children) before anything is asserted.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from orchestrator import tracing
from orchestrator.app import STREAMING_PATH, create_app
from orchestrator.config import ConfigError, parse_config
from orchestrator.logs import make_handler
from servicekit.tracing import env_wants_tracing
from tests.detectors_support import detector_service_async
from tests.e2e_support import managed_model
from tests.fakes.engine import FakeEngine
from tests.fakes.upstream import start_site
from tests.orchestrator_support import MODEL as MODEL_ID
from tests.orchestrator_support import (
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    remote,
    sse_events,
    terminal,
)
from tests.wait_support import until

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
BUDGET = 24  # min = max new tokens: the stream always has this many, whatever tiny-random says
FAULT_AFTER = 3
# every OTEL_* variable the children could inherit from the machine is cleared for these tests
OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


# -- a collector speaking OTLP/HTTP ---------------------------------------------------------------


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class FakeCollector:
    """`POST /v1/traces` with an ExportTraceServiceRequest (protobuf), as a collector takes it."""

    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.url = await start_site(self._runner)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            service = _attrs(resource_spans.resource.attributes)["service.name"]
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        CollectedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes=_attrs(s.attributes),
                            events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        )
                    )
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")


def hexid(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def parent_of(span: ReadableSpan) -> str | None:
    return format(span.parent.span_id, "016x") if span.parent is not None else None


# -- the processes --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_inherited_otel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OTEL_* variable of the machine leaks in; tracing is off again after each test."""
    for key in OTEL_VARS:
        monkeypatch.delenv(key)
    yield
    tracing.shutdown()


DETECTORS_CONFIG = {
    "detectors": {
        "pii": {"builtin": "regex", "chunker_id": "sentence"},
        "hap": {"builtin": "profanity", "chunker_id": "sentence"},
    }
}


@asynccontextmanager
async def orchestrator(
    config: dict[str, Any], exporter: InMemorySpanExporter | None
) -> AsyncIterator[str]:
    """The orchestrator app in this process; its cleanup stops managed engines gracefully (they
    export their last spans) and shuts tracing down."""
    app = create_app(parse_config(config), device="cpu", span_exporter=exporter)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        yield await start_site(runner)
    finally:
        await runner.cleanup()


async def healthy_replicas(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async def healthy() -> list[dict[str, Any]] | None:
        async with session.get(url + "/info") as r:
            replicas = (await r.json())["models"][MODEL]
        return replicas if all(r["status"] == "HEALTHY" for r in replicas) else None

    # a generous deadline: engines load torch
    return await until(healthy, 120, "the managed engines healthy", poll_s=0.2)


@contextmanager
def access_log_lines() -> Iterator[io.StringIO]:
    """The orchestrator's JSON access lines, as `serve` writes them."""
    buf = io.StringIO()
    handler = make_handler("json", stream=buf)
    logger = logging.getLogger("guardstream.access")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield buf
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- the trace of one streamed request ------------------------------------------------------------


async def test_one_trace_across_orchestrator_engines_and_detector_service(
    tmp_path: Path,
) -> None:
    collector = FakeCollector()
    collector_url = await collector.start()
    exporter = InMemorySpanExporter()
    try:
        # `--otlp-endpoint`; stopped with SIGTERM, it exports its last spans before it exits
        async with detector_service_async(
            tmp_path, DETECTORS_CONFIG, "--otlp-endpoint", collector_url
        ) as service:
            detectors_url = service.url
            config = {
                "server": {
                    "host": "127.0.0.1",
                    "port": 0,
                    # the in-memory exporter replaces this for the orchestrator itself; the
                    # managed engines inherit it through their environment
                    "tracing": {"otlp_endpoint": collector_url, "service_name": "guardstream"},
                },
                "models": {MODEL: managed_model()},
                "chunkers": {"sentence": {"type": "sentence"}},
                "detectors": {"pii": remote(detectors_url), "hap": remote(detectors_url)},
            }
            with access_log_lines() as logged:
                async with (
                    orchestrator(config, exporter) as url,
                    aiohttp.ClientSession() as session,
                ):
                    replicas = await healthy_replicas(session, url)
                    first, second = replicas  # a fresh pool dispatches to the first
                    fault = {"after_tokens": FAULT_AFTER, "mode": "error", "times": 1}
                    async with session.post(first["url"] + "/admin/faults", json=fault) as r:
                        assert r.status == 200, await r.text()
                    body = generation_body(
                        "Hello there.",
                        input={"pii": {}},
                        output={"pii": {}, "hap": {}},
                        params={"max_new_tokens": BUDGET, "min_new_tokens": BUDGET},
                        model_id=MODEL,
                    )
                    headers = {"traceparent": TRACEPARENT}
                    async with session.post(url + STREAMING_PATH, json=body, headers=headers) as r:
                        assert r.status == 200, await r.text()
                        request_id = r.headers["x-request-id"]
                        events = sse_events(await r.text())
                    assert tracing.force_flush()
                    spans = exporter.get_finished_spans()
                # the orchestrator stopped its engines: they exported their last spans
        # the detector service has exported its last spans too
    finally:
        await collector.close()

    end = terminal(events)
    sent = frames(events)
    assert_contiguous(sent)
    assert end.data["migrations"] == 1
    assert end.data["generated_token_count"] == BUDGET

    # -- the orchestrator: one trace, the client's span its parent
    mine = [s for s in spans if format(s.context.trace_id, "032x") == TRACE_ID]
    assert len(mine) == len(spans)  # nothing outside the trace
    (root,) = [s for s in mine if s.kind == SpanKind.SERVER]
    assert root.name == f"POST {STREAMING_PATH}"
    assert parent_of(root) == CLIENT_SPAN
    assert root.parent is not None and root.parent.is_remote
    attrs = dict(root.attributes or {})
    assert attrs["guardstream.surface"] == "fms_stream"
    assert attrs["guardstream.model"] == MODEL
    assert attrs["http.response.status_code"] == 200
    assert attrs["guardstream.request_id"] == request_id
    assert attrs["guardstream.terminal"] == end.name == "incomplete"
    assert attrs["guardstream.incomplete_reason"] == "max_output_tokens"
    assert attrs["guardstream.finish_reason"] == "MAX_TOKENS"
    assert attrs["guardstream.migrations"] == 1
    assert attrs["guardstream.generated_tokens"] == BUDGET
    assert attrs["guardstream.processed_index"] == end.data["processed_index"]
    assert root.status.status_code == StatusCode.UNSET

    # the hold-back of every frame, as events, in the order the frames left
    frame_events = [dict(e.attributes or {}) for e in root.events if e.name == "frame"]
    assert [(e["guardstream.frame.start"], e["guardstream.frame.end"]) for e in frame_events] == [
        (f["start_index"], f["processed_index"]) for f in sent
    ]
    assert [e["guardstream.frame.detections"] for e in frame_events] == [
        len(f["token_classification_results"].get("output", [])) for f in sent
    ]
    assert attrs["guardstream.frames"] == len(sent)
    assert all(e["guardstream.frame.hold_ms"] >= 0 for e in frame_events)

    # input detection, and its detector call under it
    (input_span,) = [s for s in mine if s.name == "input_detection"]
    assert parent_of(input_span) == hexid(root)
    assert dict(input_span.attributes or {}) == {
        "guardstream.detectors": ("pii",),
        "guardstream.detections": 0,
    }
    detector_spans = [s for s in mine if s.name.startswith("detector ")]
    (input_call,) = [s for s in detector_spans if parent_of(s) == hexid(input_span)]
    assert input_call.name == "detector pii"
    assert input_call.attributes["guardstream.detector.contents"] == 1
    assert input_call.attributes["guardstream.detector.chars"] == len("Hello there.")

    # the output detectors: every call a child of the request span
    output_calls = [s for s in detector_spans if s is not input_call]
    assert {s.name for s in output_calls} == {"detector pii", "detector hap"}
    for call in output_calls:
        a = dict(call.attributes or {})
        assert parent_of(call) == hexid(root)
        assert call.kind == SpanKind.CLIENT
        assert a["guardstream.detector.id"] == call.name.removeprefix("detector ")
        assert a["guardstream.detector.outcome"] == "ok"
        assert a["guardstream.detector.contents"] >= 1
        assert a["guardstream.detector.detections"] >= 0
        assert a["guardstream.detector.duration_ms"] >= 0
    judged = sum(s.attributes["guardstream.detector.chars"] for s in output_calls)
    assert judged == 2 * end.data["processed_index"]  # each detector judged the whole text once

    # two attempts, a migration event between them
    attempts = sorted(
        (s for s in mine if s.name == "generate.attempt"),
        key=lambda s: s.attributes["guardstream.attempt"],
    )
    assert [parent_of(s) for s in attempts] == [hexid(root)] * 2
    failed, resumed = (dict(s.attributes or {}) for s in attempts)
    moved = failed["guardstream.attempt.tokens"]
    assert moved >= FAULT_AFTER
    assert failed["guardstream.replica"] == first["name"]
    assert failed["guardstream.attempt.resumed_tokens"] == 0
    assert failed["guardstream.attempt.error_type"] == "generation_unavailable"
    assert failed["guardstream.attempt.migratable"] is True
    assert "reported an error" in failed["guardstream.attempt.failure"]
    assert attempts[0].status.status_code == StatusCode.ERROR
    assert resumed == {
        "guardstream.attempt": 2,
        "guardstream.replica": second["name"],
        "guardstream.attempt.resumed_tokens": moved,
        "guardstream.attempt.tokens": BUDGET - moved,
    }
    (migration,) = [e for e in root.events if e.name == "migration"]
    assert dict(migration.attributes or {}) == {
        "guardstream.migration.number": 1,
        "guardstream.migration.kind": "mid_stream",
        "guardstream.migration.from_replica": first["name"],
        "guardstream.migration.after_attempt": 1,
        "guardstream.migration.delivered_tokens": moved,
    }
    assert attempts[0].end_time <= migration.timestamp <= attempts[1].start_time

    # -- the engines: one SERVER span per attempt, the attempt's child
    in_trace = [s for s in collector.spans if s.trace_id == TRACE_ID]
    generates = {
        s.parent_span_id: s
        for s in in_trace
        if s.service == "guardstream-engine" and s.name == "POST /v1/generate"
    }
    assert set(generates) == {hexid(a) for a in attempts}
    on_first, on_second = (generates[hexid(a)] for a in attempts)
    for span in (on_first, on_second):
        assert span.attributes["guardstream.request_id"] == request_id
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["guardstream.decoding"] == "greedy"
    assert on_first.attributes["guardstream.resumed_tokens"] == 0
    assert on_first.attributes["guardstream.generated_tokens"] == moved
    assert "guardstream.finish_reason" not in on_first.attributes
    assert on_first.events == [("fault", {"mode": "error", "after_tokens": moved})]
    assert on_second.attributes["guardstream.resumed_tokens"] == moved
    assert on_second.attributes["guardstream.generated_tokens"] == BUDGET - moved
    assert on_second.attributes["guardstream.finish_reason"] == "MAX_TOKENS"
    assert on_first.attributes["guardstream.prompt_tokens"] == end.data["input_token_count"]

    # -- the detector service: one SERVER span per detector call, that call's child
    served = [s for s in in_trace if s.service == "guardstream-detectors"]
    by_parent = {s.parent_span_id: s for s in served}
    assert len(by_parent) == len(served) == len(detector_spans)
    for call in detector_spans:
        child = by_parent[hexid(call)]
        assert child.name == "POST /api/v1/text/contents"
        a = call.attributes
        assert child.attributes["guardstream.detector.id"] == a["guardstream.detector.id"]
        assert (
            child.attributes["guardstream.detector.contents"] == a["guardstream.detector.contents"]
        )
        assert child.attributes["guardstream.detector.chars"] == a["guardstream.detector.chars"]
        assert (
            child.attributes["guardstream.detector.detections"]
            == a["guardstream.detector.detections"]
        )
        assert child.attributes["guardstream.request_id"] == request_id
        assert child.attributes["http.response.status_code"] == 200

    # -- the request's access line carries its request id and its trace id
    lines = [json.loads(line) for line in logged.getvalue().splitlines()]
    (access,) = [e for e in lines if e.get("path") == STREAMING_PATH]
    assert access["request_id"] == request_id
    assert access["trace_id"] == TRACE_ID
    assert access["span_id"] == hexid(root)


# -- tracing off ----------------------------------------------------------------------------------


class RecordingDetector:
    """A detector service that finds nothing and records the headers of every call."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/api/v1/text/contents", self._contents)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.url = await start_site(self._runner)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _contents(self, request: web.Request) -> web.Response:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        return web.json_response([[] for _ in body["contents"]])


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[tuple[FakeEngine, RecordingDetector]]:
    engine = FakeEngine(script=["I", " am", " great", "."])
    detector = RecordingDetector()
    await engine.start()
    await detector.start()
    try:
        yield engine, detector
    finally:
        await engine.close()
        await detector.close()


async def stream_once(config: dict[str, Any], exporter: InMemorySpanExporter | None) -> str:
    async with orchestrator(config, exporter) as url, aiohttp.ClientSession() as session:
        body = generation_body("Hi", output={"d": {}})
        async with session.post(
            url + STREAMING_PATH, json=body, headers={"traceparent": TRACEPARENT}
        ) as r:
            assert r.status == 200
            events = sse_events(await r.text())
        assert terminal(events).name == "completed"
        return assert_contiguous(frames(events))


async def test_tracing_off_creates_nothing_and_sends_no_traceparent(
    fakes: tuple[FakeEngine, RecordingDetector],
) -> None:
    engine, detector = fakes
    config = native_config(engine.url, detectors={"d": remote(detector.url)})
    assert await stream_once(config, None) == "I am great."
    assert tracing.TRACER is None
    assert engine.requests and detector.headers
    # the client's traceparent is not passed on (add it to server.forward_headers for that)
    assert all("traceparent" not in {k.lower() for k in r.headers} for r in engine.requests)
    assert all("traceparent" not in h for h in detector.headers)


async def test_tracing_on_names_the_attempt_and_the_detector_call_downstream(
    fakes: tuple[FakeEngine, RecordingDetector],
) -> None:
    engine, detector = fakes
    config = native_config(engine.url, detectors={"d": remote(detector.url)})
    exporter = InMemorySpanExporter()
    assert await stream_once(config, exporter) == "I am great."
    assert tracing.TRACER is None  # the app's cleanup turned it off again
    spans = exporter.get_finished_spans()
    (attempt,) = [s for s in spans if s.name == "generate.attempt"]
    calls = [s for s in spans if s.name == "detector d"]
    assert [r.headers["traceparent"] for r in engine.requests] == [
        f"00-{TRACE_ID}-{hexid(attempt)}-01"
    ]
    assert sorted(h["traceparent"] for h in detector.headers) == sorted(
        f"00-{TRACE_ID}-{hexid(c)}-01" for c in calls
    )


async def test_unsampled_client_trace_is_followed_and_records_nothing(
    fakes: tuple[FakeEngine, RecordingDetector],
) -> None:
    engine, detector = fakes
    config = native_config(engine.url, detectors={"d": remote(detector.url)})
    exporter = InMemorySpanExporter()
    async with orchestrator(config, exporter) as url, aiohttp.ClientSession() as session:
        unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
        body = generation_body("Hi", output={"d": {}})
        async with session.post(
            url + STREAMING_PATH, json=body, headers={"traceparent": unsampled}
        ) as r:
            assert r.status == 200
            await r.read()
        assert tracing.force_flush()
    assert exporter.get_finished_spans() == ()
    # downstream gets the same decision: a not-sampled traceparent in the client's trace
    (sent,) = [r.headers["traceparent"] for r in engine.requests]
    assert sent.startswith(f"00-{TRACE_ID}-") and sent.endswith("-00")


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tracing_cfg", "error"),
    [
        ({"sample_ratio": 1.5}, "server.tracing.sample_ratio: Input should be less than or equal"),
        ({"otlp_endpoint": "collector:4318"}, "server.tracing.otlp_endpoint: must start with"),
        ({"endpoint": "http://c:4318"}, "server.tracing.endpoint: unknown key"),
    ],
)
def test_bad_tracing_settings_name_their_path(tracing_cfg: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"server": {"tracing": tracing_cfg}})
    assert any(e.startswith(error) for e in info.value.errors), info.value.errors


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ],
)
def test_the_standard_environment_turns_tracing_on(environ: dict[str, str], on: bool) -> None:
    assert env_wants_tracing(environ) is on


def test_config_tracing_is_exported_to_managed_engines_and_restored() -> None:
    environ: dict[str, str] = {"OTEL_SERVICE_NAME": "mine"}
    settings = parse_config(
        {"server": {"tracing": {"otlp_endpoint": "http://c:4318", "sample_ratio": 0.25}}}
    ).server.tracing
    for_engines = {
        "OTEL_SERVICE_NAME": "mine-engine",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    assert tracing.engine_env(settings, environ) == for_engines
    assert tracing.engine_env(None, environ) == {}  # tracing off: engines get nothing
    assert tracing.engine_env(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == {
        "OTEL_SERVICE_NAME": "guardstream-engine"  # the endpoint itself is inherited
    }
    assert tracing.configure(settings, exporter=InMemorySpanExporter(), environ=environ)
    assert environ == for_engines
    tracing.shutdown()
    assert environ == {"OTEL_SERVICE_NAME": "mine"}
    assert tracing.TRACER is None


async def test_frames_without_output_detectors_record_no_events(
    fakes: tuple[FakeEngine, RecordingDetector],
) -> None:
    """Without output detectors every engine item is a frame (per token): nothing per frame."""
    engine, _ = fakes
    exporter = InMemorySpanExporter()
    async with orchestrator(native_config(engine.url), exporter) as url:
        async with aiohttp.ClientSession() as session:
            body = generation_body("Hi")
            async with session.post(url + STREAMING_PATH, json=body) as r:
                events = sse_events(await r.text())
        assert tracing.force_flush()
    (root,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert root.events == ()
    assert root.attributes["guardstream.frames"] == len(frames(events)) == 4
    assert root.attributes["guardstream.terminal"] == "completed"


def test_compose_tracing_profile_points_every_process_at_its_collector() -> None:
    deploy = ROOT / "deploy"
    main = yaml.safe_load((deploy / "docker-compose.yaml").read_text())
    overlay = yaml.safe_load((deploy / "docker-compose.tracing.yaml").read_text())
    services = overlay["services"]
    collector = services.pop("jaeger")
    assert collector["profiles"] == ["tracing"]
    # on the internal network the engines and the detector service are confined to
    assert collector["networks"] == ["default", "backend"]
    assert collector["ports"] == ["127.0.0.1:16686:16686"]
    # every guardstream process of the main file, and only those, traces to the collector
    assert (
        set(services)
        == {"orchestrator", "engine-0", "engine-1", "detectors"}
        <= set(main["services"])
    )
    names = set()
    for name, service in services.items():
        assert set(service) == {"environment"}, name
        env = service["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert env_wants_tracing(env), name
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == len(services)


async def test_every_surface_gets_its_request_span_errors_included(
    fakes: tuple[FakeEngine, RecordingDetector],
) -> None:
    engine, _ = fakes
    exporter = InMemorySpanExporter()
    async with orchestrator(native_config(engine.url), exporter) as url:
        async with aiohttp.ClientSession() as session:
            chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}
            async with session.post(url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                answer = await r.json()
            async with session.post(
                url + "/v1/responses", json={"model": "nope", "input": "Hi"}
            ) as r:
                assert r.status == 404, await r.text()
        assert tracing.force_flush()
    by_surface = {
        s.attributes["guardstream.surface"]: s
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.SERVER
    }
    assert set(by_surface) == {"chat_completions", "responses"}
    ok = by_surface["chat_completions"].attributes
    assert ok["guardstream.terminal"] == "completed"
    assert ok["guardstream.model"] == MODEL_ID
    assert ok["http.response.status_code"] == 200
    assert answer["choices"][0]["finish_reason"] == "stop"
    bad = by_surface["responses"]
    assert bad.attributes["http.response.status_code"] == 404
    assert "guardstream.terminal" not in bad.attributes  # refused before any pipeline existed
