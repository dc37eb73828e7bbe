"""Detectors against hostile requests (DESIGN 4 "Hostile input is expected", 6): a request's
regexes are refused unless the config allows them, and then run in RE2 (a ReDoS pattern finishes
on 100 KB); long scans leave the event loop free (shown with a gate, not a clock); a request can
never name a path or any other config-only param, and is refused before anything is opened;
the detector service requires its Bearer key, and the orchestrator's remote client sends it."""

from __future__ import annotations

import asyncio
import builtins
import io
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from detectors_support import detector_service, shared_anchor_classifier
from wait_support import until

import detectors
from detectors import InvalidParams, regex_pii
from detectors.service import create_app
from orchestrator.api.errors import ApiError
from orchestrator.api.fms_requests import DetectorParams
from orchestrator.clients.detectors import (
    DetectorCallError,
    HttpDetectorClient,
    InProcessDetectorClient,
)
from orchestrator.clients.registry import DetectorRegistry
from orchestrator.config import ConfigError, DetectorConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
URL = "/api/v1/text/contents"
REDOS = "(a+)+$"
NOT_ALLOWED = (
    "patterns: custom patterns come from the detector's config; a request may send them only "
    "when the config sets allow_request_patterns: true"
)
KEY = "s3cret-detector-key"
KEYS_ENV = "GUARDSTREAM_TEST_DETECTOR_KEYS"
KEY_ENV = "GUARDSTREAM_TEST_DETECTOR_KEY"


# --- request regexes ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", [{}, {"allow_request_patterns": False}, {"kinds": ["email"]}])
def test_a_request_pattern_is_refused_unless_the_config_allows_it(config: dict) -> None:
    with pytest.raises(InvalidParams) as info:
        detectors.validate_request_params("regex", config, {"patterns": {"redos": REDOS}})
    assert str(info.value) == NOT_ALLOWED
    assert isinstance(info.value, ValueError)  # what the orchestrator turns into its 422


def test_a_request_cannot_allow_patterns_itself() -> None:
    with pytest.raises(InvalidParams) as info:
        detectors.validate_request_params(
            "regex", {}, {"allow_request_patterns": True, "kinds": ["email"]}
        )
    assert str(info.value) == (
        "allow_request_patterns: set in the detector's config only "
        "(a request may set: kinds, threshold)"
    )
    # /registry tells clients what they may set
    assert detectors.build("regex").describe()["request_params"] == ["kinds", "threshold"]
    opened = detectors.build("regex", {"allow_request_patterns": True})
    assert opened.describe()["request_params"] == ["kinds", "patterns", "threshold"]


async def test_an_allowed_redos_pattern_runs_in_linear_time_with_exact_results() -> None:
    config = {"kinds": [], "allow_request_patterns": True}
    detectors.validate_request_params("regex", config, {"patterns": {"redos": REDOS}})
    det = detectors.build("regex", config)
    big = "a" * 100_000
    out = await det.detect(["a" * 30 + "!", big, "xx aaa"], {"patterns": {"redos": REDOS}})
    assert [[(d.detection, d.start, d.end) for d in per] for per in out] == [
        [],  # backtracking engines take 2^30 steps to say so
        [("redos", 0, 100_000)],
        [("redos", 3, 6)],
    ]
    # "a"*30 + "!" against the same pattern in the config
    fixed = detectors.build("regex", {"kinds": [], "patterns": {"redos": REDOS}})
    assert await fixed.detect(["a" * 30 + "!", big + "!"]) == [[], []]


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"look": "(?<=a)b"}, "patterns.look: does not compile as an RE2 pattern: invalid perl"),
        ({"back": r"(a)\1"}, "patterns.back: does not compile as an RE2 pattern: invalid escape"),
        (
            {"huge": "a{1001}"},
            "patterns.huge: does not compile as an RE2 pattern: invalid repetition size: {1001}",
        ),
        (
            {"big": r"(?:\pL{1,100}){1,10}"},
            "patterns.big: does not compile as an RE2 pattern: pattern too large",
        ),
        ({f"p{i}": "a" for i in range(9)}, "patterns: at most 8 patterns, got 9"),
        ({"long": "a" * 513}, "patterns: pattern 'long' must be 1-512 characters"),
        ({"email": "x"}, "patterns: pattern name 'email' is a built-in kind"),
        ({"n": 5}, "patterns.n: Input should be a valid string"),
    ],
)
def test_allowed_request_patterns_are_bounded(patterns: dict, message: str) -> None:
    with pytest.raises(InvalidParams) as info:
        detectors.validate_request_params(
            "regex", {"allow_request_patterns": True}, {"patterns": patterns}
        )
    assert str(info.value).startswith(message), str(info.value)


