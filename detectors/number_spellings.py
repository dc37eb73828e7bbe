"""The number view: digits written so that a digit pattern misses them, read as digit groups.

A model asked to "write the phone number in words" or "put a space between the digits" writes
`five five five, one two three, four five six seven`, `5 5 5 1 2 3 4 5 6 7`, one digit a line,
or `555-l23-4S67` (look-alike letters among digits). A reader recovers the number at once; the
patterns of regex_pii see no run of digits. This view rewrites each such run as the digit
groups it spells (`555-123-4567`), so the same patterns, with the same checks (a phone's shape,
an SSN's ranges, a card's Luhn digit), judge it; every view character maps back to the word or
digit it came from (a word's view digit ends where the word ends), so a find covers the whole
spelling.

What makes a run (chosen so that ordinary text holds none: see README's PII section):

- tokens: the number words `zero`..`nine` and those of German, French, Spanish, Italian and
  Portuguese (`FOREIGN_DIGIT_WORDS`; any case; `oh` and `o` for zero inside a run, never
  first), `double`/`triple` before one (`double five` is 55), and single ASCII digits that stand
  alone (not part of a longer number, a decimal or a word);
- between two tokens at most one separator: up to three spaces or tabs, or one of `,;/|-` or a
  line break with up to three spaces or tabs on each side (a spelt number is written in one
  breath; a sentence end is no separator);
- single ASCII digits only run with whitespace between them, the same whitespace each time
  (`[1, 2, 3]` and `1 0 0\\n0 1 0` are lists and matrices, not numbers);
- at least 6 digits and 3 tokens, not all the same digit, and not a count (every digit one more
  or one less than the one before: `1 2 3 4 5 6 7 8 9`, `one two three four five six seven`).

Groups: where a run's separators differ, the most frequent one joins digits of a group and the
others part groups (`five five five, one two three` is 555-123). A run written with one
separator throughout is laid out as the numbers of its length are: 7 digits as 3-4, 9 as 3-2-4,
10 as 3-3-4, 11 that start with 1 as 1-3-3-4, any other length contiguous (a card's digits).

Look-alike letters (`l` and `I` for 1, `O`/`o` for 0, `S`/`s` for 5, `B` for 8, `Z`/`z`
for 2) are read as digits inside a whitespace-free token that is only digits, those letters
and dashes, dots or brackets, with at least two digits in it and at most 8 characters in each group that holds a letter (a phone's, an SSN's or a card's
group; `1Z5433965777440500` is a parcel's tracking number), and no digit and `s` at a group's
end (`1990s` is a decade).

A number split over the cells of a Markdown table row (`| 555 | 123 | 4567 |`) is read as its
groups joined by dashes when the row holds nothing else and its cells lay out a North American
phone number (3-3-4, or 1-3-3-4), an SSN (3-2-4) or a card (groups of 4; 4-6-5): a row of
round amounts (every cell ending in 0: `| 250 | 500 | 1000 |`) is none.

Chinese and Japanese numerals written a digit each (`五五五-一二三-四五六七`) are read as
digits in a run of MIN_DIGITS or more (`CJK_DIGITS`), one character for one.

Bounded work: the runs are found by one RE2 search (linear in the text); Python looks only at
the tokens of the runs found, each at most MAX_RUN_CHARS long.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import re2

from .normalise import View
from .re2_scan import CONFIG_MAX_MEM, Span, Utf8Text, re2_options

DIGIT_WORDS = {
    "zero": "0",
    "oh": "0",
    "o": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
}
# The digits' words in German, French, Spanish, Italian and Portuguese, as the normalised view
# spells them (accents dropped: `f\u00fcnf` is `funf`, `tr\u00eas` `tres`, `z\u00e9ro` `zero`;
# German's `ue` for `\u00fc` and `zwo` for 2 as said on the phone). A model asked for a number
# "in German" writes `f\u00fcnf f\u00fcnf f\u00fcnf, eins zwei drei, ...`. No word means another
# digit in another of these languages (or in English), so one table serves them all.
FOREIGN_DIGIT_WORDS = {
    "0": ("null", "cero"),  # (`zero` and `z\u00e9ro`: English's)
    "1": ("eins", "un", "une", "uno", "una", "um", "uma"),
    "2": ("zwei", "zwo", "deux", "dos", "due", "dois", "duas"),
    "3": ("drei", "trois", "tres", "tre"),
    "4": ("vier", "quatre", "cuatro", "quatro", "quattro"),
    "5": ("funf", "fuenf", "cinq", "cinco", "cinque"),
    "6": ("sechs", "seis", "sei", "meia"),  # (`six`: English's; `meia` is 6 on a Brazilian phone)
    "7": ("sieben", "sept", "siete", "sette", "sete"),
    "8": ("acht", "huit", "ocho", "otto", "oito"),
    "9": ("neun", "neuf", "nueve", "nove"),
}
DIGIT_WORDS |= {word: digit for digit, words in FOREIGN_DIGIT_WORDS.items() for word in words}
_ZERO_WORDS = frozenset(("oh", "o"))
_REPEATS = {"double": 2, "triple": 3}
# a run is cut after this many characters (a spelt card of 19 digits is ~120)
MAX_RUN_CHARS = 256
MIN_DIGITS = 6
# the digits a run at the end of an answer cut short holds before `open_run` withholds it: more
# than a number's first group (`five five five` may end a sentence; `five five five one` is a
# phone number's beginning)
CUT_DIGITS = 4
MIN_TOKENS = 3

# (longest first: an alternation tries its words in order)
_WORD = "(?:" + "|".join(sorted(DIGIT_WORDS, key=lambda w: (-len(w), w))) + ")"
_TOKEN = rf"\b(?:(?:double|triple)[ \t-]{{1,2}})?{_WORD}\b|\b[0-9]\b"
_SEPARATOR = r"(?:[ \t]{1,3}|[ \t]{0,3}[,;/|\n-][ \t]{0,3})"
# RE2: a run of 3 or more tokens (ASCII `\b`: a digit next to a letter is inside a word)
_RUN = re2.compile(
    rf"(?i)(?:{_TOKEN})(?:{_SEPARATOR}(?:{_TOKEN})){{2,}}".encode(), re2_options(CONFIG_MAX_MEM)
)
# what the number words hold (`oh` and `o` only inside a run, which holds another word too;
# `double` and `triple` only before one)
# (a word that holds another is counted by it: `une` by `un`, `seis` by `sei`; `oh` and `o`
# are never a run's first word and need two more beside them)
_WORD_STEMS = tuple(
    sorted(
        w
        for w in DIGIT_WORDS
        if w not in _ZERO_WORDS and not any(o != w and o in w for o in DIGIT_WORDS if o != "o")
    )
)
# Python's `re`, on one run at a time (at most MAX_RUN_CHARS): its tokens
_TOKENS = re.compile(rf"(?i){_TOKEN}")
# the leading neighbour that makes an ASCII digit part of a longer number (`1.5`, `3,2`, `-1`
# stays: a dash is a separator) or the trailing one (`5.0`)
_NUMBER_GLUE = frozenset(".,")

# look-alike letters of digits, inside a token of digits
_LOOKALIKES = str.maketrans("lIOoSsBZz", "110055822")
# a whitespace-free token of digits, look-alike letters and `.-()` with a letter and two
# digits in it (words and plain numbers are no candidates: no Python for them)
_X = r"[0-9lIOoSsBZz.()\-]*"
_L = "[lIOoSsBZz]"
_LEET_CANDIDATE = re2.compile(
    (
        rf"(?:^|[^A-Za-z0-9])((?:{_X}{_L}{_X}[0-9]{_X}[0-9]|{_X}[0-9]{_X}{_L}{_X}[0-9]"
        rf"|{_X}[0-9]{_X}[0-9]{_X}{_L}){_X})(?:$|[^A-Za-z0-9])"
    ).encode(),
    re2_options(CONFIG_MAX_MEM),
)
_LEET_HINT = re.compile(r"[0-9][.()\-]?[lIOoSsBZz]|[lIOoSsBZz][.()\-]?[0-9]")
_LEET_GROUP = re.compile(r"[0-9lIOoSsBZz]+")
_LEET_LETTERS = re.compile(r"[lIOoSsBZz]")


# Chinese and Japanese numerals, read a digit each as a phone number is read out (`\u4e94\u4e94\u4e94-
# \u4e00\u4e8c\u4e09-\u56db\u4e94\u516d\u4e03` is 555-123-4567; `\u5e7a` is how a 1 is said in a
# Chinese phone number): Unicode gives them no decimal digit value, so the view keeps them. A
# run of MIN_DIGITS of them or more, with at most two separators between two (what the view
# makes of `\uff0d`, `\u30fb`, `\u3001`, ideographic spaces), each read as its digit: one character
# for one, the spans are the run's. Prose holds no such run (numbers of quantity are written
# with `\u5341`, `\u767e`, `\u5343`, which end one; a year is four).
CJK_DIGITS = {
    "\u3007": "0",
    "\u96f6": "0",
    "\u4e00": "1",
    "\u5e7a": "1",
    "\u4e8c": "2",
    "\u4e09": "3",
    "\u56db": "4",
    "\u4e94": "5",
    "\u516d": "6",
    "\u4e03": "7",
    "\u516b": "8",
    "\u4e5d": "9",
}
# (the view spells `\u3007` as the Latin `O` it is confusable with: a zero in a run of numerals)
CJK_DIGITS["O"] = "0"
_CJK = "[" + "".join(CJK_DIGITS) + "]"
_CJK_RUN = re.compile(rf"{_CJK}(?:[ \t\-.,/\u3001]{{0,2}}{_CJK}){{{MIN_DIGITS - 1},}}")
_CJK_TO_ASCII = str.maketrans(CJK_DIGITS)
# a run of them ending a text (a stream cut inside a number: `open_tail`), three at least
_CJK_TAIL = re.compile(rf"{_CJK}(?:[ \t\-.,/\u3001]{{0,2}}{_CJK}){{2,}}[ \t\-.,/\u3001]{{0,2}}\Z")


@dataclass(frozen=True, slots=True)
class _Token:
    start: int
    end: int
    digits: str
    word: bool  # a number word (not a single ASCII digit)


def may_hold_a_run(text: str) -> bool:
    """Whether `text` holds enough digits and number words for a run (C counts only)."""
    digits = sum(map(text.count, "0123456789"))
    lower = text.lower()
    return digits + sum(map(lower.count, _WORD_STEMS)) >= MIN_TOKENS


def number_view(text: str) -> tuple[View, list[tuple[int, int]]] | None:
    """The view of `text` (itself a normalised view) with each spelt or spaced number written as
    digit groups and look-alike letters among digits read as digits, and the view spans of what
    was rewritten (a find that overlaps none of them is the plain text's, found without this
    view); None when nothing is rewritten (most texts: one RE2 search each)."""
    pieces: list[tuple[int, int, str, list[int], list[int]]] = []  # start, end, new, origins, ends
    runs: list[Span] = []
    # (each RE2 search costs its Python wrapper more than the C search: counts of what a run,
    # a row or a look-alike token needs, in C, spare most texts all of them)
    digits = sum(map(text.count, "0123456789"))
    spelt = may_hold_a_run(text)
    cells = "|" in text and digits >= MIN_DIGITS
    leet = digits >= 2 and _LEET_HINT.search(text) is not None
    cjk = [] if text.isascii() else [m.span() for m in _CJK_RUN.finditer(text)]
    if not (spelt or cells or leet or cjk):
        return None
    data = Utf8Text(text)
    if spelt:
        runs = list(data.spans(_run_spans(data.data)))
    for start, end in runs:
        pieces.extend(_runs(text, start, end))
    if cells:
        for start, end in data.spans(_cell_spans(data.data)):
            piece = _cells(text, start, end)
            if piece is not None:
                pieces.append(piece)
                runs.append((start, end))
    for start, end in cjk:
        piece = _cjk_numerals(text, start, end)
        if piece is not None:
            pieces.append(piece)
    if leet:
        for start, end in data.spans(_leet_spans(data.data)):
            if not any(s < end and start < e for s, e in runs):
                piece = _lookalikes(text, start, end)
                if piece is not None:
                    pieces.append(piece)
    pieces.sort()
    pieces = [p for i, p in enumerate(pieces) if not i or pieces[i - 1][1] <= p[0]]
    if not pieces:
        return None
    out: list[str] = []
    view_at: list[int] = []
    orig_at: list[int] = []
    ends: dict[int, int] = {}
    rewritten: list[tuple[int, int]] = []
    pos = 0  # original position copied up to
    vpos = 0
    for start, end, new, origins, token_ends in pieces:
        out.append(text[pos:start])
        vpos += start - pos
        run_at = vpos
        for ch_origin, ch_end in zip(origins, token_ends, strict=True):
            view_at.append(vpos)
            orig_at.append(ch_origin)
            if ch_end != ch_origin + 1:
                ends[ch_origin] = ch_end
            vpos += 1
        out.append(new)
        view_at.append(vpos)  # one-to-one again after the run
        orig_at.append(end)
        rewritten.append((run_at, vpos))
        pos = end
    out.append(text[pos:])
    view = View(text, "".join(out), view_at, orig_at, set(), ends)
    return view, rewritten


# a table row of 2-5 cells of 1-6 digits, alone on its line
_CELLS = re2.compile(
    rb"(?m)^[ \t]*(\|[ \t]*[0-9]{1,6}[ \t]*(?:\|[ \t]*[0-9]{1,6}[ \t]*){1,4}\|)[ \t]*$",
    re2_options(CONFIG_MAX_MEM),
)
_CELL_LAYOUTS = frozenset(
    ((3, 3, 4), (1, 3, 3, 4), (3, 2, 4), (4, 4, 4), (4, 4, 4, 4), (4, 4, 4, 4, 3), (4, 6, 5))
)
_CELL_DIGITS = re.compile(r"[0-9]+")


def _cell_spans(data: bytes) -> Iterator[Span]:
    if b"|" not in data:
        return
    pos = 0
    while True:
        m = _CELLS.search(data, pos)
        if m is None:
            return
        yield m.span(1)
        pos = m.end()


def _cells(text: str, start: int, end: int) -> tuple[int, int, str, list[int], list[int]] | None:
    """A table row's digit cells as one number's groups, when they are laid out as one."""
    groups = list(_CELL_DIGITS.finditer(text, start, end))
    if tuple(len(g.group()) for g in groups) not in _CELL_LAYOUTS:
        return None
    if all(g.group().endswith("0") for g in groups):
        return None  # round amounts
    new: list[str] = []
    origins: list[int] = []
    for i, g in enumerate(groups):
        if i:
            new.append("-")
            origins.append(groups[i - 1].end())
        new.append(g.group())
        origins.extend(range(g.start(), g.end()))
    first, last = groups[0].start(), groups[-1].end()
    return first, last, "".join(new), origins, [o + 1 for o in origins]


def _run_spans(data: bytes) -> Iterator[Span]:
    pos = 0
    while True:
        m = _RUN.search(data, pos)
        if m is None:
            return
        yield m.span()
        pos = m.end()


def _leet_spans(data: bytes) -> Iterator[Span]:
    pos = 0
    while True:
        m = _LEET_CANDIDATE.search(data, pos)
        if m is None:
            return
        start, end = m.span(1)
        yield start, end
        pos = max(end, pos + 1)


def _runs(text: str, lo: int, hi: int) -> list[tuple[int, int, str, list[int], list[int]]]:
    """The runs between `lo` and `hi` (an RE2 run, at most MAX_RUN_CHARS of it at a time),
    each as (start, end, its digit groups, the origin and end of each view character)."""
    out = []
    while lo < hi:
        stop = min(hi, lo + MAX_RUN_CHARS)
        tokens = [_token(text, m) for m in _TOKENS.finditer(text, lo, stop)]
        for run in _split(text, [t for t in tokens if t is not None]):
            piece = _laid_out(text, run)
            if piece is not None:
                out.append(piece)
        lo = stop
    return out


def _token(text: str, m: re.Match[str]) -> _Token | None:
    word = m.group().lower()
    if word.isdigit():
        if (
            m.start()
            and text[m.start() - 1] in _NUMBER_GLUE
            and text[m.start() - 2 : m.start() - 1].isdigit()
        ) or (
            text[m.end() : m.end() + 1] in _NUMBER_GLUE
            and text[m.end() + 1 : m.end() + 2].isdigit()
        ):
            return None  # part of a decimal or a grouped number (`1.5`, `3,2`)
        return _Token(m.start(), m.end(), word, word=False)
    first, _, rest = (
        word.partition(" ")
        if " " in word
        else word.partition("-")
        if "-" in word
        else (word, "", "")
    )
    if rest:
        rest = rest.strip(" \t-")
        return _Token(m.start(), m.end(), DIGIT_WORDS[rest] * _REPEATS[first], word=True)
    return _Token(m.start(), m.end(), DIGIT_WORDS[word], word=True)


def _split(text: str, tokens: list[_Token]) -> list[list[_Token]]:
    """Consecutive tokens joined by one separator each; two ASCII digits only by the whitespace
    the run's ASCII digits are joined by throughout (a change of it ends the run)."""
    runs: list[list[_Token]] = []
    run: list[_Token] = []
    ascii_sep: str | None = None
    for t in tokens:
        if run:
            sep = text[run[-1].end : t.start]
            joined = re.fullmatch(_SEPARATOR, sep) is not None
            if joined and not run[-1].word and not t.word:
                joined = sep.strip(" \t\n") == "" and (ascii_sep is None or sep == ascii_sep)
                ascii_sep = sep if joined else None
            if not joined:
                runs.append(run)
                run, ascii_sep = [], None
        run.append(t)
    if run:
        runs.append(run)
    return runs


