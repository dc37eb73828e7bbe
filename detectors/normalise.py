"""The normalised view every built-in detector judges (DESIGN 4.6b), and its map back.

Hostile text hides PII from an ASCII pattern without changing what a reader sees:
`jo\\u200b@example.com` (a zero-width space), `jo@exam\\u00adple.com` (a soft hyphen),
`５５５-１２３-４５６７` (full-width digits), `jо@example.com` (a Cyrillic о), `123\\u201145\\u20116789`
(non-breaking hyphens). The view undoes that, one original character at a time:

- default-ignorable code points (Unicode's Default_Ignorable_Code_Point: zero-width spaces and
  joiners, soft hyphen, word joiner, bidi controls, variation selectors, Hangul fillers, tags)
  and every other format character (category Cf) are removed;
- the rest is NFKD-decomposed, its combining marks (categories Mn and Me: accents, U+0332
  underlines, enclosing keycaps) dropped, and what is left recomposed (NFC, so Hangul and
  other scripts' letters stay whole): `s\u0301h\u0301i\u0301t\u0301` and `jo@exa\u0301mple.com`
  read as their plain forms, and so does precomposed `\u00e9` (e); compatibility forms
  (full-width and mathematical forms, ligatures, non-breaking spaces) become their plain
  characters; decimal digits of any script become ASCII digits;
- what is still non-ASCII and is a confusable of an ASCII character in Unicode's confusables
  data (UTS #39, as shipped by the `confusable-homoglyphs` package: Cyrillic and Greek
  homoglyphs, dashes and hyphens, ...) becomes that ASCII character (one confusable with a
  small capital, Cyrillic `\u043c` or `\u0442`, that capital's letter), and so do the full stops
  and middle dots of other scripts that UTS #39 does not map to `.` (`\u3002`, `\u00b7`, ...).

Each view character comes from exactly one original character (an NFKD expansion such as
`™` -> `TM` gives several view characters from one), so a view span `[s, e)` maps back to the
original characters from the one view character `s` came from through the one `e - 1` came
from: the invisible characters *inside* a value are in its original span (block and redact cover
them), those before or after it are not, except the combining marks right after its last
character: they are drawn on that character, so they belong to the value (`View.span`).

Text under a right-to-left override (U+202E) is shown reversed: `\u202emoc.elpmaxe@oj` reads
jo@example.com on screen while its characters are in the other order. The view keeps the
characters' logical order (what a program reading the text gets, and what the map back is
for); `display_order` gives the order a reader sees, with its own map, for a detector to judge
as well (regex_pii scans both: the value leaks either way).

Folding is per character (the normal form of each character on its own, which is what the
patterns need: they are ASCII). It is cached per distinct character, and ASCII text, which
cannot hold any of these characters, is its own view at the cost of one `str.isascii()` and
one search for ASCII control characters (`is_plain`).
"""

from __future__ import annotations

import bisect
import html.entities
import re
import unicodedata
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt, Unicode 15), as ranges;
# the Cf characters among them are also caught by the category test, the others (soft hyphen
# aside, which is Cf) are not: combining grapheme joiner, Hangul fillers, variation selectors.
_IGNORABLE_RANGES = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)


# Categories removed whole: format characters, control characters that are not whitespace (a
# renderer draws NUL, BEL or ESC as nothing: `f\x07uck`), private-use characters (no standard
# glyph: a font draws nothing or a box) and unassigned code points
_REMOVED_CATEGORIES = frozenset(("Cf", "Cc", "Co", "Cn"))
# The control characters that are whitespace, and the line and paragraph separators: each is
# the whitespace a reader sees (and the Braille blank, which is drawn as a space). A tab stays a tab: it separates table cells, which a space would
# join (two numbers in adjacent columns are not one phone number, nor two names one organization)
SPACES = (
    {"\t": "\t", "\n": "\n", "\r": "\r", "\u2028": "\n", "\u2029": "\n"}
    | {
        "\u2800": " ",  # Braille pattern blank: a symbol drawn as a space, used as one
    }
    | {c: "\n" for c in "\x0b\x0c\x1c\x1d\x1e\x1f\x85"}
)
# ASCII characters the view changes (controls): ASCII text without any is its own view
ASCII_CHANGED = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def is_plain(text: str) -> bool:
    """`text` is its own view: ASCII without control characters (tab, line feed and carriage
    return aside) and without markup or escapes (`MARKUP`). Three C scans."""
    return text.isascii() and ASCII_CHANGED.search(text) is None and MARKUP.search(text) is None


def is_ignorable(ch: str) -> bool:
    """Default-ignorable, a format, control (whitespace aside), private-use or unassigned
    character: removed from the view."""
    if ch in SPACES:
        return False
    cp = ord(ch)
    if unicodedata.category(ch) in _REMOVED_CATEGORIES:
        return True
    return any(lo <= cp <= hi for lo, hi in _IGNORABLE_RANGES)


def visible(text: str) -> str:
    """`text` with its ignorable characters removed (`is_ignorable`: zero-width, format, control
    but whitespace, private-use, unassigned) and nothing else changed: what a reader sees of its
    characters, for a judge model, which reads every script as written (the view's folding
    would turn a Cyrillic sentence into mixed-script gibberish) but should not be led by what
    a reader never sees (`b\u200bo\u200bmb` tokenizes as anything but `bomb`). Character by
    character, so a text judged in chunks reads the same as whole. Only the distinct
    characters are looked at in Python (`set`), the removal is one C call."""
    if text.isascii() and ASCII_CHANGED.search(text) is None:
        return text
    gone = [ch for ch in set(text) if is_ignorable(ch)]
    return text.translate(dict.fromkeys(map(ord, gone))) if gone else text