def test_a_config_pattern_re2_cannot_compile_is_a_config_error_naming_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "detectors": {
                    "pii": {
                        "builtin": "regex",
                        "params": {"patterns": {"ok": r"EMP-\d+", "look": "(?<=x)y"}},
                    }
                }
            }
        )
    assert info.value.errors == [
        "detectors.pii.params.patterns.look: does not compile as an RE2 pattern: "
        "invalid perl operator: (?<="
    ]


async def test_a_long_scan_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The long text's scan is held at a gate inside the scanner; the event loop meanwhile
    answers another detection. Were the scan on the loop, nothing could run until the gate's
    deadline, and `released` would say the gate was never opened."""
    real_find = regex_pii._find
    entered, gate, released = threading.Event(), threading.Event(), []
    long_text = "lorem ipsum " * 100 + "card 4111 1111 1111 1111"
    assert len(long_text) > regex_pii.INLINE_CHARS

    def gated(t: Any, *args: Any) -> Any:
        if t.text == long_text:
            entered.set()
            released.append(gate.wait(10))
        return real_find(t, *args)

    monkeypatch.setattr(regex_pii, "_find", gated)
    client = InProcessDetectorClient(
        "pii", DetectorConfig(builtin="regex"), detectors.build("regex")
    )
    held = asyncio.create_task(client.detect([long_text], {}))
    assert await asyncio.to_thread(entered.wait, 10)
    (quick,) = await client.detect(["mail a@b.com"], {"kinds": ["email"]})
    assert [(d.detection, d.start, d.end) for d in quick] == [("email", 5, 12)]
    assert not held.done()
    gate.set()
    (found,) = await held
    assert released == [True]
    assert [(d.detection, d.text) for d in found] == [("credit_card", "4111 1111 1111 1111")]


async def test_short_contents_are_scanned_on_the_loop_which_they_yield_every_inline_chars(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sentences cost less to scan than a thread hand-off, so they are scanned on the event
    loop, in the caller's thread; a call with many of them lets other tasks run after every
    INLINE_CHARS characters, and a long content among them goes to the thread."""
    real_find = regex_pii._find
    log: list[tuple[str, int]] = []

    def recording(t: Any, *args: Any) -> Any:
        log.append((t.text[:2], threading.get_ident()))
        return real_find(t, *args)

    monkeypatch.setattr(regex_pii, "_find", recording)
    sentence = "mail a@b.com " + "x" * (regex_pii.INLINE_CHARS // 4 - 13)  # a quarter each
    long_text = "zz " + "lorem ipsum " * (regex_pii.INLINE_CHARS // 10)
    assert len(sentence) == regex_pii.INLINE_CHARS // 4 and len(long_text) > regex_pii.INLINE_CHARS
    contents = [f"{i:02d}{sentence[2:]}" for i in range(10)]
    contents.insert(5, long_text)

    async def other_task() -> None:
        log.append(("other", threading.get_ident()))

    other = asyncio.create_task(other_task())
    results = await detectors.build("regex").detect(contents)
    await other
    loop_thread = threading.get_ident()
    inline = [(tag, ident) for tag, ident in log if tag != "zz"]
    # four quarters fit before the first yield; the other task runs there, then four more
    assert [tag for tag, _ in inline] == [
        *("00", "01", "02", "03"),
        "other",
        *("04", "05", "06", "07"),
        *("08", "09"),
    ]
    assert {ident for _, ident in inline} == {loop_thread}
    assert [ident for tag, ident in log if tag == "zz"] != [loop_thread]  # the thread's
    assert [[(d.detection, d.start, d.end) for d in r] for r in results] == [
        *([[("email", 5, 12)]] * 5),
        [],  # the long one: no PII
        *([[("email", 5, 12)]] * 5),
    ]


async def test_a_call_past_bulk_chars_is_scanned_in_the_thread_all_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole document chunked into sentences (issue 20: 1 MB, 20,000 sentences) would hold
    the loop for seconds even in INLINE_CHARS slices: past BULK_CHARS in one call, every
    content goes to the scan thread in one hand-off, with the same results."""
    real_find = regex_pii._find
    threads: list[int] = []

    def recording(t: Any, *args: Any) -> Any:
        threads.append(threading.get_ident())
        return real_find(t, *args)

    monkeypatch.setattr(regex_pii, "_find", recording)
    sentence = "Mail jo@example.com or call 555-123-4567 today. "
    contents = [sentence] * (regex_pii.BULK_CHARS // len(sentence) + 1)
    results = await detectors.build("regex").detect(contents)
    assert len(threads) == len(contents)
    assert threading.get_ident() not in threads
    assert all(
        [(d.detection, d.start, d.end) for d in r] == [("email", 5, 19), ("phone", 28, 40)]
        for r in results
    )
    threads.clear()
    await detectors.build("regex").detect(contents[:3])  # a stream's burst: on the loop
    assert threads == [threading.get_ident()] * 3


async def test_a_cancelled_scan_stops_at_its_next_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    real_spans = regex_pii._pattern_spans
    entered, gate, calls = threading.Event(), threading.Event(), []

    def gated(rx: Any, data: bytes) -> Any:
        calls.append(rx)
        entered.set()
        assert gate.wait(10)
        return real_spans(rx, data)

    monkeypatch.setattr(regex_pii, "_pattern_spans", gated)
    det = detectors.build("regex", {"kinds": [], "allow_request_patterns": True})
    task = asyncio.create_task(det.detect(["abc"], {"patterns": {"a": "a", "b": "b", "c": "c"}}))
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    done = threading.Event()
    regex_pii.scan_executor().submit(done.set)  # queued behind the abandoned scan
    assert await asyncio.to_thread(done.wait, 10)
    assert len(calls) == 1  # the second and third patterns never ran


# --- config-only params, paths --------------------------------------------------------------


@contextmanager
def no_filesystem() -> Iterator[list[str]]:
    """Every way of touching a path raises (and is recorded) inside the block; restored on
    exit, before pytest itself reads files to report anything."""
    touched: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        touched.append(str(args[0]) if args else "?")
        raise AssertionError(f"filesystem touched: {args[:1]}")

    saved = []
    for owner, name in [
        (builtins, "open"),
        (io, "open"),
        (os, "stat"),
        (os, "lstat"),
        (os, "open"),
        (os, "listdir"),
        (os, "scandir"),
        (os, "access"),
        (pathlib.Path, "stat"),
        (pathlib.Path, "open"),
        (pathlib.Path, "exists"),
        (pathlib.Path, "is_dir"),
        (pathlib.Path, "is_file"),
        (pathlib.Path, "read_text"),
    ]:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, refuse)
    try:
        yield touched
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.mark.parametrize(
    "model_path",
    ["/nonexistent/never-opened", "/proc/self/environ", "../../etc", "~/models", ""],
)
def test_model_path_in_a_request_is_refused_without_touching_the_filesystem(
    model_path: str,
) -> None:
    config = {"model_path": str(shared_anchor_classifier()), "threshold": 0.5}
    with no_filesystem() as touched, pytest.raises(InvalidParams) as info:
        detectors.validate_request_params("hf_classifier", config, {"model_path": model_path})
    assert touched == []
    assert str(info.value) == (
        "model_path: set in the detector's config only "
        "(a request may set: min_score, safe_labels, threshold, thresholds)"
    )


async def test_a_built_detector_refuses_model_path_before_opening_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    det = detectors.build("hf_classifier", {"model_path": str(shared_anchor_classifier())})
    opened: list[str] = []
    real_stat = os.stat

    def watch(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", watch)
    with pytest.raises(InvalidParams, match="model_path: set in the detector's config only"):
        await det.detect(["x"], {"model_path": "/nonexistent/evil"})
    # a request's own settings are checked against the model's labels, read at build time
    with pytest.raises(InvalidParams, match="thresholds: unknown label 'x'"):
        await det.detect(["x"], {"thresholds": {"x": 0.5}})
    assert opened == []


@pytest.mark.parametrize(
    ("builtin", "config", "allowed"),
    [
        ("regex", {}, {"kinds", "threshold"}),
        ("regex", {"allow_request_patterns": True}, {"kinds", "patterns", "threshold"}),
        ("profanity", {}, {"min_score", "threshold"}),
        ("prompt_injection", {}, {"min_score", "threshold"}),
        ("topic", {}, {"min_score", "threshold", "topics"}),
        ("hf_classifier", None, {"min_score", "safe_labels", "threshold", "thresholds"}),
    ],
)
def test_every_param_but_the_declared_ones_is_config_only(
    builtin: str, config: dict | None, allowed: set[str]
) -> None:
    if config is None:
        config = {"model_path": str(shared_anchor_classifier())}
    cls = detectors.detector_class(builtin)
    assert cls.request_param_names(config) == allowed
    for name in set(cls.Params.model_fields) - allowed:
        with pytest.raises(InvalidParams) as info:
            detectors.validate_request_params(builtin, config, {name: None})
        expected = NOT_ALLOWED if name == "patterns" else f"{name}: set in the detector's config"
        assert str(info.value).startswith(expected), str(info.value)
    with pytest.raises(InvalidParams, match=r"^nope: unknown parameter"):
        detectors.validate_request_params(builtin, config, {"nope": 1})
    with pytest.raises(InvalidParams, match="detector_params: must be an object"):
        detectors.validate_request_params(builtin, config, ["x"])


def test_declared_request_params_are_still_validated() -> None:
    path = str(shared_anchor_classifier())
    cases = [
        ("hf_classifier", {"model_path": path}, {"thresholds": {"sports": 2}}, "thresholds.sports"),
        ("hf_classifier", {"model_path": path}, {"safe_labels": ["x"]}, "safe_labels: unknown"),
        ("topic", {}, {"topics": {"a": []}}, "topics: topic 'a' needs 1-64 example phrases"),
        ("profanity", {}, {"min_score": 2}, "min_score: Input should be less than or equal"),
        ("regex", {}, {"kinds": ["emial"]}, "kinds.0: Input should be"),
    ]
    for builtin, config, request, message in cases:
        with pytest.raises(InvalidParams) as info:
            detectors.validate_request_params(builtin, config, request)
        assert message in str(info.value), (builtin, str(info.value))
    detectors.validate_request_params(
        "hf_classifier", {"model_path": path}, {"thresholds": {"sports": 0.9}, "min_score": 0.2}
    )


async def test_the_orchestrator_registry_answers_422_before_any_work() -> None:
    config = parse_config(
        {
            "detectors": {
                "pii": {"builtin": "regex", "params": {"threshold": 0.7}},
                "open": {"builtin": "regex", "params": {"allow_request_patterns": True}},
                "clf": {
                    "builtin": "hf_classifier",
                    "params": {"model_path": str(shared_anchor_classifier())},
                },
            }
        }
    )
    async with aiohttp.ClientSession() as session:
        registry = DetectorRegistry(config, session, device="cpu")
        try:
            cases = [
                ({"pii": {"patterns": {"r": REDOS}}}, f"output.pii: {NOT_ALLOWED}"),
                ({"clf": {"model_path": "/etc"}}, "output.clf: model_path: set in the detector"),
                ({"clf": {"max_queue": 1}}, "output.clf: max_queue: set in the detector"),
                (
                    {"open": {"patterns": {"look": "(?<=a)"}}},
                    "output.open: patterns.look: does not compile as an RE2 pattern",
                ),
            ]
            for requested, message in cases:
                parsed = {k: DetectorParams.model_validate(v) for k, v in requested.items()}
                with pytest.raises(ApiError) as info:
                    registry.resolve(parsed, "output", "output")
                assert info.value.code == 422
                assert info.value.details.startswith(message), info.value.details
            parsed = {
                "pii": DetectorParams.model_validate({"threshold": 0.9, "kinds": ["email"]}),
                "open": DetectorParams.model_validate({"patterns": {"r": REDOS}}),
            }
            resolved = registry.resolve(parsed, "output", "output")
            assert [(r.detector_id, r.params, r.threshold) for r in resolved] == [
                ("open", {"patterns": {"r": REDOS}}, 0.5),
                ("pii", {"kinds": ["email"]}, 0.9),
            ]
        finally:
            await registry.close()


# --- the detector service: refusals over HTTP, Bearer auth ---------------------------------------


async def test_the_service_refuses_request_regexes_and_paths_with_422(aiohttp_client: Any) -> None:
    app = create_app(
        {
            "pii": detectors.build("regex"),
            "clf": detectors.build(
                "hf_classifier", {"model_path": str(shared_anchor_classifier())}
            ),
        },
        warmup=False,
    )
    client = await aiohttp_client(app)
    cases = [
        ("pii", {"patterns": {"r": REDOS}}, f"detector_params: {NOT_ALLOWED}"),
        (
            "clf",
            {"model_path": "/nonexistent"},
            "detector_params: model_path: set in the detector's config only "
            "(a request may set: min_score, safe_labels, threshold, thresholds)",
        ),
        (
            "clf",
            {"batching": False},
            "detector_params: batching: set in the detector's config only "
            "(a request may set: min_score, safe_labels, threshold, thresholds)",
        ),
    ]
    for detector_id, params, message in cases:
        resp = await client.post(
            URL,
            json={"contents": ["a" * 30 + "!"], "detector_params": params},
            headers={"detector-id": detector_id},
        )
        assert resp.status == 422
        assert await resp.json() == {"code": 422, "message": message}


SERVICE_CONFIG = {
    "server": {"api_keys_env": KEYS_ENV},
    "detectors": {
        "pii": {"builtin": "regex"},
        "open": {"builtin": "regex", "params": {"allow_request_patterns": True, "kinds": []}},
    },
}


def test_the_service_requires_its_bearer_key_except_on_health_and_metrics(tmp_path: Path) -> None:
    async def calls(port: int) -> list[tuple[str, int, Any, str | None]]:
        base = f"http://127.0.0.1:{port}"
        body = {"contents": ["mail a@b.com"]}
        out: list[tuple[str, int, Any, str | None]] = []
        async with aiohttp.ClientSession() as session:
            for name, method, path, headers, payload in [
                ("health", "GET", "/health", {}, None),
                ("no key", "POST", URL, {}, body),
                ("wrong key", "POST", URL, {"Authorization": "Bearer nope"}, body),
                ("wrong scheme", "POST", URL, {"Authorization": f"Basic {KEY}"}, body),
                ("registry", "GET", "/registry", {}, None),
                ("metrics", "GET", "/metrics", {}, None),
                ("unknown path", "GET", "/nope", {}, None),
                ("key", "POST", URL, {"Authorization": f"Bearer {KEY}"}, body),
                ("second key", "POST", URL, {"Authorization": "bearer other-key"}, body),
                (
                    "redos",
                    "POST",
                    URL,
                    {"Authorization": f"Bearer {KEY}"},
                    {"contents": ["a" * 30 + "!"], "detector_params": {"patterns": {"r": REDOS}}},
                ),
            ]:
                async with session.request(
                    method,
                    base + path,
                    json=payload,
                    headers={"detector-id": "pii", **headers},
                ) as resp:
                    data = await resp.json() if resp.content_type == "application/json" else None
                    out.append((name, resp.status, data, resp.headers.get("WWW-Authenticate")))
            async with session.post(
                base + URL,
                json={
                    "contents": ["a" * 30 + "!", "b aa"],
                    "detector_params": {"patterns": {"r": REDOS}},
                },
                headers={"detector-id": "open", "Authorization": f"Bearer {KEY}"},
            ) as resp:
                out.append(("allowed redos", resp.status, await resp.json(), None))
        return out

    keys = {KEYS_ENV: f" {KEY}, other-key ,"}
    with detector_service(tmp_path, SERVICE_CONFIG, "--no-warmup", env=keys) as service:
        results = {name: tuple(rest) for name, *rest in asyncio.run(calls(service.port))}
    unauthorized = (401, {"code": 401, "message": "missing or invalid API key"}, "Bearer")
    assert results["health"] == (200, {"status": "ok"}, None)
    assert results["metrics"][0] == 200  # Prometheus scrapes without a key; counters only
    for name in ("no key", "wrong key", "wrong scheme", "registry", "unknown path"):
        assert results[name] == unauthorized, name
    email = {
        "start": 5,
        "end": 12,
        "text": "a@b.com",
        "detection": "email",
        "detection_type": "pii",
        "score": 1.0,
    }
    assert results["key"] == (200, [[email]], None)
    assert results["second key"] == (200, [[email]], None)
    assert results["redos"] == (
        422,
        {"code": 422, "message": f"detector_params: {NOT_ALLOWED}"},
        None,
    )
    assert results["allowed redos"] == (
        200,
        [
            [],
            [
                {
                    "start": 2,
                    "end": 4,
                    "text": "aa",
                    "detection": "r",
                    "detection_type": "pii",
                    "score": 1.0,
                }
            ],
        ],
        None,
    )


@pytest.mark.parametrize(("value", "state"), [(None, "is not set"), (" , ", "holds no key")])
def test_the_service_refuses_to_start_open_by_accident(
    tmp_path: Path, value: str | None, state: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(SERVICE_CONFIG))
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    if value is not None:
        env[KEYS_ENV] = value
    proc = subprocess.run(
        [sys.executable, "-m", "detectors", "serve", "--config", str(path), "--port", "0"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"error: server.api_keys_env: environment variable {KEYS_ENV} {state}" in proc.stderr


# --- the orchestrator's remote client sends the key ---------------------------------------------


async def test_http_detector_client_sends_the_key_from_its_env(
    aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await aiohttp_server(
        create_app({"pii": detectors.build("regex")}, api_keys=[KEY], warmup=False)
    )
    url = f"http://127.0.0.1:{server.port}"
    remote = DetectorConfig(url=url, api_key_env=KEY_ENV)
    async with aiohttp.ClientSession() as session:
        monkeypatch.delenv(KEY_ENV, raising=False)
        with pytest.raises(ConfigError) as info:
            HttpDetectorClient("pii", remote, session)
        assert info.value.errors == [
            f"detectors.pii.api_key_env: environment variable {KEY_ENV} is not set"
        ]

        monkeypatch.setenv(KEY_ENV, KEY)
        client = HttpDetectorClient("pii", remote, session)
        (found,) = await client.detect(["mail a@b.com"], {})
        assert [(d.detection, d.start, d.end) for d in found] == [("email", 5, 12)]
        assert await client.health()

        monkeypatch.setenv(KEY_ENV, "wrong")
        wrong = HttpDetectorClient("pii", remote, session)
        with pytest.raises(DetectorCallError) as call:
            await wrong.detect(["x"], {})
        # the detector's own words stay in the log (DESIGN 6: a peer is never quoted)
        assert call.value.message == "HTTP 401 (check the detector's api_key_env)"
        assert not call.value.invalid_params

        keyless = HttpDetectorClient("pii", DetectorConfig(url=url), session)
        assert await keyless.health()  # /health is open
        with pytest.raises(DetectorCallError, match="HTTP 401"):
            await keyless.detect(["x"], {})


async def test_the_service_answers_a_too_deeply_nested_body_with_422(aiohttp_client: Any) -> None:
    """Nesting past the interpreter's recursion limit is a malformed body, not a 500."""
    client = await aiohttp_client(create_app({"pii": detectors.build("regex")}, warmup=False))
    for depth in (5_000, 100_000):  # parsed inline, and in a thread (past BULK_BODY_BYTES)
        resp = await client.post(
            URL, data="[" * depth + "]" * depth, headers={"detector-id": "pii"}
        )
        assert resp.status == 422
        assert await resp.json() == {
            "code": 422,
            "message": "malformed JSON body: nested too deeply",
        }


async def test_the_service_parses_and_encodes_bulk_off_its_loop(
    aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body past BULK_BODY_BYTES is parsed, and a reply past BULK_DETECTIONS encoded, in a
    worker thread; a small one inline (where the work ran, never how long it took)."""
    from detectors import service

    seen: list[int] = []
    real = service._parse_contents

    def parse(raw: bytes) -> Any:
        seen.append(threading.get_ident())
        return real(raw)

    monkeypatch.setattr(service, "_parse_contents", parse)
    client = await aiohttp_client(create_app({"pii": detectors.build("regex")}, warmup=False))
    loop_thread = threading.get_ident()
    small = {"contents": ["Mail jo@example.com today."]}
    resp = await client.post(URL, json=small, headers={"detector-id": "pii"})
    assert resp.status == 200
    assert [[d["text"] for d in r] for r in await resp.json()] == [["jo@example.com"]]
    sentence = "Mail jo@example.com today. "
    big = {"contents": [sentence * 100] * 30}  # 81 KB, 3,000 detections
    resp = await client.post(URL, json=big, headers={"detector-id": "pii"})
    assert resp.status == 200
    reply = await resp.json()
    assert [len(r) for r in reply] == [100] * 30
    assert reply[29][99]["start"] == 99 * len(sentence) + 5
    assert seen[0] == loop_thread and seen[1] != loop_thread


# -- a request's topics (the `topic` detector embeds its example phrases) --------------------------


async def test_the_service_bounds_the_topic_phrases_a_request_may_send(aiohttp_client: Any) -> None:
    """A request's `topics` are embedded before its contents: 64 topics of 64 phrases of 1,000
    characters were ~7 minutes of the model's one thread on this CPU (64 phrases: 6.4 s),
    which every other request waited behind. Past 16,000 characters of phrases it is a 422."""
    client = await aiohttp_client(create_app({"topic": detectors.build("topic")}, warmup=False))
    topics = {f"t{i}": ["x" * 1000, "y" * 1000] for i in range(8)}  # 16,000: the bound
    over = {**topics, "t8": ["z"]}
    for params, status in ((over, 422), (topics, None)):
        resp = await client.post(
            URL,
            json={"contents": [" "], "detector_params": {"topics": params}},
            headers={"detector-id": "topic"},
        )
        if status is None:
            assert resp.status == 200, await resp.text()
            continue
        assert resp.status == 422
        assert await resp.json() == {
            "code": 422,
            "message": "detector_params: topics: at most 16000 characters of example phrases "
            "in a request, got 16001",
        }


async def test_request_topic_sets_embedded_at_once_are_bounded_the_configs_never() -> None:
    """While the model's thread is busy, two request topic sets wait to be embedded; a third
    new one is refused at once (Overloaded: 503 from the service) rather than queueing work
    without bound; a request for a set already waiting shares it, and the config's own topics
    are never refused."""
    det = detectors.build("topic", {"topics": {"cfg": ["weather forecast"]}})
    await det.warmup()
    gate = threading.Event()
    busy = det.runtime.executor.submit(gate.wait)
    try:
        waiting = [
            asyncio.ensure_future(det.detect(["rain"], {"topics": {name: [name + " phrase"]}}))
            for name in ("a", "b")
        ]
        await until(lambda: len(det._inflight) == 2, what="two topic sets waiting")
        third = asyncio.ensure_future(det.detect(["rain"], {"topics": {"c": ["c phrase"]}}))
        await until(third.done, what="the third set refused at once")
        with pytest.raises(detectors.Overloaded) as refused:
            await third
        assert str(refused.value) == (
            "topic: 2 request topic sets are being embedded (at most 2 at once)"
        )
        shared = asyncio.ensure_future(det.detect(["rain"], {"topics": {"a": ["a phrase"]}}))
        config = asyncio.ensure_future(det.detect(["rain"]))
        await until(lambda: len(det._inflight) == 3, what="the config's set waiting")
    finally:
        gate.set()
    busy.result()
    for task in (*waiting, shared, config):
        await task
    assert (await config)[0][0].detection == "cfg"
