"""Property tests of the orchestrator's HTTP surface: schemathesis drives every operation of the
served `/openapi.json` (no 5xx, statuses, content types and bodies as documented), and hypothesis
throws arbitrary bytes and JSON at every POST endpoint (always a 4xx or a 2xx, never a 5xx, and
every error is `{"code", "details", "type"}` with `code` equal to the HTTP status).

The service runs in a background thread with a fake engine (short scripts, small token limits)
and a fake remote detector plus the in-process regex detector, so requests that pass validation
run the whole pipeline quickly."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
)

from orchestrator.app import (
    CONTENT_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
    Surface,
    surface_of,
)
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.fuzz_support import (
    CHECKS,
    assert_422_names_the_field,
    content_type,
    fuzz_settings,
    json_values,
    openai_param,
    sent_json,
)
from tests.orchestrator_support import (
    ERROR_TYPES,
    MODEL,
    Orchestrator,
    ServedStack,
    native_config,
    remote,
)

NDJSON = "application/x-ndjson"
POST_PATHS = (STREAMING_PATH, UNARY_PATH, CONTENT_PATH, STREAM_CONTENT_PATH)
DETECTOR_IDS = ("you", "pii", "para", "whole", "blocker")
FUZZ = fuzz_settings(30)


def _ndjson(ctx: Any, value: Any) -> bytes:
    """stream-content bodies are documented as an array of lines: one JSON document per line."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, list):
        return "".join(json.dumps(v) + "\n" for v in value).encode()
    return json.dumps(value).encode()


schemathesis.serializer(NDJSON)(_ndjson)


def fuzz_stack() -> ServedStack:
    """Fake engine, fake detector and the orchestrator, served from a loop of their own."""
    engine = FakeEngine(script=["You", " are", " here", ".", " Mail", " me", "!"])
    dets = FakeDetectorServer()
    words = DetectorBehaviour(words={"You": 0.9, "me": 0.4}, detection="pronoun")
    for detector_id in ("you", "para", "whole", "blocker"):
        dets.add(detector_id, words)

    def config() -> dict[str, Any]:
        return native_config(
            engine.url,
            detectors={
                "you": remote(dets.url),
                "para": remote(dets.url, "paragraph"),
                "whole": remote(dets.url, "whole_doc_chunker"),
                "blocker": remote(dets.url, on_detection="block"),
                "pii": {"type": "text_contents", "builtin": "regex", "chunker_id": "sentence"},
            },
            server={"max_request_bytes": 65536, "request_timeout_s": 20},
            model={
                "limits": {
                    "max_new_tokens": 16,
                    "default_max_new_tokens": 8,
                    "max_input_chars": 2000,
                }
            },
        )

    return ServedStack("fuzz-stack", config, [engine, dets])


@pytest.fixture(scope="module")
def stack() -> Iterator[ServedStack]:
    with fuzz_stack() as s:
        yield s