def _confusables() -> dict[str, str]:
    """Non-ASCII character -> the ASCII character it is a confusable of (one each in the UTS
    #39 data once NFKC has run; characters NFKC already maps to ASCII are left to NFKC)."""
    from confusable_homoglyphs.confusables import confusables_data  # loads its JSON once

    table: dict[str, str] = {}
    for source, entries in confusables_data.items():
        if len(source) != 1 or source.isascii():
            continue
        if unicodedata.normalize("NFKC", source).isascii():
            continue
        for entry in entries:
            target = entry["c"].strip("\u200e")  # the data wraps RTL characters in LRMs
            if len(target) == 1 and target.isascii() and target.isprintable():
                table[source] = target
                break
    return table


CONFUSABLES: dict[str, str] = _confusables()


# Full stops and middle dots of other scripts that UTS #39 does not map to `.` (it maps few
# dots: U+3002 is confusable with a small circle there), and that NFKD does not make one:
# `jo@example\u3002com` and `10\u00b710\u00b70\u00b71` read as an address to a person.
DOTS = frozenset(
    "\u00b7"  # middle dot (and U+0387 Greek ano teleia, its NFKD)
    "\u0701\u0702"  # Syriac full stops
    "\u06d4"  # Arabic full stop
    "\u16eb"  # runic single punctuation
    "\u2027"  # hyphenation point
    "\u2219\u22c5"  # bullet operator, dot operator
    "\u2e31\u2e33\u2e3c"  # word separator middle dot, raised dot, stenographic full stop
    "\u3002"  # ideographic full stop (and U+FF61, U+FE12: its NFKD)
    "\u30fb"  # katakana middle dot (and U+FF65)
    "\ua4f8\ua60e"  # Lisu tone mya ti, Vai full stop
)

# Symbols drawn as a Latin letter or a digit that neither NFKC nor UTS #39 fold: negative
# squared and circled letters, regional indicators (`\U0001f1eb\U0001f1fa\U0001f1e8\U0001f1f0`
# shows F U C K), small capitals (`\ua730\u1d1c\u1d04\u1d0b`), double, negative and dingbat
# circled digits (`\u278e`). Found by their Unicode names in the blocks that hold them; the
# digits of scripts without positional numerals (Ethiopic, Brahmi, ...) are not folded.
_LETTER_NAME = re.compile(
    r"(?:(?:NEGATIVE )?(?:SQUARED|CIRCLED) LATIN CAPITAL LETTER"
    r"|REGIONAL INDICATOR SYMBOL LETTER|LATIN LETTER SMALL CAPITAL) ([A-Z])"
)
_SYMBOL_BLOCKS = ((0x0250, 0x02AF), (0x1D00, 0x1D7F), (0x2460, 0x24FF), (0x2776, 0x2793))
_SYMBOL_BLOCKS += ((0xA720, 0xA7FF), (0x1F100, 0x1F1FF))
# One symbol drawn as a digit, number or letter with a bracket or a stop around it, which NFKD
# spells out (`\u2478` -> `(5)`, `\u248c` -> `5.`, `\u24a5` -> `(j)`, `\U0001f106` -> `5,`):
# `\u2478\u2478\u2478-\u2474\u2475\u2476-...` reads as a phone number, `\u24a5\u24aa@...` as an
# e-mail address, while their NFKD is neither. The symbol is the one character it draws.
_ENCLOSED_NAME = re.compile(
    r"PARENTHESIZED (?:DIGIT|NUMBER) [A-Z]+|(?:DIGIT|NUMBER) [A-Z]+ (?:FULL STOP|COMMA)"
    r"|PARENTHESIZED LATIN (?:SMALL|CAPITAL) LETTER ([A-Z])"
)


def _symbols() -> dict[str, str]:
    table: dict[str, str] = {}
    for lo, hi in _SYMBOL_BLOCKS:
        for cp in range(lo, hi + 1):
            ch = chr(cp)
            name = unicodedata.name(ch, "")
            enclosed = _ENCLOSED_NAME.fullmatch(name)
            if enclosed:
                letter = enclosed.group(1)
                small = letter is not None and "SMALL" in name
                table[ch] = (letter.lower() if small else letter) if letter else _number(ch)
                continue
            if unicodedata.normalize("NFKC", ch).isascii() or ch in CONFUSABLES:
                continue
            letter = _LETTER_NAME.fullmatch(name)
            if letter:
                small = name.startswith("LATIN LETTER SMALL CAPITAL")
                table[ch] = letter.group(1).lower() if small else letter.group(1)
            elif "CIRCLED" in name and float(unicodedata.numeric(ch, 0.5)).is_integer():
                table[ch] = _number(ch)  # a digit, or a number (`\u24eb` negative circled 11)
    return table


def _number(ch: str) -> str:
    """The digits of a symbol's whole number (`\u247d` PARENTHESIZED NUMBER TEN: `10`)."""
    return str(int(unicodedata.numeric(ch)))


SYMBOLS: dict[str, str] = _symbols()


def _drawn_as_symbols() -> dict[str, str]:
    """Letters UTS #39 calls confusable with a symbol of SYMBOLS rather than with an ASCII
    letter (directly, or through one more such letter): Cyrillic `\u043c` (em, as `\u028d`,
    as small capital M), `\u0442` (te, small capital T), `\u043d`, `\u0432`, `\u043a`, Greek
    `\u03c4`, Cherokee small letters. In `jo@exa\u043cple.co\u043c` a reader sees an e-mail
    address; the letter is the symbol's letter."""
    from confusable_homoglyphs.confusables import confusables_data

    known = CONFUSABLES | SYMBOLS
    table: dict[str, str] = {}
    for _ in range(2):  # chains of two: `\u043a` -> `\u0138` (kra) -> small capital K
        for source, entries in confusables_data.items():
            if len(source) != 1 or source in known or source in table:
                continue
            if unicodedata.normalize("NFKC", source).isascii():
                continue
            for entry in entries:
                target = table.get(entry["c"]) or SYMBOLS.get(entry["c"])
                if target is not None and target.isalpha():
                    table[source] = target
                    break
    return table


