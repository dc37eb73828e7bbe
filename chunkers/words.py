"""`words`: windows of at most `max_words` whitespace-separated words, also cut at sentence ends."""

from __future__ import annotations

import re
from collections import deque

from .base import INF, CutStage, Emitter, Pipeline, Span, TextBuffer
from .punkt_stream import PunktCutter

_RE_SPACE = re.compile(r"\s")
_RE_NONSPACE = re.compile(r"\S")
_RE_WORD = re.compile(r"\S+")
# Characters per missing word up to which the remaining text is counted in one C call rather
# than walked word by word: a failed count wastes at most this much scanning per word the walk
# then consumes, so the whole scan stays linear.
_COUNT_SPAN = 32


class WordCutter:
    """Cuts inside each sentence (the upstream cuts) after every `max_words`-th word, when
    another word follows in the same sentence. A word is a maximal run of non-whitespace
    characters (str.isspace) within the sentence chunk; the whitespace before a word belongs to
    that word's window, like whitespace before a sentence.

    Incrementally the scan is resumable (each character is looked at once), and a window is
    committed when the word after it has started and the upstream frontier shows no sentence
    end before it: nothing later can move the cut. The scan runs only when a sentence cut
    arrived, the sentence frontier moved, or enough text arrived to finish a window (two
    characters per missing word), which keeps the per-delta cost low."""

    __slots__ = (
        "_buf",
        "_count",
        "_e",
        "_final",
        "_held_at",
        "_in_word",
        "_max_words",
        "_pos",
        "_up",
        "cuts",
        "dirty",
        "wake_len",
        "wake_rx",
    )

    def __init__(self, buf: TextBuffer, upstream: CutStage, max_words: int) -> None:
        self._buf = buf
        self._up = upstream
        self._max_words = max_words
        self.cuts: deque[int] = deque()
        self.dirty = False
        self._final = False
        self._count = 0  # complete words in the current window, before pos
        self._pos = 0  # scanned up to here
        self._in_word = False  # the character before pos is part of an unfinished word
        self._e = -1  # end of the max_words-th word, once known
        self._held_at = -1  # the sentence frontier that stopped the scan, if one did
        self.wake_rx: re.Pattern[str] | None = None
        self.wake_len = 0

    def ready(self, parts: list[str]) -> bool:
        return True

    def frontier(self) -> int:
        if self._final:
            return INF
        own = self._e if self._e >= 0 else self._pos
        upc = self._up.cuts
        up = upc[0] if upc else self._up.frontier()
        return own if own < up else up

    def keep_from(self) -> int:
        return self._pos  # nothing before the scan position is read again

    def advance(self, final: bool) -> None:
        buf = self._buf
        t, base, n = buf.text, buf.base, buf.n
        up = self._up
        upc = up.cuts
        if not (final or upc):  # skip wake-ups that cannot move a window (most of them)
            if self._held_at >= 0:
                if up.frontier() == self._held_at:
                    return
            elif n < self.wake_len:
                return
        max_words = self._max_words
        # Hot path on every wake-up: state in locals, written back on exit.
        count, pos, in_word, e = self._count, self._pos, self._in_word, self._e
        while True:
            if upc:
                b = limit = upc[0]
            else:
                b = -1
                limit = n if final else min(n, up.frontier())
            lo, hi = pos - base, limit - base
            if e >= 0:  # window full: does another word follow in this sentence?
                if _RE_NONSPACE.search(t, lo, hi) is not None:
                    b = e  # cut there
            else:
                if in_word:  # finish the word in progress
                    m = _RE_SPACE.search(t, lo, hi)
                    if m is None:
                        lo = hi
                    else:
                        lo = m.start()
                        in_word = False
                        count += 1
                if (
                    not in_word
                    and count < max_words
                    and 0 < hi - lo <= _COUNT_SPAN * (max_words - count)
                ):
                    # Count in C first; walk word by word only where a window ends. Only over
                    # a stretch that could hold about the words still missing: counting the
                    # whole rest of a long text for each window it holds was quadratic (a 1 MiB
                    # text of short words without a sentence end: minutes of CPU).
                    touches = not t[hi - 1].isspace()  # the last word may go on
                    done = len(_RE_WORD.findall(t, lo, hi)) - touches
                    if count + done < max_words:
                        count += done
                        in_word = touches
                        lo = hi
                if not in_word and count < max_words:
                    for m in _RE_WORD.finditer(t, lo, hi):
                        if m.end() == hi:  # reaches the limit: maybe unfinished
                            in_word = True
                            lo = hi
                            break
                        count += 1
                        if count == max_words:
                            lo = m.end()
                            break
                    else:
                        lo = hi
                if count == max_words:
                    e = pos = lo + base
                    continue
            if b >= 0:  # a cut: the next window starts there
                self.cuts.append(b)
                while upc and upc[0] <= b:
                    upc.popleft()
                pos = b
                count, in_word, e = 0, False, -1
                continue
            pos = limit
            self._held_at = -1
            if final:
                self._final = True
            elif limit < n:  # held back by the sentence stage: run again once it moves
                self._held_at = limit
                self.wake_len = INF
            else:
                # Fewest characters that could complete the window and start the next word.
                k = max_words - count
                self.wake_len = limit + (1 if e >= 0 else 2 * k - int(in_word))
            self._count, self._pos, self._in_word, self._e = count, pos, in_word, e
            return


class WordsChunker:
    """Windows of at most `max_words` words that never span a sentence end (NLTK Punkt), with the
    same `max_chars` safety cut as the sentence chunker applied to each window."""

    __slots__ = ("max_chars", "max_words")

    def __init__(self, max_words: int = 50, max_chars: int = 2000) -> None:
        self.max_words = max_words
        self.max_chars = max_chars

    def incremental(self) -> Pipeline:
        buf = TextBuffer()
        sentences = PunktCutter(buf)
        windows = WordCutter(buf, sentences, self.max_words)
        return Pipeline(buf, [sentences, windows], Emitter(buf, windows, self.max_chars))

    def chunk(self, text: str) -> list[Span]:
        """The incremental form fed everything at once, so the two cannot disagree."""
        state = self.incremental()
        return state.feed(text) + state.flush()

    def __repr__(self) -> str:
        return f"WordsChunker(max_words={self.max_words}, max_chars={self.max_chars})"
