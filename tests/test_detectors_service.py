"""The detector service over real HTTP on 127.0.0.1: replies (one list per content, in order),
every error case with its status and `{"code", "message"}` body, /health, /registry, /metrics,
and `python -m detectors serve --config ... --port 0` as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from detectors_support import (
    ANCHORS,
    detector_service,
    detector_service_async,
    shared_anchor_classifier,
)

import detectors
from detectors import Detection, Detector, DetectorError, Overloaded
from detectors.service import ConfigError, Limits, create_app, detectors_from_config
from tests.http_support import Reply, exchange_at, post_head
from tests.wait_support import until

ROOT = Path(__file__).resolve().parents[1]
URL = "/api/v1/text/contents"
LIMITS = Limits(max_contents=4, max_content_chars=200, max_total_chars=300, max_body_bytes=4000)


class Scripted(Detector):
    """A detector that fails the way it is told to."""

    name = "scripted"

    def __init__(self, failure: BaseException | None = None, drop_one: bool = False) -> None:
        super().__init__({})
        self.failure = failure
        self.drop_one = drop_one

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        if self.failure is not None:
            raise self.failure
        return [[] for _ in contents][: -1 if self.drop_one else None]


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    dets: dict[str, Detector] = {
        "pii": detectors.build("regex"),
        "custom": detectors.build("regex", {"allow_request_patterns": True}),
        "hap": detectors.build("profanity"),
        "crash": Scripted(RuntimeError("boom")),
        "failing": Scripted(DetectorError("model exploded")),
        "busy": Scripted(Overloaded("queue full")),
        "short": Scripted(drop_one=True),
    }
    app = create_app(dets, limits=LIMITS)
    return await aiohttp_client(app)


async def post(client: Any, body: Any, detector_id: str | None = "pii", raw: bytes | None = None):
    headers = {"content-type": "application/json"}
    if detector_id is not None:
        headers["detector-id"] = detector_id
    data = raw if raw is not None else json.dumps(body).encode()
    resp = await client.post(URL, data=data, headers=headers)
    return resp.status, await resp.json()


async def test_reply_has_one_list_per_content_in_order(client: Any) -> None:
    contents = ["mail a@b.com", "nothing here", "", "ip 10.0.0.1 then c@d.org"]
    status, body = await post(client, {"contents": contents})
    assert status == 200
    assert body == [
        [
            {
                "start": 5,
                "end": 12,
                "text": "a@b.com",
                "detection": "email",
                "detection_type": "pii",
                "score": 1.0,
            }
        ],
        [],
        [],
        [
            {
                "start": 3,
                "end": 11,
                "text": "10.0.0.1",
                "detection": "ipv4",
                "detection_type": "pii",
                "score": 1.0,
            },
            {
                "start": 17,
                "end": 24,
                "text": "c@d.org",
                "detection": "email",
                "detection_type": "pii",
                "score": 1.0,
            },
        ],
    ]
    status, body = await post(client, {"contents": []})
    assert (status, body) == (200, [])


async def test_detector_params_reach_the_detector(client: Any) -> None:
    status, body = await post(
        client,
        {
            "contents": ["ticket T-42 a@b.com"],
            "detector_params": {"kinds": [], "patterns": {"ticket": r"T-\d+"}},
        },
        "custom",
    )
    assert status == 200
    assert [(d["detection"], d["start"], d["end"]) for d in body[0]] == [("ticket", 7, 11)]
    status, body = await post(
        client, {"contents": ["ticket T-42 a@b.com"], "detector_params": {"kinds": ["email"]}}
    )
    assert status == 200
    assert [(d["detection"], d["start"], d["end"]) for d in body[0]] == [("email", 12, 19)]


async def test_model_detector_over_http(client: Any) -> None:
    status, body = await post(
        client, {"contents": ["You are a fucking idiot.", "Lovely weather."]}, "hap"
    )
    assert status == 200
    assert body[0][0]["detection"] == "profanity" and body[0][0]["score"] > 0.9
    assert body[1] == []
    assert "evidence" not in body[0][0] and "metadata" not in body[0][0]


@pytest.mark.parametrize(
    ("detector_id", "message"),
    [
        (None, "missing detector-id header"),
        ("nope", "detector `nope` not found"),
        ("", "missing detector-id header"),
    ],
)
async def test_unknown_or_missing_detector_id_is_404(
    client: Any, detector_id: str | None, message: str
) -> None:
    status, body = await post(client, {"contents": ["x"]}, detector_id)
    assert (status, body) == (404, {"code": 404, "message": message})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "malformed JSON body"),
        (b"\xff\xfe", "malformed JSON body"),
        (b"", "malformed JSON body"),
        (b'["a"]', "Input should be a valid dictionary"),
        (b"{}", "contents: Field required"),
        (b'{"contents": "a b c"}', "contents: Input should be a valid list"),
        (b'{"contents": ["ok", 5]}', "contents.1: Input should be a valid string"),
        (b'{"contents": [null]}', "contents.0: Input should be a valid string"),
        (b'{"contents": ["x"], "extra": 1}', "extra: unknown field"),
        (
            b'{"contents": ["x"], "detector_params": [1]}',
            "detector_params: Input should be a valid dictionary",
        ),
        (
            b'{"contents": ["x"], "detector_params": {"patterns": {"p": "x"}}}',
            "detector_params: patterns: custom patterns come from the detector's config; a "
            "request may send them only when the config sets allow_request_patterns: true",
        ),
        (
            b'{"contents": ["x"], "detector_params": {"kindz": []}}',
            "detector_params: kindz: unknown parameter",
        ),
    ],
)
async def test_bad_bodies_are_422_naming_the_problem(client: Any, raw: bytes, message: str) -> None:
    status, body = await post(client, None, raw=raw)
    assert status == 422 and body["code"] == 422
    assert message in body["message"], body


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (["a"] * 5, "too many contents: 5 (at most 4)"),
        (["x" * 201], "contents.0: 201 characters (at most 200)"),
        (["x" * 150, "y" * 160], "contents: 310 characters in total (at most 300)"),
    ],
)
async def test_too_many_or_too_long_contents_are_413(
    client: Any, contents: list[str], message: str
) -> None:
    status, body = await post(client, {"contents": contents})
    assert (status, body) == (413, {"code": 413, "message": message})


async def test_oversized_body_is_413(client: Any) -> None:
    status, body = await post(client, None, raw=json.dumps({"contents": ["x" * 5000]}).encode())
    assert status == 413 and body["code"] == 413
    assert "4000 bytes" in body["message"]


async def test_overloaded_is_503_with_retry_after(client: Any) -> None:
    resp = await client.post(URL, json={"contents": ["x"]}, headers={"detector-id": "busy"})
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert await resp.json() == {"code": 503, "message": "detector `busy` overloaded: queue full"}


@pytest.mark.parametrize(
    ("detector_id", "message"),
    [
        ("crash", "internal error (RuntimeError)"),
        ("failing", "detector `failing` failed: model exploded"),
        ("short", "detector `short` returned 1 results for 2 contents"),
    ],
)
async def test_detector_failures_are_500_with_a_message(
    client: Any, detector_id: str, message: str
) -> None:
    status, body = await post(client, {"contents": ["a", "b"]}, detector_id)
    assert (status, body) == (500, {"code": 500, "message": message})


async def test_wrong_method_and_unknown_route_are_json(client: Any) -> None:
    resp = await client.get(URL)
    assert resp.status == 405
    assert await resp.json() == {"code": 405, "message": f"Method Not Allowed: GET {URL}"}
    resp = await client.get("/nope")
    assert resp.status == 404 and (await resp.json())["code"] == 404


async def test_health_registry_metrics(client: Any) -> None:
    resp = await client.get("/health")
    assert (resp.status, await resp.json()) == (200, {"status": "ok"})

    resp = await client.get("/registry")
    listing = (await resp.json())["detectors"]
    by_id = {d["detector_id"]: d for d in listing}
    assert set(by_id) == {"pii", "custom", "hap", "crash", "failing", "busy", "short"}
    assert by_id["pii"]["builtin"] == "regex" and "kinds" in by_id["pii"]["params"]
    assert by_id["hap"]["builtin"] == "profanity" and by_id["hap"]["defaults"]["min_score"] == 0.1

    await post(client, {"contents": ["a", "b"]}, "hap")
    await post(client, {"contents": ["x"]}, "nope")
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'detector_requests_total{detector_id="hap",status="200"} 1.0' in text
    assert 'detector_requests_total{detector_id="_unknown",status="404"} 1.0' in text
    assert 'detector_request_seconds_count{detector_id="hap"} 1.0' in text
    assert 'detector_batch_size_count{detector_id="hap"} 1.0' in text
    assert 'detector_batch_size_sum{detector_id="hap"} 2.0' in text


async def test_a_full_micro_batch_queue_answers_503(aiohttp_client: Any) -> None:
    det = detectors.build(
        "hf_classifier", {"model_path": str(shared_anchor_classifier()), "max_queue": 2}
    )
    # the real model, held at a gate while the first request is in it
    forward, entered, gate = det.batcher._fn, threading.Event(), threading.Event()

    def gated(items: list) -> list:
        entered.set()
        assert gate.wait(30)
        return forward(items)

    det.batcher._fn = gated
    client = await aiohttp_client(create_app({"clf": det}, limits=LIMITS))
    first = asyncio.create_task(post(client, {"contents": [ANCHORS["sports"]] * 2}, "clf"))
    assert await asyncio.to_thread(entered.wait, 30)
    status, body = await post(client, {"contents": [ANCHORS["finance"]]}, "clf")
    assert status == 503 and "queue full" in body["message"]
    gate.set()
    status, body = await first
    assert status == 200 and [d[0]["detection"] for d in body] == ["sports", "sports"]
    await det.close()


def test_config_section_is_read_leniently(tmp_path: Path) -> None:
    config = {
        "server": {"port": 1, "whatever": True},  # other sections are not ours to judge
        "models": "ignored",
        "detectors": {
            "pii": {
                "type": "text_contents",
                "builtin": "regex",
                "chunker_id": "sentence",
                "params": {"kinds": ["email"], "threshold": 0.5, "on_detection": "block"},
            },
            "remote": {"url": "http://elsewhere:8080"},
            "hap": {"builtin": "profanity", "default_threshold": 0.7, "timeout_s": 3},
        },
    }
    built = detectors_from_config(config)
    assert sorted(built) == ["hap", "pii"]
    assert built["pii"].params.kinds == ["email"]
    with pytest.raises(ConfigError) as info:
        detectors_from_config(
            {
                "detectors": {
                    "a": {"builtin": "regex", "params": {"patterns": {"x": "("}}},
                    "b": {"builtin": "nope"},
                    "c": 3,
                }
            }
        )
    assert info.value.errors[0] == (
        "detectors.a.params.patterns.x: does not compile as an RE2 pattern: missing ): ("
    )
    assert info.value.errors[1].startswith("detectors.b.builtin: unknown built-in detector 'nope'")
    assert info.value.errors[2] == "detectors.c: must be a mapping"


async def test_app_from_a_config_dict(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app({"detectors": {"pii": {"builtin": "regex"}}}))
    status, body = await post(client, {"contents": ["x@y.com"]})
    assert status == 200 and body[0][0]["detection"] == "email"


def test_cli_serves_the_config_on_a_free_port(tmp_path: Path) -> None:
    config = {
        "server": {"port": 8033},
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {
            "pii": {"type": "text_contents", "builtin": "regex", "chunker_id": "sentence"},
            "hap": {"builtin": "profanity", "params": {"min_score": 0.5}},
            "remote": {"url": "http://127.0.0.1:1"},
        },
    }
    with detector_service(tmp_path, config) as service:
        # the in-process detectors, sorted; `--port 0` wins over the config's port
        assert service.ids == ["hap", "pii"]
        assert service.port not in (0, 8033)

        async def call() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    service.url + URL,
                    json={"contents": ["a@b.com", "fuck off"]},
                    headers={"detector-id": "pii"},
                ) as resp:
                    first = await resp.json()
                async with session.post(
                    service.url + URL,
                    json={"contents": ["fuck off"]},
                    headers={"detector-id": "hap"},
                ) as resp:
                    return resp.status, (first, await resp.json())

        status, (pii, hap) = asyncio.run(call())
        assert status == 200
        assert pii == [
            [
                {
                    "start": 0,
                    "end": 7,
                    "text": "a@b.com",
                    "detection": "email",
                    "detection_type": "pii",
                    "score": 1.0,
                }
            ],
            [],
        ]
        assert hap[0][0]["detection"] == "profanity"
    assert "InconsistentVersionWarning" not in service.stderr


def test_cli_reports_config_errors_with_their_path(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("detectors:\n  pii:\n    builtin: regex\n    params: {kinds: [emial]}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "detectors", "serve", "--config", str(config), "--port", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "error: detectors.pii.params.kinds.0: Input should be" in proc.stderr


# -- connections: every phase before a handler is bounded (servicekit.connections) --------------
# The 0.3 s bounds are the service's settings under test, not windows the test measures: the
# client has sent everything it will ever send, so only the bound can end the exchange, and the
# test waits for that with a generous deadline (http_support.DEADLINE_S).


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects and says nothing
        b"POST /api/v1/te",  # half a request line
        b"POST /api/v1/text/contents HTTP/1.1\r\nHost: x\r\n",  # headers never finished
    ],
    ids=["idle", "half-request-line", "unfinished-headers"],
)
async def test_a_connection_without_a_complete_request_head_is_closed(
    tmp_path: Path, sent: bytes
) -> None:
    """Repro: held open for aiohttp's keep-alive timeout, 3630 s (still open after 15 s with
    the service's defaults); the service is deployed on 0.0.0.0, and this comes before any key
    is checked. Closed after --header-timeout-s, with nothing sent."""
    config = {"detectors": {"pii": {"builtin": "regex"}}}
    async with detector_service_async(tmp_path, config, "--header-timeout-s", "0.3") as service:
        assert await exchange_at(service.port, sent) == b""


async def test_a_stalled_body_is_408_and_the_connection_closes(tmp_path: Path) -> None:
    """Repro: a body that stopped after its first byte held the connection and the handler
    for as long as the client liked."""
    config = {"detectors": {"pii": {"builtin": "regex"}}}
    async with detector_service_async(tmp_path, config, "--body-timeout-s", "0.3") as service:
        raw = await exchange_at(
            service.port, post_head(URL, 200, extra="detector-id: pii\r\n") + b"{"
        )
    reply = Reply(raw)
    assert reply.status == 408
    assert reply.headers["connection"] == "close"
    assert reply.json() == {
        "code": 408,
        "message": "the request body did not arrive within 0.3 s",
    }


class Gated(Detector):
    """A detector whose calls wait for `release`: requests held in progress, in the test's
    hands."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__({})
        self.release = asyncio.Event()
        self.calls = 0

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        self.calls += 1
        await self.release.wait()
        return [[] for _ in contents]


