"""Issue 20, item 3: built-in detectors judge the normalised view (DESIGN 4.6b) and report spans
in the original text.

First the attacks that passed a blocking `pii` (each must now be found, its span covering exactly
the characters the client sent, invisible ones inside it included), then the view itself (what
is removed, folded, expanded; the map back), a hypothesis property (inserting default-ignorable
characters inside a PII value, or writing its characters in full-width or confusable forms,
never hides it, and the span is exactly the value), the classifiers judging the view, and the
attack end to end: FMS input detection with a blocking `pii` refuses `jo\\u200b@example.com`.
"""

from __future__ import annotations

import asyncio
import html.entities
import string
import unicodedata
from typing import Any

import pytest
from detectors_support import ANCHORS, expected_probs, shared_anchor_classifier
from hypothesis import given, settings
from hypothesis import strategies as st

import detectors
from detectors.normalise import (
    CONFUSABLES,
    SYMBOLS,
    fold,
    markup_hidden,
    normalise,
    view_text,
    visible,
)
from detectors.regex_pii import find_pii
from orchestrator.app import CONTENT_PATH
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    SCRIPT,
    Orchestrator,
    frames,
    generation_body,
    native_config,
    terminal,
)

KINDS = ["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]


def pii(text: str) -> list[tuple[int, int, str, str]]:
    return [(d.start, d.end, d.detection, d.text) for d in find_pii(text, KINDS, {})]


# (text, [(start, end, kind)]): the attacks of issue 20 and their relatives
ATTACKS = [
    ("jo\u200b@example.com", [(0, 15, "email")]),  # zero-width space
    ("jo@exam\u00adple.com", [(0, 15, "email")]),  # soft hyphen
    ("Call \uff15\uff15\uff15-\uff11\uff12\uff13-\uff14\uff15\uff16\uff17", [(5, 17, "phone")]),
    ("jo\uff20example.com", [(0, 14, "email")]),  # full-width @
    ("jo\u2060@example.com", [(0, 15, "email")]),  # word joiner
    ("j\u043e@\u0435\u0445\u0430mple.com", [(0, 14, "email")]),  # Cyrillic о, е, х, а
    ("card 4111\u200b1111\u200b1111\u200b1111 ok", [(5, 24, "credit_card")]),
    ("ssn 123\u201145\u20116789.", [(4, 15, "ssn")]),  # non-breaking hyphens
    ("jo\u200c@exa\u200dmple.com", [(0, 16, "email")]),  # ZWNJ, ZWJ
    ("jo\u202e@example.com\u202c", [(0, 15, "email")]),  # bidi override: inside, then outside
    ("\u200bjo@example.com\u200b", [(1, 15, "email")]),  # invisible edges are not the value
    ("ip 192\uff0e168\uff0e0\uff0e1", [(3, 14, "ipv4")]),  # full-width full stops
    ("tel \u0665\u0665\u0665-\u0661\u0662\u0663-\u0664\u0665\u0666\u0667", [(4, 16, "phone")]),
]


@pytest.mark.parametrize(("text", "want"), ATTACKS)
def test_invisible_and_look_alike_characters_do_not_hide_pii(
    text: str, want: list[tuple[int, int, str]]
) -> None:
    assert pii(text) == [(s, e, kind, text[s:e]) for s, e, kind in want]


async def test_the_regex_detector_reports_original_spans_inline_and_in_its_thread() -> None:
    """Short contents are scanned on the loop, long ones in the scan thread: both map back."""
    det = detectors.build("regex", {})
    short = "Mail jo\u200b@example.com now."
    long = "x" * 2000 + " " + short
    got = await det.detect([short, long])
    assert [(d.start, d.end, d.text) for d in got[0]] == [(5, 20, "jo\u200b@example.com")]
    assert [(d.start, d.end, d.text) for d in got[1]] == [(2006, 2021, "jo\u200b@example.com")]


def test_custom_patterns_judge_the_view_too() -> None:
    det = detectors.build("regex", {"kinds": [], "patterns": {"order": r"ORD-[0-9]{4}"}})
    got = asyncio.run(det.detect(["ref \uff2f\uff32\uff24-12\u200b34"]))[0]
    assert [(d.start, d.end, d.detection) for d in got] == [(4, 13, "order")]


# --- the view -------------------------------------------------------------------------------


def test_ascii_is_its_own_view_with_no_map() -> None:
    view = normalise("plain jo@example.com")
    assert view.text == "plain jo@example.com" and view.identity


def test_text_that_folds_to_itself_is_its_own_view() -> None:
    text = "\u201cquoted\u201d \u4f60\u597d \U0001f600 \uac00"
    view = normalise(text)
    assert view.text == text and view.identity


def test_east_asian_dashes_are_dashes_between_digits_only() -> None:
    """A katakana long vowel mark, the ideograph one, the Hangul vowel eu and box-drawing
    lines between digits are a phone number's dashes; in a word they stay letters."""
    text = "\u30b3\u30fc\u30d2\u30fc 03\u30fc1234\u30fc5678 010\u31611234\u31615678 5\u25005"
    view = normalise(text)
    assert view.text == "\u30b3\u30fc\u30d2\u30fc 03-1234-5678 010-1234-5678 5-5"
    assert view.span(5, 17) == (5, 17)


def test_precomposed_accents_fold_in_place() -> None:
    """An accented letter is its base letter plus a mark after NFKD (issue 32, item 6): one
    character for one, so positions stay the same."""
    view = normalise("caf\u00e9 \u00e0 la cr\u00e8me")
    assert view.text == "cafe a la creme" and view.identity


@pytest.mark.parametrize(
    ("char", "folded"),
    [
        ("\u200b", ""),
        ("\u200c", ""),
        ("\u200d", ""),
        ("\u2060", ""),
        ("\u00ad", ""),
        ("\ufeff", ""),
        ("\u202e", ""),
        ("\u2066", ""),
        ("\u034f", ""),
        ("\ufe0f", ""),
        ("\U000e0041", ""),  # tag latin capital a
        ("\u3164", ""),  # Hangul filler
        ("\uff20", "@"),
        ("\uff15", "5"),
        ("\u0665", "5"),  # Arabic-Indic five
        ("\u2011", "-"),
        ("\u2212", "-"),
        ("\u0430", "a"),
        ("\u0435", "e"),
        ("\u043e", "o"),
        ("\u0440", "p"),
        ("\u0455", "s"),
        ("\u03bf", "o"),  # Greek omicron
        # confusable with a small capital (UTS #39), directly or through another letter
        ("\u043c", "m"),  # Cyrillic em: turned w, small capital M
        ("\u0442", "t"),  # Cyrillic te: small capital T
        ("\u043a", "k"),  # Cyrillic ka: kra, small capital K
        ("\u03c4", "t"),  # Greek tau
        ("\u03b5", "e"),  # Greek epsilon (UTS #39: a Latin open e, itself no ASCII letter)
        ("\u03c7", "x"),  # Greek chi
        ("\u00a0", " "),
        ("\u2122", "TM"),
        ("\u00e9", "e"),  # e and a combining acute after NFKD: the mark is dropped
        ("\u0301", ""),  # combining acute
        ("\u0332", ""),  # combining low line
        ("\u20e3", ""),  # combining enclosing keycap (Me)
        ("\u0451", "e"),  # Cyrillic yo: Cyrillic ie and a diaeresis, then the confusable
        ("\uac00", "\uac00"),  # a Hangul syllable decomposes into letters, recomposed
        ("\u3002", "."),  # ideographic full stop
        ("\uff61", "."),  # half-width ideographic full stop
        ("\u00b7", "."),  # middle dot
        ("\u06d4", "."),  # Arabic full stop
        ("\u4f60", "\u4f60"),
        # control, private-use and unassigned characters are drawn as nothing (issue: redtext)
        ("\x00", ""),
        ("\x07", ""),
        ("\x1b", ""),
        ("\x7f", ""),
        ("\x9b", ""),  # C1 control sequence introducer
        ("\ue000", ""),  # private use
        ("\U000f0000", ""),  # supplementary private use
        ("\U000e0080", ""),  # unassigned (in the tags block)
        # whitespace controls are the whitespace they show as; a tab stays a tab (table cells)
        ("\t", "\t"),
        ("\n", "\n"),
        ("\x0b", "\n"),
        ("\x0c", "\n"),
        ("\x85", "\n"),
        ("\u2028", "\n"),
        ("\u2029", "\n"),
        ("\u2800", " "),  # Braille pattern blank
        # a bracketed or stopped digit, number or letter is what it draws, not its NFKD
        ("\u2478", "5"),  # parenthesized digit five: (5)
        ("\u247d", "10"),  # parenthesized number ten: (10)
        ("\u248c", "5"),  # digit five full stop: 5.
        ("\U0001f106", "5"),  # digit five comma: 5,
        ("\u24a5", "j"),  # parenthesized latin small letter j: (j)
        ("\U0001f119", "J"),  # parenthesized latin capital letter j: (J)
        ("\u24eb", "11"),  # negative circled number eleven
        # dashes the confusables data leaves alone
        ("\u2014", "-"),  # em dash
        ("\u2015", "-"),  # horizontal bar
        ("\u2e3a", "-"),  # two-em dash
        ("\u301c", "-"),  # wave dash
        ("\u058a", "-"),  # Armenian hyphen
        ("\u1400", "="),  # Canadian syllabics hyphen: drawn as `=`, as UTS #39 says
        # symbols drawn as Latin letters and digits
        ("\U0001f175", "F"),  # negative squared latin capital letter f
        ("\U0001f155", "F"),  # negative circled latin capital letter f
        ("\U0001f1eb", "F"),  # regional indicator symbol letter f
        ("\ua730", "f"),  # latin letter small capital f
        ("\u1d1c", "u"),  # latin letter small capital u
        ("\u0262", "g"),  # latin letter small capital g
        ("\u278e", "5"),  # dingbat negative circled sans-serif digit five
        ("\u2776", "1"),  # dingbat negative circled digit one
        ("\u24f5", "1"),  # double circled digit one
        # digits of scripts without positional numerals stay
        ("\u136d", "\u136d"),  # Ethiopic digit five
        ("\U00011056", "\U00011056"),  # Brahmi number five
    ],
)
def test_fold(char: str, folded: str) -> None:
    assert fold(char) == folded


@pytest.mark.parametrize(
    ("text", "view"),
    [
        ("jo&#64;example.com", "jo@example.com"),
        ("jo&#x40;example.com", "jo@example.com"),
        ("jo&#64example.com", "jo@example.com"),  # browsers decode it without its `;` too
        ("jo&#8203;@example.com", "jo@example.com"),  # a reference to an invisible character
        ("jo&commat;example&period;com", "jo@example.com"),
        ("jo\\u0040example.com", "jo@example.com"),
        ("jo\\x40example.com", "jo@example.com"),
        ("jo%40example%2Ecom", "jo@example.com"),
        ("jo\\@example\\.com", "jo@example.com"),  # Markdown escapes
        ("5<b></b>55-<i>123</i>-4567", "555-123-4567"),
        ('5<span class="x">55', "555"),
        ("555<br>123<br/>4567", "555\n123\n4567"),  # a line break stays one
        ("f<!-- -->uck", "fuck"),
        ("jo@ex**am**ple.com", "jo@example.com"),  # emphasis inside a value
        ("555-**123**-4567", "555-123-4567"),
        ("jo@ex`am`ple.com", "jo@example.com"),
        ("jo@[example](https://x.org/a_b).com", "jo@example.com"),  # a Markdown link
        ("see [1] and [the docs](https://x.org)", "see [1] and the docs"),
        ("&#65313;", "A"),  # decoded, then folded (a full-width A)
        # decoded once, as a renderer does
        ("&amp;#64;", "&#64;"),
        # what stays: emphasis around words, between digits (a product) or in a masked value;
        # unknown entities, out-of-range references, comparisons, a lone percent sign
        ("**Title**: x", "**Title**: x"),
        ("140*60*75 cm", "140*60*75 cm"),
        ("980******@qq.com", "980******@qq.com"),
        ("5 * 3 = 15", "5 * 3 = 15"),
        ("&nope; &#99999999; &#xD800;", "&nope; &#99999999; &#xD800;"),
        ("a < b and c > d", "a < b and c > d"),
        ("50% off", "50% off"),
    ],
)
def test_markup_and_escapes_show_what_they_stand_for(text: str, view: str) -> None:
    assert normalise(text).text == view


def test_a_value_ending_in_an_escape_covers_the_whole_escape() -> None:
    """The escape is one view character from its first original one: a value that ends with
    it covers it through its `;` (else `#109;` would be released beside the mask)."""
    text = "Mail jo@example.co&#109; now"
    assert pii(text) == [(5, 24, "email", "jo@example.co&#109;")]


def test_removals_and_expansions_map_back_character_by_character() -> None:
    text = "a\u2122b\u200b\u200bc\u00add"
    view = normalise(text)
    assert view.text == "aTMbcd"
    assert [view.position(v) for v in range(len(view.text))] == [0, 1, 1, 2, 5, 7]
    assert view.span(1, 2) == (1, 2)  # "T" is the whole ™
    assert view.span(2, 4) == (1, 3)  # "Mb": from the ™ through b
    assert view.span(3, 6) == (2, 8)  # "bcd": the invisible characters inside, included
    assert view.span(6, 6) == (8, 8)


def test_a_lone_surrogate_passes_through() -> None:
    assert normalise("jo@example.com \ud800").text == "jo@example.com \ud800"
    assert pii("jo@example.com \ud800") == [(0, 14, "email", "jo@example.com")]


def test_classifiers_see_the_view() -> None:
    assert view_text("f\u200buck y\u043eu") == "fuck you"
    assert view_text("plain") == "plain"


async def test_profanity_scores_the_view_not_the_disguise() -> None:
    det = detectors.build("profanity", {"min_score": 0.0})
    plain, hidden = await det.detect(
        ["you stupid fucking idiot", "you st\u200bupid f\u200bucking \u0456diot"]
    )
    assert hidden[0].score == pytest.approx(plain[0].score)
    assert (hidden[0].start, hidden[0].end) == (0, 26)  # the whole original content


async def test_hf_classifier_windows_read_the_view_and_map_back() -> None:
    """Zero-width spaces inside a sentence would change its word pieces (and its window): the
    model reads the view, and the window's span covers the original characters."""
    det = detectors.build(
        "hf_classifier",
        {
            "model_path": str(shared_anchor_classifier()),
            "safe_labels": ["safe"],
            "max_length": 12,
            "stride": 0,
        },
    )
    sports = ANCHORS["sports"].replace("football", "foot\u200bball").replace("won", "w\u00adon")
    text = " ".join([ANCHORS["safe"], sports, ANCHORS["safe"]])
    (found,) = await det.detect([text])
    start = text.index(sports)
    assert [(d.detection, d.start, d.end, d.text) for d in found] == [
        ("sports", start, start + len(sports), sports)
    ]
    assert found[0].score == pytest.approx(expected_probs("sports")["sports"], abs=1e-4)
    assert found[0].metadata == {"windows": 3, "window": 1}


# --- the property ---------------------------------------------------------------------------

IGNORABLES = [
    "\u200b",
    "\u200c",
    "\u200d",
    "\u2060",
    "\u00ad",
    "\ufeff",
    "\u202a",
    "\u202c",
    "\u202e",
    "\u2066",
    "\u2069",
    "\u180e",
    "\u034f",
    "\ufe0f",
    "\U000e0020",
    "\x00",
    "\x07",
    "\x1b",
    "\x7f",
    "\x9b",
    "\ue000",
    "\U000f0000",
]
# every non-ASCII form the view folds back to each ASCII character: full-width (NFKC), the
# confusables data, other scripts' decimal digits, dashes, circled digits and small capitals
LOOK_ALIKES: dict[str, list[str]] = {}
for _source, _target in CONFUSABLES.items():
    if fold(_source) == _target:
        LOOK_ALIKES.setdefault(_target, []).append(_source)
for _cp in range(0x21, 0x7F):
    LOOK_ALIKES.setdefault(chr(_cp), []).append(chr(_cp + 0xFEE0))
for _cp in range(0x80, 0x10000):
    _digit = unicodedata.decimal(chr(_cp), None)
    if _digit is not None and fold(chr(_cp)) == str(_digit):
        LOOK_ALIKES.setdefault(str(_digit), []).append(chr(_cp))

for _cp in range(0x80, 0x110000):  # dashes of every kind
    if unicodedata.category(chr(_cp)) == "Pd" and fold(chr(_cp)) == "-":
        LOOK_ALIKES["-"].append(chr(_cp))
for _source, _target in SYMBOLS.items():  # circled digits, small capitals
    LOOK_ALIKES.setdefault(_target, []).append(_source)

VALUES = st.one_of(
    st.tuples(
        st.from_regex(r"[a-z][a-z0-9]{0,8}@[a-z]{1,8}\.(com|org|net)", fullmatch=True),
        st.just("email"),
    ),
    st.tuples(st.from_regex(r"[2-9][0-9]{2}-[0-9]{3}-[0-9]{4}", fullmatch=True), st.just("phone")),
    st.tuples(st.sampled_from(["123-45-6789", "078 05 1120", "219-09-9999"]), st.just("ssn")),
    st.tuples(
        st.sampled_from(["4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005"]),
        st.just("credit_card"),
    ),
    st.tuples(st.sampled_from(["192.168.0.1", "10.20.30.40", "8.8.4.4"]), st.just("ipv4")),
)


@st.composite
def disguised(draw: Any) -> tuple[str, str, str]:
    """(plain value, its disguise, kind): some characters replaced by look-alikes, then
    default-ignorable characters inserted between characters (never before the first or after
    the last: those are outside the value, and outside its span)."""
    plain, kind = draw(VALUES)
    chars = list(plain)
    for i in draw(st.sets(st.integers(0, len(chars) - 1), max_size=len(chars))):
        forms = LOOK_ALIKES.get(chars[i])
        if forms:
            chars[i] = draw(st.sampled_from(forms))
    gaps = draw(st.lists(st.integers(1, len(chars) - 1), max_size=6))
    for gap in sorted(gaps, reverse=True):
        chars.insert(gap, "".join(draw(st.lists(st.sampled_from(IGNORABLES), min_size=1))))
    return plain, "".join(chars), kind


# markup a renderer or a program decodes (DESIGN 4.6b): each character written as an escape, and
# markup that draws nothing between characters
_ENTITIES: dict[str, list[str]] = {}
for _name, _value in html.entities.html5.items():
    if _name.endswith(";") and len(_value) == 1 and _value.isascii():
        _ENTITIES.setdefault(_value, []).append(f"&{_name}")


def escapes(ch: str) -> list[str]:
    """Every escape the view decodes back to `ch`."""
    cp = ord(ch)
    out = [f"&#{cp};", f"&#x{cp:x};", f"&#X{cp:04X};", f"\\u{cp:04x}", f"\\x{cp:02x}"]
    out += [f"%{cp:02X}", f"%{cp:02x}", *_ENTITIES.get(ch, [])]
    if ch in string.punctuation:
        out.append("\\" + ch)  # a Markdown escape
    return out


MARKUP_NOTHING = ["<b></b>", "</i>", '<span class="x">', "<!-- -->", "<!--x-->", "<wbr>", "[](x)"]


@st.composite
def marked_up(draw: Any) -> tuple[str, str, str]:
    """(plain value, its disguise, kind): some characters escaped, and markup that draws
    nothing inserted between characters."""
    plain, kind = draw(VALUES)
    chars = list(plain)
    for i in draw(st.sets(st.integers(0, len(chars) - 1), max_size=len(chars))):
        chars[i] = draw(st.sampled_from(escapes(chars[i])))
    gaps = draw(st.lists(st.integers(1, len(chars) - 1), max_size=4))
    for gap in sorted(gaps, reverse=True):
        chars.insert(gap, draw(st.sampled_from(MARKUP_NOTHING)))
    return plain, "".join(chars), kind


@settings(max_examples=300, deadline=None)
@given(marked_up(), st.sampled_from(["", "Contact: ", "\u00e9t\u00e9 <b>\u200b"]))
def test_no_markup_hides_pii_and_the_span_is_exactly_the_value(
    case: tuple[str, str, str], prefix: str
) -> None:
    plain, value, kind = case
    text = f"{prefix}{value} thanks."
    start = len(prefix)
    want = (start, start + len(value), kind, value)
    assert want in pii(text), (plain, value)
    assert normalise(value).text == plain


PIECES = [
    "a",
    "5",
    "@",
    ".",
    " ",
    "\n",
    "\t",
    "&#64;",
    "&amp;",
    "&nope;",
    "&#99999999;",
    "\\u0040",
    "\\",
    "%40",
    "%",
    "<b>",
    "</b>",
    "<br>",
    "<",
    ">",
    "<!-- -->",
    "**",
    "*",
    "~~",
    "`",
    "\u200b",
    "\u0301",
    "\u2122",
    "\uff20",
    "\x07",
    "\u2014",
    "\u278e",
    "\U0001f1eb",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40))
