"""The pieces of text a client sent in a conversation, each judged on its own by the input
detectors (DESIGN 4.8, 4.9). The OpenAI request models say what their pieces are; the pipeline
(streaming/text_judgement.py) judges them: the type lives here, below both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# `field` of a stop sequence judged as input (DESIGN 4.6a), `message_index` its index: stop
# sequences reach the engine, so the input guardrails judge them like the prompt
STOP_SEQUENCE_FIELD = "stop"
# `field` of a chat message's `name`: it reaches the model (the chat template renders it), so an
# input redaction replaces it there like a content
NAME_FIELD = "name"
# OpenAI fields that only label or route a request: they never enter the model's prompt (an
# end user's e-mail address is a common `user`). Where a backend receives them (an `openai`
# chat backend) they leave the service all the same, for a provider that logs them: the input
# detectors judge them there, and one they flag is withheld from the backend rather than the
# request refused (`request_field_pieces(..., labels=True)`, guarded_generation.py)
LABEL_FIELDS = frozenset(
    {"user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier"}
)
# The words of a tool definition's and a response format's structure: JSON Schema's keywords,
# type and format names, and the OpenAI fields' own (`function`, `json_schema`, `auto`). A
# string (key or value) that is exactly one of these words is not judged: a fixed word of this
# list carries no instruction, personal data or abuse whatever its place, and the injection
# model judged such one-word texts as it judges "ok" (the embedding of a word lies near an
# empty text's). Any other string is judged, tool and parameter names and enum values
# included: those are text the model reads.
SCHEMA_WORDS = frozenset(
    {
        # OpenAI tools, tool_choice, response_format
        "type", "function", "name", "description", "parameters", "strict", "json_schema",
        "json_object", "schema", "auto", "none", "required", "allowed_tools", "mode", "tools",
        # JSON Schema keywords
        "properties", "items", "enum", "const", "default", "title", "examples", "format",
        "additionalProperties", "anyOf", "oneOf", "allOf", "not", "$ref", "$defs",
        "definitions", "$schema", "$id", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "minItems",
        "maxItems", "uniqueItems", "minProperties", "maxProperties", "nullable",
        "patternProperties", "prefixItems", "contains", "deprecated", "readOnly", "writeOnly",
        # JSON Schema's types and OpenAPI's formats
        "object", "string", "number", "integer", "boolean", "array", "null", "date-time",
        "date", "time", "duration", "email", "uri", "uuid", "ipv4", "ipv6", "hostname",
        "int32", "int64", "float", "double",
    }
)  # fmt: skip

# A piece's path names each key on its way at most this long, and stops growing past
# PATH_CHARS: the path is a label, the key is judged as a piece of its own. Whole paths made a
# body's size squared (a 512 KiB key over 64 Ki small values: 34 billion characters of paths).
PATH_KEY_CHARS = 64
PATH_CHARS = 256
_ELIDED = "\u2026"


@dataclass(frozen=True, slots=True)
class InputPiece:
    """One piece of text a client sent in a conversation, judged on its own (DESIGN 4.8, 4.9):
    a message's content (`field` None), its `name` or `refusal`, or Responses `instructions`
    (`message_index` None). Every piece is judged, whatever its role: a guardrail that saw only
    the last user message would let a system message or an earlier turn carry what it refuses."""

    text: str
    message_index: int | None = None
    field: str | None = None
    # the index of the message this text is in the generation request (None: it never reaches
    # the engine, like a `refusal`): where an input redaction goes
    target: int | None = None
    # the arguments of that message's tool call at this index (an assistant turn's call sent
    # back), not its content
    tool_call: int | None = None
    # it reaches the engine but cannot be replaced there (a tool call's name or id, a stop
    # sequence, a tool definition): a redacting detector's finding in it refuses the request
    fixed: bool = False
    # a decoded view of text another piece holds (an argument written with escapes): judged,
    # not counted again against the model's `max_input_chars`
    decoded: bool = False
    # a tool call's arguments (a JSON string) as the client wrote them: its values are judged
    # across their boundaries too (streaming/tool_calls.py `judge_sent_back_calls`)
    arguments: bool = False
    # a user message's text: the user turns are also judged across their boundaries
    # (streaming/joined_turns.py), so an instruction cut into turns is read whole
    user_turn: bool = False


def input_chars(pieces: list[InputPiece]) -> int:
    """The characters of a conversation checked against the model's `max_input_chars`: every
    piece the input detectors judge and the engine receives, names and tool call ids included
    (on 8cb75df only message contents counted, so a 300,000-character tool call id passed a
    limit of 1,000 and was judged in full)."""
    return sum(len(p.text) for p in pieces if not p.decoded)


def request_field_chars(pieces: Iterable[InputPiece]) -> tuple[int, list[str]]:
    """The characters of the fields the engine receives beside the conversation (their pieces:
    `request_field_pieces`) and those fields' names, largest first: a tool definition is
    prompt text, bounded by the model's `max_input_chars` like a message."""
    sizes: dict[str, int] = {}
    for p in pieces:
        name = (p.field or "").split(".", 1)[0]
        sizes[name] = sizes.get(name, 0) + len(p.text)
    return sum(sizes.values()), sorted(sizes, key=lambda n: (-sizes[n], n))