async def test_requests_past_max_concurrent_requests_are_503_before_their_body_is_read(
    aiohttp_client: Any,
) -> None:
    """Repro: the service admitted any number of requests at once, each holding its body (up to
    max_body_bytes, 4 MiB, and its parsed contents) while it waited for a scan thread or a
    model: memory grew with the clients' connections. Past `max_concurrent_requests` a request
    is refused at once, 503 with Retry-After, its body unread; the ones admitted finish, and
    room is made again when they do."""
    gated = Gated()
    limits = Limits(max_concurrent_requests=2)
    client = await aiohttp_client(create_app({"gated": gated}, limits=limits))
    held = [
        asyncio.ensure_future(post(client, {"contents": [f"held {i}"]}, "gated")) for i in range(2)
    ]
    await until(lambda: gated.calls == 2, what="two requests in progress")
    resp = await client.post(URL, json={"contents": ["one more"]}, headers={"detector-id": "gated"})
    assert (resp.status, resp.headers["Retry-After"]) == (503, "1")
    assert await resp.json() == {
        "code": 503,
        "message": "2 requests in progress (at most max_concurrent_requests = 2): retry later",
    }
    assert gated.calls == 2
    gated.release.set()
    assert [await h for h in held] == [(200, [[]]), (200, [[]])]
    assert await post(client, {"contents": ["now"]}, "gated") == (200, [[]])