def test_every_view_span_maps_inside_the_text_in_order(pieces: list[str]) -> None:
    """The map back stays exact whatever mix of markup, escapes and characters: every view
    character comes from an original one, in order, and every span is inside the text."""
    text = "".join(pieces)
    view = normalise(text)
    at = [view.position(v) for v in range(len(view.text))]
    assert at == sorted(at) and all(0 <= a < len(text) for a in at)
    for s in range(len(view.text) + 1):
        for e in (s, min(len(view.text), s + 1), len(view.text)):
            a, b = view.span(s, e)
            assert 0 <= a <= b <= len(text), (text, s, e)
            if e > s:
                assert a == at[s] and b > at[e - 1]


@settings(max_examples=300, deadline=None)
@given(disguised(), st.sampled_from(["", "Contact: ", "\u00e9t\u00e9 \u200b"]))
def test_no_disguise_hides_pii_and_the_span_is_exactly_the_value(
    case: tuple[str, str, str], prefix: str
) -> None:
    plain, value, kind = case
    text = f"{prefix}{value} thanks."
    start = len(prefix)
    want = (start, start + len(value), kind, value)
    assert want in pii(text), (plain, value)
    assert normalise(value).text == plain


# --- end to end -----------------------------------------------------------------------------


async def test_a_blocking_pii_refuses_a_disguised_email_and_reports_its_original_span() -> None:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    dets = {"pii": {"builtin": "regex", "chunker_id": "sentence"}}
    inputs = "Write to jo\u200b@exam\u00adple.com or call \uff15\uff15\uff15-\uff11\uff12\uff13-\uff14\uff15\uff16\uff17."
    try:
        async with Orchestrator(native_config(engine.url, detectors=dets)) as orch:
            events = await orch.stream(generation_body(inputs, input={"pii": {}}))
            found = frames(events)[0]["token_classification_results"]["input"]
            assert [(d["start"], d["end"], d["word"], d["entity"]) for d in found] == [
                (9, 25, "jo\u200b@exam\u00adple.com", "email"),
                (34, 46, inputs[34:46], "phone"),
            ]
            assert terminal(events).name == "incomplete"
            assert engine.requests == []  # the model was never called
            status, body = await orch.post(
                CONTENT_PATH, {"content": inputs, "detectors": {"pii": {}}}
            )
            assert status == 200
            assert [(d["start"], d["end"], d["text"]) for d in body["detections"]] == [
                (9, 25, "jo\u200b@exam\u00adple.com"),
                (34, 46, inputs[34:46]),
            ]
    finally:
        await engine.close()


