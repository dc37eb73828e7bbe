"""One detector's queue of chunks within one stream (DESIGN 4.4).

Chunks are judged in stream order; whatever accumulated while a call was in flight goes out in the
next call as one multi-content request, so a fast stream costs few detector round trips. Verdicts
are posted to the pipeline's inbox: the queue never calls back into the pipeline.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from chunkers import Span
from detectors.api import Detection
from detectors.normalise import (
    MARKUP_MOST,
    BidiStack,
    fold,
    is_plain,
    markup_hidden,
    markup_hidden_runs,
)

from ..clients.registry import RequestedDetector
from ..judge_templates import JudgeContext
from .aggregation import DetectorResult
from .findings import Finding, kept_findings
from .inbox import Inbox
from .read_after import read_back, shifted

Result = DetectorResult[Finding]

# A redacting detector judges overlapping windows, so that no entity escapes by straddling a
# chunk boundary (or arriving one character per token): each call judges the new chunks plus the
# unreleased tail of the previous window, and reports only up to a "safe" end at least
# SEAM_CHARS before the window's end, moved back to the start of the whitespace-free run there
# (at most SEAM_RUN_CHARS back) and never inside a detection. What lies after it is judged again,
# whole, by the next window. An entity up to SEAM_CHARS long (phone and card numbers with
# spaces), or without whitespace up to SEAM_RUN_CHARS long (e-mails, URLs, keys), is therefore
# always seen whole by one call before any of it is released, whatever the chunk size. A window
# that ends at a chunk end which is no seam for the detector (a natural cut its spans never
# cross: `seam_ends`) is reported whole and carries nothing; a blocking detector likewise posts
# such a chunk without waiting for the text after it.
#
# Both count characters of the detectors' normalised view (DESIGN 4.6b): invisible ones (zero-
# width spaces, soft hyphens, bidi controls) and what markup keeps out of it (an escape is one
# character, `&#x00006a;` a `j`; tags, comments) do not count, so padding an e-mail with them does
# not push it past the window. SEAM_RUN_CHARS bounds what one entity may span: more than an
# e-mail can (64 + 1 + 255: `regex` ends a longer domain 255 characters after its `@`). A walk
# steps over at most SEAM_RAW_CHARS original characters (invisible ones included), so the
# carried text stays bounded however it is padded (each call judges it again: an unbounded
# carry would make a long run cost quadratic time). A run longer than SEAM_RUN_CHARS visible
# characters is cut SEAM_RUN_CHARS before the count: the next window carries every entity the
# cut crosses whole (cut at the count, a 320-character e-mail in a 1,200-character run was
# cut before its top-level label came, and released raw). Past SEAM_RAW_CHARS with fewer
# visible characters than that (a whitespace-free run of mostly hidden ones: `jo` +
# `<b></b>` x 1300 + `@example.com`, which shows `jo@example.com`; no e-mail, phone number or URL written plainly
# is one, nor base64 or a URL of percent escapes) the cut would release a value's head before
# its tail was seen: the run is redacted instead (`obfuscated`, DESIGN 4.6a), from its start,
# and so is the rest of it in the windows that follow, up to the whitespace that ends it
# (unless what the cut releases of it shows nothing: markup alone hides no value's head). This
# fails closed at no extra cost: the work per character stays bounded (a run's start and end
# are found once per window that cuts it, in linear time). Ordinary text never trips it (none
# of bench/quality.py's 4,765 everyday texts; bench/hidden_runs.py): only a run like that of
# several KB does, such as JSON of escaped CJK prose or minified code-highlighting spans.
SEAM_CHARS = 64
SEAM_RUN_CHARS = 1024
SEAM_RAW_CHARS = 4096
# How far past a chunk boundary a blocking span detector's held chunk waits while the detector
# says an entity goes on across it (`held_from`: a number spelt as words, longer than
# SEAM_CHARS; detectors/number_spellings.py's MAX_RUN_CHARS): then it is posted as judged
HELD_REACH = 256
# the detection (and `{entity}` of `redact_with`) of a run redacted at a raw bound
OBFUSCATED = "obfuscated"


def _visible(ch: str) -> bool:
    """The character is in the normalised view (printable ASCII always is; ASCII controls
    other than whitespace are not)."""
    return " " <= ch < "\x7f" or fold(ch) != ""


def _invisible_run(text: str, lo: int, hi: int) -> re.Pattern[str] | None:
    """A run of the characters of `text[lo:hi]` that are neither visible nor whitespace, which
    a walk steps over at once (a walk one character at a time over SEAM_RAW_CHARS zero-width
    spaces each side of every boundary was most of judging such a text: 15x ordinary text);
    None when it holds none."""
    unseen = [ch for ch in set(text[lo:hi]) if not _visible(ch) and not ch.isspace()]
    if not unseen:
        return None
    return re.compile("[" + "".join(map(re.escape, sorted(unseen))) + "]+")


# The stretches a walk prepares (the markup hidden there, the invisible characters it steps
# over), shortest first: a walk that ends inside one (at whitespace, or with its count reached)
# needs no more. Preparing SEAM_RAW_CHARS each way at once made every seam of `a . a . ...` (a
# `.` after a space is no natural cut: a seam every four characters) read 16 KiB: 1 MiB of it
# took about a minute of CPU to judge (bench/input_cost.py, tests/test_request_cost.py).
WALK_STAGES = (64, 512, SEAM_RAW_CHARS)


def _back(text: str, i: int, count: int, floor: int, *, run: bool) -> tuple[int, bool, bool]:
    """Walking back from `i` (not below `floor`): the position after `count` visible
    characters, or with `run`, also stopping after whitespace (the start of the whitespace-free
    run); whether a bound stopped it (the count or SEAM_RAW_CHARS, not whitespace or the
    floor); and whether it was SEAM_RAW_CHARS with fewer than `count` visible characters in
    them (a run of mostly hidden ones: see SEAM_RAW_CHARS). ASCII is walked with arithmetic
    where no whitespace matters. What markup hides neither counts nor ends a run: a walk steps
    over each of its runs at once (`markup_hidden_runs`). The walk prepares WALK_STAGES'
    stretches in turn, so its work is what it walks, not SEAM_RAW_CHARS each time."""
    if not run:
        j = max(floor, i - count)
        if is_plain(text[j:i]):
            return j, i - count >= floor, False
    bound = max(floor, i - SEAM_RAW_CHARS)
    for reach in WALK_STAGES:
        limit = max(bound, i - reach)
        j, seen, spaced = _walk_back(text, i, count, limit, run)
        if spaced:
            return j, False, False
        if j > limit or limit == bound:
            break
    raw = seen < count and j == bound and bound > floor
    return j, seen >= count or raw, raw


def _walk_back(text: str, i: int, count: int, limit: int, run: bool) -> tuple[int, int, bool]:
    """`_back`'s walk within `text[limit:i]`: where it stopped, the visible characters seen,
    and whether whitespace stopped it (with `run`). Where it stops inside the stretch, a
    longer stretch's walk stops there too (`markup_hidden_runs` finds the stretch's runs as
    the whole text's scan does; `_invisible_run` only speeds the walk up)."""
    hidden = markup_hidden_runs(text, limit, i)
    h = len(hidden) - 1  # the last hidden run that starts before `j`
    skip = _invisible_run(text, limit, i)
    back = text[limit:i][::-1] if skip is not None else ""  # back[k] is text[i - 1 - k]
    j, seen = i, 0
    while j > limit and seen < count:
        while h >= 0 and hidden[h][0] >= j:
            h -= 1
        if h >= 0 and hidden[h][1] >= j:  # `text[j - 1]` is hidden: so is its run
            j = hidden[h][0]
            continue
        if skip is not None and (m := skip.match(back, i - j)) is not None:
            j -= m.end() - m.start()  # none visible, none whitespace
            continue
        ch = text[j - 1]
        if run and ch.isspace():
            return j, seen, True
        j -= 1
        if _visible(ch):
            seen += 1
    return j, seen, False


