"""Detectors on a text that is whole from the start: task inputs (after masks), every piece of
a conversation's input, and the detection/content endpoint. Each detector chunks the text with
its own chunker and judges all chunks in one call; the detectors run concurrently.

No seam leaks: besides its chunks, a span detector judges a window across each chunk boundary
that is a seam for it (`seam_ends`: SEAM_CHARS each side, widened to whole whitespace-free runs)
and keeps from it what straddles the boundary: an e-mail or a card number cut by a `max_chars`
safety cut is found like any other, so a blocking input guardrail cannot be walked around by
placing it there. A boundary at a natural cut (whitespace after a sentence end, or a line break:
`chunkers.natural_cut`) is no seam for a detector whose spans cross none (the built-in regex
kinds): a window at every sentence end doubled the detector work of bulk text (a 5,000-sentence
input was 9,999 detector items; issue 20's `bench/loop_lag.py`: 15 s -> 50 s for four 1 MB
requests). A classifier judges its chunks alone, with no window (DESIGN 4.6a: its verdict is on
the chunk it was given; `detectors/windows.py` keeps padding inside a chunk from diluting it).
A window that the raw bound cuts inside a whitespace-free run of mostly hidden characters (a
value padded with markup or invisible ones past SEAM_RAW_CHARS, detector_queue.py) sees no value
whole: the run is an `obfuscated` finding (one per run), as a stream's is, so a blocking input
guardrail refuses a prompt padded so rather than pass it to the model.
Inputs, where any detection refuses, keep a detection covering a whole window (an entity may
fill it); the content endpoint (annotations of the client's own text, `annotating`) drops it as
a verdict on the window rather than an entity in it. A redacting span detector judges each text
whole instead (nothing to split).

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
import bisect
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from chunkers import Span
from detectors.api import Detection
from detectors.normalise import open_overrides

from ..api.input_pieces import InputPiece
from ..clients.registry import ChunkerRegistry, RequestedDetector
from ..config import WHOLE_DOC_CHUNKER
from .detector_queue import obscured_finding, seam_ends, seam_window
from .fanout import ChunkerFailure
from .findings import Finding, kept_findings, sort_findings
from .read_after import read_back
from .verdict_cache import TenantVerdicts

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


def _redacts_whole(detector: RequestedDetector, whole: bool) -> bool:
    """A redacting span detector judges each whole text in one piece: a chunk boundary could
    split an entity (a card number cut at a `max_chars` whitespace) and both halves would pass.
    A classifier judges the chunks its chunker gives it, each alone and with no seam window:
    what it redacts is exactly a chunk, and a verdict on a whole text or on a mixture of two
    chunks is diluted by the benign part (on de9ac67 `redact` on `hap` found nothing in a
    six-sentence text where `annotate` found the profane sentence)."""
    return (whole or detector.redacting) and not detector.judges_chunks


def _chunker_of(detector: RequestedDetector, whole: bool) -> str:
    return WHOLE_DOC_CHUNKER if _redacts_whole(detector, whole) else detector.chunker_id


async def judge_text(
    text: str,
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    masks: list[tuple[int, int]] | None = None,
    *,
    whole: bool = False,
    annotating: bool = False,
    verdicts: TenantVerdicts | None = None,
) -> list[Finding]:
    """Findings over `text` (spans relative to all of it), sorted; `masks` (the task's input
    masks) restrict the request's own detectors to those `[start, end)` slices, never an
    enforced one, which judges the whole text (DESIGN 1: a request cannot narrow what the
    operator's guardrails see); `whole`: every detector judges each
    slice in one piece (the text is to be redacted); `annotating`: the content endpoint's
    annotations (a detection covering a whole window is dropped: see the module's docstring);
    `verdicts`: the tenant's kept input verdicts (verdict_cache.py), None for none."""
    everything = [(0, len(text))]

    async def one(detector: RequestedDetector) -> list[Finding]:
        slices = everything if masks is None or detector.enforced else masks
        found = await _judge(
            detector,
            [(text, s, e, None) for s, e in slices],
            _chunker_of(detector, whole),
            chunkers,
            annotating,
            verdicts,
        )
        return [f for _, f in found]

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    return await _sorted([f for t in tasks for f in t.result()])


async def judge_pieces(
    pieces: list[InputPiece],
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    verdicts: TenantVerdicts | None = None,
) -> list[Finding]:
    """Findings over every piece, each span relative to its own piece and tagged with it,
    sorted. One detector call covers the chunks of all pieces (those `verdicts` has no reply
    for)."""
    pieces = [p for p in pieces if p.text]
    if not pieces:
        return []

    async def one(detector: RequestedDetector) -> list[Finding]:
        found = await _judge(
            detector,
            [(p.text, 0, len(p.text), p) for p in pieces],
            _chunker_of(detector, False),
            chunkers,
            False,
            verdicts,
        )
        return [
            replace(f, message_index=piece.message_index, field=piece.field) for piece, f in found
        ]

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    return await _sorted([f for t in tasks for f in t.result()])


async def _judge(
    detector: RequestedDetector,
    regions: list[tuple[str, int, int, Any]],
    chunker_id: str,
    chunkers: ChunkerRegistry,
    annotating: bool,
    verdicts: TenantVerdicts | None = None,
) -> list[tuple[Any, Finding]]:
    """(owner, finding) over `[start, end)` of each `(text, start, end, owner)`, in one call:
    the chunks, then one window per chunk boundary that is a seam for the detector
    (`seam_ends`; see the module's docstring); with `verdicts`, only the contents it keeps no
    reply for. Past BULK_CHARS, chunking, hashing and building findings run off the loop."""
    bulk = sum(end - start for _, start, end, _ in regions) > BULK_CHARS
    spans: list[Span] = []
    owners: list[Any] = []
    # (window, the boundaries it spans, owner)
    seams: list[tuple[Span, tuple[int, ...], Any]] = []
    obscured: list[tuple[Any, Finding]] = []  # runs a window had to cut at the raw bound
    # what a chunk (by index) or window (by index) is read after: the bidi overrides the whole
    # text has open where it starts (`open_overrides`), so a piece reads as a reader sees it
    after: dict[int, str] = {}
    window_after: dict[int, str] = {}
    seam_after = seam_ends(detector)

    def chunk() -> None:
        for text, start, end, owner in regions:
            chunks = _chunk_regions(text, [(start, end)], chunker_id, chunkers)
            first_seam = len(seams)
            spans.extend(chunks)
            owners.extend([owner] * len(chunks))
            if seam_after is not None:
                for prev, nxt in itertools.pairwise(chunks):
                    if seam_after(prev):
                        window, hidden = _seam(text, start, end, nxt.start)
                        seams.append((window, (nxt.start,), owner))
                        lo, hi = window.start, window.end
                        if not hidden:
                            continue
                        # fails closed, as a stream's windows do (detector_queue.py): one finding
                        # per run however many cuts it holds
                        last = obscured[-1] if obscured else None
                        if last is not None and last[0] is owner and lo <= last[1].end:
                            lo = last[1].start
                            obscured.pop()
                        obscured.append((owner, obscured_finding(detector, lo, max(hi, lo))))
            if not detector.judges_chunks:
                seams[first_seam:] = _merged(text, seams[first_seam:])
            windows = [w for w, _, _ in seams[first_seam:]]
            starts = sorted({s.start for s in (*chunks, *windows)})
            opened = dict(zip(starts, open_overrides(text, starts), strict=True))
            for i, c in enumerate(chunks, start=len(spans) - len(chunks)):
                if opened[c.start]:
                    after[i] = opened[c.start]
            for i, w in enumerate(windows, start=first_seam):
                if opened[w.start]:
                    window_after[i] = opened[w.start]

    await off_loop(chunk) if bulk else chunk()
    if not spans:
        return []
    contents = [after.get(i, "") + s.text for i, s in enumerate(spans)]
    contents += [window_after.get(i, "") + w.text for i, (w, _, _) in enumerate(seams)]
    replies = await _detect(detector, contents, verdicts, bulk)
    if after or window_after:  # back to positions in the pieces themselves
        opened = [after.get(i, "") for i in range(len(spans))]
        opened += [window_after.get(i, "") for i in range(len(seams))]
        replies = read_back(replies, opened)

    def build() -> list[tuple[Any, Finding]]:
        return _findings(detector, owners, spans, seams, replies, annotating) + obscured

    return await off_loop(build) if bulk else build()


def _merged(
    text: str, seams: list[tuple[Span, tuple[int, ...], Any]]
) -> list[tuple[Span, tuple[int, ...], Any]]:
    """A span detector's overlapping windows of one region as one window over their union,
    which looks across each of their boundaries (`_findings`: a finding counts where it
    straddles any). Windows reach SEAM_RAW_CHARS raw characters each side inside hidden runs:
    with `max_chars` 500 a text of `<b>` was judged 16-32 times over, one window per cut (30 s
    of CPU at 1 MiB); merged, the windows hold each character once. Not for a classifier: its
    verdict is on the whole text it reads, which a merged window would dilute. Each union is
    sliced once, when it is complete: sliced at each merge, a seam every few characters (`a .
    a . ...`) made the merging quadratic (tests/test_request_cost.py)."""
    # (start, end, boundaries, owner) of each union so far
    groups: list[tuple[int, int, list[int], Any]] = []
    for window, boundaries, owner in seams:
        if groups and groups[-1][3] is owner and window.start < groups[-1][1]:
            lo, hi, joined, _ = groups[-1]
            joined.extend(boundaries)
            groups[-1] = (min(lo, window.start), max(hi, window.end), joined, owner)
        else:
            groups.append((window.start, window.end, list(boundaries), owner))
    return [(Span(lo, hi, text[lo:hi]), tuple(joined), owner) for lo, hi, joined, owner in groups]


async def _detect(
    detector: RequestedDetector,
    contents: list[str],
    verdicts: TenantVerdicts | None,
    bulk: bool,
) -> list[list[Detection]]:
    """The detector's reply to each content: the kept ones from `verdicts`, the others from
    one call with each distinct missing content once, in order; no call when all are kept."""
    lookup = verdicts.lookup(detector) if verdicts is not None else None
    if lookup is None:
        return await detector.client.detect(contents, detector.params)
    keys = await off_loop(lambda: lookup.keys(contents)) if bulk else lookup.keys(contents)
    replies = lookup.get(keys, contents)
    missing: dict[bytes, int] = {}  # key -> the index of its first content
    for i, (key, reply) in enumerate(zip(keys, replies, strict=True)):
        if reply is None:
            missing.setdefault(key, i)
    if not missing:
        return [r for r in replies if r is not None]
    firsts = list(missing.values())
    fresh = await detector.client.detect([contents[i] for i in firsts], detector.params)
    by_key = dict(zip(missing, fresh, strict=True))
    for key, i in missing.items():
        lookup.put(key, contents[i], by_key[key])
    return [by_key[k] if r is None else r for k, r in zip(keys, replies, strict=True)]


def _findings(
    detector: RequestedDetector,
    owners: list[Any],
    spans: list[Span],
    seams: list[tuple[Span, tuple[int, ...], Any]],
    replies: list[list[Detection]],
    annotating: bool,
) -> list[tuple[Any, Finding]]:
    """(owner, finding) of every chunk's reply, then what each boundary window's reply found
    straddling its boundary; an entity across several boundaries once (each of their windows
    finds it)."""
    n = len(spans)
    chunked = [
        (owner, f)
        for owner, span, dets in zip(owners, spans, replies[:n], strict=True)
        for f in kept_findings(detector, span, dets)
    ]
    seen: set[tuple[int, int, int, str]] = set()
    across: list[tuple[Any, Finding]] = []
    for (window, boundaries, owner), dets in zip(seams, replies[n:], strict=True):
        for f in kept_findings(detector, window, dets):
            whole_window = f.start == window.start and f.end == window.end
            straddles = any(f.start < b < f.end for b in boundaries)
            if straddles and not (annotating and whole_window):
                key = (id(owner), f.start, f.end, f.detection)
                if key not in seen:
                    seen.add(key)
                    across.append((owner, f))
    return _without_cut_parts(chunked, across) + across


def _without_cut_parts(
    chunked: list[tuple[Any, Finding]], across: list[tuple[Any, Finding]]
) -> list[tuple[Any, Finding]]:
    """The chunks' findings less those a window's finding of the same kind covers: a chunk cut
    inside an entity (`max_chars`) finds its part (`jo@example.co` of `jo@example.com`), the
    window across the cut the whole; the part said beside it is the same entity twice.
    O((chunks' + windows' findings) log) by a running maximum of the windows' ends."""
    if not across or not chunked:
        return chunked
    by_kind: dict[tuple[int, str], tuple[list[int], list[int]]] = {}
    for owner, f in sorted(across, key=lambda of: of[1].start):
        starts, reach = by_kind.setdefault((id(owner), f.detection), ([], []))
        starts.append(f.start)
        reach.append(max(f.end, reach[-1]) if reach else f.end)

    def covered(owner: Any, f: Finding) -> bool:
        kind = by_kind.get((id(owner), f.detection))
        if kind is None:
            return False
        starts, reach = kind
        i = bisect.bisect_right(starts, f.start) - 1
        return i >= 0 and reach[i] >= f.end

    return [(owner, f) for owner, f in chunked if not covered(owner, f)]


def _seam(text: str, start: int, end: int, boundary: int) -> tuple[Span, bool]:
    """The text around a chunk boundary within `[start, end)` (`seam_window`: SEAM_CHARS visible
    characters each side, widened to the whitespace-free runs there), and whether the raw bound
    cut it inside a run of mostly hidden characters."""
    lo, hi, hidden = seam_window(text, start, end, boundary)
    return Span(lo, hi, text[lo:hi]), hidden


async def _sorted(found: list[Finding]) -> list[Finding]:
    """sort_findings, off the loop when there are many."""
    if len(found) > 1024:
        return await off_loop(lambda: sort_findings(found))
    return sort_findings(found)


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
        spans.extend(replace(c, start=c.start + start, end=c.end + start) for c in chunks)
    return spans