CONFUSABLES.update(_drawn_as_symbols())
# Greek (and IPA) small letters UTS #39 maps to no ASCII letter (epsilon to a Latin open e,
# chi to a Latin chi, ...) that a reader takes for the Latin letter in a word of Latin ones:
# `jo@\u03b5\u03c7ample.com` reads as an e-mail address
CONFUSABLES.update({"\u03b5": "e", "\u025b": "e", "\u03c7": "x", "\u03c9": "w", "\u03b7": "n"})

# Combining marks: drawn on the character before them (Mc, spacing marks, take room of their
# own and stay)
_MARKS = frozenset(("Mn", "Me"))


@lru_cache(maxsize=65536)
def fold(ch: str) -> str:
    """The view of one non-ASCII character: "" (removed), one character, or several (an NFKD
    expansion). Cached: a text repeats few distinct characters."""
    if ch in SPACES:
        return SPACES[ch]
    if is_ignorable(ch):
        return ""
    if ch in SYMBOLS:
        return SYMBOLS[ch]
    kept = [
        c
        for c in unicodedata.normalize("NFKD", ch)
        if unicodedata.category(c) not in _MARKS and not is_ignorable(c)
    ]
    out: list[str] = []
    for c in unicodedata.normalize("NFC", "".join(kept)):
        if c.isascii():
            out.append(c)
        elif c in DOTS:
            out.append(".")
        else:
            digit = unicodedata.decimal(c, None)
            if digit is not None:
                out.append(str(digit))
            elif unicodedata.category(c) == "Pd":  # a dash the confusables leave alone (em
                out.append(CONFUSABLES.get(c, "-"))  # dash, horizontal bar, wave dash)
            else:
                out.append(CONFUSABLES.get(c, c))
    return "".join(out)


def is_mark(ch: str) -> bool:
    """A character the view drops that is not invisible: a combining mark (or a character made
    of nothing else), drawn on the character before it."""
    return not ch.isascii() and not fold(ch) and not is_ignorable(ch)