def _forward(text: str, i: int, count: int, ceiling: int, *, run: bool) -> tuple[int, bool, bool]:
    """`_back` walking forward from `i` (not past `ceiling`)."""
    if not run:
        j = min(ceiling, i + count)
        if is_plain(text[i:j]):
            return j, i + count <= ceiling, False
    bound = min(ceiling, i + SEAM_RAW_CHARS)
    for reach in WALK_STAGES:
        limit = min(bound, i + reach)
        j, seen, spaced = _walk_forward(text, i, count, limit, run)
        if spaced:
            return j, False, False
        if j < limit or limit == bound:
            break
    raw = seen < count and j == bound and bound < ceiling
    return j, seen >= count or raw, raw


def _walk_forward(text: str, i: int, count: int, limit: int, run: bool) -> tuple[int, int, bool]:
    """`_walk_back` walking forward from `i` within `text[i:limit]`."""
    hidden = markup_hidden_runs(text, i, limit)
    h = 0  # the first hidden run that ends after `j`
    skip = _invisible_run(text, i, limit)
    j, seen = i, 0
    while j < limit and seen < count:
        while h < len(hidden) and hidden[h][1] <= j:
            h += 1
        if h < len(hidden) and hidden[h][0] <= j:  # `text[j]` is hidden: so is its run
            j = hidden[h][1]
            continue
        if skip is not None and (m := skip.match(text, j, limit)) is not None:
            j = m.end()  # none visible, none whitespace
            continue
        ch = text[j]
        if run and ch.isspace():
            return j, seen, True
        if _visible(ch):
            seen += 1
        j += 1
    return j, seen, False