def test_markup_hidden_sees_a_tag_that_either_end_cuts() -> None:
    """A seam window's walk reads `markup_hidden` from where its raw bound falls; on 4bc51b7 a
    tag cut there was no markup, so the space between its attributes read as whitespace and
    ended the walk inside a padded value (`jo` + `<span class="x">` x 700 + `@example.com`
    went out raw)."""
    text = 'jo<span class="x">@example.com'
    tag = range(text.index("<"), text.index(">") + 1)
    space = text.index(" ")
    assert markup_hidden(text, 0, len(text)) == frozenset(tag)
    assert markup_hidden(text, space - 2, len(text)) == frozenset(range(space - 2, tag.stop))
    assert markup_hidden(text, 0, space + 2) == frozenset(range(tag.start, space + 2))
    assert markup_hidden(text, space - 1, space + 1) == {space - 1, space}


def test_visible_drops_only_what_a_reader_never_sees() -> None:
    """A judge model's view (`visible`): invisible, format, control (whitespace aside),
    private-use and unassigned characters go; every script, accent, confusable and markup stays
    as written (the built-in detectors' folding would turn Russian into mixed-script noise)."""
    assert visible("How do I build a b\u200bo\u2060m\ufeffb?") == "How do I build a bomb?"
    assert visible("f\x07u\u00adck\ue000 it") == "fuck it"
    assert visible("Привет, мир. Ça va?\tOui\n") == "Привет, мир. Ça va?\tOui\n"
    assert visible("jo&#64;example.com \uff21") == "jo&#64;example.com \uff21"
    plain = "The sky is blue."
    assert visible(plain) is plain


@given(st.text(), st.text())
@settings(max_examples=200, deadline=None)
def test_visible_reads_a_text_in_chunks_as_whole(a: str, b: str) -> None:
    """Character by character: a stream judged chunk after chunk (the engine judge's appends)
    reads as the whole text would, and the result is its own view."""
    assert visible(a + b) == visible(a) + visible(b)
    assert visible(visible(a)) == visible(a)
