"""deploy/grafana/guardstream.json against the real services.

The file is a Grafana dashboard with the panels an operator needs; every query parses as PromQL
(promql-parser, the Prometheus grammar); and every metric and label a query names is on a real
`GET /metrics` after real requests, scraped without a key from services that require keys, as
Prometheus scrapes them in deploy/: the orchestrator (fake engines that migrate and fail, remote
detectors on the real detector service), a real tiny-random engine, the detector service. A
query that names `guardstream_frames` where Prometheus stores `guardstream_frames_total`, rates a
gauge, groups by a label the series lack, or charts a metric that was renamed, fails here."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import promql_parser
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from detectors.service import create_app as create_detector_app
from generation import models
from generation.server import create_app as create_engine_app
from orchestrator.app import STREAMING_PATH
from tests.fakes.engine import FakeEngine, Fault
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    frames,
    generation_body,
    native_config,
    remote,
    terminal,
)

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD: dict[str, Any] = json.loads((ROOT / "deploy/grafana/guardstream.json").read_text())
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# What Grafana puts in place of its built-in variables before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
# Labels Prometheus adds to every scraped series (they are on no /metrics page).
TARGET_LABELS = frozenset({"job", "instance"})
# Functions whose argument must be a counter (or a histogram's cumulative series).
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase"})

# A panel the dashboard must have, and a series it must chart.
REQUIRED_PANELS = {
    "Active streams": "guardstream_active_streams",
    "Requests by endpoint and status": "guardstream_requests_total",
    "Frames/s": "guardstream_frames_total",
    "Detections by detector": "guardstream_detections_total",
    "Detector call latency": "guardstream_detector_latency_seconds_bucket",
    "Hold-back time": "guardstream_frame_hold_back_seconds_bucket",
    "Event loop lag": "guardstream_event_loop_lag_seconds_bucket",
    "Time in garbage collection": "guardstream_gc_pause_seconds_sum",
    "Migrations": "guardstream_migrations_total",
    "Engine tokens/s": "guardstream_engine_tokens_generated_total",
    "Engine decode batch size": "guardstream_engine_decode_batch_size_bucket",
}

CLIENT_KEY = "client-key"
ENGINE_KEY = "engine-key"
DETECTORS_KEY = "detectors-key"
# Two sentences: PII (the email) in the first, HAP in the second.
SCRIPT = ["Write", " to", " bob@example.com", ".", " You", " idiot", "!"]


# -- the dashboard ------------------------------------------------------------------------------


def panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves excluded."""
    out = []
    for panel in DASHBOARD["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def as_sent(expr: str) -> str:
    """A target's query as Grafana sends it to Prometheus: its variables replaced."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace("${" + variable[1:] + "}", value).replace(variable, value)
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr


def queries() -> list[tuple[str, str]]:
    """(panel title / refId, the query as sent) for every target."""
    return [
        (f"{panel['title']} / {target['refId']}", as_sent(target["expr"]))
        for panel in panels()
        for target in panel["targets"]
    ]


@dataclass(frozen=True)
class Selector:
    """A series a query reads: its name, the labels it matches on, the labels it is grouped by
    (`by (...)` of an enclosing aggregation) and the function applied to it directly, if any."""

    name: str
    matched: frozenset[str]
    grouped: frozenset[str]
    function: str | None


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of a query, with what the query asks of its labels."""
    out: list[Selector] = []

    def visit(node: Any, grouped: frozenset[str], function: str | None) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            matched = frozenset(m.name for m in node.matchers.matchers) - {"__name__"}
            out.append(Selector(node.name, matched, grouped, function))
        elif isinstance(node, promql_parser.MatrixSelector):
            visit(node.vector_selector, grouped, function)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                visit(arg, grouped, node.func.name)
        elif isinstance(node, promql_parser.AggregateExpr):
            modifier = node.modifier
            inner = grouped
            if modifier is not None:
                assert modifier.type == promql_parser.AggModifierType.By, f"use `by` in {expr}"
                inner = grouped | frozenset(modifier.labels)
            visit(node.expr, inner, None)
        elif isinstance(node, promql_parser.BinaryExpr):
            assert node.modifier is None or not node.modifier.matching, (
                f"vector matching (on/ignoring) is not checked here: {expr}"
            )
            visit(node.lhs, grouped, None)
            visit(node.rhs, grouped, None)
        elif isinstance(node, promql_parser.ParenExpr | promql_parser.UnaryExpr):
            visit(node.expr, grouped, function)
        else:
            assert isinstance(node, promql_parser.NumberLiteral), f"{type(node)} in {expr}"

    visit(promql_parser.parse(expr), frozenset(), None)
    return out


def test_the_dashboard_is_a_grafana_dashboard_with_the_required_panels() -> None:
    assert DASHBOARD["uid"] == "guardstream" and DASHBOARD["title"] == "guardstream"
    assert isinstance(DASHBOARD["schemaVersion"], int)
    (variable,) = DASHBOARD["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    ids = [p["id"] for p in DASHBOARD["panels"]] + [
        p["id"] for row in DASHBOARD["panels"] for p in row.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = [p["title"] for p in panels()]
    assert len(titles) == len(set(titles)), "panel titles are unique"
    for panel in panels():
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["description"], panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["legendFormat"], panel["title"]
    by_title = {p["title"]: p for p in panels()}
    for title, series in REQUIRED_PANELS.items():
        assert title in by_title, f"missing panel {title!r}"
        targets = by_title[title]["targets"]
        names = {s.name for t in targets for s in selectors(as_sent(t["expr"]))}
        assert series in names, f"{title!r} charts {names}, not {series}"


def test_the_panels_tile_the_grid_without_overlapping() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in DASHBOARD["panels"]:  # rows take a line of their own
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        for y in range(g["y"], g["y"] + g["h"]):
            for x in range(g["x"], g["x"] + g["w"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize(("where", "expr"), queries(), ids=[w for w, _ in queries()])
def test_every_query_parses_as_promql(where: str, expr: str) -> None:
    found = selectors(expr)
    assert found, f"{where}: reads no series"
    for s in found:
        if s.name.endswith("_bucket"):
            # a quantile needs the bucket boundaries: histogram_quantile over `by (le, ...)`
            assert s.function in COUNTER_FUNCTIONS and "le" in s.grouped, where
            assert "histogram_quantile" in expr, where


# -- the real /metrics pages --------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    component: str
    family_type: str  # counter | gauge | histogram | ...
    labels: frozenset[str]


def exposition(component: str, text: str) -> dict[str, list[Series]]:
    """{sample name: its series} of one /metrics page, parsed by prometheus_client."""
    out: dict[str, list[Series]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series = Series(component, family.type, frozenset(sample.labels))
            out.setdefault(sample.name, []).append(series)
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str) -> str:
    """GET /metrics without a key, as the deployments' Prometheus does."""
    async with session.get(base_url + "/metrics") as r:
        assert r.status == 200, f"{base_url}/metrics: {r.status}"
        assert r.headers["Content-Type"].startswith("text/plain")
        return await r.text()


@pytest.fixture
async def detector_service(keys: None, aiohttp_server: Any) -> str:
    """The real detector service from a config like deploy/detectors.yaml: regex PII and the
    profanity (HAP) model, micro-batched, behind the key `server.api_keys_env` names."""
    config = {
        "server": {"api_keys_env": "TEST_DETECTORS_KEY"},
        "detectors": {"pii": {"builtin": "regex"}, "hap": {"builtin": "profanity"}},
    }
    server: TestServer = await aiohttp_server(create_detector_app(config, warmup=False))
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def fake_engines() -> AsyncIterator[dict[str, list[FakeEngine]]]:
    """Replicas per model, each model failing its own way so that every migration series moves:
    both replicas of MODEL reset their first stream after two tokens (two migrations, then it
    completes); `exhausted` resets with migration off; `unmigratable` sends an in-band error
    that is not the replica's trouble; `finished` ends after the last token without
    complete_final (the model had finished: completed without re-dispatch)."""
    groups = {
        MODEL: [FakeEngine(script=list(SCRIPT), fail=Fault("close", after_tokens=2)) for _ in "ab"],
        "exhausted": [FakeEngine(script=list(SCRIPT), fail=Fault("close", after_tokens=1))],
        "unmigratable": [
            FakeEngine(
                script=list(SCRIPT),
                fail=Fault("error", after_tokens=1, error_type="generation_error"),
            )
        ],
        "finished": [FakeEngine(script=list(SCRIPT), fail=Fault("eof", after_tokens=len(SCRIPT)))],
    }
    for group in groups.values():
        for engine in group:
            await engine.start()
    yield groups
    for group in groups.values():
        for engine in group:
            await engine.close()


def orchestrator_config(engines: dict[str, list[FakeEngine]], detectors_url: str) -> dict[str, Any]:
    """Shaped like deploy/'s: client keys, a key per engine and detector service."""
    cfg = native_config(
        engines[MODEL][0].url,
        # the deployments open /metrics to their Prometheus (public_metrics), nothing else
        server={"api_keys_env": "TEST_CLIENT_KEYS", "public_metrics": True},
        chunkers={"sentence": {"type": "sentence"}},
        detectors={
            name: remote(detectors_url, api_key_env="TEST_DETECTORS_KEY") for name in ("pii", "hap")
        },
    )
    # a remote detector whose input verdicts are kept, in a partition of one entry: the cache's
    # hits, misses and evictions reach /metrics
    cfg["detection_cache"] = {"max_entries_per_tenant": 1}
    cfg["detectors"]["pii"]["cache"] = True
    for model, group in engines.items():
        cfg["models"][model] = {
            "backends": [
                {"type": "native", "url": e.url, "api_key_env": "TEST_ENGINE_KEY"} for e in group
            ],
            "migration": {"limit": 3 if model == MODEL else 0, "quarantine_s": 0},
        }
    return cfg


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables the configs name, as the deployments' Secrets / env files set them."""
    monkeypatch.setenv("TEST_CLIENT_KEYS", CLIENT_KEY)
    monkeypatch.setenv("TEST_ENGINE_KEY", ENGINE_KEY)
    monkeypatch.setenv("TEST_DETECTORS_KEY", DETECTORS_KEY)


async def orchestrator_metrics(
    engines: dict[str, list[FakeEngine]], detectors_url: str
) -> dict[str, str]:
    """Real requests through the orchestrator, then its /metrics (and the detector service's,
    which the orchestrator's remote detectors called)."""
    auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    async with Orchestrator(orchestrator_config(engines, detectors_url)) as orch:
        assert orch.session is not None
        body = generation_body("Say it.", output={"pii": {}, "hap": {}})
        events = await orch.stream(body, headers=auth)
        assert terminal(events).name == "completed"
        assert terminal(events).data["migrations"] == 2
        found = {
            t["detector_id"]: t["word"]
            for f in frames(events)
            for t in f.get("token_classification_results", {}).get("output", [])
        }
        assert found == {"pii": "bob@example.com", "hap": "You idiot!"}
        # the failures: an `error` event (no frame had been sent), or `completed` for the model
        # that had finished before its replica failed
        outcomes = {}
        for model in ("exhausted", "unmigratable", "finished"):
            events = await orch.stream({**body, "model_id": model}, headers=auth)
            end = terminal(events)
            outcomes[model] = (end.name, end.data.get("type"))
        assert outcomes == {
            "exhausted": ("error", "generation_unavailable"),
            "unmigratable": ("error", "generation_error"),
            "finished": ("completed", None),
        }
        # input judged by the cached pii: a miss, a miss that evicts it, a hit
        for text in ("Say it.", "Say it again.", "Say it again."):
            events = await orch.stream(generation_body(text, input={"pii": {}}), headers=auth)
            assert terminal(events).name == "completed"
        pages = {"orchestrator": await scrape(orch.session, orch.url)}
        pages["detector service"] = await scrape(orch.session, detectors_url)
        # both require keys for everything else: /metrics is open, the services are not
        async with orch.session.post(orch.url + STREAMING_PATH, json=body) as r:
            assert r.status == 401
        contents = {"contents": ["You idiot!"], "detector_params": {}}
        async with orch.session.post(
            detectors_url + "/api/v1/text/contents", json=contents, headers={"detector-id": "hap"}
        ) as r:
            assert r.status == 401
    # the deployment's wiring: the orchestrator sends each engine the key its config names
    for group in engines.values():
        for engine in group:
            assert engine.requests, engine.url
            assert {r.headers["Authorization"] for r in engine.requests} == {f"Bearer {ENGINE_KEY}"}
    return pages


async def engine_metrics(aiohttp_server: Any, model: models.LoadedModel) -> str:
    """A real tiny-random engine that requires a key, as deployed: a generation with the key,
    then /metrics without one."""
    server: TestServer = await aiohttp_server(create_engine_app(model, api_keys=[ENGINE_KEY]))
    url = str(server.make_url("")).rstrip("/")
    body = {"prompt": "a", "max_new_tokens": 4}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/generate", json=body) as r:
            assert r.status == 401  # the engine is not open; only its /metrics is
        headers = {"Authorization": f"Bearer {ENGINE_KEY}"}
        async with session.post(url + "/v1/generate", json=body, headers=headers) as r:
            assert r.status == 200
            lines = [json.loads(line) for line in (await r.text()).splitlines()]
        assert lines[-1] == {"complete_final": True}
        return await scrape(session, url)


async def test_every_series_a_query_reads_is_on_a_real_metrics_page(
    keys: None,
    fake_engines: dict[str, list[FakeEngine]],
    detector_service: str,
    aiohttp_server: Any,
    tiny_model: models.LoadedModel,
) -> None:
    pages = await orchestrator_metrics(fake_engines, detector_service)
    pages["engine"] = await engine_metrics(aiohttp_server, tiny_model)
    exposed: dict[str, list[Series]] = {}
    for component, text in pages.items():
        for name, series in exposition(component, text).items():
            assert name not in exposed, f"{name} is on two components' pages"
            exposed[name] = series

    problems = []
    charted = set()
    for where, expr in queries():
        for s in selectors(expr):
            series = exposed.get(s.name)
            if not series:
                problems.append(f"{where}: no series {s.name} on any /metrics page")
                continue
            charted.add(s.name)
            labels = frozenset().union(*(x.labels for x in series)) | TARGET_LABELS
            if not (s.matched | s.grouped) <= labels:
                missing = sorted((s.matched | s.grouped) - labels)
                problems.append(f"{where}: {s.name} has no label {missing}")
            family_type = series[0].family_type
            if s.function in COUNTER_FUNCTIONS and family_type not in ("counter", "histogram"):
                problems.append(f"{where}: {s.function}() of the {family_type} {s.name}")
            if family_type != "gauge" and s.function not in COUNTER_FUNCTIONS:
                problems.append(f"{where}: the cumulative {s.name} outside rate() or increase()")
    assert problems == []

    # and the dashboard charts every series the three components expose (a histogram through
    # its buckets, or its sum and count; the `_created` timestamps are not charted)
    families = {
        re.sub(r"_(total|bucket|sum|count)$", "", name)
        for name in exposed
        if not name.endswith("_created")
    }
    uncharted = {f for f in families if not any(c.startswith(f) for c in charted)}
    assert uncharted == set()