def check_error_body(
    response: requests.Response | schemathesis.Response, openai: bool = False
) -> None:
    """Every error is the API's error body, with `code` equal to the HTTP status (on the OpenAI
    surfaces, inside OpenAI's `{"error": {message, type, param, code}}`)."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code < 400:
        return
    assert content_type(response).startswith("application/json")
    body = response.json()
    if openai:
        assert set(body) == {"error"}, body
        body = body["error"]
        assert set(body) == {"message", "type", "param", "code"}, body
        param = body["param"]
        body = {"code": body["code"], "details": body["message"], "type": body["type"]}
    assert set(body) == {"code", "details", "type"}, body
    assert body["code"] == response.status_code
    assert isinstance(body["details"], str) and body["details"]
    assert body["type"] in ERROR_TYPES
    if response.status_code == 422:
        path = assert_422_names_the_field(body["details"], sent_json(response.request.body))
        if openai:
            assert param == openai_param(path), (param, body["details"])


def check_stream(body: str) -> None:
    """A 200 stream ends with exactly one terminal event, and never a server error."""
    events = [b for b in body.split("\n\n") if b.strip()]
    names = [b.split("\n")[0][len("event: ") :] for b in events if b.startswith("event: ")]
    terminal = [n for n in names if n in ("completed", "incomplete", "failed", "error")]
    assert len(terminal) == 1 and names[-1] == terminal[0], names
    last = json.loads(events[-1].split("data: ", 1)[1])
    assert last.get("type", last.get("error", {}).get("type")) != "server_error", last


# -- schemathesis: every documented operation -------------------------------------------------


def test_openapi_document_covers_every_route(stack: ServedStack, http: requests.Session) -> None:
    doc = http.get(stack.url + "/openapi.json", timeout=10).json()
    documented = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert stack.orch.runner is not None
    routes = {
        (r.method, r.resource.canonical)
        for r in stack.orch.runner.app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    assert documented == routes
    # schemathesis reads it (it leaves out the document's own path)
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    loaded = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert loaded == documented - {("GET", "/openapi.json")}


def fuzz_operation(
    operation: schemathesis.APIOperation, mode: GenerationMode, url: str, http: requests.Session
) -> None:
    checks = CHECKS
    if operation.path == STREAM_CONTENT_PATH:
        # only the first NDJSON line is validated before the reply starts; a bad later line
        # ends a 200 reply with an in-band error line (checked by the stream-content test)
        checks = [c for c in CHECKS if c is not negative_data_rejection]

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, session=http, timeout=30)
        case.validate_response(response, checks=checks)
        check_error_body(response, surface_of(operation.path) is Surface.OPENAI)
        if response.status_code == 200 and operation.path == STREAMING_PATH:
            check_stream(response.text)

    fuzz()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_every_operation(
    stack: ServedStack, http: requests.Session, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and (
            operation.method.upper() == "GET" or not operation.body
        ):
            continue  # no parameters or body (GETs, POST /admin/reload): nothing to negate
        fuzz_operation(operation, mode, stack.url, http)


# -- hypothesis: arbitrary bytes and JSON at every POST endpoint ------------------------------

texts = st.sampled_from(["You are here.", "mail a@b.com now. You too", ""]) | st.text(max_size=60)

# near-valid parts: mostly accepted, so the pipeline behind validation runs too
good_params = st.fixed_dictionaries(
    {},
    optional={
        "threshold": st.floats(0, 1),
        "on_detection": st.sampled_from(["annotate", "block"]),
    },
)
good_maps = st.dictionaries(st.sampled_from(DETECTOR_IDS), good_params, max_size=3)
good_gen = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(1, 16),
        "min_new_tokens": st.integers(0, 1),
        "decoding_method": st.sampled_from(["GREEDY", "SAMPLING"]),
        "temperature": st.floats(0.1, 2),
        "top_k": st.integers(0, 5),
        "top_p": st.floats(0.1, 1),
        "seed": st.integers(0, 2**32),
        "repetition_penalty": st.floats(0.5, 2),
        "stop_sequences": st.lists(st.sampled_from(["here", ".", "!", "zz"]), max_size=2),
        "max_time": st.sampled_from([0.0, 5.0]),
    },
)


@st.composite
def good_task_bodies(draw: st.DrawFn) -> dict[str, Any]:
    inputs = draw(texts)
    body: dict[str, Any] = {"model_id": MODEL, "inputs": inputs}
    guardrails: dict[str, Any] = {}
    if draw(st.booleans()):
        mask = st.integers(0, len(inputs)).flatmap(
            lambda a: st.tuples(st.just(a), st.integers(a, len(inputs)))
        )
        guardrails["input"] = {"models": draw(good_maps), "masks": draw(st.lists(mask, max_size=2))}
    if draw(st.booleans()):
        guardrails["output"] = {"models": draw(good_maps)}
    if guardrails:
        body["guardrail_config"] = guardrails
    if draw(st.booleans()):
        body["text_gen_parameters"] = draw(good_gen)
    return body


# wild parts: wrong types, out-of-range values, unknown ids and keys, NaN and Infinity (which
# json.dumps writes and Python's parser reads, though they are not JSON)
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
wild_params = st.dictionaries(
    st.sampled_from(["threshold", "on_detection", "kinds", "patterns", "x"]) | st.text(max_size=6),
    json_values
    | st.floats(-1, 2)
    | non_finite
    | st.sampled_from(["block", "annotate", "email", "0.5"]),
    max_size=3,
)
wild_maps = st.dictionaries(
    st.sampled_from(DETECTOR_IDS) | st.text(max_size=8), wild_params | json_values, max_size=3
)
wild_gen = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(-1, 20) | json_values,
        "min_new_tokens": st.integers(-1, 20),
        "decoding_method": st.sampled_from(["GREEDY", "SAMPLING", "BEAM", "greedy"]),
        "temperature": st.floats(-1, 3) | non_finite | json_values,
        "top_k": st.integers(-1, 5),
        "top_p": st.floats(-0.5, 1.5),
        "seed": st.integers(-1, 2**64),
        "repetition_penalty": st.floats(-1, 3),
        "stop_sequences": st.lists(st.text(max_size=4), max_size=20) | json_values,
        "max_time": st.floats(-1, 2) | non_finite,
        "bogus": json_values,
    },
)
wild_task_bodies = st.fixed_dictionaries(
    {"model_id": st.sampled_from([MODEL, "nope"]) | json_values, "inputs": texts | json_values},
    optional={
        "guardrail_config": st.fixed_dictionaries(
            {},
            optional={
                "input": st.fixed_dictionaries(
                    {"models": wild_maps},
                    optional={
                        "masks": st.lists(st.tuples(st.integers(-2, 70), st.integers(-2, 70)))
                        | json_values
                    },
                ),
                "output": st.fixed_dictionaries({"models": wild_maps}),
                "extra": json_values,
            },
        )
        | json_values,
        "text_gen_parameters": wild_gen | json_values,
    },
)
good_content_bodies = st.fixed_dictionaries({"content": texts, "detectors": good_maps.filter(bool)})
wild_content_bodies = st.fixed_dictionaries(
    {"content": texts | json_values, "detectors": wild_maps | json_values},
    optional={"extra": json_values},
)
# valid-looking bodies, bodies with mistakes in them, any JSON document, raw bytes
task_payloads = good_task_bodies() | wild_task_bodies | json_values | st.binary(max_size=64)
content_payloads = good_content_bodies | wild_content_bodies | json_values | st.binary(max_size=64)


def ndjson_lines(text: str) -> list[str]:
    """NDJSON splits at \\n only (str.splitlines would also split at U+2028 inside strings)."""
    return [line for line in text.split("\n") if line]


def _post(http: requests.Session, url: str, data: bytes, content_type: str) -> requests.Response:
    return http.post(url, data=data, headers={"Content-Type": content_type}, timeout=30)


@pytest.mark.parametrize("path", [STREAMING_PATH, UNARY_PATH])
def test_task_endpoints_never_5xx(stack: ServedStack, http: requests.Session, path: str) -> None:
    @FUZZ
    @given(body=task_payloads)
    def fuzz(body: Any) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = _post(http, stack.url + path, data, "application/json")
        check_error_body(response)
        if response.status_code == 200 and path == STREAMING_PATH:
            check_stream(response.text)

    fuzz()


def test_content_endpoint_never_5xx(stack: ServedStack, http: requests.Session) -> None:
    @FUZZ
    @given(
        body=content_payloads,
        ctype=st.sampled_from(["application/json", "text/plain", ""]),
    )
    def fuzz(body: Any, ctype: str) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = _post(http, stack.url + CONTENT_PATH, data, ctype)
        check_error_body(response)
        if ctype == "text/plain":
            assert response.status_code == 415

    fuzz()


good_first_line = st.fixed_dictionaries({"content": texts, "detectors": good_maps.filter(bool)})
good_line = st.fixed_dictionaries({"content": texts})
wild_line = (
    st.fixed_dictionaries({"content": texts | json_values}, optional={"detectors": wild_maps})
    | json_values
)


def test_stream_content_endpoint_never_5xx(stack: ServedStack, http: requests.Session) -> None:
    @FUZZ
    @given(
        first=(good_first_line | wild_line).map(json.dumps) | st.text(max_size=20),
        rest=st.lists(
            (good_line | wild_line).map(json.dumps) | st.text(max_size=20),
            max_size=4,
        ),
        blank=st.booleans(),
        tail=st.just(b"") | st.binary(max_size=16),
    )
    def fuzz(first: str, rest: list[str], blank: bool, tail: bytes) -> None:
        lines = [first, *rest]
        if blank:
            lines.insert(1, "")
        data = ("\n".join(lines) + "\n").encode() + tail
        response = _post(http, stack.url + STREAM_CONTENT_PATH, data, NDJSON)
        check_error_body(response)
        if response.status_code == 200:
            lines = ndjson_lines(response.text)
            for line in lines:
                item = json.loads(line)
                if "code" in item:  # an in-band error ends the reply
                    assert set(item) == {"code", "details", "type"}
                    assert 400 <= item["code"] < 500 or item["type"] != "server_error", item
                    assert line == lines[-1]
                else:
                    assert set(item) == {"detections", "start_index", "processed_index"}

    fuzz()


@pytest.mark.parametrize(
    "detectors", [{"blocker": {}}, {"you": {"on_detection": "block"}}], ids=["config", "request"]
)
def test_stream_content_with_a_blocking_detector_is_no_server_error(
    stack: ServedStack, http: requests.Session, detectors: dict[str, Any]
) -> None:
    line = json.dumps({"content": "You are here.", "detectors": detectors})
    response = _post(http, stack.url + STREAM_CONTENT_PATH, (line + "\n").encode(), NDJSON)
    assert response.status_code == 200
    items = [json.loads(x) for x in ndjson_lines(response.text)]
    assert all("code" not in item for item in items), items
    assert [d["text"] for item in items for d in item["detections"]] == ["You"]


@pytest.mark.parametrize("path", POST_PATHS)
def test_oversized_bodies_are_413(stack: ServedStack, http: requests.Session, path: str) -> None:
    big = json.dumps({"content": "x" * 70_000, "detectors": {"you": {}}}).encode()
    response = _post(
        http, stack.url + path, big, NDJSON if path == STREAM_CONTENT_PATH else "application/json"
    )
    assert response.status_code == 413
    check_error_body(response)


@pytest.mark.parametrize(
    "params",
    [
        {"text_gen_parameters": {"seed": False}},
        {"text_gen_parameters": {"max_new_tokens": "4"}},
        {"text_gen_parameters": {"stop_sequences": [""]}},
        {"guardrail_config": {"input": {"models": {}, "masks": [[True, 2]]}}},
    ],
)
def test_values_the_schema_rejects_are_422(
    stack: ServedStack, http: requests.Session, params: dict[str, Any]
) -> None:
    body = json.dumps({"model_id": MODEL, "inputs": "You are here.", **params}).encode()
    response = _post(http, stack.url + UNARY_PATH, body, "application/json")
    assert response.status_code == 422, response.text
    check_error_body(response)


@pytest.mark.parametrize(
    "params",
    [
        {"text_gen_parameters": {"temperature": math.nan}},
        {"text_gen_parameters": {"max_time": math.inf}},
        {"guardrail_config": {"output": {"models": {"you": {"threshold": math.nan}}}}},
        {"guardrail_config": {"output": {"models": {"you": {"extra": -math.inf}}}}},
    ],
)
def test_nan_and_infinity_are_not_json(
    stack: ServedStack, http: requests.Session, params: dict[str, Any]
) -> None:
    body = json.dumps({"model_id": MODEL, "inputs": "You are here.", **params}).encode()
    response = _post(http, stack.url + UNARY_PATH, body, "application/json")
    assert response.status_code == 400, response.text
    assert response.json()["details"].endswith("is not valid JSON")
    check_error_body(response)


@pytest.mark.parametrize("path", [*POST_PATHS, "/health", "/metrics"])
def test_wrong_methods_are_405_with_the_error_body(
    stack: ServedStack, http: requests.Session, path: str
) -> None:
    method = "GET" if path in POST_PATHS else "POST"
    response = http.request(method, stack.url + path, timeout=10)
    assert response.status_code == 405
    check_error_body(response)


def test_405_names_the_allowed_methods(stack: ServedStack, http: requests.Session) -> None:
    response = http.get(stack.url + UNARY_PATH, timeout=10)
    assert response.status_code == 405
    assert response.headers.get("Allow") == "POST"


async def test_openapi_names_the_deployment_and_its_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARDSTREAM_TEST_FUZZ_KEYS", "secret")
    config = native_config(
        "http://127.0.0.1:9",  # never called
        detectors={"pii": {"type": "text_contents", "builtin": "regex"}},
        server={"api_keys_env": "GUARDSTREAM_TEST_FUZZ_KEYS"},
    )
    async with Orchestrator(config) as orch:
        assert orch.session is not None
        async with orch.session.get(orch.url + "/openapi.json") as r:  # open without a key
            anonymous_status, anonymous = r.status, await r.json()
        headers = {"Authorization": "Bearer secret"}
        async with orch.session.get(orch.url + "/openapi.json", headers=headers) as r:
            status, doc = r.status, await r.json()
    assert anonymous_status == 200
    # without a key, the generic API: no model or detector id
    assert MODEL not in json.dumps(anonymous) and '"pii"' not in json.dumps(anonymous)
    assert anonymous["paths"] == doc["paths"]
    assert status == 200
    schemas = doc["components"]["schemas"]
    assert schemas["GuardrailsHttpRequest"]["properties"]["model_id"]["enum"] == [MODEL]
    assert schemas["ContentDetectionRequest"]["properties"]["detectors"]["propertyNames"] == {
        "enum": ["pii"]
    }
    assert schemas["OutputGuardrail"]["properties"]["models"]["propertyNames"] == {"enum": ["pii"]}
    for path, item in doc["paths"].items():
        for operation in item.values():
            public = ("/health", "/info", "/openapi.json")  # /metrics: server.public_metrics
            expected = None if path in public else [{"bearer": []}]
            assert operation.get("security") == expected, path


# -- nesting, lone surrogates and Unicode tricks (issue 20) ------------------------------------

TOO_DEEP = "invalid JSON body: nested deeper than 64 levels"
LONE_SURROGATE = "text must be valid Unicode (it contains a lone surrogate)"
NEST = '"__NEST__"'  # where a nested value goes in a body


def nested(depth: int, kind: str) -> str:
    """`depth` levels of lists or objects, as text (json.dumps would recurse that deep)."""
    if kind == "list":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def body_for(path: str, text: str, params: Any = None) -> dict[str, Any]:
    """A valid body for `path` carrying `text` where the endpoint takes text, and `params` as
    a detector's params."""
    detector = {"you": {} if params is None else {"p": params}}
    if path in (STREAMING_PATH, UNARY_PATH):
        return {
            "model_id": MODEL,
            "inputs": text,
            "guardrail_config": {"output": {"models": detector}},
        }
    return {"content": text, "detectors": detector}