def seam_bounds(text: str, lo: int, hi: int, boundary: int) -> tuple[int, int, bool]:
    """The window around a chunk boundary within `text[lo:hi]`: SEAM_CHARS visible characters
    each side, widened to the ends of the whitespace-free runs there (at most SEAM_RUN_CHARS
    visible characters more); and whether the text after the boundary was long enough for all
    of it (more text could not change the window): a bound or whitespace, not `hi`, ended it."""
    start, _, _ = _back(text, boundary, SEAM_CHARS, lo, run=False)
    start, _, _ = _back(text, start, SEAM_RUN_CHARS, lo, run=True)
    end, complete, _ = _seam_end(text, boundary, hi)
    return start, end, complete


def seam_window(text: str, lo: int, hi: int, boundary: int) -> tuple[int, int, bool]:
    """`seam_bounds` of a text that is whole (an input): the window, and whether SEAM_RAW_CHARS
    cut it inside a whitespace-free run of mostly hidden characters on either side (the window
    does not see what the run shows whole: the run is `obfuscated`, as a stream's is)."""
    start, _, _ = _back(text, boundary, SEAM_CHARS, lo, run=False)
    start, _, before = _back(text, start, SEAM_RUN_CHARS, lo, run=True)
    end, _, after = _seam_end(text, boundary, hi)
    return start, end, before or after


def _seam_end(text: str, boundary: int, hi: int) -> tuple[int, bool, bool]:
    """The end of a boundary's window within `text[:hi]`; whether it is complete; and whether
    SEAM_RAW_CHARS ended it inside a whitespace-free run of mostly hidden characters."""
    end, counted, _ = _forward(text, boundary, SEAM_CHARS, hi, run=False)
    end, bounded, raw = _forward(text, end, SEAM_RUN_CHARS, hi, run=True)
    return end, counted and (end < hi or bounded), raw


def _every(chunk: Span) -> bool:
    return True


def _not_natural(chunk: Span) -> bool:
    return not chunk.natural_end


def seam_ends(detector: RequestedDetector) -> Callable[[Span], bool] | None:
    """Which chunk ends a seam window must look across for `detector`. A classifier's unit is
    the chunk its chunker gives it (a sentence), judged alone (DESIGN 4.6a): a natural cut is no
    seam for it; but a cut its chunker had to make inside a sentence (`max_chars`, a word count)
    could split a phrase it must see whole (an injection cut in two halves that each read
    benign), so a classifier that blocks or annotates looks across those; one that redacts
    redacts exactly its chunks and gets none (a window's verdict would redact a mixture).
    For a span detector, every end that is not a natural cut (`Span.natural_end`:
    a `max_chars` cut inside a run, a word-count cut, a cut with no whitespace after it), or
    every end when its spans may cross a natural one (a remote detector, custom patterns:
    `crosses_natural_cuts`). A sentence end of a 5,000-sentence input is no seam for the
    built-in regex kinds, so it costs no second judgement."""
    if detector.judges_chunks:
        return None if detector.redacting else _not_natural
    if detector.client.crosses_natural_cuts(detector.params):
        return _every
    return _not_natural


@dataclass(frozen=True, slots=True)
class DetectorFinished:
    """This detector judged every chunk it will ever get."""

    detector_id: str


