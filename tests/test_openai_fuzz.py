"""Property tests of the Chat Completions surface (DESIGN 4, "Hostile input is expected"; 4.8)
against real parts: the orchestrator in a background thread, the real `tiny-random` engine server
(`tiny_server`) as a native backend, and the real built-in detectors (regex PII, profanity).

Whatever the body (random or malformed messages, roles and content parts, numbers out of range or
beyond a float, NaN as strings, unknown fields, detector maps with unknown ids, bad thresholds
and params, any `stream` flag, raw bytes): never a 5xx; every 4xx is OpenAI's error body with
`code` equal to the status; every 200 stream has `data: [DONE]` exactly once and last, and
before it exactly one `finish_reason` or exactly one error object; every unary 200 is a valid
`chat.completion`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from orchestrator.app import CHAT_DETECTION_PATH, CHAT_PATH, MODELS_PATH
from tests.engine_processes import ThreadedServer
from tests.fuzz_support import (
    CHECKS,
    Reply,
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
    ServedStack,
    native_config,
)

DETECTOR_IDS = ("pii", "hap", "pii_block")
FUZZ = fuzz_settings(80)


def chat_stack(engine_url: str) -> ServedStack:
    """The orchestrator in front of the real engine server, served from a loop of its own."""

    def config() -> dict[str, Any]:
        return native_config(
            engine_url,
            detectors={
                "pii": {"builtin": "regex", "chunker_id": "sentence"},
                "hap": {"builtin": "profanity", "chunker_id": "sentence"},
                "pii_block": {
                    "builtin": "regex",
                    "chunker_id": "whole_doc_chunker",
                    "on_detection": "block",
                },
            },
            server={"max_request_bytes": 65536, "request_timeout_s": 20},
            model={
                "limits": {
                    "max_new_tokens": 16,
                    "default_max_new_tokens": 8,
                    "max_input_chars": 2000,
                },
                "guardrails": {"output": {"hap": {}}},  # enforced on every request
            },
        )

    return ServedStack("fuzz-chat", config)


@pytest.fixture(scope="module")
def stack(tiny_server: ThreadedServer) -> Iterator[ServedStack]:
    with chat_stack(tiny_server.url) as s:
        yield s


# -- the properties ---------------------------------------------------------------------------


def check_error(response: Reply) -> None:
    """Never a 5xx; a 4xx is `{"error": {message, type, param, code}}` with code = status."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code < 400:
        return
    assert content_type(response).startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == response.status_code
    assert error["type"] in ERROR_TYPES
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] is None or isinstance(error["param"], str)
    if response.status_code == 422:
        path = assert_422_names_the_field(error["message"], sent_json(response.request.body))
        assert error["param"] == openai_param(path), error


def check_stream(text: str, include_usage: bool) -> None:
    """`[DONE]` once and last; before it exactly one finish_reason or one error object (last)."""
    data: list[str] = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if not line or line.startswith(":"):  # keep-alive comments
                continue
            assert line.startswith("data: "), line
            data.append(line[len("data: ") :])
    assert data.count("[DONE]") == 1 and data[-1] == "[DONE]", data[-3:]
    items = [json.loads(d) for d in data[:-1]]
    errors = [i for i in items if "error" in i]
    chunks = [i for i in items if "error" not in i]
    finishes = [c["finish_reason"] for i in chunks for c in i["choices"] if c["finish_reason"]]
    assert (len(finishes), len(errors)) in ((1, 0), (0, 1)), (finishes, errors)
    assert len({c["id"] for c in chunks}) <= 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    if errors:
        assert items[-1] is errors[0]
        error = errors[0]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] in ERROR_TYPES - {"server_error"}, error
        return
    assert finishes[0] in ("stop", "length", "content_filter")
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[-1]["choices"][0]["finish_reason"] == finishes[0]
    usage = [c for c in chunks if "usage" in c]
    if include_usage:
        assert usage == [chunks[-1]] and chunks[-1]["choices"] == []
    else:
        assert usage == []


