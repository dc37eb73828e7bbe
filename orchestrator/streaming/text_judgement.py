"""Detectors on a text that is whole from the start: task inputs (after masks) and the
detection/content endpoint. Each detector chunks the text with its own chunker and judges all
chunks in one call; the detectors run concurrently.

Nothing CPU-heavy on the event loop (DESIGN 4): chunking a megabyte of text takes about a second
of CPU, and turning tens of thousands of detections into findings about as much; on the loop
that froze every other request (issue 20: four 1 MB requests stalled /health for 3 s). Past
BULK_CHARS, chunking and finding-building run in `bulk_executor()`'s threads, and the loop only
waits for them (a Python thread holds the GIL for at most the switch interval at a time, so the
loop keeps answering). Below it, a sentence or a prompt, they stay inline: a hand-off costs more
than the work.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from chunkers import Span
from detectors.api import Detection

from ..clients.registry import ChunkerRegistry, RequestedDetector
from .fanout import ChunkerFailure
from .findings import Finding, keep, sort_findings

# A text longer than this is chunked, and its findings built, off the event loop. Sentence
# chunking cost ~3.5 us a character here (2 busy cores): 4 Ki characters is ~15 ms on the loop,
# the most one request may take from it in one go; a hand-off to a thread costs ~0.1 ms.
BULK_CHARS = 4 * 1024

T = TypeVar("T")

_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def bulk_executor() -> ThreadPoolExecutor:
    """Threads of their own for the CPU work of large requests: a flood of them never occupies
    the default executor (aiohttp's DNS lookups), and a few big requests queue here instead of
    all competing with the loop for the GIL at once."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            workers = max(1, min(2, os.cpu_count() or 1))
            _EXECUTOR = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bulk-judge")
        return _EXECUTOR


async def off_loop(fn: Callable[[], T]) -> T:
    """`fn()` in a bulk thread."""
    return await asyncio.get_running_loop().run_in_executor(bulk_executor(), fn)


async def judge_text(
    text: str,
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    regions: list[tuple[int, int]] | None = None,
) -> list[Finding]:
    """Findings over `text` (spans relative to all of it), sorted; `regions` restricts detection
    to those `[start, end)` slices, as input masks do."""
    if regions is None:
        regions = [(0, len(text))]
    bulk = sum(end - start for start, end in regions) > BULK_CHARS

    async def one(detector: RequestedDetector) -> list[Finding]:
        def chunk() -> list[Span]:
            return _chunk_regions(text, regions, detector.chunker_id, chunkers)

        spans = await off_loop(chunk) if bulk else chunk()
        if not spans:
            return []
        replies = await detector.client.detect([s.text for s in spans], detector.params)

        def build() -> list[Finding]:
            return _findings(detector, spans, replies)

        return await off_loop(build) if bulk else build()

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    found = [f for t in tasks for f in t.result()]
    if len(found) > 1024:
        return await off_loop(lambda: sort_findings(found))
    return sort_findings(found)


def _findings(
    detector: RequestedDetector, spans: list[Span], replies: list[list[Detection]]
) -> list[Finding]:
    return [
        f for span, dets in zip(spans, replies, strict=True) for f in keep(detector, span, dets)
    ]


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