class DetectorQueue:
    def __init__(
        self,
        detector: RequestedDetector,
        inbox: Inbox,
        *,
        max_batch: int = 32,
        conversation: tuple[tuple[str, str], ...] = (),
        ready: tuple[tuple[str, str], ...] | None = None,
        lead: str = "",
    ) -> None:
        """`conversation`: the request's (role, content) messages, which a judge reads beside
        each chunk with the answer before it (`reads_context`); `ready`: them made judge-ready
        once for the stream (JudgeContext.ready); `lead`: the text the answer continues (see
        `leads_into`), judged before the answer's first chunk by a span detector that redacts
        or blocks."""
        self.detector = detector
        self._inbox = inbox
        self._max_batch = max_batch
        self._pending: deque[Span] = deque()
        self._closed = False
        self._cut = False  # the text was cut short, not ended by the model (see `close`)
        self._wakeup = asyncio.Event()
        self.calls = 0
        # characters put and not answered yet: the pipeline reads the engine no further ahead
        # of this detector than a bound (a burst must not starve judging and release)
        self.unjudged = 0
        # a classifier redacts the chunk it was given, judged alone: no windows (DESIGN 4.6a)
        self._windowed = (
            detector.redacting and not detector.whole_doc and not detector.judges_chunks
        )
        # a judge reads the answer so far with each chunk: what straddles a boundary is in the
        # context of the chunk after it, and a seam window would be judged out of context
        self._in_context = detector.client.reads_context
        self._conversation = conversation
        self._ready = ready
        self._answer = ""  # in context: the text judged so far (the chunks are consecutive)
        self._stream = object()  # in context: this stream's token (JudgeContext.stream)
        # a redacting or blocking span detector looks across the chunk ends that are seams for it
        self._seam_after = seam_ends(detector)
        self._seamed = (
            detector.blocking
            and self._seam_after is not None
            and not detector.whole_doc
            and not self._in_context
        )
        self._carry = ""  # windowed: text from `_carry_start` to the next chunk, not reported
        self._carry_start = 0
        # windowed: the carry starts inside a run of mostly hidden characters being redacted
        self._in_hidden_run = False
        self._before = ""  # windowed: the text just before the carry (see `_obscured`)
        # the bidi controls open where the next chunk to be judged starts (windowed: where the
        # carry starts): each chunk and window is read after those open where it starts
        # (read_after.py), as a reader of the whole stream sees it. Read once per character,
        # as the chunks are judged. A judge reads the answer before each chunk as it is.
        self._overrides = BidiStack()
        # the text the answer continues, at stream indices [-len(lead), 0): joined to the
        # first chunk (`put`), so that an entity it starts and the answer finishes is seen
        # whole; only the answer's part of a finding is reported (`_post`)
        self._lead = lead if leads_into(detector) else ""
        self._led = bool(self._lead)
        if self._windowed:
            self._carry_start = -len(self._lead)

    def _read(self, text: str) -> str:
        """What the next chunk, `text`, is read after (read_after.py); the state moves past it."""
        opened = self._overrides.opened
        self._overrides.read(text)
        return opened

    def put(self, span: Span) -> None:
        if self._lead:  # the answer's first chunk: judged after the text it continues
            lead, self._lead = self._lead, ""
            span = Span(span.start - len(lead), span.end, lead + span.text, span.natural_end)
        self._pending.append(span)
        self.unjudged += len(span.text)
        self._wakeup.set()

    def close(self, *, cut: bool = False) -> None:
        """No more chunks will come; the queue finishes once the pending ones are judged.
        `cut`: the model did not end the text (a token or time budget, a stop sequence), so
        its tail is judged as a cut one (`Detector.open_tail`'s `cut`)."""
        self._closed = True
        self._cut = cut
        self._wakeup.set()

    async def run(self) -> None:
        """Judges until closed and drained; a failed call raises (the pipeline's task wrapper
        turns it into a failure message)."""
        if self._windowed:
            await self._run_windowed()
            return
        if self._seamed:
            await self._run_seamed()
            return
        try:
            await self._run_chunks()
        finally:
            if self._in_context and self.calls:
                # the stream is over, however it ended: a judge's session for it is freed now,
                # not when a table of finished streams overflows (an engine's session slots
                # held by ended streams refuse the streams that are running)
                context = JudgeContext(self._conversation, self._answer, self._stream, self._ready)
                self.detector.client.release(context)

    async def _run_chunks(self) -> None:
        """Each pending chunk judged alone (or with the answer before it, in context)."""
        detector = self.detector
        while True:
            if not self._pending:
                if self._closed:
                    break
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = [
                self._pending.popleft() for _ in range(min(self._max_batch, len(self._pending)))
            ]
            self.calls += 1
            texts = [s.text for s in batch]
            if self._in_context:
                context = JudgeContext(self._conversation, self._answer, self._stream, self._ready)
                replies = await detector.client.detect(texts, detector.params, context)
                self._answer += "".join(texts)
            else:
                opened = [self._read(s.text) for s in batch]
                contents = [o + t for o, t in zip(opened, texts, strict=True)]
                replies = read_back(await detector.client.detect(contents, detector.params), opened)
            self.unjudged -= sum(len(s.text) for s in batch)
            self._inbox.answered()  # a reader held while detectors are behind looks again
            ends = self._closed and not self._pending and (detector.redacting or detector.blocking)
            for i, (span, detections) in enumerate(zip(batch, replies, strict=True)):
                found = self._kept(span, detections)
                if ends and i == len(batch) - 1:  # (a whole-doc detector: its only chunk)
                    found = open_tail(detector, span.text, span.start, found, cut=self._cut)
                self._post(span, found)
        self._inbox.put(DetectorFinished(detector.detector_id))

    async def _run_windowed(self) -> None:
        """Every pending chunk in one window with the carried tail (see SEAM_CHARS); nothing is
        carried past a chunk end that is no seam for the detector."""
        detector = self.detector
        while True:
            if not self._pending and not (self._closed and self._carry):
                if self._closed:
                    break
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self._pending)
            self._pending.clear()
            start = self._carry_start
            text = self._carry + "".join([s.text for s in batch])
            end = start + len(text)
            final = self._closed and not self._pending
            self.calls += 1
            opened = self._overrides.opened
            [detections] = await detector.client.detect([opened + text], detector.params)
            detections = shifted(detections, len(opened))
            self.unjudged -= sum(len(s.text) for s in batch)
            self._inbox.answered()
            found = self._kept(Span(start, end, text), detections)
            final = final or (self._closed and not self._pending)
            if final:
                found = open_tail(detector, text, start, found, cut=self._cut)
            # a window that ends at a chunk end that is no seam (`seam_ends`) carries nothing:
            # no entity of this detector goes on across it
            no_seam = bool(batch) and not self._seam_after(batch[-1])  # type: ignore[misc]
            safe, hidden_from = (
                (end, None) if final or no_seam else safe_end(text, start, found, self._before)
            )
            if safe < end:
                # a run the detector says may still be the head of a longer entity (a number
                # spelt as words, longer than SEAM_CHARS) is carried too
                held = detector.client.held_from(text, safe - start, detector.params)
                if held is not None:
                    safe = max(start, start + held)
            self._overrides.read(text, 0, safe - start)  # (the next window starts at `safe`)
            self._carry = text[safe - start :]
            self._carry_start = safe
            reported = tuple(f for f in found if f.end <= safe)
            reported += self._obscured(text, start, safe, hidden_from)
            self._post(Span(start, safe, ""), reported)
        self._inbox.put(DetectorFinished(detector.detector_id))

    def _obscured(
        self, text: str, start: int, safe: int, hidden_from: int | None
    ) -> tuple[Finding, ...]:
        """The redaction of a run of mostly hidden characters that this window reports part of
        (see SEAM_RAW_CHARS): from where the run starts (`hidden_from`, or the window's start
        while the carry is inside one) to where it ends, as far as the window holds it. It may
        reach past `safe`: the next window's part of the run overlaps it, and the redactor
        merges the two into one replacement."""
        before = self._before
        # (the text before the carry, up to the longest markup: a tag the carry starts in
        # hides the spaces between its attributes, which are no end of the run)
        self._before = (before + text[: safe - start])[-MARKUP_MOST:]
        # the run the carry is in, and one the cut falls in (the same one, or a later one)
        starts = [start] if self._in_hidden_run else []
        starts += [] if hidden_from is None else [hidden_from]
        inside = self._in_hidden_run and safe <= start  # nothing reported: the carry stays
        out: list[Finding] = []
        for lo in starts:
            if lo >= safe or (out and lo < out[-1].end):
                continue
            run_end = _run_end(before + text, len(before) + lo - start)
            stop = start + len(text) if run_end is None else start + run_end - len(before)
            inside = inside or stop > safe
            if stop > lo:
                out.append(obscured_finding(self.detector, lo, stop))
        self._in_hidden_run = inside
        return tuple(out)

    async def _run_seamed(self) -> None:
        """A blocking span detector judges each chunk alone (as any detector does) and also the
        text across the chunk boundaries that are seams for it (`seam_ends`) and that it has
        not released, keeping what straddles one of them: an entity cut in two by a boundary
        blocks like any other. A clean chunk is posted once its end is no seam, or once the
        text after its end reached past the boundary's window (SEAM_CHARS, and the rest of the
        whitespace-free run there: `seam_bounds`), or the text ended, so no part of an entity
        is released before it is seen whole. A flagged one is posted at once, after the clean
        chunks held before it (judged with the text there was: only a straddling entity's head
        could be among them).

        The held chunks' seams are judged in one window, from the first one's window start to
        the end of the text, not one window per boundary: the windows of neighbouring
        boundaries overlap, and with the run bounds (SEAM_RUN_CHARS) and a small `max_chars`
        that judged each held character hundreds of times a call. One window costs the held
        text once, and the held text is bounded by the windows' own bounds.

        Each chunk and the window is read after the bidi controls open where it starts: a
        held chunk's state is kept (`held_at`, only where something is open), and the window's
        is that of the chunk it starts in, read on to its start (one chunk, not the held text).
        """
        detector = self.detector
        seam_after = self._seam_after
        assert seam_after is not None
        held: list[tuple[Span, tuple[Finding, ...]]] = []
        held_at: dict[int, BidiStack] = {}  # chunk start -> the controls open there, if any
        while True:
            if not self._pending:
                if self._closed:
                    break
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self._pending)
            self._pending.clear()
            opened: list[str] = []
            for span in batch:
                if self._overrides.open:
                    held_at[span.start] = self._overrides.copy()
                opened.append(self._read(span.text))
            chain = [span for span, _ in held] + batch
            text = "".join([s.text for s in chain])
            base = chain[0].start
            # seams[i]: the end of chain[i] is a seam (chain[i + 1] follows it)
            seams = [seam_after(span) for span in chain[:-1]]
            window: Span | None = None
            if any(seams):
                first = seams.index(True)
                lo, _, _ = seam_bounds(text, 0, len(text), chain[first + 1].start - base)
                window = Span(base + lo, base + len(text), text[lo:])
                opened.append(_opened_at(chain, held_at, text, lo))
            self.calls += 1
            contents = [s.text for s in batch] + ([window.text] if window is not None else [])
            contents = [o + c for o, c in zip(opened, contents, strict=True)]
            replies = read_back(await detector.client.detect(contents, detector.params), opened)
            self.unjudged -= sum(len(s.text) for s in batch)
            self._inbox.answered()
            own = [self._kept(span, dets) for span, dets in zip(batch, replies, strict=False)]
            judged = held + list(zip(batch, own, strict=True))
            across = () if window is None else self._kept(window, replies[-1])
            # (a detection of the whole window counts too: it may be an entity that fills it,
            # and for a block any detection is reason enough)
            straddling = [
                tuple(f for f in across if f.start < nxt.start < f.end) if seam else ()
                for nxt, seam in zip(chain[1:], seams, strict=True)
            ]
            final = self._closed and not self._pending
            if final:
                judged = self._flag_tail(judged)
            posted = 0
            for i, (span, found) in enumerate(judged):
                flags = found + (straddling[i] if i < len(straddling) else ())
                if flags:  # the block: the clean chunks before it go out first, but only up
                    # to the run of number characters the flagged entity starts in, and judged
                    # as a text that ended (a tail in them that could still have grown into an
                    # entity blocks where it starts): a prefix of the stream can read a run of
                    # digit groups as another entity than the whole text does (`555-123-4` and
                    # a phone in `567555-12`, where the whole text held a card from `123-4`),
                    # nor any of the whitespace-free run it starts in: more text can make that
                    # run one longer entity (a phone in `a.555-123-45` was the local part of
                    # `a.555-123-4567jo@example.com` once its `@` came)
                    first_flag = min(f.start for f in flags) - base
                    run_from, _, _ = _back(text, first_flag, SEAM_RUN_CHARS, 0, run=True)
                    limit = base + min(number_run_start(text, first_flag), run_from)
                    before = judged[posted:i]
                    cut = next((k for k, (s0, _) in enumerate(before) if s0.end > limit), None)
                    if cut is not None:
                        before = before[:cut]
                    for span0, found0 in self._flag_tail(before):
                        self._post(span0, found0)
                        if found0:
                            break
                    else:
                        if cut is None:
                            self._post(span, flags)
                        else:  # the block starts on the chunk the run starts in
                            self._post(judged[posted + cut][0], flags)
                    posted = len(judged)
                    break
            else:
                for i, (span, found) in enumerate(judged):
                    # in order: a chunk waits for every chunk before it; the last one, for the
                    # text after it, unless its end is no seam (decided when it was cut)
                    if final:
                        self._post(span, found)
                        posted = i + 1
                        continue
                    if i + 1 >= len(chain):
                        if seam_after(span):
                            break
                    elif seams[i]:
                        boundary = chain[i + 1].start - base
                        _, complete, hidden = _seam_end(text, boundary, len(text))
                        if not complete:
                            break
                        if len(text) - boundary < HELD_REACH and (
                            detector.client.held_from(text, boundary, detector.params) is not None
                        ):
                            break  # a spelt number may go on across it (`held_from`)
                        lo = _run_start(text, boundary) if hidden else boundary
                        if hidden and _shows(text, lo, boundary):
                            # a run of mostly hidden characters goes on past the window's raw
                            # bound (see SEAM_RAW_CHARS): what it shows was never seen whole
                            lo = max(base + lo, span.start)
                            flag = obscured_finding(detector, lo, base + boundary)
                            self._post(span, (*found, flag))
                            posted = len(judged)
                            break
                    self._post(span, found)
                    posted = i + 1
            held = judged[posted:]
            held_at = {s.start: held_at[s.start] for s, _ in held if s.start in held_at}
        # the text ended: nothing follows the held chunks (but the text may end inside an entity)
        for span, found in self._flag_tail(held):
            self._post(span, found)
            if found:
                break
        self._inbox.put(DetectorFinished(detector.detector_id))

    def _flag_tail(
        self, judged: list[tuple[Span, tuple[Finding, ...]]]
    ) -> list[tuple[Span, tuple[Finding, ...]]]:
        """The held chunks of a text that ended, with a tail that could still grow into a match
        flagged on the chunk where it starts (see `open_tail`). The chunks posted before these
        had their boundary window complete: a tail cannot start in them (a run past the bounds
        aside, which is judged as it is)."""
        if not judged:
            return judged
        base = judged[0][0].start
        text = "".join([span.text for span, _ in judged])
        tail = open_tail(self.detector, text, base, (), cut=self._cut)
        if not tail:
            return judged
        [flag] = tail
        out = list(judged)
        for i, (span, found) in enumerate(out):
            if span.start <= flag.start < span.end or i == len(out) - 1:
                out[i] = (span, (*found, flag))
                break
        return out

    def _kept(self, span: Span, detections: list[Detection]) -> tuple[Finding, ...]:
        """`kept_findings`, less those wholly in the lead: the client's own text, which must
        neither be reported nor decide anything (a flagged chunk is posted at once, and one
        posted so would be released before its window across the answer was judged)."""
        found = kept_findings(self.detector, span, detections)
        if self._led and span.start < 0:
            return tuple(f for f in found if f.end > 0)
        return found

    def _post(self, span: Span, found: tuple[Finding, ...]) -> None:
        """The verdict on `[span.start, span.end)`; after a lead, on the answer's part of it
        alone (what lies wholly in the lead is the client's own text: never reported)."""
        start, end = span.start, span.end
        if self._led and (start < 0 or any(f.start < 0 for f in found)):
            found = tuple(_answer_part(f) for f in found if f.end > 0)
            if end <= 0 and not found:
                return
            start, end = max(start, 0), max(end, 0)
        self._inbox.put(DetectorResult(self.detector.detector_id, start, end, found))


