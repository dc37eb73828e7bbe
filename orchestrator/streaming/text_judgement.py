"""Detectors on a text that is whole from the start: task inputs (after masks), every piece of
a conversation's input, and the detection/content endpoint. Each detector chunks the text with
its own chunker and judges all chunks in one call; the detectors run concurrently."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from chunkers import Span

from ..clients.registry import ChunkerRegistry, RequestedDetector
from ..config import WHOLE_DOC_CHUNKER
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
) -> list[Finding]:
    """Findings over `text` (spans relative to all of it), sorted; `regions` restricts detection
    to those `[start, end)` slices, as input masks do; `whole`: every detector judges each
    region in one piece (the text is to be redacted)."""
    if regions is None:
        regions = [(0, len(text))]

    async def one(detector: RequestedDetector) -> list[Finding]:
        spans = _chunk_regions(text, regions, _chunker_of(detector, whole), chunkers)
        if not spans:
            return []
        replies = await detector.client.detect([s.text for s in spans], detector.params)
        return [
            f for span, dets in zip(spans, replies, strict=True) for f in keep(detector, span, dets)
        ]

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
        owners: list[InputPiece] = []
        spans: list[Span] = []
        for piece in pieces:
            chunks = _chunk_regions(
                piece.text, [(0, len(piece.text))], _chunker_of(detector, False), chunkers
            )
            spans.extend(chunks)
            owners.extend([piece] * len(chunks))
        if not spans:
            return []
        replies = await detector.client.detect([s.text for s in spans], detector.params)
        return [
            replace(f, message_index=piece.message_index, field=piece.field)
            for piece, span, dets in zip(owners, spans, replies, strict=True)
            for f in keep(detector, span, dets)
        ]

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    return sort_findings([f for t in tasks for f in t.result()])


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