def text_field(path: str) -> str:
    return "inputs" if path in (STREAMING_PATH, UNARY_PATH) else "content"


def post_json(http: requests.Session, url: str, path: str, raw: str | bytes) -> requests.Response:
    data = raw.encode() if isinstance(raw, str) else raw
    if path == STREAM_CONTENT_PATH:
        return _post(http, url + path, data + b"\n", NDJSON)
    return _post(http, url + path, data, "application/json")


def error_line(response: requests.Response) -> dict[str, Any]:
    """The in-band error that ends a stream-content reply."""
    assert response.status_code == 200, response.text
    last = json.loads(ndjson_lines(response.text)[-1])
    assert set(last) == {"code", "details", "type"}, last
    return last


@pytest.mark.parametrize("path", POST_PATHS)
def test_nesting_past_the_bound_is_400_on_every_endpoint(
    stack: ServedStack, http: requests.Session, path: str
) -> None:
    """A body nested past 64 levels, at the top or deep inside detector params, is a 400 with
    the error body (a 1000-deep one used to be a 500 with a traceback); on stream-content a
    later line ends the stream with that error line."""

    @FUZZ
    @given(
        depth=st.integers(65, 3000) | st.sampled_from([65, 1000, 1024, 2000]),
        kind=st.sampled_from(["list", "dict"]),
        inside=st.booleans(),
    )
    def fuzz(depth: int, kind: str, inside: bool) -> None:
        if inside:
            raw = json.dumps(body_for(path, "Hi", "__NEST__")).replace(NEST, nested(depth, kind))
        else:
            raw = nested(depth, kind)
        response = post_json(http, stack.url, path, raw)
        check_error_body(response)
        assert response.status_code == 400
        assert response.json() == {"code": 400, "details": TOO_DEEP, "type": "invalid_request"}
        if path == STREAM_CONTENT_PATH:
            first = json.dumps(body_for(path, "You are here. "))
            later = _post(http, stack.url + path, f"{first}\n{raw}\n".encode(), NDJSON)
            assert error_line(later) == {
                "code": 400,
                "details": TOO_DEEP,
                "type": "invalid_request",
            }

    fuzz()


