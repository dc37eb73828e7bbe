"""Words written so that a reader still reads them and a bag-of-words model does not, read back
(DESIGN 4.6b): the censored spellings people use to get a swear word past a filter.

- symbols and digits for letters, stars for the letters left out: `f*ck`, `f**k`, `f***`,
  `sh!t`, `a$$hole`, `b1tch`, `@ss` (a token that holds a letter and one of CENSOR_MARKS);
- letters one apart: `f u c k`, `f.u.c.k`, `f-u-c-k`, one letter per line (`LETTER_RUN`);
- a letter written many times: `fuuuuck`, `shiiiit`, `fukk` (a run read once or twice);
- spelt as it sounds: `phuck`, `shyt`, `azzhole`, `kunt`, `fvck` (SOUNDS);
- cut by a dot, a hyphen or an underscore: `fu.ck`, `sh-it` (`_CUT`);
- written backwards: `kcuf` (a word of four letters or more).

A tokenizer of words drops single letters and cuts at symbols, so `f*ck` reads as `ck` and `f u
c k` as nothing. `reading` writes each such token as the word it can stand for, the word with
the highest score among the candidates it is given (`Readings`: a model's vocabulary and each
word's score alone, e.g. `profanity`'s), so the reading is the worst one a reader could take:
`f**k` is `fuck`, not `fork`. A token that is a word as it stands (`Readings.known`) is never
read as another, and a disguise that reads as no candidate is left as it is, so ordinary text
comes back unchanged (None) and a benign text's reading reads as benign as the text.

Linear work: the scans are regular expressions that start only where a run of their
characters starts, each token is compared with the candidates of its own length and first
letter (tens), and spaced letters are segmented into words over at most SEGMENT_CHARS letters
at a time.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# characters drawn for a letter (a star or a hash for any letter)
CENSOR_MARKS: Mapping[str, str] = {
    "$": "s",
    "@": "a",
    "!": "il",
    "|": "il",
    "1": "il",
    "0": "o",
    "3": "e",
    "4": "a",
    "5": "s",
    "7": "t",
    "8": "b",
    "9": "g",
}
_ANY = frozenset("*#")
_CHARS = "A-Za-z0-9*#$@!|"
# a token of letters and marks holding a mark, not starting with a star (`**bold**` is markup):
# starts only where a run starts (lookbehind), so a long run is read once
_CENSORED = re.compile(rf"(?<![{_CHARS}])(?:[$@!|0-9][{_CHARS}]*|[A-Za-z]+[*#$@!|0-9][{_CHARS}]*)")
_LETTERS = re.compile(r"[A-Za-z]")

# a letter (or a digit or mark drawn for one) standing alone (no letter, digit or mark beside
# it: `a r*t*rd` has none; `!` after it may be punctuation, `'s` is a word's end), and what may
# part the letters of a spaced word (the same throughout a run): `f u c k`, `f.u.c.k`, `i d i 0 t`
_SINGLE = re.compile(rf"(?<![{_CHARS}'\u2019])[{_CHARS}](?![A-Za-z0-9*#$@|]|!+[A-Za-z0-9*#$@|])")
SEPARATORS = frozenset((" ", ".", "-", "_", "/", ",", "+", "~", ":", "\n", "\r\n"))
_GAPS = frozenset("".join(SEPARATORS))
ONE_LETTER_WORDS = frozenset("aiuyr")  # `a`, `I`, and `u`, `y`, `r` for you, why, are
SEGMENT_CHARS = 60  # letters of a run segmented into words at a time

_RUNS = re.compile(r"([a-z])\1+")
MAX_RUNS = 4  # stretched runs of one word tried both ways (2**4 readings at most)

# spellings by sound, each tried on or off (`phuck`: ph as f)
SOUNDS = (("ph", "f"), ("y", "i"), ("zz", "ss"), ("z", "s"), ("k", "c"), ("v", "u"))
_WORD = re.compile(r"(?<![A-Za-z])[A-Za-z]{3,}(?![A-Za-z])")
# a word cut by single dots, hyphens or underscores (`fu.ck`, `sh-it`; as detectors/respell.py)
_CUT = re.compile(r"(?<![A-Za-z.\-_])[A-Za-z]+(?:[.\-_][A-Za-z]+)+(?![A-Za-z\-_])")
_CUT_MARKS = re.compile(r"[.\-_]")
BACKWARDS_MIN = 4  # letters of a word read backwards (`kcuf`; `god` is `dog`)
_SOUNDED = re.compile(r"ph|y|z|k|v")


@dataclass(frozen=True)
class Readings:
    """What a disguised token may be read as: `words` (a model's vocabulary, lower case) with
    the score of each alone, highest first within each (length, first letter) bucket; `known`:
    the words a token may be as it stands (never read as another word); spaced letters are
    segmented into those, `words` and `vocabulary` (the model's other words)."""

    words: Mapping[str, float]
    known: frozenset[str]
    vocabulary: frozenset[str] = frozenset()
    by_shape: Mapping[tuple[int, str], tuple[str, ...]] = field(init=False)
    by_length: Mapping[int, tuple[str, ...]] = field(init=False)

    def __post_init__(self) -> None:
        shape: dict[tuple[int, str], list[str]] = defaultdict(list)
        length: dict[int, list[str]] = defaultdict(list)
        for w in sorted(self.words, key=lambda w: (-self.words[w], w)):
            shape[len(w), w[0]].append(w)
            length[len(w)].append(w)
        object.__setattr__(self, "by_shape", {k: tuple(v) for k, v in shape.items()})
        object.__setattr__(self, "by_length", {k: tuple(v) for k, v in length.items()})

    def best(self, candidates: Iterable[str]) -> str | None:
        """The candidate among `words` with the highest score (None when none is a word)."""
        found = [c for c in candidates if c in self.words]
        return max(found, key=lambda w: (self.words[w], w)) if found else None


def _fits(token: str, word: str) -> bool:
    return all(
        c == w or c in _ANY or w in CENSOR_MARKS.get(c, "")
        for c, w in zip(token, word, strict=True)
    )


def uncensored(token: str, readings: Readings) -> str | None:
    """The word of `readings` that `token` (lower case, letters and CENSOR_MARKS, stars) stands
    for, the highest scored: `f**k` fuck, `sh!t` shit, `b1tch` bitch; None when none fits. A
    mark ending the token may be punctuation (`sh!t!`): the token without it is tried too."""
    bare = token.rstrip("!|1")
    for t in (token, bare) if bare != token and len(bare) >= 2 else (token,):
        if t[0].isalpha():
            pool = readings.by_shape.get((len(t), t[0]), ())
        else:
            pool = readings.by_length.get(len(t), ())
        word = next((w for w in pool if _fits(t, w)), None)
        if word is not None:
            return word + token[len(t) :]
    return None


def unstretched(word: str, readings: Readings) -> str | None:
    """`fuuuuck` -> fuck: each run of a letter written twice or more (at most MAX_RUNS of them)
    read once or twice, the best reading among `readings`' words; None when none is one."""
    runs = list(_RUNS.finditer(word))[:MAX_RUNS]
    if not runs:
        return None
    tries = []
    for picks in itertools.product((1, 2), repeat=len(runs)):
        out, at = [], 0
        for m, n in zip(runs, picks, strict=True):
            out += [word[at : m.start()], m.group(1) * n]
            at = m.end()
        tries.append("".join(out) + word[at:])
    return readings.best(tries)


def sounded(word: str, readings: Readings) -> str | None:
    """`phuck` -> fuck, `shyt` -> shit: SOUNDS applied in every combination that changes the
    word; the best reading among `readings`' words; None when none is one."""
    rules = [(a, b) for a, b in SOUNDS if a in word]
    tries = []
    for picks in itertools.product((False, True), repeat=len(rules)):
        if any(picks):
            out = word
            for (a, b), on in zip(rules, picks, strict=True):
                out = out.replace(a, b) if on else out
            tries.append(out)
    return readings.best(tries)


def segmented(letters: str, readings: Readings) -> str:
    """`afuckingidiot` -> `a fucking idiot`: the fewest words of `readings` (`known`, `words`,
    `vocabulary`), a word of one or two letters counting double, SEGMENT_CHARS letters at a
    time; `letters` as they are where a piece is no word (`fuuk`, `idi0t`: one token, which
    the token readings then read)."""
    out = []
    for lo in range(0, len(letters), SEGMENT_CHARS):
        piece = _segment(letters[lo : lo + SEGMENT_CHARS], readings)
        if piece is None:
            return letters
        out.append(piece)
    return " ".join(out)


def _segment(s: str, readings: Readings) -> str | None:
    n = len(s)
    cost = [0.0] + [float("inf")] * n
    back = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(max(0, end - 24), end):
            piece = s[start:end]
            if end - start == 1:
                step = 2.0 if piece in ONE_LETTER_WORDS else 5.0
            elif piece in readings.known or piece in readings.words or piece in readings.vocabulary:
                step = 1.0 if end - start >= 3 else 2.0
            else:
                continue
            if cost[start] + step < cost[end]:
                cost[end], back[end] = cost[start] + step, start
    words, at = [], n
    while at > 0:
        words.append(s[back[at] : at])
        at = back[at]
    if any(len(w) == 1 and w not in ONE_LETTER_WORDS for w in words):
        return None
    return " ".join(reversed(words))


def letter_runs(text: str) -> list[tuple[int, int]]:
    """[start, end) of each run of lone characters (`_SINGLE`), two or more of them letters, one
    separator apart (the same one throughout the run: SEPARATORS); where two runs share a
    character (`a s.h.i.t`: `a s` and `s.h.i.t`), the longer is the word. One look at each."""
    letters = [m.start() for m in _SINGLE.finditer(text)]
    runs: list[list[int]] = []  # letter positions of each run, in order
    sep: str | None = None
    for prev, at in itertools.pairwise(letters):
        gap = text[prev + 1 : at]
        if gap in SEPARATORS and gap == sep and runs and runs[-1][-1] == prev:
            runs[-1].append(at)
        elif gap in SEPARATORS:
            runs.append([prev, at])
            sep = gap
        else:
            sep = None
    claimed: set[int] = set()
    out: list[tuple[int, int]] = []
    for run in sorted(runs, key=len, reverse=True):
        run = [at for at in run if at not in claimed]  # (only an end can be claimed)
        if sum(text[at].isalpha() for at in run) >= 2:
            claimed.update(run)
            out.append((run[0], run[-1] + 1))
    return sorted(out)


def _joined(text: str, readings: Readings) -> str:
    """`text` with each of its `letter_runs` joined into the words it spells (`f u c k` fuck,
    `f u c k y o u` fuck you); `text` itself when it has none."""
    runs = letter_runs(text)
    if not runs:
        return text
    out, at = [], 0
    for a, b in runs:
        letters = "".join(c for c in text[a:b] if c not in _GAPS).lower()
        word = letters if letters in readings.known else segmented(letters, readings)
        out += [text[at:a], word]
        at = b
    return "".join(out) + text[at:]


def reading(text: str, readings: Readings) -> str | None:
    """`text` with every disguised word read back (spaced letters joined into words, then cut,
    censored, stretched, sounded and backwards tokens read as `readings`' words); None when
    nothing is."""

    def censored(m: re.Match[str]) -> str:
        nonlocal changed
        token = m.group().lower()
        if not any(c.isalpha() for c in token):
            return m.group()
        word = uncensored(token, readings)
        if word is None:
            return m.group()
        changed = True
        return word

    def rejoined(m: re.Match[str]) -> str:
        nonlocal changed
        parts = _CUT_MARKS.split(m.group().lower())
        word = "".join(parts)
        if word not in readings.words or all(p in readings.known for p in parts):
            return m.group()
        changed = True
        return word

    def respelt(m: re.Match[str]) -> str:
        nonlocal changed
        word = m.group().lower()
        if word in readings.known or word in readings.words:
            return m.group()
        found = unstretched(word, readings) if _RUNS.search(word) else None
        if found is None and _SOUNDED.search(word):
            found = sounded(word, readings)
        if found is None and len(word) >= BACKWARDS_MIN and word[::-1] in readings.words:
            found = word[::-1]
        if found is None:
            return m.group()
        changed = True
        return found

    out = _joined(text, readings)
    changed = out is not text
    out = _CUT.sub(rejoined, out)
    out = _CENSORED.sub(censored, out)
    out = _WORD.sub(respelt, out)
    return out if changed else None