def leads_into(detector: RequestedDetector) -> bool:
    """`detector` judges the answer after the text it continues (DESIGN 4.6a): a span detector
    that redacts or blocks, for which an entity the prompt starts and the answer finishes is
    one entity. A classifier judges its chunks alone and a judge reads the conversation
    already: the prompt's text in their chunk would make the answer carry the prompt's
    verdict."""
    return (
        (detector.redacting or detector.blocking)
        and not detector.judges_chunks
        and not detector.client.reads_context
    )


def _answer_part(f: Finding) -> Finding:
    """A finding that starts in the lead, cut to the answer's part of it (stream index 0 on)."""
    if f.start >= 0:
        return f
    return replace(f, start=0, text=f.text[-f.start :])


def _opened_at(chain: list[Span], at: dict[int, BidiStack], text: str, lo: int) -> str:
    """What a window from `text[lo]` is read after, where `text` is `chain`'s chunks joined and
    `at` the controls open where each of them starts (none: nothing open): the state where the
    chunk holding `lo` starts, read on to `lo`."""
    base = chain[0].start
    span = next(c for c in reversed(chain) if c.start - base <= lo)
    state = at[span.start].copy() if span.start in at else BidiStack()
    state.read(text, span.start - base, lo)
    return state.opened


# what a run of numbers is made of (digit groups and their separators): a block withholds the
# whole run its entity starts in (`_run_seamed`)
_NUMBER_RUN = frozenset("0123456789 -./()+")


