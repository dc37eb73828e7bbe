"""The normalised view every built-in detector judges (DESIGN 4.6b), and its map back.

Hostile text hides PII from an ASCII pattern without changing what a reader sees:
`jo\\u200b@example.com` (a zero-width space), `jo@exam\\u00adple.com` (a soft hyphen),
`５５５-１２３-４５６７` (full-width digits), `jо@example.com` (a Cyrillic о), `123\\u201145\\u20116789`
(non-breaking hyphens). The view undoes that, one original character at a time:

- default-ignorable code points (Unicode's Default_Ignorable_Code_Point: zero-width spaces and
  joiners, soft hyphen, word joiner, bidi controls, variation selectors, Hangul fillers, tags)
  and every other format character (category Cf) are removed;
- the rest is NFKC-normalised (full-width and mathematical forms, ligatures, non-breaking
  spaces); decimal digits of any script become ASCII digits;
- what is still non-ASCII and is a confusable of an ASCII character in Unicode's confusables
  data (UTS #39, as shipped by the `confusable-homoglyphs` package: Cyrillic and Greek
  homoglyphs, dashes and hyphens, ...) becomes that ASCII character.

Each view character comes from exactly one original character (an NFKC expansion such as
`™` -> `TM` gives several view characters from one), so a view span `[s, e)` maps back to the
original characters from the one view character `s` came from through the one `e - 1` came
from: the invisible characters *inside* a value are in its original span (block and redact cover
them), those before or after it are not.

Folding is per character (NFKC of each character on its own, which is what the patterns need:
they are ASCII). It is cached per distinct character, and ASCII text, which cannot hold any of
these characters, is its own view at the cost of one `str.isascii()`.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from functools import lru_cache

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


def is_ignorable(ch: str) -> bool:
    """Default-ignorable or a format character: removed from the view."""
    cp = ord(ch)
    if unicodedata.category(ch) == "Cf":
        return True
    return any(lo <= cp <= hi for lo, hi in _IGNORABLE_RANGES)


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


@lru_cache(maxsize=65536)
def fold(ch: str) -> str:
    """The view of one non-ASCII character: "" (removed), one character, or several (an NFKC
    expansion). Cached: a text repeats few distinct characters."""
    if is_ignorable(ch):
        return ""
    out: list[str] = []
    for c in unicodedata.normalize("NFKC", ch):
        if c.isascii():
            out.append(c)
        elif is_ignorable(c):
            continue
        else:
            digit = unicodedata.decimal(c, None)
            out.append(str(digit) if digit is not None else CONFUSABLES.get(c, c))
    return "".join(out)


class View:
    """A text's normalised view and the map from view positions to original ones.

    `_view_at[k]` / `_orig_at[k]`: from view position `_view_at[k]` on, view characters map
    one-to-one onto original characters from `_orig_at[k]`, until the next breakpoint; an
    expansion (one original character, several view characters) is a breakpoint per view
    character, all with that character's position. No breakpoints: positions are the same."""

    __slots__ = ("_expanded", "_orig_at", "_view_at", "original", "text")

    def __init__(
        self,
        original: str,
        text: str,
        view_at: list[int] | None = None,
        orig_at: list[int] | None = None,
        expanded: set[int] | None = None,
    ) -> None:
        self.original = original
        self.text = text
        self._view_at = view_at or []
        self._orig_at = orig_at or []
        self._expanded = expanded or set()

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
        through the one `end - 1` came from (inner removed characters included)."""
        if not self._view_at:
            return start, end
        if end <= start:
            if start >= len(self.text):
                return len(self.original), len(self.original)
            at = self.position(start)
            return at, at
        return self.position(start), self.position(end - 1) + 1


_ASCII = frozenset(map(chr, range(0x80)))


def normalise(text: str) -> View:
    """The view of `text` (DESIGN 4.6b). ASCII text is its own view (one C call); so is text
    whose distinct characters all fold to themselves (accents, CJK, curly quotes, most emoji):
    `set(text)` is one C pass, and only its distinct non-ASCII characters are looked at in
    Python. Changed characters are replaced with C string calls; only removals and expansions
    cost a scan for their positions."""
    if text.isascii():
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
    where = re.compile("[" + "".join(re.escape(ch) for ch in resized) + "]")
    for m in where.finditer(text):
        i = m.start()
        size = len(changed[text[i]])
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
        orig_at.append(i + 1)
        delta += size - 1
    return View(text, view, view_at, orig_at, expanded)


def view_text(text: str) -> str:
    """Only the view's text (what a classifier judges: its detection is the whole content)."""
    return text if text.isascii() else normalise(text).text
