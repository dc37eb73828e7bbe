"""The three streaming surfaces cannot disagree (DESIGN section 1, "one pipeline, many writers").

One table of pipeline event sequences (frames with detections, a refusal of either direction,
keep-alives, bursts marked `more`, and every terminal kind: completed, incomplete for a budget
and for a guardrail, failed, and error both server-side and the client's own) is served through
the real service on all three surfaces: the FMS task stream, Chat Completions and Responses. Only
the pipeline is scripted (the handlers' `prepare_*` return it); the handlers, the serving loop,
the writers and the error middleware are the real ones, over real HTTP.

Each case asserts every surface's exact wire output (ids and timestamps normalised), which
writes it came in (HTTP chunk boundaries: a burst is one write on every surface, a keep-alive
its own), and that the three agree on the released text and its indices, the detections, the
refusal, how the stream ended and the error type."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.api.errors import ErrorType, Failure
from orchestrator.app import (
    CHAT_PATH,
    RESPONSES_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
)
from orchestrator.handlers import (
    fms_stream,
    fms_unary,
    openai_chat,
    openai_responses,
    stream_content,
)
from orchestrator.streaming.events import KEEP_ALIVE, Event, Frame, KeepAlive, Refusal, Terminal
from orchestrator.streaming.findings import Finding
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    MODEL,
    NDJSON,
    Orchestrator,
    generation_body,
    native_config,
)

S1, S2 = "I am great.", " What about you?"
GREAT = Finding(5, 10, "great", "positive", "sentiment", "mood", 0.9)
WHAT = Finding(12, 16, "", "question", "form", "mood", 0.75)  # withheld: no text (4.6)
HI = Finding(0, 2, "Hi", "greeting", "form", "mood", 1.0, message_index=0)
BLOCKED = "The response was withheld: detector `mood` flagged the generated text."
REFUSED = "The request was refused: detector `mood` flagged the input."
# Each case's replies, as the service wrote them before the three surfaces shared one serving
# loop (commit ac9a8b9, read and checked against DESIGN 4.3, 4.8 and 4.9 when recorded): the
# loop changed how the bytes are written, never which bytes.
GOLDEN = Path(__file__).parent / "golden" / "writers_agree.json"


class ScriptedPipeline:
    """Yields a fixed event sequence: the pipeline's side of the contract, nothing else."""

    def __init__(self, events: list[Event]) -> None:
        self._events = events

    async def events(self) -> AsyncIterator[Event]:
        for event in self._events:
            yield event

    def shut_down(self) -> None:
        raise AssertionError("no drain in these tests")