def _laid_out(text: str, run: list[_Token]) -> tuple[int, int, str, list[int], list[int]] | None:
    while run and run[0].word and text[run[0].start : run[0].end].lower() in _ZERO_WORDS:
        run = run[1:]  # `oh` and `o` are zeros only inside a run
    digits = "".join(t.digits for t in run)
    if len(run) < MIN_TOKENS or len(digits) < MIN_DIGITS or len(set(digits)) == 1:
        return None
    seps = [text[a.end : b.start] for a, b in itertools.pairwise(run)]
    steps = {(int(b) - int(a)) % 10 for a, b in itertools.pairwise(digits)}
    if len(set(seps)) == 1 and steps in ({1}, {9}):
        return None  # a count (grouped, `one two three, four five, ...` is a number)
    common = Counter(seps).most_common(1)[0][0]
    origins: list[int] = []
    token_ends: list[int] = []
    new: list[str] = []
    if len(set(seps)) == 1:
        layout = {7: (3, 4), 9: (3, 2, 4), 10: (3, 3, 4)}.get(len(digits))
        if len(digits) == 11 and digits[0] == "1":
            layout = (1, 3, 3, 4)
        # each digit's token
        owners = [t for t in run for _ in t.digits]
        cuts = set()
        if layout:
            at = 0
            for n in layout[:-1]:
                at += n
                cuts.add(at)
        for i, (d, t) in enumerate(zip(digits, owners, strict=True)):
            if i in cuts:
                prev = owners[i - 1]
                new.append("-")
                origins.append(prev.end)
                token_ends.append(prev.end + 1)
            new.append(d)
            origins.append(t.start)
            token_ends.append(t.end)
    else:
        for i, t in enumerate(run):
            if i and seps[i - 1] != common:
                new.append("-")
                origins.append(run[i - 1].end)
                token_ends.append(run[i - 1].end + 1)
            for d in t.digits:
                new.append(d)
                origins.append(t.start)
                token_ends.append(t.end)
    return run[0].start, run[-1].end, "".join(new), origins, token_ends