class View:
    """A text's normalised view and the map from view positions to original ones.

    `_view_at[k]` / `_orig_at[k]`: from view position `_view_at[k]` on, view characters map
    one-to-one onto original characters from `_orig_at[k]`, until the next breakpoint; an
    expansion (one original character, several view characters) is a breakpoint per view
    character, all with that character's position. No breakpoints: positions are the same."""

    __slots__ = ("_ends", "_expanded", "_orig_at", "_view_at", "original", "text")

    def __init__(
        self,
        original: str,
        text: str,
        view_at: list[int] | None = None,
        orig_at: list[int] | None = None,
        expanded: set[int] | None = None,
        ends: dict[int, int] | None = None,
    ) -> None:
        self.original = original
        self.text = text
        self._view_at = view_at or []
        self._orig_at = orig_at or []
        self._expanded = expanded or set()
        # an escape (`&#64;`) is one view character from its first original character: the
        # end of the escape, for a value that ends with it
        self._ends = ends or {}

    @property
    def identity(self) -> bool:
        """Positions in the view are positions in the original."""
        return not self._view_at

    def position(self, v: int) -> int:
        """The original position of view character `v` (0 <= v < len(text))."""
        if not self._view_at:
            return v
        k = bisect.bisect_right(self._view_at, v) - 1
        if k < 0:
            return v
        if k in self._expanded:
            return self._orig_at[k]
        return self._orig_at[k] + (v - self._view_at[k])

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of view span `[start, end)`: from the character `start` came from
        through the one `end - 1` came from (inner removed characters included), and through
        the combining marks drawn on that last character (invisible characters between them
        included; those after the last mark are not)."""
        if not self._view_at:
            return start, end
        if end <= start:
            if start >= len(self.text):
                return len(self.original), len(self.original)
            at = self.position(start)
            return at, at
        at = self.position(end - 1)
        last = self._ends.get(at, at + 1)
        original, size, j = self.original, len(self.original), last
        while j < size and not original[j].isascii() and not fold(original[j]):
            j += 1
            if is_mark(original[j - 1]):
                last = j  # drawn on the value's last character
        return self.position(start), last


_ASCII = frozenset(c for c in map(chr, range(0x80)) if not ASCII_CHANGED.match(c))


def _folded(text: str, fold: Callable[[str], str] = fold) -> View:
    """The character-by-character part of the view (`fold`). ASCII text without controls is
    its own view (two C calls); so is text whose distinct characters all fold to themselves (CJK, curly quotes, most emoji):
    `set(text)` is one C pass, and only its distinct non-ASCII characters are looked at in
    Python. Changed characters are replaced with C string calls (an accented letter becomes its
    base letter in place: no map); only removals (invisible characters, combining marks) and
    expansions cost a scan for their positions."""
    if text.isascii() and ASCII_CHANGED.search(text) is None:
        return View(text, text)
    changed: dict[str, str] = {}
    for ch in set(text).difference(_ASCII):
        folded = fold(ch)
        if folded != ch:
            changed[ch] = folded
    if not changed:
        return View(text, text)
    if len(changed) <= 16:
        view = text
        for ch, folded in changed.items():
            view = view.replace(ch, folded)
    else:
        view = text.translate({ord(ch): folded for ch, folded in changed.items()})
    resized = [ch for ch, folded in changed.items() if len(folded) != 1]
    if not resized:  # same length, characters replaced in place: positions are the same
        return View(text, view)
    view_at: list[int] = []
    orig_at: list[int] = []
    expanded: set[int] = set()
    delta = 0  # view position - original position, before the current character
    removed = "".join(re.escape(ch) for ch in resized if not changed[ch])
    grown = "".join(re.escape(ch) for ch in resized if changed[ch])
    # a run of removed characters is one step (10^6 zero-width spaces are one match, not
    # 10^6 turns of this loop); an expansion, one per character
    where = re.compile("|".join([f"[{removed}]+"] * bool(removed) + [f"[{grown}]"] * bool(grown)))
    for m in where.finditer(text):
        i = m.start()
        size = len(changed[text[i]])
        run = m.end() - i  # removals: the run's length; an expansion: 1
        vpos = i + delta
        if view_at and view_at[-1] == vpos:  # consecutive removals: the last one holds
            view_at.pop()
            orig_at.pop()
            expanded.discard(len(view_at))
        for j in range(size):  # an expansion: each of its characters comes from `i`
            expanded.add(len(view_at))
            view_at.append(vpos + j)
            orig_at.append(i)
        view_at.append(vpos + size)  # then one-to-one again, from the next character
        orig_at.append(i + run)
        delta += size - run
    return View(text, view, view_at, orig_at, expanded)


# Markup and escapes a client renders or decodes as the characters they stand for (a chat
# interface renders Markdown and HTML; a program decodes JSON and URLs): `jo&#64;example.com`,
# `jo&commat;example.com`, `jo\\u0040example.com`, `jo%40example.com`, `jo\\@example.com`,
# `5<b></b>55-123-4567`, `jo@ex**am**ple.com`, `f<!-- -->uck` show what they hide. Each is
# one alternative that starts with its own literal (the regex engine skips to those characters
# in C) and has a bounded length, so a scan is linear in the text. Decoded once, as a renderer
# does: `&amp;#64;` shows `&#64;`.
MARKUP = re.compile(
    # (a numeric reference without its `;` is decoded by browsers too: `jo&#64example.com`)
    r"&(?:#([0-9]{1,7});?|#[xX]([0-9a-fA-F]{1,6});?|([A-Za-z][A-Za-z0-9]{1,31});)"
    r"|\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x([0-9a-fA-F]{2})|([!-/:-@\[-`{-~]))"
    r"|%([2-7][0-9a-fA-F])"
    r"|<(?:/?([A-Za-z][A-Za-z0-9]{0,15})(?:[ \t\n/][^<>]{0,256})?>|!(--)[^<>]{0,256}?-->)"
    # a Markdown link shows its text: `jo@[example](https://x).com`. The opener only when its
    # text (no bracket: a scan from one `[` stops at the next) and the target follow.
    r"|\[()(?=[^\[\]\n]{0,64}\]\([^()\s]{0,256}\))|\]()\([^()\s]{0,256}\)"
    r"|\*\*?\*?|~~|``?`?"  # emphasis (no group: `lastindex` None)
)
# Every alternative starts with a literal character outside any group, so that the regex engine
# skips to those characters in C (a group around one costs that: 4 -> 35 ms per MB of prose)

# what joins the parts of a value (e-mail, phone, address), beside emphasis marks inside it
_JOINERS = frozenset("@.-_+")
# tags a renderer draws as a line break (the rest draw nothing)
_BLOCK_TAGS = frozenset(
    "br p div li ul ol tr td th table h1 h2 h3 h4 h5 h6 hr blockquote pre dt dd section".split()
)


def _decoded(m: re.Match[str]) -> str | None:
    """What one MARKUP match shows: one character, "" (nothing) or None (left as it is: an
    unknown entity, an out-of-range code point, emphasis marks at a word's edge)."""
    g = m.lastindex
    if g in (10, 11, 12):  # a comment, a Markdown link's opener and its target
        return ""
    if g is None:  # emphasis inside a word or value: `ex**am**ple`, `555-**123**-4567`; a
        # whole run (`980******@qq.com` is masked), not between two digits (`140*60*75` is a
        # product); emphasis around words (`**Title**:`) stays, as the words read the same
        text, i, j = m.string, m.start(), m.end()
        before = text[i - 1] if i else " "
        after = text[j] if j < len(text) else " "
        if text[i] in (before, after) or (before.isdigit() and after.isdigit()):
            return None
        inside = (before.isalnum() or before in _JOINERS) and (after.isalnum() or after in _JOINERS)
        return "" if inside else None
    value = m.group(g)
    if g in (1, 2, 4, 5, 6, 8):
        cp = int(value, 10 if g == 1 else 16)
        if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
            return None
        return chr(cp) if g != 8 or 0x20 <= cp < 0x7F else None
    if g == 3:
        decoded = html.entities.html5.get(value + ";")
        return decoded if decoded is not None and len(decoded) == 1 else None
    if g == 7:
        return value
    return "\n" if value.lower() in _BLOCK_TAGS else ""  # g == 9: a tag


def _unmarked(text: str) -> View | None:
    """The view with markup and escapes decoded (None: there are none), each match one view
    character from its first original character (its end in `_ends`) or none. Tags back to
    back are taken a run at a time (`_tag_run`); those that show nothing are one removal
    (removals back to back map as one)."""
    view_at: list[int] = []
    orig_at: list[int] = []
    ends: dict[int, int] = {}
    pieces: list[str] = []
    at = 0  # original text copied so far
    delta = 0  # view position - original position, after `at`
    taken = 0  # the end of the last run of tags taken whole: its tags are skipped
    for m in MARKUP.finditer(text):
        i, j = m.start(), m.end()
        if i < taken:
            continue
        if m.lastindex in (9, 10) and text.startswith("<", j):
            run = _tag_run(text, m, len(text))
            if run is not None:  # (a scan from its end finds what this one finds after it)
                taken, parts = run
                *parts, (i, j, shown) = parts
                for i0, j0, shown0 in parts:  # as below (a loop over 1-tuples costs 20 %)
                    pieces += (text[at:i0], shown0)
                    at = j0
                    vpos = i0 + delta + len(shown0)
                    if shown0:
                        ends[i0] = j0
                    if view_at and view_at[-1] == vpos:
                        view_at.pop()
                        orig_at.pop()
                    view_at.append(vpos)
                    orig_at.append(j0)
                    delta += len(shown0) - (j0 - i0)
            elif (shown := _decoded(m)) is None:
                continue
        elif (shown := _decoded(m)) is None:
            continue
        pieces += (text[at:i], shown)
        at = j
        vpos = i + delta + len(shown)  # from here on, one-to-one from `j`
        if shown:
            ends[i] = j
        if view_at and view_at[-1] == vpos:  # removals back to back: the last one holds
            view_at.pop()
            orig_at.pop()
        view_at.append(vpos)
        orig_at.append(j)
        delta += len(shown) - (j - i)
    if not pieces:
        return None
    pieces.append(text[at:])
    return View(text, "".join(pieces), view_at, orig_at, set(), ends)


# the longest markup match (a tag with its attributes, a comment); what `unfinished_markup` and
# `markup_hidden` read beyond their ends
MARKUP_MOST = 300


def markup_hidden(text: str, lo: int, hi: int) -> frozenset[int]:
    """The positions in `text[lo:hi]` that markup keeps out of the view (each escape but its
    first character, tags, comments, emphasis): what a count of view characters skips
    (`orchestrator.streaming.detector_queue`'s seam windows), so `&#x00006a;` is one character
    there as it is to the detectors. Markup that starts before `lo` or ends after `hi` counts
    too (the text around them is read, up to the longest markup): a tag cut by either end
    hides its attributes' spaces, which read as whitespace ended a seam window's walk inside a
    padded value (`jo` + `<span class="x">` x 300 + `@example.com`). Linear in `hi - lo`.
    The positions of `markup_hidden_runs`."""
    return frozenset(i for a, b in markup_hidden_runs(text, lo, hi) for i in range(a, b))


# One tag or comment exactly as MARKUP's alternative for them matches it at its `<` (the same
# pattern without its groups), and a run of them back to back: nothing follows the repeat, so
# each tag in a run is matched as a scan from its `<` matches it alone (a repeat never gives
# back a tag's characters to make the run longer). Inside a tag no `<` can occur: every `<` of
# a run begins one of its tags.
_TAG_RUN = re.compile(
    r"(?:<(?:/?[A-Za-z][A-Za-z0-9]{0,15}(?:[ \t\n/][^<>]{0,256})?>|!--[^<>]{0,256}?-->))+"
)
# a tag of a run that draws a line break (`_decoded`: its first character is shown): its name
# whole (the name is every letter and digit up to what ends it)
_BLOCK_TAG = re.compile(
    r"</?(?:" + "|".join(sorted(_BLOCK_TAGS)) + r")(?=[ \t\n/>])", re.IGNORECASE | re.ASCII
)


def markup_hidden_runs(text: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """`markup_hidden` as sorted, disjoint, non-adjacent `[start, end)` runs (a walk steps over
    each at once). A run of tags back to back (`<b>` x 10^5, minified markup) is taken a piece
    at a time in C (`_units`), and a long text's markup is scanned once (`_MarkupIndex`):
    scanned a tag at a time by each seam window's walk, a 1 MiB input of `<b>` cost 16 s of
    CPU."""
    out: list[tuple[int, int]] = []

    def hide(a: int, b: int) -> None:
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            return
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))

    pos, stop = max(0, lo - MARKUP_MOST), hi + MARKUP_MOST
    index = _index(text) if len(text) >= _INDEXED_CHARS else None
    units = _units(text, pos, stop, hi)
    while index is not None and not index.synced(text, pos):  # (see `_MarkupIndex`)
        unit = next(units, None)
        if unit is None:
            return out
        for i, j, shown in unit[2]:
            hide(i + len(shown), j)
        pos = unit[1]
    if index is not None:
        pos, found = index.hidden(pos, stop, max(pos, lo), hi)
        if found:
            hide(*found[0])  # (it may join the last run before it; those after it cannot)
            out.extend(found[1:])
        units = _units(text, pos, stop, hi)
    for _, _, decoded in units:
        for i, j, shown in decoded:
            hide(i + len(shown), j)
    return out


