"""Tool calls of the native engine (DESIGN 7): whether a model's chat template takes tools, and
the parser that takes the calls out of the model's streamed text.

Support is read off the template's source: it must reference `tools` (transformers renders the
request's tools through `apply_chat_template(tools=...)`) and name a call format the engine can
parse. One family is known today, `hermes`: a call is a JSON object `{"name": ..., "arguments":
{...}}` between `<tool_call>` and `</tool_call>` (Hermes 2 Pro, Qwen 2/2.5/3, SmolLM3 and the
templates written after them). A template that takes tools in another format (Llama 3.1's bare
JSON, Mistral's `[TOOL_CALLS]`) is reported as without tool support rather than rendered and
left unparsed: a call the engine cannot see would reach the client as text.

The parser is hand-written (two fixed tags, a few lines) where a library would bring a whole
serving stack (vLLM's tool parsers): what it releases for a text depends only on the text, never
on how it was split into deltas, so a resumed stream that re-parses the resumed tokens' text
knows exactly what the first replica released.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from dataclasses import dataclass
from typing import Any

HERMES = "hermes"
HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"

_TOOLS_REFERENCE = re.compile(r"\btools\b")


def tool_call_format(template: str | dict[str, str] | None) -> str | None:
    """The call format of a chat template that takes tools (`hermes`), or None: no template, a
    template that never mentions `tools`, or one whose call format the engine cannot parse. A
    tokenizer with named templates (a dict) counts them all (transformers picks `tool_use`
    when tools are given)."""
    if isinstance(template, dict):
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not template or not _TOOLS_REFERENCE.search(template):
        return None
    if HERMES_START in template and HERMES_END in template:
        return HERMES
    return None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One whole call as the native protocol sends it (`data.tool_calls[]`): its index in the
    answer, a deterministic id, the function's name and its arguments as a JSON string (the
    OpenAI shape)."""

    index: int
    id: str
    name: str
    arguments: str

    def wire(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "name": self.name, "arguments": self.arguments}


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (what may still
    become the tag with the next delta)."""
    i = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while i >= 0:  # only where the tag's first character is (most deltas have none)
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON string) of a call's JSON body; None when it is not a call. Nor is
    a body nested deeper than Python's json takes (RecursionError), or one whose strings are no
    Unicode text (the escape of a lone surrogate, which no UTF-8 wire carries): the model's
    output decides both, and they go out as the text it wrote, never failing the stream."""
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):  # else already a JSON string (some models write it so)
            args = json.dumps(args, ensure_ascii=False)
        name: str = obj["name"]
        name.encode(), args.encode()  # UnicodeEncodeError (a ValueError): a lone surrogate
    except (ValueError, RecursionError):
        return None
    return name, args


class ToolCallParser:
    """Splits a stream's text into the text the client sees and whole tool calls (hermes).

    Text before a call flows as text (only a tail that may be the start of `<tool_call>` waits
    for the next delta); a call's content is withheld and leaves as one `ToolCall` when its
    closing tag arrives. A call whose body is not a JSON call, and a call still open when the
    stream ends, go out as the text the model wrote. `skip` visible characters are dropped from
    the start (a resumed stream: the client already has them; the calls are sent again whole,
    since the orchestrator holds call fragments until the finish and drops them on a failure).
    """

    def __init__(self, prompt_ids: list[int], skip: int = 0) -> None:
        # ids name the prompt and the call: the same on every replica (resumes stay exact) and
        # different for the same call on a later turn of the conversation
        self._salt = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).digest()
        self._skip = skip
        self._pending = ""  # outside a call: a tail that may be the start of HERMES_START
        self._in_call = False
        self._body: list[str] = []  # inside a call: its text so far, in pieces
        self._tail = ""  # the body's last characters, where HERMES_END may have begun
        self._count = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The visible text and the completed calls this delta releases. A call's body is kept
        in pieces and only its tail is searched again: a long call costs linear time."""
        out: list[str] = []
        calls: list[ToolCall] = []
        s = text
        while s:
            if not self._in_call:
                s, self._pending = self._pending + s, ""
                i = s.find(HERMES_START)
                if i < 0:
                    keep = _held_prefix(s, HERMES_START)
                    out.append(s[: len(s) - keep])
                    self._pending = s[len(s) - keep :]
                    break
                out.append(s[:i])
                s = s[i + len(HERMES_START) :]
                self._in_call, self._body, self._tail = True, [], ""
            else:
                probe = self._tail + s
                j = probe.find(HERMES_END)
                if j < 0:
                    self._body.append(s)
                    self._tail = probe[-(len(HERMES_END) - 1) :]
                    break
                whole = "".join(self._body) + s
                cut = len(whole) - len(probe) + j
                body, s = whole[:cut], whole[cut + len(HERMES_END) :]
                self._in_call, self._body, self._tail = False, [], ""
                call = self._call(body)
                if call is None:
                    out.append(HERMES_START + body + HERMES_END)
                else:
                    calls.append(call)
        return self._visible("".join(out)), calls

    def finish(self) -> str:
        """What is still held when the stream ends: an unfinished call goes out as its text."""
        held = HERMES_START + "".join(self._body) if self._in_call else self._pending
        self._pending, self._in_call, self._body, self._tail = "", False, [], ""
        return self._visible(held)

    def _visible(self, text: str) -> str:
        if self._skip and text:
            dropped = min(self._skip, len(text))
            self._skip -= dropped
            text = text[dropped:]
        return text

    def _call(self, body: str) -> ToolCall | None:
        parsed = _parse_call(body.strip())
        if parsed is None:
            return None
        index = self._count
        self._count += 1
        digest = hashlib.blake2b(
            f"{index}\n{body}".encode(), digest_size=12, key=self._salt
        ).hexdigest()
        return ToolCall(index, f"call_{digest}", parsed[0], parsed[1])


def visible_prefix(text: str) -> str:
    """The text a stream of `text` has released so far (nothing flushed): what a client resuming
    it may have received at most."""
    parser = ToolCallParser([])
    return parser.feed(text)[0]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as transformers' templates expect them: an assistant turn's
    `tool_calls[].function.arguments` as an object (templates render it with `tojson`), not the
    JSON string the OpenAI wire carries; arguments that are not a JSON object stay a string."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        args = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # nested past what json takes: the client's string
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**function, "arguments": args}}