lone_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts_with_a_lone_surrogate = st.builds(
    lambda before, surrogate, after: before + surrogate + after,
    st.text(max_size=12),  # hypothesis never puts surrogates in text()
    lone_surrogates,
    st.text(max_size=12),
)


@pytest.mark.parametrize("path", POST_PATHS)
def test_a_lone_surrogate_is_422_on_every_endpoint(
    stack: ServedStack, http: requests.Session, path: str
) -> None:
    """Anywhere in the text, escaped (`\\ud800`) or as raw UTF-8-encoded surrogate bytes: a 422
    naming the field, before the first byte (FMS streaming used to answer 200, then an
    `event: error`)."""

    @FUZZ
    @given(text=texts_with_a_lone_surrogate, raw_bytes=st.booleans())
    def fuzz(text: str, raw_bytes: bool) -> None:
        body = json.dumps(body_for(path, text), ensure_ascii=not raw_bytes)
        data = body.encode("utf-8", "surrogatepass")
        response = post_json(http, stack.url, path, data)
        check_error_body(response)
        expected = {
            "code": 422,
            "details": f"{text_field(path)}: {LONE_SURROGATE}",
            "type": "invalid_request",
        }
        assert response.json() == expected
        if path == STREAM_CONTENT_PATH:
            first = json.dumps(body_for(path, "You are here. "))
            line = json.dumps({"content": text}).encode()
            later = _post(http, stack.url + path, first.encode() + b"\n" + line + b"\n", NDJSON)
            assert error_line(later) == expected

    fuzz()