def check_completion(body: dict[str, Any]) -> None:
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length", "content_filter")
    if choice["finish_reason"] == "content_filter":
        assert choice["message"]["content"] is None and choice["message"]["refusal"]
    else:
        assert isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def post(
    http: requests.Session, url: str, data: bytes, ctype: str = "application/json"
) -> requests.Response:
    return http.post(url, data=data, headers={"Content-Type": ctype}, timeout=60)


def check_reply(response: Reply, body: Any) -> None:
    check_error(response)
    if response.status_code != 200:
        return
    assert isinstance(body, dict)
    if body.get("stream") is True:
        assert content_type(response).startswith("text/event-stream")
        options = body.get("stream_options") or {}
        check_stream(response.text, options.get("include_usage") is True)
    else:
        assert content_type(response).startswith("application/json")
        check_completion(response.json())


# -- schemathesis: the documented operations ---------------------------------------------------

OPERATIONS = {("POST", CHAT_PATH), ("POST", CHAT_DETECTION_PATH), ("GET", MODELS_PATH)}


def fuzz_operation(
    operation: schemathesis.APIOperation, mode: GenerationMode, url: str, http: requests.Session
) -> None:
    post_body = operation.method.upper() == "POST"

    @settings(FUZZ, max_examples=25)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, session=http, timeout=60)
        case.validate_response(response, checks=CHECKS)
        check_error(response)
        if response.status_code == 200 and post_body:
            check_reply(response, case.body)

    fuzz()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_chat_operations(
    stack: ServedStack, http: requests.Session, mode: GenerationMode
) -> None:
    """Bodies from the served document (its model and detector ids narrowed to this
    deployment): replies as documented, and the properties above."""
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [o for o in operations if (o.method.upper(), o.path) in OPERATIONS]
    assert {(o.method.upper(), o.path) for o in operations} == OPERATIONS
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters or body: nothing to negate
        fuzz_operation(operation, mode, stack.url, http)


def test_the_document_names_this_deployment(stack: ServedStack, http: requests.Session) -> None:
    doc = http.get(stack.url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    detectors = schemas["ChatDetectors"]["properties"]
    for direction in ("input", "output"):
        assert detectors[direction]["propertyNames"] == {"enum": list(DETECTOR_IDS)}
    for path in (CHAT_PATH, CHAT_DETECTION_PATH):
        operation = doc["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ChatCompletionRequest"
        }
        ok = operation["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/OpenAIErrorBody"
        }
    models = doc["paths"][MODELS_PATH]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelList"}


# -- the bodies -------------------------------------------------------------------------------

texts = st.sampled_from(
    [
        "Hello there. How are you?",
        "Mail jo@example.com, you stupid idiot.",
        "My SSN is 123-45-6789.",
        # JSON can carry lone surrogates; a detection quotes them back
        "a lone \ud800 surrogate, mail jo@example.com\udfff",
        "you stupid fucking idiot \ud800.",
        "",
    ]
) | st.text(max_size=60)
huge = st.sampled_from([10**20, -(10**20), 2**64, 10**400, -(10**400)])
nan_strings = st.sampled_from(["NaN", "nan", "Infinity", "-inf", "1e400", "0.5", "1"])
wild_numbers = st.integers(-2, 20) | st.floats(-1, 3) | huge | nan_strings | json_values

roles = st.sampled_from(["system", "developer", "user", "assistant"])
wild_roles = roles | st.sampled_from(["tool", "function", "USER", ""]) | json_values
parts = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
wild_parts = (
    parts
    | st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "x"})})
    | st.fixed_dictionaries({"type": st.just("text")}, optional={"text": json_values})
    | json_values
)


@st.composite
def good_messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    before = draw(st.lists(st.fixed_dictionaries({"role": roles, "content": texts}), max_size=3))
    content = draw(texts | st.lists(parts, min_size=1, max_size=2))
    return [*before, {"role": "user", "content": content}]