# the most characters of a run of tags taken in one match (`_units`)
_RUN_PIECE = 512


def _units(
    text: str, pos: int, stop: int, hi: int
) -> Iterator[tuple[int, int, list[tuple[int, int, str]]]]:
    """The MARKUP matches of a scan of `text[pos:stop]` that start before `hi`, in order, as
    `(start, end, [(start, end, what it shows) of each that shows something else])`; tags back
    to back (`_TAG_RUN`) are one, up to about _RUN_PIECE characters of them (the rest of the
    run is the next one), each stretch between their block tags one match that shows nothing,
    and the scan goes on after them, as it would have gone on after their last tag."""
    at: int | None = pos
    while at is not None:
        pos, at = at, None
        for m in MARKUP.finditer(text, pos, stop):
            start = m.start()
            if start >= hi:
                return
            if m.lastindex in (9, 10) and text.startswith("<", m.end(), stop):
                run = _tag_run(text, m, stop)
                if run is not None:
                    yield start, run[0], run[1]
                    at = run[0]
                    break
            shown = _decoded(m)
            yield start, m.end(), [] if shown is None else [(start, m.end(), shown)]


def _tag_run(text: str, m: re.Match[str], stop: int) -> tuple[int, list[Any]] | None:
    """Where the run of tags back to back that MARKUP's tag match `m` begins ends (at most
    about _RUN_PIECE characters of it, and not past `stop`: an end cuts a run between two tags,
    see `_TAG_RUN`), and its matches that show something else, `(start, end, shown)`: each
    stretch between its block tags one that shows nothing, each block tag a line break; None
    when `m` is alone."""
    start = m.start()
    run = _TAG_RUN.match(text, start, min(stop, max(start + _RUN_PIECE, m.end())))
    if run is None or run.end() <= m.end():  # (it matches `m` at least)
        return None
    end = run.end()
    parts: list[tuple[int, int, str]] = []
    for block in _BLOCK_TAG.finditer(text, start, end):
        if block.start() > start:
            parts.append((start, block.start(), ""))
        start = text.index(">", block.end()) + 1  # (no `>` inside a tag)
        parts.append((block.start(), start, "\n"))
    if end > start:
        parts.append((start, end, ""))
    return end, parts


