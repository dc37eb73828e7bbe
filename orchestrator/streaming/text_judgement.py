"""Detectors on a text that is whole from the start: task inputs (after masks), every piece of
a conversation's input, and the detection/content endpoint. Each detector chunks the text with
its own chunker and judges all chunks in one call; the detectors run concurrently.

No seam leaks: besides its chunks, a detector judges a window across every chunk boundary
(SEAM_CHARS each side, widened to whole whitespace-free runs) and keeps from it what straddles
the boundary: an e-mail or a card number cut by a `max_chars` safety cut is found like any other,
so a blocking input guardrail cannot be walked around by placing it there. On the content
endpoint (annotations of the client's own text) a detection covering a whole window is dropped
as a classifier's verdict on the window rather than an entity in it; on inputs, where any
detection refuses, it counts (an entity may fill the window). A redacting detector judges each
text whole instead (nothing to split)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from chunkers import Span

from ..clients.registry import ChunkerRegistry, RequestedDetector
from ..config import WHOLE_DOC_CHUNKER
from .detector_queue import SEAM_CHARS, SEAM_RUN_CHARS
from .fanout import ChunkerFailure
from .findings import Finding, keep, sort_findings


def _chunker_of(detector: RequestedDetector, whole: bool) -> str:
    """A redacting detector judges each whole text in one piece: a chunk boundary could split
    an entity (a card number cut at a `max_chars` whitespace) and both halves would pass."""
    return WHOLE_DOC_CHUNKER if whole or detector.redacting else detector.chunker_id


async def judge_text(
    text: str,
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    regions: list[tuple[int, int]] | None = None,
    *,
    whole: bool = False,
    window_verdicts: bool = True,
) -> list[Finding]:
    """Findings over `text` (spans relative to all of it), sorted; `regions` restricts detection
    to those `[start, end)` slices, as input masks do; `whole`: every detector judges each
    region in one piece (the text is to be redacted); `window_verdicts`: keep detections that
    cover a whole boundary window (see the module's docstring)."""
    if regions is None:
        regions = [(0, len(text))]

    async def one(detector: RequestedDetector) -> list[Finding]:
        found = await _judge(
            detector,
            [(text, s, e, None) for s, e in regions],
            _chunker_of(detector, whole),
            chunkers,
            window_verdicts,
        )
        return [f for _, f in found]

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    return sort_findings([f for t in tasks for f in t.result()])


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


async def judge_pieces(
    pieces: list[InputPiece], detectors: list[RequestedDetector], chunkers: ChunkerRegistry
) -> list[Finding]:
    """Findings over every piece, each span relative to its own piece and tagged with it,
    sorted. One detector call covers the chunks of all pieces."""
    pieces = [p for p in pieces if p.text]
    if not pieces:
        return []

    async def one(detector: RequestedDetector) -> list[Finding]:
        found = await _judge(
            detector,
            [(p.text, 0, len(p.text), p) for p in pieces],
            _chunker_of(detector, False),
            chunkers,
            True,
        )
        return [
            replace(f, message_index=piece.message_index, field=piece.field) for piece, f in found
        ]

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    return sort_findings([f for t in tasks for f in t.result()])


async def _judge(
    detector: RequestedDetector,
    regions: list[tuple[str, int, int, Any]],
    chunker_id: str,
    chunkers: ChunkerRegistry,
    window_verdicts: bool,
) -> list[tuple[Any, Finding]]:
    """(owner, finding) over `[start, end)` of each `(text, start, end, owner)`, in one call:
    the chunks, then one window per chunk boundary (see the module's docstring)."""
    spans: list[Span] = []
    owners: list[Any] = []
    seams: list[tuple[Span, int, Any]] = []  # (window, the boundary it spans, owner)
    for text, start, end, owner in regions:
        chunks = _chunk_regions(text, [(start, end)], chunker_id, chunkers)
        spans.extend(chunks)
        owners.extend([owner] * len(chunks))
        for nxt in chunks[1:]:
            seams.append((_seam(text, start, end, nxt.start), nxt.start, owner))
    if not spans:
        return []
    contents = [s.text for s in spans] + [w.text for w, _, _ in seams]
    replies = await detector.client.detect(contents, detector.params)
    n = len(spans)
    out = [
        (owner, f)
        for owner, span, dets in zip(owners, spans, replies[:n], strict=True)
        for f in keep(detector, span, dets)
    ]
    for (window, boundary, owner), dets in zip(seams, replies[n:], strict=True):
        for f in keep(detector, window, dets):
            whole_window = f.start == window.start and f.end == window.end
            if f.start < boundary < f.end and (window_verdicts or not whole_window):
                out.append((owner, f))
    return out


def _seam(text: str, start: int, end: int, boundary: int) -> Span:
    """The text around a chunk boundary: SEAM_CHARS each side, widened to the ends of the
    whitespace-free runs there (at most SEAM_RUN_CHARS more), within `[start, end)`."""
    lo = max(start, boundary - SEAM_CHARS)
    floor = max(start, lo - SEAM_RUN_CHARS)
    while lo > floor and not text[lo - 1].isspace():
        lo -= 1
    hi = min(end, boundary + SEAM_CHARS)
    ceiling = min(end, hi + SEAM_RUN_CHARS)
    while hi < ceiling and not text[hi].isspace():
        hi += 1
    return Span(lo, hi, text[lo:hi])


def _chunk_regions(
    text: str, regions: list[tuple[int, int]], chunker_id: str, chunkers: ChunkerRegistry
) -> list[Span]:
    chunker = chunkers.get(chunker_id)
    spans: list[Span] = []
    for start, end in regions:
        try:
            chunks = chunker.chunk(text[start:end])
        except Exception as exc:
            raise ChunkerFailure(chunker_id, f"{type(exc).__name__}: {exc}") from exc
        spans.extend(Span(c.start + start, c.end + start, c.text) for c in chunks)
    return spans
