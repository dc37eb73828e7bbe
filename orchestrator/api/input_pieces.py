"""The pieces of text a client sent in a conversation, each judged on its own by the input
detectors (DESIGN 4.8, 4.9). The OpenAI request models say what their pieces are; the pipeline
(streaming/text_judgement.py) judges them: the type lives here, below both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# `field` of a stop sequence judged as input (DESIGN 4.6a), `message_index` its index: stop
# sequences reach the engine, so the input guardrails judge them like the prompt
STOP_SEQUENCE_FIELD = "stop"
# OpenAI fields that only label or route a request: they never enter the model's prompt (an
# end user's e-mail address is a common `user`), so the input detectors do not judge them
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
    # the engine, like a `name`): where an input redaction goes
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


def input_chars(pieces: list[InputPiece]) -> int:
    """The characters of a conversation checked against the model's `max_input_chars`: every
    piece the input detectors judge and the engine receives, names and tool call ids included
    (on 8cb75df only message contents counted, so a 300,000-character tool call id passed a
    limit of 1,000 and was judged in full)."""
    return sum(len(p.text) for p in pieces if not p.decoded)


def request_field_chars(extra: Mapping[str, Any]) -> tuple[int, list[str]]:
    """The characters of the fields the engine receives beside the conversation (what
    `request_field_pieces` judges) and those fields' names, largest first: a tool definition is
    prompt text, bounded by the model's `max_input_chars` like a message."""
    sizes: dict[str, int] = {}
    for p in request_field_pieces(extra):
        name = (p.field or "").split(".", 1)[0]
        sizes[name] = sizes.get(name, 0) + len(p.text)
    return sum(sizes.values()), sorted(sizes, key=lambda n: (-sizes[n], n))


def request_field_pieces(extra: Mapping[str, Any]) -> list[InputPiece]:
    """Every string and number of the fields the engine receives beside the conversation
    (`tools`, `tool_choice`, `response_format`, whatever an `openai` chat backend is forwarded),
    keys too, each a piece named by its path (`tools.0.function.description`), but for the
    structure's own words (SCHEMA_WORDS: `type`, `object`, `string`...). A chat template
    renders tool definitions into the prompt, so text there is prompt text: an input guardrail
    that skipped it would let a tool's description carry what it refuses in a message.
    Iterative: the body's depth is the JSON parser's to bound, not the stack's."""
    out: list[InputPiece] = []
    todo: list[tuple[str, Any]] = [
        (name, value) for name, value in extra.items() if name not in LABEL_FIELDS
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
            items = list(value.items())
            for key, item in reversed(items):
                todo.append((f"{path}.{key}", item))
            out.extend(
                InputPiece(str(key), field=f"{path}.{key}", fixed=True)
                for key, _ in items
                if key and str(key) not in SCHEMA_WORDS
            )
        elif isinstance(value, list | tuple):
            todo.extend((f"{path}.{i}", item) for i, item in reversed(list(enumerate(value))))
    return out


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
    out = [InputPiece(arguments, message_index, field, target, tool_call=tool_call)]
    if "\\" not in arguments:
        return out
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return out  # not JSON: rendered as the string it is
    todo: list[tuple[str, Any]] = [(field, parsed)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if _escaped(key, arguments):
                    out.append(
                        InputPiece(key, message_index, f"{path}.{key}", fixed=True, decoded=True)
                    )
                todo.append((f"{path}.{key}", item))
        elif isinstance(value, list):
            todo.extend((f"{path}.{i}", item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str) and _escaped(value, arguments):
            out.append(InputPiece(value, message_index, path, fixed=True, decoded=True))
    return out


def _escaped(text: str, raw: str) -> bool:
    """Whether `text` is not in the raw JSON `raw` as itself (it was written with escapes)."""
    return bool(text) and json.dumps(text, ensure_ascii=False)[1:-1] not in raw