def _lookalikes(
    text: str, start: int, end: int
) -> tuple[int, int, str, list[int], list[int]] | None:
    """A token of digits and look-alike letters (two digits at least: `_LEET_CANDIDATE`) read
    as digits, when every group of it that holds a letter is at most 8 characters long (a
    phone's, an SSN's or a grouped card's; `1Z5433965777440500` is a parcel's tracking number)
    and does not end in a digit and `s` (`1990s` is a decade)."""
    token = text[start:end]
    changed = False
    for m in _LEET_GROUP.finditer(token):
        group = m.group()
        if _LEET_LETTERS.search(group) is None:
            continue
        if len(group) > 8 or (group[-1] == "s" and group[-2:-1].isdigit()):
            return None
        changed = True
    if not changed:
        return None
    new = token.translate(_LOOKALIKES)
    positions = list(range(start, end))
    return start, end, new, positions, [p + 1 for p in positions]


def _cjk_numerals(
    text: str, start: int, end: int
) -> tuple[int, int, str, list[int], list[int]] | None:
    """A run of Chinese or Japanese numerals (`_CJK_RUN`) read as digits, one for one, unless
    its digits are one digit repeated or a count (`\u4e00\u3001\u4e8c\u3001\u4e09...`)."""
    run = text[start:end]
    digits = [CJK_DIGITS[c] for c in run if c in CJK_DIGITS]
    if run.count("O") == len(digits):
        return None  # (Latin letters: no numeral)
    steps = {(int(b) - int(a)) % 10 for a, b in itertools.pairwise(digits)}
    if len(set(digits)) == 1 or steps in ({1}, {9}):
        return None
    positions = list(range(start, end))
    return start, end, run.translate(_CJK_TO_ASCII), positions, [p + 1 for p in positions]