@dataclass(frozen=True)
class Outcome:
    """What a client learns from a surface, in surface-neutral terms."""

    pieces: list[tuple[int, int, str]]  # released text, [start, end) per frame
    detections: list[tuple[int, int, str, str]]  # (start, end, detector_id, detection)
    refused: str | None  # the direction a guardrail refused in
    ending: str  # completed | max_output_tokens | content_filter | failed | error
    error_type: str | None = None
    input_detections: list[tuple[int, int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    id: str
    events: list[Event]
    outcome: Outcome
    writes: int  # HTTP chunks of each 200 reply (the FMS reply's headers go out at once)
    status: dict[str, int] = field(default_factory=lambda: {"fms": 200, "chat": 200, "resp": 200})
    # the unary replies' statuses: an error there is an HTTP error, unless the Responses object
    # already holds text (it then says `failed`)
    unary: dict[str, int] = field(default_factory=lambda: {"fms": 200, "chat": 200, "resp": 200})


def frame(start: int, text: str, **kw: Any) -> Frame:
    return Frame(start, start + len(text), text, **kw)


def end(kind: str, count: int = 8, at: int = 27, **kw: Any) -> Terminal:
    return Terminal(
        kind, generated_token_count=count, input_token_count=3, processed_index=at, **kw
    )  # type: ignore[arg-type]


UNAVAILABLE = Failure(503, ErrorType.GENERATION_UNAVAILABLE, "no replica could serve the model")
DETECTOR_DOWN = Failure(502, ErrorType.DETECTOR_ERROR, "detector `mood` failed: 500")
BAD_PARAMS = Failure(422, ErrorType.INVALID_REQUEST, "detector `mood` refused its params")
FINAL = {"final": True, "finish_reason": "EOS_TOKEN", "generated_token_count": 8}

CASES = [
    Case(
        "completed",
        [
            frame(0, S1, input_token_count=3),
            frame(11, S2, input_token_count=3, more=True, **FINAL),
            end("completed", finish_reason="EOS_TOKEN"),
        ],
        Outcome([(0, 11, S1), (11, 27, S2)], [], None, "completed"),
        writes=2,
    ),
    Case(
        "burst, detections and a keep-alive",
        [
            frame(0, S1, detections=[GREAT], judged=True, more=True),
            frame(11, " What", judged=True),
            KEEP_ALIVE,
            frame(16, " about you?", judged=True, more=True, **FINAL),
            end("completed", finish_reason="EOS_TOKEN"),
        ],
        Outcome(
            [(0, 11, S1), (11, 16, " What"), (16, 27, " about you?")],
            [(5, 10, "mood", "positive")],
            None,
            "completed",
        ),
        writes=3,
    ),
    Case(
        "token budget",
        [
            frame(
                0,
                S1,
                more=True,
                final=True,
                finish_reason="MAX_TOKENS",
                generated_token_count=4,
            ),
            end("incomplete", 4, 11, finish_reason="MAX_TOKENS", reason="max_output_tokens"),
        ],
        Outcome([(0, 11, S1)], [], None, "max_output_tokens"),
        writes=1,
    ),
    Case(
        "output refusal",
        [
            frame(0, S1, judged=True, more=True),
            Refusal("output", BLOCKED, [WHAT], input_token_count=3),
            end("incomplete", 4, 11, finish_reason="CANCELLED", reason="content_filter"),
        ],
        Outcome([(0, 11, S1)], [(12, 16, "mood", "question")], "output", "content_filter"),
        writes=2,
    ),
    Case(
        "input refusal",
        [
            Refusal("input", REFUSED, [HI], input_token_count=3),
            end("incomplete", 0, 0, reason="content_filter"),
        ],
        Outcome([], [], "input", "content_filter", input_detections=[(0, 2, "mood")]),
        writes=2,
    ),
    Case(
        "failed after a frame",
        [
            frame(0, S1, input_token_count=3),
            end("failed", 4, 11, finish_reason="ERROR", error=UNAVAILABLE),
        ],
        Outcome([(0, 11, S1)], [], None, "failed", "generation_unavailable"),
        writes=2,
        unary={"fms": 503, "chat": 503, "resp": 200},
    ),
    Case(
        "error before any frame, the server's",
        [end("error", 0, 0, finish_reason="ERROR", error=DETECTOR_DOWN)],
        Outcome([], [], None, "error", "detector_error"),
        writes=1,
        status={"fms": 200, "chat": 502, "resp": 200},
        unary={"fms": 502, "chat": 502, "resp": 502},
    ),
    Case(
        "error before any frame, the client's",
        [end("error", 0, 0, finish_reason="ERROR", error=BAD_PARAMS)],
        Outcome([], [], None, "error", "invalid_request"),
        writes=1,
        status={"fms": 200, "chat": 422, "resp": 422},
        unary={"fms": 422, "chat": 422, "resp": 422},
    ),
]


# -- the wire, parsed ----------------------------------------------------------------------------


def sse_blocks(raw: str) -> list[tuple[str | None, str | None]]:
    """(event name, data) per SSE block; a comment block (keep-alive) is (None, None)."""
    out: list[tuple[str | None, str | None]] = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        name = data = None
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if line.startswith(":"):
                assert line == ": keep-alive", line
            elif key == "event":
                name = value
            elif key == "data":
                data = value
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        out.append((name, data))
    return out


def normalised(raw: str) -> str:
    """Ids and clocks replaced: everything else is compared byte for byte."""
    raw = re.sub(r"chatcmpl-[0-9a-f]{32}", "chatcmpl-ID", raw)
    raw = re.sub(r"resp_[0-9a-f]{32}", "resp_ID", raw)
    raw = re.sub(r"msg_[0-9a-f]{32}", "msg_ID", raw)
    return re.sub(r'"(created|created_at|completed_at)":\d+', r'"\1":0', raw)


def fms_outcome(raw: str) -> Outcome:
    blocks = [(n, json.loads(d)) for n, d in sse_blocks(raw) if d is not None]
    pieces, detections, inputs = [], [], []
    refused = error_type = None
    for name, data in blocks:
        if name is None:
            if any(w["id"] == "UNSUITABLE_INPUT" for w in data.get("warnings") or []):
                refused = "input"
            if data.get("generated_text"):
                pieces.append(
                    (data["start_index"], data["processed_index"], data["generated_text"])
                )
            tcr = data["token_classification_results"]
            detections += [
                (d["start"], d["end"], d["detector_id"], d["entity"])
                for d in tcr.get("output") or []
            ]
            inputs += [(d["start"], d["end"], d["detector_id"]) for d in tcr.get("input") or []]
        elif name == "refusal.done":
            refused = "output"
            detections += [
                (d["start"], d["end"], d["detector_id"], d["entity"]) for d in data["detections"]
            ]
    name, data = blocks[-1]
    ending = name
    if name == "incomplete":
        ending = data["incomplete_details"]["reason"]
    elif name == "failed":
        error_type = data["error"]["type"]
    elif name == "error":
        error_type = data["type"]
    return Outcome(pieces, detections, refused, ending, error_type, inputs)  # type: ignore[arg-type]


def chat_outcome(raw: str, status: int) -> Outcome:
    if status != 200:
        error = json.loads(raw)["error"]
        return Outcome([], [], None, "error", error["type"])
    blocks = sse_blocks(raw)
    assert blocks[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in blocks[:-1] if d is not None]
    pieces, detections, inputs = [], [], []
    refused = finish = error_type = None
    at = 0
    for chunk in chunks:
        if "error" in chunk:
            error_type = chunk["error"]["type"]
            continue
        [choice] = chunk["choices"]
        text = choice["delta"].get("content")
        if text:
            pieces.append((at, at + len(text), text))
            at += len(text)
        if choice["delta"].get("refusal"):
            refused = "input" if "input" in (chunk.get("detections") or {}) else "output"
        finish = choice["finish_reason"] or finish
        dets = chunk.get("detections") or {}
        for group in dets.get("output") or []:
            detections += [
                (d["start"], d["end"], d["detector_id"], d["entity"]) for d in group["results"]
            ]
        for group in dets.get("input") or []:
            inputs += [(d["start"], d["end"], d["detector_id"]) for d in group["results"]]
    ending = {
        "stop": "completed",
        "length": "max_output_tokens",
        "content_filter": "content_filter",
    }.get(finish)  # type: ignore[arg-type]
    if error_type is not None:
        ending = "failed" if pieces else "error"
    assert ending is not None
    return Outcome(pieces, detections, refused, ending, error_type, inputs)


def responses_outcome(raw: str, status: int) -> Outcome:
    if status != 200:
        error = json.loads(raw)["error"]
        return Outcome([], [], None, "error", error["type"])
    events = [(n, json.loads(d)) for n, d in sse_blocks(raw) if d is not None]
    for seq, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == seq
    name, last = events[-1]
    if name == "error":
        return Outcome([], [], None, "error", last["code"])
    pieces, at = [], 0
    for n, data in events:
        if n == "response.output_text.delta":
            pieces.append((at, at + len(data["delta"]), data["delta"]))
            at += len(data["delta"])
    response = last["response"]
    guardrails = response["guardrails"]
    detections = [
        (a["start_index"], a["end_index"], a["detector_id"], a["detection"])
        for a in guardrails["output"]
    ]
    inputs = [(a["start_index"], a["end_index"], a["detector_id"]) for a in guardrails["input"]]
    refused = None
    if any(n == "response.refusal.done" for n, _ in events):
        refused = "input" if inputs else "output"
    status_ = response["status"]
    ending = (
        status_ if status_ in ("completed", "failed") else response["incomplete_details"]["reason"]
    )
    error_type = response["error"]["type"] if response["error"] else None
    return Outcome(pieces, detections, refused, ending, error_type, inputs)  # type: ignore[arg-type]


# -- the test ------------------------------------------------------------------------------------


async def post(orch: Orchestrator, path: str, body: dict[str, Any] | str) -> tuple[int, list[str]]:
    """The status and the reply's HTTP chunks (one per server write); a str body is NDJSON."""
    assert orch.session is not None
    writes, buf = [], b""
    sent: dict[str, Any] = (
        {"json": body}
        if isinstance(body, dict)
        else {"data": body, "headers": {"Content-Type": NDJSON}}
    )
    async with orch.session.post(orch.url + path, **sent) as r:
        async for data, end_of_chunk in r.content.iter_chunks():
            buf += data
            if end_of_chunk:
                writes.append(buf.decode())
                buf = b""
        if buf:
            writes.append(buf.decode())
        return r.status, writes


def script(monkeypatch: pytest.MonkeyPatch, events: list[Event]) -> None:
    """Every generation handler gets a pipeline that yields `events`."""

    async def prepared(*args: Any, **kwargs: Any) -> ScriptedPipeline:
        return ScriptedPipeline(events)

    for module, name in (
        (fms_stream, "prepare"),
        (fms_unary, "prepare"),
        (openai_chat, "prepare"),
        (openai_responses, "prepare_response"),
        (stream_content, "prepare_content"),
    ):
        monkeypatch.setattr(module, name, prepared)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_the_surfaces_agree(
    case: Case, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(monkeypatch, case.events)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    resp = {"model": MODEL, "input": "Hi", "stream": True}
    async with Orchestrator(native_config(engine.url)) as orch:
        replies = {
            "fms": await post(orch, STREAMING_PATH, generation_body()),
            "chat": await post(orch, CHAT_PATH, chat),
            "resp": await post(orch, RESPONSES_PATH, resp),
        }
    assert engine.requests == []  # only the scripted pipeline ran
    assert {k: status for k, (status, _) in replies.items()} == case.status
    for surface, (status, writes) in replies.items():
        if status == 200:
            assert len(writes) == case.writes, (surface, writes)
    raw = {k: normalised("".join(writes)) for k, (_, writes) in replies.items()}
    assert raw == json.loads(GOLDEN.read_text())[case.id]
    outcomes = {
        "fms": fms_outcome(raw["fms"]),
        "chat": chat_outcome(raw["chat"], replies["chat"][0]),
        "resp": responses_outcome(raw["resp"], replies["resp"][0]),
    }
    assert outcomes == {"fms": case.outcome, "chat": case.outcome, "resp": case.outcome}


# -- the unary replies: the same events folded ---------------------------------------------------


def folded(outcome: Outcome) -> tuple[Any, ...]:
    """What a unary reply can say: the text whole, not frame by frame."""
    text = "".join(t for _, _, t in outcome.pieces)
    return (text, outcome.detections, outcome.refused, outcome.ending, outcome.error_type)


def fms_unary_outcome(body: dict[str, Any]) -> tuple[Any, ...]:
    tcr = body["token_classification_results"]
    output = [
        (d["start"], d["end"], d["detector_id"], d["entity"]) for d in tcr.get("output") or []
    ]
    refused = None
    if body.get("refusal"):
        refused = "output"
        output += [
            (d["start"], d["end"], d["detector_id"], d["entity"])
            for d in body["refusal"]["detections"]
        ]
    if any(w["id"] == "UNSUITABLE_INPUT" for w in body.get("warnings") or []):
        refused = "input"
    ending = (
        body["status"] if body["status"] == "completed" else body["incomplete_details"]["reason"]
    )
    return (body.get("generated_text") or "", output, refused, ending, None)


def chat_unary_outcome(body: dict[str, Any]) -> tuple[Any, ...]:
    [choice] = body["choices"]
    dets = body.get("detections") or {}
    output = [
        (d["start"], d["end"], d["detector_id"], d["entity"])
        for group in dets.get("output") or []
        for d in group["results"]
    ]
    refused = None
    if choice["message"]["refusal"]:
        refused = "input" if dets.get("input") else "output"
    ending = {"stop": "completed", "length": "max_output_tokens"}.get(
        choice["finish_reason"], choice["finish_reason"]
    )
    return (choice["message"]["content"], output, refused, ending, None)


def responses_unary_outcome(body: dict[str, Any]) -> tuple[Any, ...]:
    events = (
        "event: response.completed\ndata: "
        + json.dumps({"type": "response.completed", "sequence_number": 0, "response": body})
        + "\n\n"
    )
    outcome = responses_outcome(events, 200)
    [item] = body["output"]
    text = "".join(part["text"] for part in item["content"] if part["type"] == "output_text")
    refused = None
    if any(part["type"] == "refusal" for part in item["content"]):
        refused = "input" if body["guardrails"]["input"] else "output"
    return (text, outcome.detections, refused, outcome.ending, outcome.error_type)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_the_unary_surfaces_agree(
    case: Case, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folds of the same events: every 200 reply says what the stream said; an HTTP error
    carries the stream's error type."""
    script(monkeypatch, case.events)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    async with Orchestrator(native_config(engine.url)) as orch:
        replies = {
            "fms": await orch.post(UNARY_PATH, generation_body()),
            "chat": await orch.post(CHAT_PATH, chat),
            "resp": await orch.post(RESPONSES_PATH, {"model": MODEL, "input": "Hi"}),
        }
    assert {k: status for k, (status, _) in replies.items()} == case.unary
    project = {
        "fms": fms_unary_outcome,
        "chat": chat_unary_outcome,
        "resp": responses_unary_outcome,
    }
    for surface, (status, body) in replies.items():
        if status == 200:
            expected = folded(case.outcome)
            if surface == "chat":
                # a refused chat.completion's message has `content: null` (DESIGN 4.8)
                expected = (None if case.outcome.refused else expected[0], *expected[1:])
            assert project[surface](body) == expected, surface
        else:
            error = (
                body["error"] if surface != "fms" else {"type": body["type"], "code": body["code"]}
            )
            assert (error["type"], error["code"]) == (case.outcome.error_type, status), surface


# -- stream-content: the same loop, the NDJSON writer ---------------------------------------------

# stream-content's pipeline judges text it is given: it never refuses and never goes silent
# (no keep-alive), so it shares the cases without a refusal, keep-alives left out
CONTENT_CASES = [c for c in CASES if not any(isinstance(e, Refusal) for e in c.events)]
# the content form of GREAT (DESIGN 4.1: the content endpoints' detection)
GREAT_CONTENT = {
    "start": 5,
    "end": 10,
    "text": "great",
    "detection": "positive",
    "detection_type": "sentiment",
    "detector_id": "mood",
    "score": 0.9,
}


def ndjson(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":")) + "\n"


@pytest.mark.parametrize("case", CONTENT_CASES, ids=[c.id for c in CONTENT_CASES])
async def test_stream_content_says_what_the_streams_say(
    case: Case, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stream-content is served by the same loop with the NDJSON writer: one line per frame (a
    burst in one write), the error body as the last line of a stream that broke, nothing after
    a completed one; the reply started before the pipeline's first event (the first line was
    validated), so every error is in-band, as on the FMS stream."""
    events = [e for e in case.events if not isinstance(e, KeepAlive)]
    script(monkeypatch, events)
    line = ndjson({"detectors": {"mood": {}}, "content": "Hi"})
    async with Orchestrator(native_config(engine.url)) as orch:
        status, writes = await post(orch, STREAM_CONTENT_PATH, line)
    assert status == 200
    expected, pending = [], ""
    for event in events:
        if isinstance(event, Frame):
            detections = [GREAT_CONTENT] if event.detections == [GREAT] else []
            assert len(detections) == len(event.detections)
            pending += ndjson(
                {
                    "detections": detections,
                    "start_index": event.start,
                    "processed_index": event.end,
                }
            )
            if event.more:
                continue
        elif isinstance(event, Terminal) and event.error is not None:
            error = event.error
            pending += ndjson(
                {"code": error.code, "details": error.message, "type": error.type.value}
            )
        if pending:
            expected.append(pending)
            pending = ""
    assert writes == expected
    lines = [json.loads(x) for x in "".join(writes).splitlines()]
    results = [x for x in lines if "processed_index" in x]
    pieces = [(x["start_index"], x["processed_index"]) for x in results]
    assert pieces == [(start, end) for start, end, _ in case.outcome.pieces]
    errors = [x["type"] for x in lines if "code" in x]
    assert errors == ([case.outcome.error_type] if case.outcome.error_type else [])