# Texts at least this long have their markup scanned once (`_MarkupIndex`): the walks of a
# long input's seam windows read SEAM_RAW_CHARS each, both sides of each `max_chars` cut, each
# character about 40 times over
_INDEXED_CHARS = 1 << 15
# How far a MARKUP match reads from its start (a Markdown link's opener looks ahead over its
# text and target): one that starts this far before a scan's end is matched as without it
_MARKUP_READS = 1 + 64 + 2 + 256 + 1


class _MarkupIndex:
    """A whole text's markup, scanned once (`_units` from 0): each unit's `starts`/`ends`,
    whether it is tags back to back (`tags`), and what they hide as merged runs
    `hidden_starts`/`hidden_ends`.

    A scan of a stretch (`markup_hidden_runs`: from `lo - MARKUP_MOST` to `hi + MARKUP_MOST`)
    finds what the whole text's scan finds from where it looks for a match at a position the
    whole scan looked at too (`synced`: both look for the leftmost match from there, and where a
    match starts does not depend on where a scan started; every `<` among tags back to back
    begins a tag), up to where its end cuts a match's reading short, after which it scans on
    its own. So the stretch's runs are exactly those it would have scanned, at the cost of a
    look-up and the few matches at its ends."""

    __slots__ = ("ends", "hidden_ends", "hidden_starts", "starts", "tags")

    def __init__(self, text: str) -> None:
        self.starts, self.ends = array("q"), array("q")
        self.tags = bytearray()
        self.hidden_starts, self.hidden_ends = array("q"), array("q")
        hs, he = self.hidden_starts, self.hidden_ends
        for start, end, decoded in _units(text, 0, len(text), len(text)):
            self.starts.append(start)
            self.ends.append(end)
            self.tags.append(text[start] == "<" and "<" in text[start + 1 : end])
            for i, b, shown in decoded:
                a = i + len(shown)
                if a >= b:
                    continue
                if he and he[-1] >= a:
                    he[-1] = max(he[-1], b)
                else:
                    hs.append(a)
                    he.append(b)

    def _inside(self, pos: int) -> int:
        """The unit that holds `pos` after its start, or -1."""
        k = bisect.bisect_right(self.starts, pos) - 1
        return k if k >= 0 and self.starts[k] < pos < self.ends[k] else -1

    def synced(self, text: str, pos: int) -> bool:
        """The whole text's scan looked for a match at `pos` too: no unit holds it after its
        start, or it is a `<` among tags back to back."""
        k = self._inside(pos)
        return k < 0 or (self.tags[k] == 1 and text[pos] == "<")

    def hidden(self, pos: int, stop: int, lo: int, hi: int) -> tuple[int, list[tuple[int, int]]]:
        """Where a scan looking from `pos` (`synced`) to `stop` goes on looking after the units
        that it finds as the whole text's scan does (those that start early enough that `stop`
        does not cut their reading short, and a run of tags it starts in: a cut between its
        tags only ends it sooner); and what they hide in `[lo, hi)` (`lo >= pos`), as runs
        (sliced out in C: a text of `<br>` hides three characters of four)."""
        inside = self._inside(pos)
        first = bisect.bisect_left(self.starts, pos) if inside < 0 else inside
        last = bisect.bisect_left(self.starts, stop - _MARKUP_READS)
        if last <= first:
            return pos, []
        end = self.ends[last - 1]
        hi = min(hi, end)
        hs, he = self.hidden_starts, self.hidden_ends
        a, b = bisect.bisect_right(he, lo), bisect.bisect_left(hs, hi)
        found = list(zip(hs[a:b], he[a:b], strict=True))
        if found:
            found[0] = (max(found[0][0], lo), found[0][1])
            found[-1] = (found[-1][0], min(found[-1][1], hi))
        return end, found


@lru_cache(maxsize=4)
def _index(text: str) -> _MarkupIndex:
    """The index of a long text (the walks of one text's seam windows share it; a few texts
    judged at once each keep theirs)."""
    return _MarkupIndex(text)


@lru_cache(maxsize=1)
def _partial_markup() -> Any:
    import regex  # partial matching (the `re` module has none); nltk needs it too

    return regex.compile(MARKUP.pattern)


def unfinished_markup(text: str) -> int | None:
    """Where an escape or tag begins that `text` ends inside of (`...co&#10`, `5<spa`): what a
    stream cut there (a stop sequence, a token budget) would release raw, which could still
    become any character; None when the text ends outside one. Reads the last MARKUP_MOST
    characters."""
    rx = _partial_markup()
    pos = max(0, len(text) - MARKUP_MOST)
    while pos < len(text):
        m = rx.search(text, pos, partial=True)
        if m is None or m.start() == len(text):  # (the end itself: nothing begun)
            return None
        if m.partial:
            return m.start()
        pos = max(m.end(), pos + 1)
    return None