def cjk_tail_as_digits(text: str) -> str:
    """`text` with a run of Chinese or Japanese numerals that ends it read as digits (one
    character for one), for the question whether a stream cut there is inside a number."""
    if text.isascii():
        return text
    m = _CJK_TAIL.search(text, max(0, len(text) - MAX_RUN_CHARS))
    if m is None or m.group().count("O") == sum(c in CJK_DIGITS for c in m.group()):
        return text  # (none, or Latin `O`s only)
    return text[: m.start()] + m.group().translate(_CJK_TO_ASCII)


def open_run(text: str, least: int = MIN_DIGITS) -> int | None:
    """Where a run of number tokens that reaches the end of `text` (but for one separator after
    it) starts, when it holds `least` digits or more: a stream that ends there (a token
    budget, a stop sequence) may have cut a spelt number short, which must not be released
    raw (DESIGN 4.6a). None otherwise. Looks at the last MAX_RUN_CHARS characters. A stream
    cut short asks with CUT_DIGITS: more digits than a number's first group."""
    lo = max(0, len(text) - MAX_RUN_CHARS)
    tokens = [t for t in (_token(text, m) for m in _TOKENS.finditer(text, lo)) if t is not None]
    if not tokens:
        return None
    run = _split(text, tokens)[-1]
    rest = text[run[-1].end :]
    if rest and re.fullmatch(_SEPARATOR, rest) is None:
        return None
    while run and run[0].word and text[run[0].start : run[0].end].lower() in _ZERO_WORDS:
        run = run[1:]
    if sum(len(t.digits) for t in run) < least:
        return None
    return run[0].start


def run_across(text: str, at: int) -> int | None:
    """Where a run of number tokens with MIN_DIGITS digits or more that goes on across `at`
    (a token before it and one after it) starts; None when none does. A window of a stream cut
    at `at` must not release that run's head: spelt, a card's number is longer than the text a
    window keeps after its cut. Looks at MAX_RUN_CHARS characters each side."""
    lo, hi = max(0, at - MAX_RUN_CHARS), min(len(text), at + MAX_RUN_CHARS)
    tokens = [t for t in (_token(text, m) for m in _TOKENS.finditer(text, lo, hi)) if t is not None]
    for run in _split(text, tokens):
        if run[0].start < at < run[-1].end:
            while run and run[0].word and text[run[0].start : run[0].end].lower() in _ZERO_WORDS:
                run = run[1:]
            if run and sum(len(t.digits) for t in run) >= MIN_DIGITS:
                return min(run[0].start, at)
            return None
    return None