wild_message = st.fixed_dictionaries(
    {},
    optional={
        "role": wild_roles,
        "content": texts | st.lists(wild_parts, max_size=3) | json_values,
        "name": st.text(max_size=8) | json_values,
        "refusal": st.none() | st.text(max_size=8),
        "tool_calls": json_values,
        "extra": json_values,
    },
)
wild_messages = st.lists(wild_message | json_values, max_size=4) | json_values

good_params = st.fixed_dictionaries(
    {},
    optional={
        "threshold": st.floats(0, 1),
        "on_detection": st.sampled_from(["annotate", "block"]),
    },
)
good_detectors = st.fixed_dictionaries(
    {},
    optional={
        "input": st.dictionaries(st.sampled_from(DETECTOR_IDS), good_params, max_size=2),
        "output": st.dictionaries(st.sampled_from(DETECTOR_IDS), good_params, max_size=3),
    },
)
# thresholds stay within a float here: one beyond it is a separate case (see the module's end)
wild_params = st.dictionaries(
    st.sampled_from(["threshold", "on_detection", "patterns", "kinds", "model_path", "x"])
    | st.text(max_size=6),
    st.floats(-1, 2) | nan_strings | st.sampled_from(["block", "annotate", "email"]) | json_values,
    max_size=3,
)
wild_maps = st.dictionaries(
    st.sampled_from([*DETECTOR_IDS, "nope"]) | st.text(max_size=8), wild_params | json_values
)
wild_detectors = (
    st.fixed_dictionaries(
        {}, optional={"input": wild_maps, "output": wild_maps, "extra": json_values}
    )
    | json_values
)


@st.composite
def good_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Near-valid: mostly accepted, so the pipeline behind validation runs too."""
    body: dict[str, Any] = {"model": MODEL, "messages": draw(good_messages())}
    optional = {
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "max_tokens": st.integers(1, 16),
        "max_completion_tokens": st.integers(1, 16),
        "temperature": st.sampled_from([0, 0.5, 1.0, 2]),
        "top_p": st.floats(0.1, 1),
        "seed": st.integers(0, 2**32),
        "stop": st.sampled_from(["e", ".", "zz"]) | st.lists(st.sampled_from(["a", " t"])),
        "n": st.just(1),
        "user": st.text(max_size=8),
        "detectors": good_detectors,
    }
    for key, values in optional.items():
        if draw(st.booleans()):
            body[key] = draw(values)
    return body


wild_bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from([MODEL, "nope"]) | json_values,
        "messages": good_messages() | wild_messages,
    },
    optional={
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values})
        | json_values,
        "max_tokens": wild_numbers,
        "max_completion_tokens": wild_numbers,
        "temperature": wild_numbers | st.just(150),
        "top_p": wild_numbers,
        "seed": wild_numbers | st.integers(-1, 2**70),
        "n": wild_numbers,
        "stop": texts | st.lists(texts, max_size=20) | st.just("x" * 300) | json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "logprobs": json_values,
        "response_format": json_values,
        "detectors": good_detectors | wild_detectors,
        "bogus": json_values,
    },
)


def encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


@pytest.mark.parametrize("path", [CHAT_PATH, CHAT_DETECTION_PATH])
def test_chat_completions_never_5xx(stack: ServedStack, http: requests.Session, path: str) -> None:
    @FUZZ
    @given(body=good_bodies() | good_bodies().map(lambda b: {**b, "stream": True}) | wild_bodies)
    def fuzz(body: Any) -> None:
        check_reply(post(http, stack.url + path, encode(body)), body)

    fuzz()


@settings(FUZZ, max_examples=30)
@given(
    data=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64),
    ctype=st.sampled_from(["application/json", "text/plain", ""]),
)
def test_any_document_or_bytes_is_a_4xx_with_the_openai_body(
    stack: ServedStack, http: requests.Session, data: bytes, ctype: str
) -> None:
    response = post(http, stack.url + CHAT_PATH, data, ctype)
    check_error(response)
    if ctype == "text/plain":
        assert response.status_code == 415


# -- cases the strategies above reach only by chance -------------------------------------------

USER = '"messages": [{"role": "user", "content": "Hello"}]'


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ('"temperature": 1e400', "temperature"),  # Python's parser makes it inf
        ('"temperature": 1' + "0" * 400, "temperature"),  # an int no float can hold
        ('"top_p": -1' + "0" * 400, "top_p"),
        ('"max_tokens": 1e400', "max_tokens"),
        ('"max_completion_tokens": -1e400', "max_completion_tokens"),
        ('"seed": 1e400', "seed"),
        ('"n": 1e400', "n"),
        ('"max_tokens": 1' + "0" * 400, "max_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_numbers_beyond_a_float_are_422(
    stack: ServedStack, http: requests.Session, fields: str, param: str, stream: bool
) -> None:
    raw = f'{{"model": "{MODEL}", {USER}, "stream": {json.dumps(stream)}, {fields}}}'
    response = post(http, stack.url + CHAT_PATH, raw.encode())
    check_error(response)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": "true"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_booleans_are_booleans(
    stack: ServedStack, http: requests.Session, fields: dict[str, Any], param: str
) -> None:
    """The schema says boolean: a string or a number is a 422, never a guess (which would also
    decide between an event stream and a JSON reply)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}
    response = post(http, stack.url + CHAT_PATH, json.dumps(body).encode())
    check_error(response)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param


