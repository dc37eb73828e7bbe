"""Tool calls through the output guardrails (DESIGN 4.8): the fragments of each call, assembled;
its arguments judged as text; the call released whole, redacted, or withheld.

A call's arguments are a JSON string the model writes fragment by fragment. What detectors judge
is the text in it: every JSON string, keys as well as values (a key is text the model wrote: `{"jo@
example.com": 1}` holds an e-mail address), and every number (`{"card": 4111111111111111}` holds a
card number), each as its own piece, with spans that point into the arguments string as the
client receives it. A span detector also judges a call's values across their boundaries
(`joined_values`): an e-mail address the model wrote as `{"user": "jo.smith@", "domain":
"example.com"}` is in no value, and the tool that joins them sends mail to it. A redacted number becomes a string (`"[credit_card]"`): still valid JSON. Arguments that are not JSON (a model that broke off,
or wrote something else) are judged whole, as text. A call's name must be one the request offered
(`offered_names`): the client's own text, judged as input; any other is a failure, never sent.
A call's id is text the upstream sends beside the call, and a model may write it (vLLM's Kimi-K2
parser takes `functions.NAME:N` from the model's output): it is judged too, and an id a detector
flags is replaced by one minted here (an id is a handle, not content; the client sends it back
and the upstream sees it consistently); a blocking detector's finding on it withholds the call.

A call is released once it is whole and every output detector that applies to tool calls
(`applies_to`) judged it: `block` withholds it (the stream ends with a refusal), `redact`
replaces the flagged part of the value inside the JSON, re-encoded so that the arguments stay
valid JSON (the other values keep their bytes), `annotate` reports it. A call is whole at the end
of the stream: a block must be able to withhold all of it, and an agent acts on a call only once
the turn ended anyway.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..api.input_pieces import InputPiece
from ..clients.backend import ToolCallDelta
from ..clients.registry import ChunkerRegistry, RequestedDetector
from .events import ToolCall
from .findings import Finding, sort_findings
from .redaction import redact_text
from .text_judgement import BULK_CHARS, judge_pieces, off_loop

# the `field` of a call's id among the judged pieces (its values' are their indices)
ID_FIELD = "id"

# a JSON string or number token (the regex engine scans in C: arguments may be long); valid JSON
# only. Strings first: a string's digits are part of it, never a number of their own
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?', re.DOTALL)


# what follows a string token when it is an object's key
_COLON = re.compile(r"\s*:")

# a surrogate in a str is always a lone one (a pair decodes to one code point)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogates(encoded: str) -> str:
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", encoded)


@dataclass(slots=True)
class _Open:
    index: int
    id: str | None
    name: str | None
    parts: list[str]


class ToolCallAssembler:
    """The fragments of a stream's tool calls, gathered by call index; `finish()` gives the
    whole calls in index order (the `id` and `name` are the first fragment's that had one)."""

    def __init__(self) -> None:
        self._calls: dict[int, _Open] = {}

    def feed(self, deltas: Iterable[ToolCallDelta]) -> None:
        calls = self._calls
        for d in deltas:
            call = calls.get(d.index)
            if call is None:
                call = calls[d.index] = _Open(d.index, d.id, d.name, [])
            else:
                call.id = call.id or d.id
                call.name = call.name or d.name
            if d.arguments:
                call.parts.append(d.arguments)

    def finish(self) -> list[ToolCall]:
        calls = sorted(self._calls.values(), key=lambda c: c.index)
        self._calls = {}
        return [ToolCall(c.index, c.id, c.name, "".join(c.parts)) for c in calls]


@dataclass(frozen=True, slots=True)
class StringValue:
    """A piece of text of the arguments: a JSON string's raw text between the quotes, or a
    number's literal (`number`), `[start, end)` in the arguments string, and what it decodes
    to. `json` False: arguments that are not JSON, one value that is all of them, judged and
    redacted as the text they are."""

    start: int
    end: int
    text: str
    json: bool = True
    number: bool = False
    key: bool = False  # an object's key (a name the schema chose, judged on its own only)

    def encode(self, text: str) -> str:
        """`text` (redacted) as this value's raw form: JSON-escaped without quotes for a string,
        a quoted JSON string in a number's place (a replacement is no number). A lone surrogate
        (only the arguments' own `\\udXXX` escape can make one) stays an escape: written raw, it
        is no UTF-8 text, and a strict client cannot read the call."""
        if self.number:
            return _escape_surrogates(json.dumps(text, ensure_ascii=False))
        if not self.json:
            return text
        return _escape_surrogates(json.dumps(text, ensure_ascii=False)[1:-1])

    def offsets(self, raw: str) -> list[int]:
        if self.number:  # the literal itself, or the string it was redacted into
            if raw.startswith('"'):
                return [1 + o for o in raw_offsets(raw[1:-1])]
            return list(range(len(raw) + 1))
        return raw_offsets(raw) if self.json else list(range(len(raw) + 1))


def string_values(arguments: str) -> list[StringValue]:
    """Every string (keys and values) and number of JSON `arguments`, in order; the whole string
    as one value when it is not JSON (it is then judged as the text it is)."""
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return [StringValue(0, len(arguments), arguments, json=False)]
    return [
        StringValue(
            m.start() + 1,
            m.end() - 1,
            json.loads(m.group()),
            key=_COLON.match(arguments, m.end()) is not None,
        )
        if m.group().startswith('"')
        else StringValue(m.start(), m.end(), m.group(), json=False, number=True)
        for m in _TOKEN.finditer(arguments)
    ]


# The `field` of the text of a call's values judged across their boundaries
JOINED_FIELD = "joined"
# Where two values meet in that text, nothing between them when the first ends with one of
# _GLUE_AFTER or the second starts with one of _GLUE_BEFORE, else a space.
#
# Why: a tool that takes PII in parts joins them itself, so a guardrail that judges each value
# alone passes `{"user": "jo.smith@", "domain": "example.com"}`. Judging the values glued
# together would find it, and would also make tokens that no value holds out of unrelated
# neighbours (`{"count": "12", "code": "3-45-6789"}` as the SSN 123-45-6789, runs of digits as
# card or phone numbers). A space between them reads like a sentence that lists the values,
# the text the detectors are tuned for: what spans values there is what a sentence of those
# words holds (a name in two parts, a phone number or a card in groups, an address over lines),
# and no token is made. Glued are only the boundaries where a PII token is split inside itself
# by a character that sits inside such tokens and never ends a word of prose: the `@` of an
# address (`jo.smith@` | `example.com`, `jo.smith` | `@example.com`), a domain's dot at the
# start of a value (`jo@example` | `.com`; a sentence's own dot ends a value, and is not glued)
# and the hyphen of a phone number's or an SSN's groups (`555-` | `1234`, `123-45` | `-6789`).
# Keys are left out: a key is the schema's name for the value after it, and between two parts
# of one token it would break it. Not judging the raw arguments text instead: its quotes,
# keys and commas separate every value (it finds nothing across them) and it holds the escapes,
# not the text.
_GLUE_AFTER = frozenset("@-")
_GLUE_BEFORE = frozenset("@.-")


def joined_values(values: list[StringValue]) -> tuple[str, list[tuple[int, int, int]]]:
    """The text of a call's values (keys left out) in order, joined as the comment above says,
    and where each is in it: (index in `values`, start, end)."""
    parts: list[str] = []
    placed: list[tuple[int, int, int]] = []
    at = 0
    previous = ""
    for j, v in enumerate(values):
        if v.key or not v.text:
            continue
        if parts and previous[-1] not in _GLUE_AFTER and v.text[0] not in _GLUE_BEFORE:
            parts.append(" ")
            at += 1
        parts.append(v.text)
        placed.append((j, at, at + len(v.text)))
        at += len(v.text)
        previous = v.text
    return "".join(parts), placed


def _across_values(
    found: Finding,
    placed: list[tuple[int, int, int]],
    own: dict[tuple[int, str], list[tuple[int, int]]],
    values: list[StringValue],
) -> list[Finding]:
    """A finding on a call's joined values as its part in each value it covers (spans in the
    value, field its index): none when it lies in one value (that value's own judgement has
    it), or when one of its parts overlaps what the same detector found in that value alone
    (the value's own finding, stretched by a neighbour: `re-` and `jo@example.com`)."""
    parts = []
    # the values it covers, from the last that starts at or before it (a bisection: a call of
    # many values with many findings must not cost their product)
    k = max(0, bisect.bisect_right(placed, found.start, key=lambda p: p[1]) - 1)
    for j, a, b in itertools.islice(placed, k, None):
        if a >= found.end:
            break
        if max(found.start, a) < min(found.end, b):
            parts.append((j, max(found.start, a) - a, min(found.end, b) - a))
    if len(parts) < 2:
        return []
    for j, start, end in parts:
        for s, e in own.get((j, found.detector_id), ()):
            if s < end and start < e:
                return []
    return [
        replace(found, start=start, end=end, text=values[j].text[start:end], field=str(j))
        for j, start, end in parts
    ]


def _sent_back(
    pieces: list[InputPiece],
) -> list[tuple[InputPiece, list[StringValue], str, list[tuple[int, int, int]]]]:
    """The arguments pieces of a conversation with more than one value: each with its values
    and their joined text (`joined_values`)."""
    out = []
    for p in pieces:
        if p.arguments:
            values = string_values(p.text)
            text, placed = joined_values(values)
            if len(placed) > 1:
                out.append((p, values, text, placed))
    return out


async def judge_sent_back_calls(
    pieces: list[InputPiece],
    findings: list[Finding],
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    verdicts: Any = None,
) -> list[Finding]:
    """The input side of `joined_values` (DESIGN 4.8, 4.9): the calls a conversation sends
    back (an assistant turn's `tool_calls`, a Responses `function_call`) reach the model
    whole, so a span detector judges each call's values across their boundaries too, as on
    output; `findings` are the pieces' own. A finding that crosses a boundary is its part in
    each value: on the arguments piece, spans into the JSON the client wrote (a redaction
    there stays inside the value's string); in a value written with escapes, on that value's
    decoded piece (its path: a redaction there is refused, as the value's own finding is).
    None where the part overlaps the same detector's own finding there (stretched)."""
    spans = [d for d in detectors if not d.judges_chunks]
    if not spans:
        return []
    bulk = sum(len(p.text) for p in pieces if p.arguments) > BULK_CHARS
    calls = await off_loop(lambda: _sent_back(pieces)) if bulk else _sent_back(pieces)
    if not calls:
        return []
    joined = [
        InputPiece(text, message_index=k, field=JOINED_FIELD)
        for k, (_, _, text, _) in enumerate(calls)
    ]
    found = await judge_pieces(joined, spans, chunkers, verdicts)
    own: dict[tuple[int | None, str | None, str], list[tuple[int, int]]] = {}
    for f in findings:
        own.setdefault((f.message_index, f.field, f.detector_id), []).append((f.start, f.end))
    decoded = {(p.message_index, p.text): p.field for p in pieces if p.decoded}
    out: list[Finding] = []
    for f in found:
        if f.unjudged:  # a failure is the pieces' own warning already
            continue
        piece, values, _, placed = calls[f.message_index or 0]
        mapped = []
        for part in _across_values(f, placed, {}, values):
            value = values[int(part.field or 0)]
            raw = piece.text[value.start : value.end]
            field = decoded.get((piece.message_index, value.text)) if "\\" in raw else None
            if field is not None:  # written with escapes: the decoded value's piece
                mapped.append(replace(part, message_index=piece.message_index, field=field))
                continue
            offsets = value.offsets(raw)
            start, end = value.start + offsets[part.start], value.start + offsets[part.end]
            mapped.append(
                replace(
                    part,
                    start=start,
                    end=end,
                    text=piece.text[start:end],
                    message_index=piece.message_index,
                    field=piece.field,
                )
            )
        if not any(
            s < m.end and m.start < e
            for m in mapped
            for s, e in own.get((m.message_index, m.field, m.detector_id), ())
        ):
            out += mapped
    return out


def redact_arguments(
    arguments: str, findings: list[Finding], redactors: dict[str, RequestedDetector]
) -> str:
    """Input redaction of a tool call's arguments sent back (DESIGN 4.6a), `findings` spans
    into the JSON as the client wrote it: each value's part of a span is redacted inside that
    value and re-encoded, as on output, so the arguments the model receives stay valid JSON. A
    number becomes a string (`5551234567` as `"[phone]"`; in place, `{"n": [phone]}` was no
    JSON), a replacement is escaped inside a string, and the JSON's own quotes, colons and
    brackets are never replaced. Arguments that are not JSON are redacted as the text they
    are."""
    values = string_values(arguments)
    if len(values) == 1 and not values[0].json and not values[0].number:
        return redact_text(arguments, findings, redactors)[0]
    spans = [
        f for f in findings if f.detector_id in redactors and f.end > f.start and not f.unjudged
    ]
    starts = [v.start for v in values]
    by_value: dict[int, list[Finding]] = {}
    for f in spans:  # the values each span covers, from the last that starts at or before it
        for j in range(max(0, bisect.bisect_right(starts, f.start) - 1), len(values)):
            if values[j].start >= f.end:
                break
            if values[j].end > f.start:
                by_value.setdefault(j, []).append(f)
    pieces: list[str] = []
    at = 0
    for j in sorted(by_value):
        value = values[j]
        raw = arguments[value.start : value.end]
        offsets = value.offsets(raw)  # where each character of the value is written in `raw`
        parts = []
        for f in by_value[j]:
            start = max(f.start, value.start) - value.start
            end = min(f.end, value.end) - value.start
            # the characters whose writing the part touches (an escape's whole)
            first = max(0, bisect.bisect_right(offsets, start) - 1)
            parts.append(replace(f, start=first, end=bisect.bisect_left(offsets, end)))
        text, _ = redact_text(value.text, parts, redactors)
        if text != value.text:
            pieces += (arguments[at : value.start], value.encode(text))
            at = value.end
    pieces.append(arguments[at:])
    return "".join(pieces)


def offered_names(tools: Any) -> frozenset[str]:
    """The names of the tools a request offered (`{"type": T, T: {"name": ...}}`, as Chat
    Completions declares a `function` tool and any other kind alike)."""
    names = set()
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        spec = tool.get(kind) if isinstance(kind, str) else None
        name = spec.get("name") if isinstance(spec, dict) else None
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


def raw_offsets(raw: str) -> list[int]:
    """Where each decoded character of a JSON string's raw text (without its quotes) starts in
    it, and its end: `len(decoded) + 1` offsets. An escape is one character (a surrogate pair of
    `\\u` escapes is one code point, as Python decodes it)."""
    out = []
    i, n = 0, len(raw)
    while i < n:
        out.append(i)
        if raw[i] != "\\":
            i += 1
        elif raw[i + 1] != "u":
            i += 2
        else:
            high = int(raw[i + 2 : i + 6], 16)
            i += 6
            if 0xD800 <= high < 0xDC00 and raw.startswith("\\u", i):
                try:
                    low = int(raw[i + 2 : i + 6], 16)
                except ValueError:
                    low = 0
                if 0xDC00 <= low < 0xE000:
                    i += 6
    out.append(n)
    return out


@dataclass(frozen=True, slots=True)
class JudgedCall:
    """A judged call: the call to release (arguments redacted, detections on it), or, when a
    blocking detector flagged it, the detections that withhold it."""

    call: ToolCall
    blocked: list[Finding] | None = None


async def judge_tool_calls(
    calls: list[ToolCall], detectors: list[RequestedDetector], chunkers: ChunkerRegistry
) -> list[JudgedCall]:
    """Each call judged by `detectors` (those that apply to tool calls); one detector call per
    detector covers every value of every call."""
    if not detectors:
        return [JudgedCall(c) for c in calls]
    calls = list(calls)  # a flagged id is replaced below
    # scanning and re-encoding arguments is CPU work: off the loop past BULK_CHARS, as text is
    bulk = sum(len(c.arguments) for c in calls) > BULK_CHARS

    def scan() -> tuple[list[list[StringValue]], list[tuple[str, list[tuple[int, int, int]]]]]:
        values = [string_values(c.arguments) for c in calls]
        return values, [joined_values(vs) for vs in values]

    values, joined = await off_loop(scan) if bulk else scan()
    pieces = [
        InputPiece(v.text, message_index=i, field=str(j))
        for i, vs in enumerate(values)
        for j, v in enumerate(vs)
    ]
    pieces += [
        InputPiece(c.id, message_index=i, field=ID_FIELD) for i, c in enumerate(calls) if c.id
    ]
    # span detectors judge each call's values across their boundaries too (`joined_values`),
    # in the same detector call; a classifier does not: its verdict on a text of unrelated
    # values glued together is on a text nobody wrote, and would fall on every value
    across = [
        InputPiece(text, message_index=i, field=JOINED_FIELD)
        for i, (text, placed) in enumerate(joined)
        if len(placed) > 1
    ]
    spans = [d for d in detectors if not d.judges_chunks]
    classifiers = [d for d in detectors if d.judges_chunks]
    async with asyncio.TaskGroup() as tg:
        by_spans = tg.create_task(judge_pieces(pieces + across, spans, chunkers))
        by_classifiers = tg.create_task(judge_pieces(pieces, classifiers, chunkers))
    findings = by_spans.result() + by_classifiers.result()
    by_id = {d.detector_id: d for d in detectors}
    mine: dict[int, list[Finding]] = {}
    on_id: dict[int, list[Finding]] = {}
    on_joined: list[Finding] = []
    own: dict[int, dict[tuple[int, str], list[tuple[int, int]]]] = {}
    for f in findings:
        if f.field == JOINED_FIELD:
            if not f.unjudged:  # a failure is the values' own warning already
                on_joined.append(f)
            continue
        i = f.message_index or 0
        (on_id if f.field == ID_FIELD else mine).setdefault(i, []).append(f)
        if f.field != ID_FIELD:
            own.setdefault(i, {}).setdefault((int(f.field or 0), f.detector_id), []).append(
                (f.start, f.end)
            )
    for f in on_joined:
        i = f.message_index or 0
        parts = _across_values(f, joined[i][1], own.get(i, {}), values[i])
        if parts:
            mine.setdefault(i, []).extend(parts)
    for i, flagged in on_id.items():
        if any(not f.unjudged for f in flagged):
            # the id is a handle, not content: one a detector flags is replaced, never sent
            calls[i] = replace(calls[i], id=f"call_{secrets.token_hex(12)}")
            mine.setdefault(i, []).extend(
                f for f in flagged if by_id[f.detector_id].blocking and not f.unjudged
            )

    def apply() -> list[JudgedCall]:
        return [_apply(c, values[i], mine.get(i, []), by_id) for i, c in enumerate(calls)]

    return await off_loop(apply) if bulk else apply()


def _apply(
    call: ToolCall,
    values: list[StringValue],
    findings: list[Finding],
    detectors: dict[str, RequestedDetector],
) -> JudgedCall:
    """The call as released: a block withholds it; redactions replace inside the JSON; every
    finding's span is moved into the arguments string and names the call."""
    call = replace(call, judged=True)
    blocking = [f for f in findings if detectors[f.detector_id].blocking and not f.unjudged]
    if blocking:
        withheld = []
        offsets_of: dict[int, list[int]] = {}  # by value: once each, not once per finding
        for f in blocking:
            if f.field == ID_FIELD:  # no part of the arguments: an empty span at their start
                withheld.append(_on_call(call, f, 0, 0))
                continue
            j = int(f.field or 0)
            value = values[j]
            offsets = offsets_of.get(j)
            if offsets is None:
                raw = call.arguments[value.start : value.end]
                offsets = offsets_of[j] = value.offsets(raw)
            withheld.append(
                _on_call(call, f, value.start + offsets[f.start], value.start + offsets[f.end])
            )
        return JudgedCall(call, sort_findings(withheld))
    if not findings:
        return JudgedCall(call)
    redactors = {k: d for k, d in detectors.items() if d.redacting}
    by_value: dict[int, list[Finding]] = {}
    for f in findings:
        by_value.setdefault(int(f.field or 0), []).append(f)
    pieces: list[str] = []
    placed: list[Finding] = []
    at = 0  # how far the original arguments are copied
    shift = 0  # how much longer the released arguments are than the original, so far
    for j, value in enumerate(values):
        found = by_value.get(j)
        if not found:
            continue
        raw = call.arguments[value.start : value.end]
        if any(f.detector_id in redactors and not f.unjudged for f in found):
            text, found = redact_text(value.text, found, redactors)
            raw = value.encode(text)
        offsets = value.offsets(raw)
        pieces += (call.arguments[at : value.start], raw)
        at = value.end
        base = value.start + shift
        placed += (_on_call(call, f, base + offsets[f.start], base + offsets[f.end]) for f in found)
        shift += len(raw) - (value.end - value.start)
    pieces.append(call.arguments[at:])
    released = replace(call, arguments="".join(pieces), detections=sort_findings(placed))
    return JudgedCall(released)


def _on_call(call: ToolCall, f: Finding, start: int, end: int) -> Finding:
    """A finding on a value, moved to `[start, end)` of the arguments string, naming the call."""
    return replace(
        f,
        start=start,
        end=end,
        message_index=None,
        field=None,
        tool_call_index=call.index,
        tool_call_id=call.id,
    )
