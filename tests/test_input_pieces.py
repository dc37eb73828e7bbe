"""What of a request's forwarded fields the input detectors judge (`request_field_pieces`,
DESIGN 4.8): every string, key and number, but for the structure's own words (SCHEMA_WORDS),
which carry nothing a detector looks for."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.api.input_pieces import SCHEMA_WORDS, InputPiece, request_field_pieces

TOOL = {
    "type": "function",
    "function": {
        "name": "git_log",
        "description": "Shows the commit logs",
        "parameters": {
            "type": "object",
            "properties": {
                "repo_path": {"title": "Repo Path", "type": "string"},
                "max_count": {"type": "integer", "default": 10},
                "order": {"type": "string", "enum": ["newest", "oldest", "string"]},
            },
            "required": ["repo_path"],
        },
    },
}


def test_a_tool_definition_is_judged_but_for_its_structure_words() -> None:
    pieces = request_field_pieces({"tools": [TOOL], "tool_choice": "auto"})
    f = "tools.0.function"
    p = f"{f}.parameters.properties"
    assert [(x.field, x.text) for x in pieces] == [
        (f"{f}.name", "git_log"),
        (f"{f}.description", "Shows the commit logs"),
        (f"{p}.repo_path", "repo_path"),
        (f"{p}.max_count", "max_count"),
        (f"{p}.order", "order"),
        (f"{p}.repo_path.title", "Repo Path"),
        (f"{p}.max_count.default", "10"),
        (f"{p}.order.enum.0", "newest"),
        (f"{p}.order.enum.1", "oldest"),
        (f"{f}.parameters.required.0", "repo_path"),
    ]
    assert all(x.fixed for x in pieces)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.sampled_from(sorted(SCHEMA_WORDS)),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.text(max_size=6) | st.sampled_from(sorted(SCHEMA_WORDS)), inner, max_size=3
        )
    ),
    max_leaves=12,
)


def _expected(value: Any) -> list[str]:
    """Every key, string and number of `value`, as text, but empty texts and SCHEMA_WORDS."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [json.dumps(value)]
    if isinstance(value, list):
        return [t for v in value for t in _expected(v)]
    return [*value, *(t for v in value.values() for t in _expected(v))]


@settings(max_examples=60, deadline=None)
@given(_json)
def test_every_other_string_key_and_number_is_a_fixed_piece(value: Any) -> None:
    pieces = request_field_pieces({"tools": value})
    want = [t for t in _expected(value) if t and t not in SCHEMA_WORDS]
    assert sorted(p.text for p in pieces) == sorted(want)
    assert all(isinstance(p, InputPiece) and p.fixed for p in pieces)
    assert not any(p.text in SCHEMA_WORDS for p in pieces)