def test_a_threshold_beyond_a_float_is_422(stack: ServedStack, http: requests.Session) -> None:
    raw = (
        f'{{"model": "{MODEL}", {USER}, '
        '"detectors": {"output": {"pii": {"threshold": 1' + "0" * 400 + "}}}}"
    )
    response = post(http, stack.url + CHAT_PATH, raw.encode())
    check_error(response)
    assert response.status_code == 422


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_literals_are_400(
    stack: ServedStack, http: requests.Session, value: float
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": value}
    response = post(http, stack.url + CHAT_PATH, json.dumps(body).encode())
    check_error(response)
    assert response.status_code == 400
    assert response.json()["error"]["message"].endswith("is not valid JSON")


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_is_422_before_any_byte(
    stack: ServedStack, http: requests.Session, stream: bool
) -> None:
    """JSON can spell a lone surrogate (`"\\ud800"`), which is not Unicode: refused with the
    field it is in, before the reply starts (it used to be quoted back in a detection)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "you stupid fucking idiot \ud800."}],
        "stream": stream,
        "detectors": {"input": {"hap": {}}},
    }
    response = post(http, stack.url + CHAT_PATH, json.dumps(body).encode())
    check_error(response)
    assert response.status_code == 422
    assert response.json()["error"] == {
        "message": "messages.0.content: text must be valid Unicode (it contains a lone surrogate)",
        "type": "invalid_request",
        "param": "messages.0.content",
        "code": 422,
    }


# -- nesting, lone surrogates and Unicode tricks (issue 20) ------------------------------------

TOO_DEEP = "invalid JSON body: nested deeper than 64 levels"
LONE_SURROGATE = "text must be valid Unicode (it contains a lone surrogate)"


def nested(depth: int, kind: str) -> str:
    """`depth` levels of lists or objects, as text (json.dumps would recurse that deep)."""
    if kind == "list":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def test_nesting_past_the_bound_is_400(stack: ServedStack, http: requests.Session) -> None:
    """At the top, in a message's content parts or in detector params: a 400 in OpenAI's error
    shape (a 1000-deep body used to be a 500 with a traceback)."""

    @settings(FUZZ, max_examples=20)
    @given(
        depth=st.integers(65, 3000) | st.just(1000),
        kind=st.sampled_from(["list", "dict"]),
        where=st.sampled_from(["top", "content", "params"]),
        stream=st.booleans(),
    )
    def fuzz(depth: int, kind: str, where: str, stream: bool) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": stream,
        }
        if where == "content":
            body["messages"][0]["content"] = "__NEST__"
        elif where == "params":
            body["detectors"] = {"output": {"pii": {"p": "__NEST__"}}}
        raw = nested(depth, kind) if where == "top" else json.dumps(body)
        response = post(
            http, stack.url + CHAT_PATH, raw.replace('"__NEST__"', nested(depth, kind)).encode()
        )
        check_error(response)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == TOO_DEEP

    fuzz()


def test_a_lone_surrogate_anywhere_in_a_message_is_422(
    stack: ServedStack, http: requests.Session
) -> None:
    """In any role's content, a text part, a `name`, or a stop sequence: 422 with the field as
    OpenAI's `param`, before the first byte, streaming or not."""

    @settings(FUZZ, max_examples=30)
    @given(
        before=st.text(max_size=8),
        surrogate=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        after=st.text(max_size=8),
        role=roles,
        where=st.sampled_from(["content", "part", "name", "stop"]),
        stream=st.booleans(),
    )
    def fuzz(before: str, surrogate: str, after: str, role: str, where: str, stream: bool) -> None:
        text = before + surrogate + after
        message: dict[str, Any] = {"role": role, "content": "Hi"}
        body: dict[str, Any] = {"model": MODEL, "messages": [message], "stream": stream}
        if where == "content":
            message["content"], field = text, "messages.0.content"
        elif where == "part":
            message["content"] = [{"type": "text", "text": text}]
            field = "messages.0.content.0.text"
        elif where == "name":
            message["name"], field = text, "messages.0.name"
        else:
            body["stop"], field = [text], "stop.0"
        response = post(http, stack.url + CHAT_PATH, json.dumps(body).encode())
        check_error(response)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["message"] == f"{field}: {LONE_SURROGATE}"
        assert response.json()["error"]["param"] == field

    fuzz()


# format and bidi controls, zero-width characters, combining marks, full-width and mathematical
# letters, line separators, private use, a BOM, NUL and astral characters
TRICKS = [
    "\ufeff",
    "\u200b",
    "\u2060",
    "\u00ad",
    "\u202e",
    "\u0301",
    "\uff39\uff4f\uff55",
    "\U0001d418\U0001d428\U0001d42e",
    "\u2028",
    "\ue000",
    "\x00",
    "\U0001f600",
    "stupid idiot",
    ". ",
]


def test_unicode_tricks_are_never_a_server_error(
    stack: ServedStack, http: requests.Session
) -> None:
    """Valid Unicode of any kind in any message gets a well-formed reply (the enforced `hap`
    guardrail judges it), never a 5xx or a broken stream."""

    @settings(FUZZ, max_examples=25)
    @given(
        text=st.lists(st.sampled_from(TRICKS) | st.text(max_size=3), min_size=1, max_size=10).map(
            "".join
        ),
        role=roles,
        stream=st.booleans(),
    )
    def fuzz(text: str, role: str, stream: bool) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": role, "content": text}, {"role": "user", "content": "Hi"}],
            "stream": stream,
            "max_tokens": 4,
            "detectors": {"input": {"pii": {}}},
        }
        response = post(http, stack.url + CHAT_PATH, json.dumps(body, ensure_ascii=False).encode())
        check_reply(response, body)
        assert response.status_code == 200, response.text

    fuzz()


def test_an_engine_limit_names_the_request_field(
    stack: ServedStack, http: requests.Session
) -> None:
    # (stop sequences are bounded by the request model itself: tests/test_request_bounds.py)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "H"}] * 1025,  # the engine takes 1024
    }
    response = post(http, stack.url + CHAT_PATH, encode(body))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "messages", error
    assert error["message"] == (
        f"messages: model `{MODEL}`: messages has 1025 entries; at most 1024 are accepted"
    ), error