class _Composed(View):
    """Markup decoded (`outer`), then folded character by character (`inner`, on the outer
    view's text): positions and spans map through both."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, outer: View, inner: View) -> None:
        super().__init__(outer.original, inner.text)
        self._outer, self._inner = outer, inner

    @property
    def identity(self) -> bool:
        return False

    def position(self, v: int) -> int:
        return self._outer.position(self._inner.position(v))

    def span(self, start: int, end: int) -> tuple[int, int]:
        return self._outer.span(*self._inner.span(start, end))


def unmarked_view(text: str) -> View | None:
    """The view with markup and escapes left as they are (each character folded), where the
    text holds any (None: `normalise`'s view is this one). A value written beside markup can
    read as a value only so: `%555-123-4567` shows a phone number to a reader, while decoding
    `%55` (a `U`) hides it; span detectors judge both views (regex_pii._scan)."""
    if is_plain(text) or _unmarked(text) is None:
        return None
    return _folded(text)


def normalise(text: str) -> View:
    """The view of `text` (DESIGN 4.6b): markup and escapes decoded (`MARKUP`), then each
    character folded (`fold`). ASCII text without controls or markup is its own view (three C
    scans)."""
    return _view(text, fold)


def _view(text: str, fold_one: Callable[[str], str]) -> View:
    if is_plain(text):
        return View(text, text)
    outer = _unmarked(text)
    if outer is None:
        view = _folded(text, fold_one)
    else:
        inner = _folded(outer.text, fold_one)
        view = outer if inner.identity and inner.text == outer.text else _Composed(outer, inner)
    if fold_one is fold and _DASH_LIKE.search(view.text):
        view.text = _DIGIT_DASH.sub("-", view.text)  # one character for one: the map holds
    return view


# Between two digits, what East Asian keyboards give for a dash (the katakana long vowel mark,
# the ideograph one, the Hangul vowel eu after NFKD) and box-drawing lines: `555\u30fc123\u30fc4567`
# and `010\u31611234\u31615678` are phone numbers. Only between digits: elsewhere they are letters
# of words (`\u30b3\u30fc\u30d2\u30fc`) the classifiers read.
_DASH_LIKE = re.compile("[\u30fc\u4e00\u1173\u2500\u2501\u23af]")
_DIGIT_DASH = re.compile("(?<=[0-9])[\u30fc\u4e00\u1173\u2500\u2501\u23af](?=[0-9])")


@lru_cache(maxsize=65536)
def compatible(ch: str) -> str:
    """One character of `script_view`: removed when invisible (as in `fold`), whitespace as
    in `fold`, else its NFKC (full-width and mathematical forms, ligatures), its script,
    case and accents as they are."""
    if ch in SPACES:
        return SPACES[ch]
    if is_ignorable(ch):
        return ""
    return unicodedata.normalize("NFKC", ch)


def script_view(text: str) -> View:
    """The view a pattern written in the text's own script matches (`regex`'s custom
    patterns, which an operator writes as the phrase is spelt: `(?i)бомба`, `café`):
    markup decoded and invisible characters removed as in `normalise`, compatibility forms
    made plain, but letters kept in their script (the confusables folding turns Cyrillic
    о and а into Latin letters) and with their accents."""
    return _view(text, compatible)


# Bidi controls (UAX #9): what opens an embedding, an override or an isolate, and what closes
# them; paragraph separators end them all
_RLO, _LRO, _LRE, _RLE, _PDF = "\u202e", "\u202d", "\u202a", "\u202b", "\u202c"
_ISOLATES, _PDI = "\u2066\u2067\u2068", "\u2069"
_PARAGRAPH = "\n\r\x1c\x1d\x1e\x85\u2029"
_BIDI = re.compile("[" + _RLO + _LRO + _LRE + _RLE + _PDF + _ISOLATES + _PDI + _PARAGRAPH + "]")


def reversed_runs(text: str) -> list[tuple[int, int]]:
    """The stretches of `text` under a right-to-left override (`[start, end)`, controls left
    out), which a reader sees in the reverse order. A small part of UAX #9: the stack of
    explicit embeddings, overrides and isolates (their closing controls, paragraph ends); only
    an override changes the order of Latin letters and digits, which are what PII is made of
    (in right-to-left embeddings they keep their own order)."""
    runs: list[tuple[int, int]] = []
    stack = BidiStack()
    start = -1
    for m in _BIDI.finditer(text):
        i, ch = m.start(), m.group()
        if start >= 0:
            if i > start:
                runs.append((start, i))
            start = -1
        stack.step(ch)
        if stack.open and stack.open[-1] == _RLO:
            start = i + 1
    if start >= 0 and start < len(text):
        runs.append((start, len(text)))
    return runs


# UAX #9's max_depth: a control that would nest deeper is ignored (and so is the control that
# closes it). Also what keeps `open_overrides` bounded: 10^5 unclosed overrides would otherwise
# be put before every piece of the text (a quadratic amount of text for the detectors).
MAX_DEPTH = 125


class BidiStack:
    """The explicit controls open after the text read so far (UAX #9 X1-X8, without the
    levels): `open` holds at most MAX_DEPTH of them; the overflow counts stand for the ignored
    ones, which their closing controls cancel first, as the algorithm's counters do.

    One state machine for every reader of a text in pieces: a whole text's pieces
    (`open_overrides`) and a stream's chunks and windows (`read`, one piece after another, each
    character once: linear in the stream, and `opened` is bounded by MAX_DEPTH)."""

    __slots__ = ("embeddings_over", "isolates_over", "open")

    def __init__(self) -> None:
        self.open: list[str] = []
        self.embeddings_over = 0
        self.isolates_over = 0

    def copy(self) -> BidiStack:
        out = BidiStack()
        out.open = self.open.copy()
        out.embeddings_over, out.isolates_over = self.embeddings_over, self.isolates_over
        return out

    @property
    def opened(self) -> str:
        """What a piece read from here is read after: the open controls when one of them is a
        right-to-left override (the only control that changes the order of what a detector
        matches), else ""."""
        return "".join(self.open) if _RLO in self.open else ""

    def read(self, text: str, lo: int = 0, hi: int | None = None) -> None:
        """After `text[lo:hi]`. With nothing open, up to its first opening control nothing
        changes (closing controls and paragraph ends do nothing then): one C search skips it,
        so plain text (and its line breaks) costs no Python turn per control."""
        hi = len(text) if hi is None else hi
        if not self.open:  # (nothing open: no overflow either, it needs a full stack)
            first = _OPENING.search(text, lo, hi)
            if first is None:
                return
            lo = first.start()
        step = self.step
        for m in _BIDI.finditer(text, lo, hi):
            step(m.group())

    def step(self, ch: str) -> None:
        """After `ch` (one of `_BIDI`'s characters)."""
        stack = self.open
        if ch in _PARAGRAPH:
            stack.clear()
            self.embeddings_over = self.isolates_over = 0
        elif ch == _PDF:
            if self.isolates_over:
                pass
            elif self.embeddings_over:
                self.embeddings_over -= 1
            elif stack and stack[-1] not in _ISOLATES:
                stack.pop()
        elif ch == _PDI:
            if self.isolates_over:
                self.isolates_over -= 1
            else:  # the innermost isolate and all opened in it (all, when none is open)
                self.embeddings_over = 0
                while stack and stack[-1] not in _ISOLATES:
                    stack.pop()
                if stack:
                    stack.pop()
        elif len(stack) < MAX_DEPTH and not self.isolates_over and not self.embeddings_over:
            stack.append(ch)
        elif ch in _ISOLATES:
            self.isolates_over += 1
        elif not self.isolates_over:
            self.embeddings_over += 1


_OPENING = re.compile("[" + _RLO + _LRO + _LRE + _RLE + _ISOLATES + "]")


def open_overrides(text: str, positions: Sequence[int]) -> list[str]:
    """For each of `positions` (ascending), the explicit controls still open there when one of
    them is a right-to-left override (`BidiStack.opened`), else "". A piece of `text` judged
    alone (a chunk, a window) that starts inside an override is read with these put before it,
    so that its characters are in the order a reader of the whole text sees them: an override
    in an earlier sentence reverses a phone number in a later one. One scan of `text`."""
    if _RLO not in text:
        return [""] * len(positions)
    out: list[str] = []
    stack = BidiStack()
    at = 0
    for pos in positions:
        stack.read(text, at, max(at, pos))
        at = max(at, pos)
        out.append(stack.opened)
    return out


def display_order(text: str) -> tuple[str, list[int]] | None:
    """`text` in the order a reader sees it when it holds a right-to-left override, and the
    original position of each of its characters; None when it holds none (one C scan). Each
    overridden stretch is reversed in place, a character together with the combining marks and
    invisible characters after it (they stay drawn on it)."""
    if _RLO not in text:
        return None
    runs = reversed_runs(text)
    if not runs:
        return None
    order = list(range(len(text)))
    for start, end in runs:
        run = text[start:end]
        attached = "".join(c for c in set(run).difference(_ASCII) if not fold(c))
        if not attached:  # no marks: one C-speed reversal
            order[start:end] = range(end - 1, start - 1, -1)
            continue
        # clusters: a character and the marks and invisible characters after it (or a run of
        # those at the start), found by a regex rather than a Python loop per character
        cls = re.escape(attached)
        cluster = re.compile(f"[^{cls}][{cls}]*|[{cls}]+", re.DOTALL)
        spans = [m.span() for m in cluster.finditer(run)]
        order[start:end] = [start + i for s, e in reversed(spans) for i in range(s, e)]
    return "".join(text[i] for i in order), order


# a quoted attribute value of a tag (its attributes are bounded by MARKUP: linear)
_ATTRIBUTE_VALUE = re.compile(r"""=[ \t\n]*(?:"([^"]*)"|'([^']*)')""")


def markup_hidden_text(text: str) -> str:
    """What markup keeps out of the view that a model reading the raw text still reads: the
    contents of HTML comments and the values of tags' attributes that hold words (`alt`,
    `title`, ...), one line each; "" when there are none. A renderer hides them, and so does
    the view; the model a guardrail guards reads `<!-- Ignore all previous instructions -->`
    as it is. An attribute value without a space (a URL, a class name, a path) is left out:
    it holds no sentence, and a classifier reads lines of URLs as instructions (the shipped
    `prompt_injection` scored a line of GitHub links 0.47). One MARKUP scan, each match
    bounded."""
    parts: list[str] = []
    for m in MARKUP.finditer(text):
        g = m.lastindex
        if g == 9:  # a tag: its attributes' values
            for value in _ATTRIBUTE_VALUE.finditer(m.group(), m.end(9) - m.start()):
                words = (value.group(1) or value.group(2) or "").strip()
                if " " in words:
                    parts.append(words)
        elif g == 10 and m.group()[4:-3].strip():  # a comment
            parts.append(m.group()[4:-3].strip())
    return "\n".join(parts)


def view_text(text: str, *, markup: bool = True) -> str:
    """Only the view's text (what a classifier judges: its detection is the whole content).
    Under a right-to-left override, the view in the order a reader sees follows it on a line
    of its own: `\u202ekcuf` is judged as what it shows, and as what a program reads. With
    `markup` False, markup and escapes are left as they are (what `decode` searches for
    encoded payloads: Ascii85 and base85 are written with `&`, `%`, `*`, `<`, `\\`)."""
    view_of = normalise if markup else _folded
    if text.isascii() and ASCII_CHANGED.search(text) is None:
        if not markup or MARKUP.search(text) is None:
            return text
    view = view_of(text).text
    shown = display_order(text)
    return view if shown is None else f"{view}\n{view_of(shown[0]).text}"


def judged_texts(text: str) -> list[str]:
    """What a classifier judges of a content (its verdict the maximum over them): its view
    (`view_text`: under a right-to-left override, the view in the order a reader sees it on a
    second line) and, under an override, that display-order view alone as well: joined to the
    reversed line, a short instruction was half a window of gibberish (`\u202e` and the
    reversed words of one scored 0.30 where the words scored 0.76), while the reversed line
    alone reads as gibberish to the classifier in benign text too (88 of 200 everyday requests
    flagged, against 48 joined); and, where markup hides words from the view, those words
    (`markup_hidden_text`), as a text of their own, so that they cannot change how the view
    itself is windowed."""
    view = view_text(text)
    if is_plain(text) and view is text:
        return [view]
    texts = [view]
    shown = display_order(text)
    if shown is not None:
        texts.append(normalise(shown[0]).text)
    hidden = markup_hidden_text(text)
    return [*texts, normalise(hidden).text] if hidden else texts
