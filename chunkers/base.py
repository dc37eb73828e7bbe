"""The chunk type, the chunker protocols, and the machinery every chunker shares: an append-only
text buffer and the emitter that turns a stream of cut positions into spans (applying the
`max_chars` safety cut).

Model: a chunker decides *cut positions* in the text. Chunks are the pieces between consecutive
cuts, so they are contiguous and cover the text by construction; a cut always sits right after a
chunk's last character, so whitespace between two chunks belongs to the following one. Each
chunker's batch form is its incremental form fed the whole text at once, so the two agree by
construction as long as the incremental form only ever commits a cut that no continuation of the
text could change (each stage below argues that for itself).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

#: "No limit" / "not yet" for positions and thresholds.
INF = sys.maxsize

#: Text a buffer may hold before the consumed part is dropped (tests lower it to exercise trims).
TRIM_MIN = 512


@dataclass(frozen=True, slots=True)
class Span:
    """A chunk: code-point offsets `[start, end)` into the whole text, and that text.

    `natural_end`: the chunk ends at a natural cut (`natural_cut`): whitespace follows a sentence
    end, or a line break follows. A span detector that declares none of its spans crosses one
    (`Detector.crosses_natural_cuts`) needs no seam window there; every other cut (a `max_chars`
    cut inside a run, a word-count cut, a cut with no whitespace after it, the end of the text)
    is not natural, whichever chunker made it. Not part of equality."""

    start: int
    end: int
    text: str
    natural_end: bool = field(default=False, compare=False)


#: What ends a sentence for `natural_cut`: NLTK Punkt's sentence-final punctuation, then any run of
#: the closing quotes and brackets it moves into the sentence (`_realign_boundaries`).
SENTENCE_FINAL = frozenset(".?!")
CLOSERS = frozenset(")]}\"'")
LINE_BREAKS = frozenset("\n\r")
#: A right-to-left override: what follows it is read in the reverse order (the detectors judge
#: that order too: detectors/normalise.py), where a sentence end may sit inside a value.
RLO = "\u202e"


def natural_cut(text: str, i: int, start: int = 0) -> bool:
    """The end at `i` of the chunk `text[start:i]` is a natural cut: `text[i]` is whitespace
    and either a line break, or the chunk ends with sentence-final punctuation followed only by
    closers; and no right-to-left override comes before it (`jo@example.com\u202e. moc.x`
    holds an address in the order a reader sees). Decided from the text up to the cut,
    whichever chunker made it (a safety cut or a word-count cut can fall at a sentence end
    too), so batch and incremental chunking agree on it. A cut with no `text[i]` (the end of
    the text so far) is not natural: what follows is not known."""
    if i >= len(text) or not text[i].isspace() or RLO in text[:i]:
        return False
    return _natural_here(text, i, start)


def natural_cuts(text: str) -> list[int]:
    """Every natural cut of `text` in one pass: each `i` where `natural_cut(text, i, start)`
    holds for the piece that starts at the cut before it (0 first). A detector that judges each
    piece alone finds no span across a natural cut, and sees the same pieces in any window of
    the text that starts at one (pii_ner: a model's verdicts then do not depend on how a
    stream's sentences were batched)."""
    limit = text.find(RLO)  # no cut after an override
    out: list[int] = []
    start = 0
    for m in _CUT_CANDIDATE.finditer(text, 0, len(text) if limit < 0 else limit):
        i = m.end() - 1  # the whitespace
        if i > start and _natural_here(text, i, start):
            out.append(i)
            start = i
    return out


# whitespace that may make a natural cut: a line break, or whitespace after what ends a sentence
_CUT_CANDIDATE = re.compile(r"[\n\r]|[.?!)\]}\"'][^\S\n\r]")


def _natural_here(text: str, i: int, start: int) -> bool:
    """`natural_cut` without the override test, `text[i]` being whitespace. Two line ends are
    none: one right after a lone digit or a number word (`5\n5\n5...`, `five five five\none
    two three...`: a number written a digit a line goes on across it, and the regex detector
    reads it so, detectors/number_spellings.py), and a `.` after a space (`jo . smith @
    example . com`: no sentence ends so)."""
    if text[i] in LINE_BREAKS:
        j = i  # (what the detectors' view removes before the line break does not count)
        while j > start and i - j < 64 and unicodedata.category(text[j - 1]) in _UNSEEN:
            j -= 1
        return _NUMBER_TOKEN_END.search(_unaccented(text[max(start, j - 16) : j])) is None
    j = i - 1
    while j > start and text[j] in CLOSERS:
        j -= 1
    if j >= start and text[j] == ".":
        k = j  # (what the view removes between the space and the dot does not count)
        while k > start and j - k < 64 and unicodedata.category(text[k - 1]) in _UNSEEN:
            k -= 1
        if k > start and text[k - 1].isspace():
            return False
    return j >= start and text[j] in SENTENCE_FINAL


# categories of the characters the detectors' view removes or draws on the one before
# (detectors/normalise.py): format, private-use, unassigned, combining marks
_UNSEEN = frozenset(("Cf", "Co", "Cn", "Mn", "Me"))
# a lone digit (of any script: the view folds them) or a number word (English, German, French,
# Spanish, Italian or Portuguese, as the view spells it: accents dropped; the words of
# detectors/number_spellings.DIGIT_WORDS, which tests/test_chunkers.py holds this to), with
# spaces or tabs after it, ending the text searched:
_NUMBER_WORDS = (
    "zero|oh|o|one|two|three|four|five|six|seven|eight|nine"
    "|null|eins|zwei|zwo|drei|vier|funf|fuenf|sechs|sieben|acht|neun"
    "|un|une|deux|trois|quatre|cinq|sept|huit|neuf"
    "|cero|uno|una|dos|tres|cuatro|cinco|seis|siete|ocho|nueve"
    "|due|tre|quattro|cinque|sei|sette|otto|nove"
    "|um|uma|dois|duas|quatro|meia|sete|oito"
)
_NUMBER_TOKEN_END = re.compile(rf"(?i)(?<![^\W_]|[.,])(?:\d|{_NUMBER_WORDS})[ \t]*\Z")


def _unaccented(text: str) -> str:
    """`text` without its accents (`f\u00fcnf` -> `funf`), as the detectors' view reads it."""
    if text.isascii():
        return text
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


class IncrementalChunker(Protocol):
    """Per-stream state: `feed` returns the chunks that the text so far proves complete
    (offsets relative to the whole stream), `flush` the rest at end of stream."""

    def feed(self, delta: str) -> list[Span]: ...

    def flush(self) -> list[Span]: ...


class Chunker(Protocol):
    """Immutable and shareable across threads and streams; `incremental()` gives a fresh state."""

    def chunk(self, text: str) -> list[Span]: ...

    def incremental(self) -> IncrementalChunker: ...


class TextBuffer:
    """The stream's text from absolute offset `base` on. Deltas are queued in `parts` and joined
    only when some stage has work to do (`sync`), so a stage that waits for a rare character
    (the end of a very long token, say) costs O(delta) per feed rather than O(buffer)."""

    __slots__ = ("base", "n", "parts", "text")

    def __init__(self) -> None:
        self.text = ""  # text[base:base + len(text)] once synced
        self.base = 0
        self.n = 0  # total length of the stream so far, synced or not
        self.parts: list[str] | None = []  # None once the stream has ended

    def sync(self) -> None:
        parts = self.parts
        if parts:
            parts.insert(0, self.text)
            self.text = "".join(parts)
            parts.clear()

    def trim(self, keep: int) -> None:
        """Forget text before absolute offset `keep`, once that is at least `TRIM_MIN`
        characters and half the buffer, so the copying stays amortised O(1) per character."""
        drop = keep - self.base
        if drop >= TRIM_MIN and drop * 2 >= len(self.text):
            self.text = self.text[drop:]
            self.base = keep


class CutStage(Protocol):
    """A producer of cut positions. `cuts` holds confirmed cuts not yet consumed (increasing);
    `frontier()` is a position F such that every cut below F is already known (INF at the end).

    Wake-up contract, which keeps a feed that cannot change anything down to a few checks: the
    pipeline calls `advance` only once a delta matched the first stage's `wake_rx` and its
    `ready` agreed (then `dirty` is set), or the stream reached some stage's `wake_len`
    characters. These only decide *when* work happens: a stage must commit the same cuts
    whenever it is advanced, so a late wake-up delays chunks but never changes them."""

    cuts: deque[int]
    dirty: bool
    wake_rx: re.Pattern[str] | None
    wake_len: int

    def ready(self, parts: list[str]) -> bool:
        """After `wake_rx` matched: wake up now? (`parts`: the deltas not yet synced.)"""
        ...

    def advance(self, final: bool) -> None: ...

    def frontier(self) -> int: ...

    def keep_from(self) -> int: ...


def max_cut(text: str, base: int, start: int, max_chars: int) -> int:
    """Where the safety cut splits an over-long chunk starting at `start`: at the last whitespace
    run that starts after a non-space character within the first `max_chars` characters (the
    whitespace goes to the next piece, like whitespace between sentences), else hard at
    `start + max_chars`. Needs text up to `start + max_chars` inclusive."""
    lo = start - base
    q = lo + max_chars
    while q > lo:
        if text[q].isspace() and not text[q - 1].isspace():
            return q + base
        q -= 1
    return start + max_chars


class Emitter:
    """Turns a stage's cuts into spans, splitting chunks longer than `max_chars`.

    Sequential definition (identical in batch and incremental use): from the current start `a`,
    let `b` be the next cut (or the end of text). If `b - a <= max_chars` the chunk is `[a, b)`;
    otherwise it is `[a, max_cut(a))`, and the same rule continues from there. Incrementally, an
    over-long piece is emitted as soon as the stage's frontier shows there is no cut in
    `(a, a + max_chars]` and the text extends past `a + max_chars`, which is exactly the batch
    condition, so the result does not depend on how the text was split into deltas."""

    __slots__ = ("_buf", "_eager", "_max", "_rlo", "_stage", "a", "wake_len")

    def __init__(
        self, buf: TextBuffer, stage: CutStage, max_chars: int | None, *, eager: bool = False
    ) -> None:
        """`eager`: the stage advances on any wake-up (it has no wake-up of its own for text
        that holds no boundary), so waking it at the safety cut's length is what moves it."""
        self._buf = buf
        self._stage = stage
        self._eager = eager
        self._max = INF if max_chars is None else max_chars
        self.a = 0  # start of the next chunk to emit
        self._rlo = False  # a right-to-left override in the text emitted so far (natural_cut)
        self.wake_len = INF  # stream length at which a safety cut could become possible

    def emit(self, final: bool) -> list[Span]:
        buf = self._buf
        n = buf.n
        cuts = self._stage.cuts
        mx = self._max
        a = self.a
        out: list[Span] = []
        if not cuts and not final and n <= a + mx:  # the usual wake-up: nothing to emit
            self.wake_len = a + mx + 1 if mx != INF else INF  # checked when reached (below)
            return out
        text, base = buf.text, buf.base
        while True:
            if cuts:
                b = cuts[0]
                if b - a <= mx:
                    piece = text[a - base : b - base]
                    natural = self._natural(piece, text, a - base, b - base)
                    out.append(Span(a, b, piece, natural_end=natural))
                    a = b
                    cuts.popleft()
                    continue
            elif final:
                if a >= n:
                    break
                if n - a <= mx:
                    out.append(Span(a, n, text[a - base :]))
                    a = n
                    break
            elif n <= a + mx or self._stage.frontier() <= a + mx:
                break
            p = max_cut(text, base, a, mx)
            piece = text[a - base : p - base]
            natural = self._natural(piece, text, a - base, p - base)
            out.append(Span(a, p, piece, natural_end=natural))
            a = p
        self.a = a
        # Only worth waking for a safety cut when the stage has caught up with the text (its
        # frontier then moves with the text); otherwise the stage's own wake-up comes first.
        if self._eager:
            # past a + mx and still here: the stage's frontier waits for its own wake-up
            open_ended = not final and mx != INF and n <= a + mx
        else:
            open_ended = not final and mx != INF and self._stage.frontier() >= n
        self.wake_len = a + mx + 1 if open_ended else INF
        return out

    def _natural(self, piece: str, text: str, start: int, i: int) -> bool:
        """`natural_cut` at the end of the chunk `piece` (`text[start:i]`): the chunks come in
        order, so whether an override came before is remembered, not searched for."""
        self._rlo = self._rlo or RLO in piece
        if self._rlo or i >= len(text) or not text[i].isspace():
            return False
        return _natural_here(text, i, start)


class Pipeline:
    """The incremental state shared by all chunkers: a buffer, a chain of cut stages (each
    consuming the previous one's cuts; the first one reads the text and is the one with a
    `wake_rx`) and the emitter over the last stage."""

    __slots__ = ("_buf", "_emitter", "_source", "_stages", "_wake_len")

    def __init__(self, buf: TextBuffer, stages: list[CutStage], emitter: Emitter) -> None:
        self._buf = buf
        self._stages = stages
        self._source = stages[0]
        self._emitter = emitter
        self._wake_len = 0

    def feed(self, delta: str) -> list[Span]:
        buf = self._buf
        parts = buf.parts
        if parts is None:
            raise RuntimeError("feed() after flush(): an incremental chunker serves one stream")
        if not delta:
            return []
        # The hot path: most deltas only get queued.
        parts.append(delta)
        n = buf.n = buf.n + len(delta)
        source = self._source
        rx = source.wake_rx
        if rx is not None and rx.search(delta) is not None and source.ready(parts):
            source.dirty = True
        elif n < self._wake_len:
            return []
        parts.insert(0, buf.text)  # buf.sync(), inlined: this runs on every wake-up
        text = buf.text = "".join(parts)
        parts.clear()
        stages = self._stages
        for stage in stages:
            stage.advance(False)
        emitter = self._emitter
        out = emitter.emit(False)
        wake_len = emitter.wake_len
        for stage in stages:
            if stage.wake_len < wake_len:
                wake_len = stage.wake_len
        self._wake_len = wake_len
        if len(text) >= 2 * TRIM_MIN:
            keep = emitter.a
            for stage in stages:
                keep = min(keep, stage.keep_from())
            buf.trim(keep)
        return out

    def flush(self) -> list[Span]:
        buf = self._buf
        if buf.parts is None:
            return []
        buf.sync()
        buf.parts = None
        for stage in self._stages:
            stage.advance(True)
        return self._emitter.emit(True)