# Characters that change how text looks or is cut without changing what it says: format and
# bidi controls, zero-width ones, combining marks, full-width and mathematical letters,
# line/paragraph separators, private use, a BOM, NUL, and astral characters.
TRICKS = [
    "\ufeff",
    "\u200b",
    "\u200d",
    "\u2060",
    "\u00ad",
    "\u202e",
    "\u2066",
    "\u0301",
    "\uff39\uff4f\uff55",
    "\U0001d418\U0001d428\U0001d42e",
    "\u2028",
    "\u2029",
    "\ue000",
    "\x00",
    "\U0001f600",
    "\U000e0041",
    "You",
    ". ",
    "\n\n",
]
tricky_texts = st.lists(st.sampled_from(TRICKS) | st.text(max_size=4), max_size=12).map("".join)


def test_unicode_tricks_are_judged_with_spans_into_the_text(
    stack: ServedStack, http: requests.Session
) -> None:
    """Valid Unicode of any kind is accepted, and every detection's span indexes the text the
    client sent (code points), quoting exactly what is there."""

    @FUZZ
    @given(text=tricky_texts)
    def fuzz(text: str) -> None:
        body = {"content": text, "detectors": {"you": {}, "pii": {}}}
        raw = json.dumps(body, ensure_ascii=False).encode()
        response = _post(http, stack.url + CONTENT_PATH, raw, "application/json")
        check_error_body(response)
        if not text.strip():
            return  # an empty text may be refused; it is never a 5xx
        assert response.status_code == 200, response.text
        for found in response.json()["detections"]:
            assert 0 <= found["start"] <= found["end"] <= len(text)
            assert text[found["start"] : found["end"]] == found["text"]

    fuzz()


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf4\x90\x80\x80", b"\xed\xb0\x80", b"\x80"],
    ids=["ff", "overlong-slash", "overlong-3", "beyond-10ffff", "cesu-low", "continuation"],
)
def test_bytes_that_are_not_utf8_are_4xx(
    stack: ServedStack, http: requests.Session, path: str, bad: bytes
) -> None:
    """Invalid or overlong UTF-8 inside a string: the error body, never a 5xx or a 200."""
    raw = json.dumps(body_for(path, "Hi __BAD__")).encode().replace(b"__BAD__", bad)
    response = post_json(http, stack.url, path, raw)
    check_error_body(response)
    assert response.status_code in (400, 422), response.text
