"""What of a request's forwarded fields the input detectors judge (`request_field_pieces`,
DESIGN 4.8): every string, key and number, but for the structure's own words (SCHEMA_WORDS),
which carry nothing a detector looks for."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.api.input_pieces import (
    PATH_CHARS,
    PATH_KEY_CHARS,
    SCHEMA_WORDS,
    InputPiece,
    arguments_pieces,
    request_field_pieces,
)
from tests.wait_support import within

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


def test_a_long_key_names_its_members_with_a_bounded_path() -> None:
    """Repro: each piece's path held every key on its way whole, so a 300,000-character key
    over 2,000 small values made 600 million characters of paths (a 1 MiB body: tens of
    billions, before any limit was checked). A key is judged whole as a piece of its own; in
    paths it is shortened, and a path stops growing at PATH_CHARS."""
    key = "k" * 300_000
    pieces = request_field_pieces({"tools": [{key: {f"p{i}": "v" for i in range(2_000)}}]})
    short = "tools.0." + "k" * PATH_KEY_CHARS + "\u2026"
    assert (pieces[0].field, pieces[0].text) == (short, key)  # the key itself, whole
    assert [(p.field, p.text) for p in pieces[1:3]] == [
        (f"{short}.p0", "p0"),
        (f"{short}.p1", "p1"),
    ]
    assert len(pieces) == 1 + 2 * 2_000
    deep: Any = ["x"]
    for _ in range(200):
        deep = {"level": deep}
    [piece] = [p for p in request_field_pieces({"tools": deep}) if p.text == "x"]
    assert piece.field is not None and piece.field.startswith("tools.level.level.")
    assert piece.field.endswith(".\u2026") and len(piece.field) <= PATH_CHARS + 2
    assert max(len(p.field or "") for p in request_field_pieces({"tools": deep})) <= PATH_CHARS + 2


async def test_escaped_arguments_are_found_in_linear_time() -> None:
    """Repro: whether a string of a tool call's arguments was written with escapes was a
    search of the whole arguments for it, so 1 MiB of short escaped strings (`"\\u0061%d"`,
    87,000 of them) cost ~10^11 character comparisons (3.6 s for 256 KiB, about a minute for
    1 MiB, in request parsing on the event loop; 0.3 s now). The raw string tokens are
    collected once. A generous deadline only, never a timing assertion."""
    arguments = json.dumps([f"\\u0061{i}" for i in range(87_000)]).replace("\\\\", "\\")
    assert len(arguments) > 1_000_000
    async with within(10, "finding the escaped strings of 1 MiB of tool call arguments"):
        pieces = await asyncio.to_thread(arguments_pieces, arguments, 0, "args", 0, 0)
    assert [(p.field, p.text, p.decoded) for p in pieces[1:3]] == [
        ("args.0", "a0", True),
        ("args.1", "a1", True),
    ]
    assert len(pieces) == 1 + 87_000


def test_an_escaped_string_is_judged_unless_written_plainly_as_a_whole_string() -> None:
    """`s\\u0065cret` reads `secret`: judged decoded, though `secret` is inside another string
    written plainly (the search of the whole raw text took that for the same string), and not
    judged again where `secret` is a string of its own there."""
    inside = '{"a": "s\\u0065cret", "b": "top secret"}'
    assert [(p.field, p.text) for p in arguments_pieces(inside, 0, "x", 0, 0)[1:]] == [
        ("x.a", "secret")
    ]
    alone = '{"a": "s\\u0065cret", "b": "secret"}'
    assert arguments_pieces(alone, 0, "x", 0, 0)[1:] == []
