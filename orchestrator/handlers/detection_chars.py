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
    carries (its name, refusal, tool calls with their keys, a part's other fields...) but its
    role and its parts' types. Read off the model, not `wire()`: a 1 MiB body holds ~35,000
    messages, counted on the event loop."""
    m = message
    total = len(m.text()) + text_chars([m.name, m.refusal, m.tool_call_id, m.reasoning_content])
    total += text_chars(m.tool_calls)
    if isinstance(m.content, list):
        total += sum(len(p.refusal or "") + text_chars(p.image_url) for p in m.content)
    return total


def chat_chars(messages: list[ChatMessage], tools: list[dict[str, Any]]) -> dict[str, int]:
    """The characters of a chat detection request, by field."""
    return {"messages": sum(map(message_chars, messages)), "tools": text_chars(tools)}