async def test_a_model_error_quoting_the_text_stays_out_of_the_reply(
    aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Repro: the micro-batcher's `model call failed: {exc}` went into the 500 body, and an
    exception's text can quote the text judged (a tokenizer error). The body names the
    detector and the exception's type; the log has the exception whole."""
    from detectors.profanity import ProfanityDetector

    def raising(self: Any, items: list[str]) -> list[float]:
        raise ValueError(f"cannot tokenize {items!r}")

    monkeypatch.setattr(ProfanityDetector, "_forward", raising)
    client = await aiohttp_client(create_app({"hap": detectors.build("profanity")}, limits=LIMITS))
    resp = await client.post(
        URL, json={"contents": ["the launch code is swordfish"]}, headers={"detector-id": "hap"}
    )
    raw = await resp.read()
    assert resp.status == 500 and b"swordfish" not in raw
    assert json.loads(raw) == {
        "code": 500,
        "message": "detector `hap` failed: profanity: model call failed (ValueError)",
    }
    assert "swordfish" in caplog.text


class NonFinite(Detector):
    """A detector whose reply holds a number JSON cannot carry (a score, or metadata)."""

    name = "non_finite"

    def __init__(self, score: float, metadata: dict[str, Any] | None = None) -> None:
        super().__init__({})
        self.score = score
        self.metadata = metadata

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        found = Detection(
            start=0,
            end=1,
            text=contents[0][:1],
            detection="x",
            detection_type="x",
            score=self.score,
            metadata=self.metadata,
        )
        return [[found] for _ in contents]


def strict_json(raw: bytes) -> Any:
    """`raw` parsed as JSON proper: `NaN`, `Infinity` and `-Infinity` are not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(raw, parse_constant=refuse)


@pytest.mark.parametrize(
    "detector",
    [NonFinite(float("nan")), NonFinite(float("inf")), NonFinite(0.5, {"p": float("-inf")})],
    ids=["nan-score", "inf-score", "inf-metadata"],
)
async def test_a_non_finite_number_is_a_500_never_invalid_json(
    aiohttp_client: Any, detector: Detector
) -> None:
    """Repro: the reply was written by `json.dumps` as it is, NaN as a bare `NaN` (Python's
    extension, not JSON: a strict client cannot read the reply). The model detectors fail a
    call whose model output is not finite (`require_finite`); anything that still slips through
    is a 500 naming the detector, in JSON proper."""
    client = await aiohttp_client(create_app({"odd": detector}, limits=LIMITS))
    resp = await client.post(URL, json={"contents": ["a"]}, headers={"detector-id": "odd"})
    raw = await resp.read()
    assert resp.status == 500
    assert strict_json(raw) == {
        "code": 500,
        "message": "detector `odd` failed: its reply holds a number that is not finite",
    }


async def test_a_builtin_raising_with_the_text_keeps_it_out_of_the_reply(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Repro: a detector raising anything but a DetectorError (a bug: a KeyError quoting the
    content) was answered `internal error: KeyError: '<the content>'`. The body names the
    exception's type only, as the orchestrator does for an in-process built-in; the log has it."""
    client = await aiohttp_client(
        create_app({"crash": Scripted(KeyError("the launch code is swordfish"))}, limits=LIMITS)
    )
    resp = await client.post(URL, json={"contents": ["a"]}, headers={"detector-id": "crash"})
    raw = await resp.read()
    assert resp.status == 500 and b"swordfish" not in raw
    assert json.loads(raw) == {"code": 500, "message": "internal error (KeyError)"}
    assert "swordfish" in caplog.text