def number_run_start(text: str, i: int) -> int:
    """Where the run of number characters that `text[i]` starts or continues begins, as the
    view reads it: markup it hides (`4<b></b>111`), characters it drops and digits it folds
    (`\uff14`) continue the run, as an escape of one does (`&#52;`). Reads at most
    SEAM_RAW_CHARS back."""
    i = max(0, min(i, len(text)))
    floor = max(0, i - SEAM_RAW_CHARS)
    hidden: frozenset[int] | None = None
    while i > floor:
        ch = text[i - 1]
        if ch in _NUMBER_RUN:
            i -= 1
            continue
        if hidden is None:  # (only past markup or a character that is not ASCII)
            hidden = markup_hidden(text, floor, i)
        if i - 1 in hidden or (ch in "&\\%" and i in hidden) or not _visible(ch):
            i -= 1  # inside markup, the start of an escape, or a dropped character
        elif not ch.isascii() and fold(ch) and all(c in _NUMBER_RUN for c in fold(ch)):
            i -= 1
        else:
            break
    return i


def safe_end(
    text: str, start: int, found: tuple[Finding, ...], before: str = ""
) -> tuple[int, int | None]:
    """How far a window `[start, start + len(text))` may be reported (see SEAM_CHARS); and
    where the whitespace-free run that end falls in starts (a stream index before it) when the
    walk back over that run stopped at SEAM_RAW_CHARS with few visible characters (see
    SEAM_RAW_CHARS: the run is redacted, not released as judged), else None. `before`: the
    text before the window (up to MARKUP_MOST characters), which a tag the window starts in
    began in."""
    p, counted, _ = _back(text, len(text), SEAM_CHARS, 0, run=False)
    if not counted or p <= 0:
        return start, None
    q, _, raw = _back(text, p, SEAM_RUN_CHARS, 0, run=True)
    k = len(before)
    whole = before + text if raw and k else text
    hidden_from = max(_run_start(whole, q + k) - k, 0) + start if raw else None
    if raw:
        q = p  # a run of mostly hidden characters past SEAM_RAW_CHARS: cut where the count is
    # (a run of SEAM_RUN_CHARS visible ones is cut that far before the count: an entity
    # without whitespace that the cut crosses, and the window's end, is seen whole by the next
    # window; cut at the count, an e-mail's head left raw before its top-level label came)
    q += start
    moved = True
    while moved:  # never inside a detection: it is reported whole, now or by the next window
        moved = False
        for f in found:
            if f.start < q < f.end:
                q = f.start
                moved = True
    q = max(q, start)
    if (
        hidden_from is None
        or hidden_from >= q
        or not _shows(whole, hidden_from - start + k, q - start + k)
    ):
        return q, None  # (a run of markup alone, a minified SVG, shows nothing to hide)
    return q, hidden_from