def request_field_pieces(extra: Mapping[str, Any], *, labels: bool = False) -> list[InputPiece]:
    """Every string and number of the fields the engine receives beside the conversation
    (`tools`, `tool_choice`, `response_format`, whatever an `openai` chat backend is forwarded),
    keys too, each a piece named by its path (`tools.0.function.description`), but for the
    structure's own words (SCHEMA_WORDS: `type`, `object`, `string`...). A chat template
    renders tool definitions into the prompt, so text there is prompt text: an input guardrail
    that skipped it would let a tool's description carry what it refuses in a message.
    `labels`: the LABEL_FIELDS too (`is_label` tells their pieces). Iterative: the body's depth
    is the JSON parser's to bound, not the stack's."""
    out: list[InputPiece] = []
    todo: list[tuple[str, Any]] = [
        (_key(name), value) for name, value in extra.items() if labels or name not in LABEL_FIELDS
    ]
    todo.reverse()
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if value and value not in SCHEMA_WORDS:
                out.append(InputPiece(value, field=path, fixed=True))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            # as a template writes it (`tojson`): a card number as a default is text too
            out.append(InputPiece(json.dumps(value), field=path, fixed=True))
        elif isinstance(value, Mapping):
            items = [(child_path(path, key), key, item) for key, item in value.items()]
            todo.extend((at, item) for at, _, item in reversed(items))
            out.extend(
                InputPiece(str(key), field=at, fixed=True)
                for at, key, _ in items
                if key and str(key) not in SCHEMA_WORDS
            )
        elif isinstance(value, list | tuple):
            todo.extend((child_path(path, i), item) for i, item in reversed(list(enumerate(value))))
    return out


def label_of(piece: InputPiece) -> str | None:
    """The label field (LABEL_FIELDS) a piece of `request_field_pieces` is in, else None."""
    if piece.message_index is not None or piece.field is None:
        return None
    head = piece.field.split(".", 1)[0]
    return head if head in LABEL_FIELDS else None


def _key(key: object) -> str:
    key = str(key)
    return key if len(key) <= PATH_KEY_CHARS else key[:PATH_KEY_CHARS] + _ELIDED


def child_path(path: str, key: object) -> str:
    """The path of `path`'s member `key` (`tools.0.function`): a long key shortened, and a path
    that would pass PATH_CHARS ends in an ellipsis, so a piece's path costs O(1) whatever the
    body holds (see PATH_CHARS)."""
    if path.endswith("." + _ELIDED):  # cut off already: its members are named by it
        return path
    step = f"{path}.{_key(key)}"
    return step if len(step) <= PATH_CHARS else f"{path}.{_ELIDED}"


def arguments_pieces(
    arguments: str,
    message_index: int,
    field: str,
    target: int | None,
    tool_call: int | None,
) -> list[InputPiece]:
    """The pieces of a tool call's arguments sent back in the conversation: the JSON string as
    the client wrote it (where a redaction goes), and each string (key or value) that it wrote
    with escapes, decoded, as its own `fixed` piece named by its path (`<field>.to`). The chat
    template renders arguments decoded (`tojson` of the parsed object, in transformers and
    vLLM alike), so `s\\u0065cret` reaches the model as `secret`: judged only as written, it
    passed every detector that does not decode escapes itself. A string written plainly is in
    the raw piece already and is not judged twice."""
    out = [InputPiece(arguments, message_index, field, target, tool_call=tool_call, arguments=True)]
    if "\\" not in arguments:
        return out
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return out  # not JSON: rendered as the string it is
    plain = _plain_strings(arguments)
    # (the parent's path, the key, the value): a path is made when its value is reached, so
    # the values waiting hold their parents' paths, not one each
    todo: list[tuple[str, Any, Any]] = [(field, None, parsed)]
    while todo:
        parent, name, value = todo.pop()
        path = parent if name is None else child_path(parent, name)
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if _escaped(key, plain):
                    at = child_path(path, key)
                    out.append(InputPiece(key, message_index, at, fixed=True, decoded=True))
                todo.append((path, key, item))
        elif isinstance(value, list):
            todo.extend((path, i, item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str) and _escaped(value, plain):
            out.append(InputPiece(value, message_index, path, fixed=True, decoded=True))
    return out


# a JSON string token (the unrolled form: one way to match each token, linear)
_STRING = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)


def _plain_strings(raw: str) -> frozenset[str]:
    """The string tokens (keys and values) of the JSON text `raw` as written there, without
    their quotes."""
    return frozenset(m.group(1) for m in _STRING.finditer(raw))


def _escaped(text: str, plain: frozenset[str]) -> bool:
    """Whether the string `text` is written in the raw JSON with escapes: no string token there
    is it as `json.dumps` writes it. A set lookup: searching the raw text for each string cost
    its size times their number (80,000 escaped strings in 1 MiB of arguments: about a minute)."""
    return bool(text) and json.dumps(text, ensure_ascii=False)[1:-1] not in plain
