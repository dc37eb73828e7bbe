"""The bound on the characters one detection request asks to be judged: `server.max_detection_chars`,
lowered by a tenant's `limits.max_detection_chars`. A detector model reads a text several times
at a cost per character (`injection`: 1.6-3 times, ~270 ms of CPU per 1,000 characters), so the
body limit alone let one 1 MiB request hold a CPU for minutes. Checked before any detector runs:
422 naming the field, as the generation endpoints' `max_input_chars`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from ..api.errors import invalid
from ..api.fms_detection import ChatMessage
from ..state import AppState
from ..tenants import CALLER


def detection_char_limit(state: AppState, request: web.Request) -> int:
    """The request's limit: the server's, or its tenant's where that is lower."""
    limit = state.config.server.max_detection_chars
    caller = request.get(CALLER)
    own = caller.tenant.limits.max_detection_chars if caller is not None else None
    return min(limit, own) if own is not None else limit


def check_detection_chars(sizes: Mapping[str, int], limit: int) -> None:
    """422 when the fields' characters together exceed `limit`; the details name the largest
    field, and the others' share when they hold any."""
    total = sum(sizes.values())
    if total <= limit:
        return
    largest = max(sizes, key=lambda name: sizes[name])  # the first of equals: the body's order
    others = [name for name in sizes if name != largest and sizes[name]]
    if not others:
        raise invalid(f"{largest}: {total} characters exceed the detection limit of {limit}")
    raise invalid(
        f"{largest}: {sizes[largest]} characters, with the {total - sizes[largest]} of "
        f"{' and '.join(others)}, exceed the detection limit of {limit}"
    )


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON value, object keys included: what a detector
    receives of it. Iterative: the body's depth is the JSON parser's to bound, not the stack's."""
    total = 0
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item)
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return total


def message_chars(message: ChatMessage) -> int:
    """What a detector receives of a chat message: its content's text, and every other string it
    carries (a part's other fields, its name, tool calls with their keys, ...) but its role and
    its parts' types."""
    wire = message.wire()
    wire.pop("role")
    content = wire.pop("content", None)
    total = len(message.text()) + text_chars(list(wire.values()))
    if isinstance(content, list):
        for part in content:
            total += text_chars([v for k, v in part.items() if k not in ("type", "text")])
    return total