def _shows(text: str, lo: int, hi: int) -> bool:
    """`text[lo:hi]` holds a visible character (one that shows in the view)."""
    hidden = markup_hidden(text, lo, hi)
    return any(_visible(text[i]) and i not in hidden for i in range(lo, hi))


_SPACE = re.compile(r"\s")


def _run_start(text: str, i: int) -> int:
    """Where the whitespace-free run that `text[:i]` ends in starts (whitespace that markup
    hides, inside a tag, is part of it). Linear in `i`; only for a run found hidden."""
    hidden = markup_hidden(text, 0, i)
    ends = [m.end() for m in _SPACE.finditer(text, 0, i) if m.start() not in hidden]
    return ends[-1] if ends else 0


def _run_end(text: str, i: int) -> int | None:
    """Where the whitespace-free run that `text[i]` is in ends (None: not in `text`)."""
    hidden = markup_hidden(text, 0, len(text))
    return next((m.start() for m in _SPACE.finditer(text, i) if m.start() not in hidden), None)


def obscured_finding(detector: RequestedDetector, start: int, end: int) -> Finding:
    """A run of mostly hidden characters that a window had to cut (see SEAM_RAW_CHARS): redacted
    by `detector` as `obfuscated`, since no call of it saw what the run shows whole."""
    return Finding(start, end, "", OBFUSCATED, OBFUSCATED, detector.detector_id, 1.0)


def open_tail(
    detector: RequestedDetector,
    text: str,
    start: int,
    found: tuple[Finding, ...],
    *,
    cut: bool = False,
) -> tuple[Finding, ...]:
    """What a redacting or blocking detector flags at the end of a text that ended (DESIGN
    4.6a): beside `found` (its findings in `text`, which starts at stream index `start`), the
    tail that could still grow into a match (the in-process regex detector knows; a remote one
    says nothing), unless a finding already covers it; with `cut` (the model did not end the
    text), any beginning of an entity past its first group (`Detector.open_tail`)."""
    tail = detector.client.open_tail(text, detector.params, cut=cut)
    if tail is None:
        return found
    end = start + len(text)
    if any(f.start <= start + tail.start and f.end >= end for f in found):
        return found
    return found + kept_findings(detector, Span(start, end, text), [tail])
