"""The fuzz harness of the HTTP surfaces (test_orchestrator_fuzz, test_openai_fuzz): the
served stack under test (orchestrator_support.ServedStack), the schemathesis checks, the
hypothesis settings and JSON values, and the oracles every reply is held to: never a 5xx, and a
422 that names the field."""

from __future__ import annotations

import json
import re
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

Reply = requests.Response | schemathesis.Response

# schemathesis' checks of a reply against the served document
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def fuzz_settings(max_examples: int) -> settings:
    """Modest example counts (CI has 2 cores); no example database, no health checks: a
    served stack is slow by the standards of a unit property."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def content_type(response: Reply) -> str:
    value = response.headers.get("content-type") or response.headers.get("Content-Type") or ""
    return value[0] if isinstance(value, list) else value


# -- the fuzz tests' oracle of a 422: it names the field ------------------------------------------

# pydantic's words for a body that is no JSON object: there is no field to name
WHOLE_BODY = "Input should be a valid dictionary or instance of "
# fms-guardrails-orchestrator's own texts, kept for parity (api/fms_detection.py): a field in
# backticks, or a message of the chat-detection body
FMS_NAMED = re.compile(
    r"`(?P<required>[^`]*)` (is required|must not be empty( .*)?)"
    r"|missing field `(?P<missing>[^`]*)`"
    r"|unknown field `(?P<unknown>.*)`, expected one of .*"
    r"|detector `(?P<detector>[^`]*)` is not supported by this endpoint"
    # the FMS orchestrator's words for a detector's threshold (detectors.<id>.threshold)
    r"|`threshold` parameter specified for model `(?P<threshold>[^`]*)` must be a number",
    re.DOTALL,  # a field's name may hold a newline (schemathesis sent `{"\n": ...}`)
)
FMS_CHAT_MESSAGES = {"Message content cannot be empty", "Only content of type text is allowed"}


def sent_json(request_body: bytes | str | None) -> Any:
    """The JSON document a fuzz test sent (an NDJSON body: its first line); None where none."""
    if request_body is None:
        return None
    raw = request_body.encode() if isinstance(request_body, str) else request_body
    try:
        return json.loads(raw.split(b"\n", 1)[0] if raw.lstrip()[:1] == b"{" else raw)
    except ValueError:
        return None


def field_path(message: str) -> str | None:
    """The field a message starts with (`path: what is wrong`), or None."""
    head, sep, _ = message.partition(": ")
    return head if sep else None


def openai_param(path: str | None) -> str | None:
    """OpenAI's `param` for a message naming `path`: the path, where it is one a client can
    read back as a name (not empty, no spaces, at most 128 characters)."""
    return path if path and " " not in path and len(path) <= 128 else None


def assert_422_names_the_field(message: str, sent: Any) -> str | None:
    """A 422 says which field is wrong: its message starts with the path of a field the body
    holds (or of a required one it lacks), or names it as the FMS orchestrator does. A body
    that is no JSON object has no field to name. Returns the path (what the OpenAI surfaces
    must put in `param`), None where the message has none."""
    if not isinstance(sent, dict):  # no JSON object (or none at all): nothing to name
        return None
    assert not message.startswith(WHOLE_BODY), (message, sent)
    fms = FMS_NAMED.fullmatch(message)
    if fms is not None or message in FMS_CHAT_MESSAGES:
        if fms is not None and fms["unknown"] is not None:
            assert fms["unknown"] in sent, (message, sent)
        return None
    if "" in sent and message.startswith("unknown field ("):
        return None  # the field's name is empty: there is nothing to put before the colon
    path = field_path(message)
    assert path is not None, f"the 422 names no field: {message!r}"
    held = any(path == key or path.startswith((f"{key}.", f"{key}[")) for key in sent)
    lacked = path.isidentifier() and path not in sent  # a required field the body lacks
    assert held or lacked, f"the 422 names {path!r}, not a field of the body {sent!r}"
    return path
