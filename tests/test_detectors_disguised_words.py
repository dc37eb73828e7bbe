"""Censored spellings of a swear word read back (detectors/disguised_words.py) and judged by
`profanity` (HAP) beside the text.

On 6a2408a `profanity` scored each of DISGUISED below under 0.5 (its TF-IDF tokenizer drops
single letters and cuts at symbols: `f**k` was nothing to it, `f*ck` the word `ck`, `sh!t` the
word `sh`), so an enforced `hap` let them through; and it judged none of the payloads the
injection detector decodes (a base64 or ROT13 insult, one written backwards)."""

from __future__ import annotations

import base64
import codecs
import time

import pytest

import detectors
from detectors.disguised_words import Readings, reading, segmented

WORDS = Readings(
    {"fuck": 1.0, "fucking": 1.0, "shit": 1.0, "bitch": 1.0, "asshole": 1.0, "ass": 0.99,
     "cunt": 1.0, "idiot": 0.99, "fork": 0.2, "dumbass": 0.99},
    frozenset({"you", "are", "what", "the", "fork", "and", "this", "fucking", "hello", "philosophy",
               "good", "fuck", "idiot", "ass", "bold", "cost", "is", "dumb"}),
)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("What the f**k", "What the fuck"),
        ("What the f*ck", "What the fuck"),
        ("What the f***", "What the fuck"),
        ("this is sh!t!", "this is shit!"),
        ("you a$$hole", "you asshole"),
        ("you b1tch", "you bitch"),
        ("@ss", "ass"),
        ("f u c k you", "fuck you"),
        ("f.u.c.k you", "fuck you"),
        ("f-u-c-k you", "fuck you"),
        ("f\nu\nc\nk\nyou", "fuck\nyou"),
        ("f u c k y o u", "fuck you"),
        ("f u u u c k", "fuck"),
        ("i d i 0 t", "idiot"),
        ("a r*t*rd", None),  # (`r` is no lone letter: no run)
        ("a s.h.i.t", "a shit"),
        ("an I D I O T!!!", "an idiot!!!"),  # (the marks after it are punctuation)
        ("you'r e", None),  # (`'r` ends a word: no lone letter)
        ("1 2 3 go", None),
        ("a f u c k i n g idiot", "a fucking idiot"),
        ("fuuuuuck you", "fuck you"),
        ("shiiiiit", "shit"),
        ("fukk", None),  # `fuk` is no word of WORDS
        ("phuck you", "fuck you"),
        ("shyt", "shit"),
        ("kunt", "cunt"),
        ("fvck", "fuck"),
        ("fu.ck you", "fuck you"),
        ("sh-it", "shit"),
        ("dumb-ass", None),  # (both parts are words as they stand)
        ("kcuf you", "fuck you"),
        ("gnikcuf", "fucking"),
    ],
)
def test_a_disguised_word_reads_as_the_worst_word_it_can_stand_for(
    text: str, read: str | None
) -> None:
    assert reading(text, WORDS) == read


@pytest.mark.parametrize(
    "text",
    [
        "2*3 = 6 and 10*20",
        "Use **bold** and *italics*.",
        "It costs $5 or 4k, on 1st May at 7am.",
        "Write to jo@example.com",
        "Hello, philosophy is good.",
        "sooooo good",
        "the fork",
        "f**x",  # fits no word
        "",
    ],
)
def test_ordinary_text_reads_as_it_stands(text: str) -> None:
    assert reading(text, WORDS) is None


def test_a_word_as_it_stands_is_never_read_as_another() -> None:
    """`fork` is a word: not read as `fuck`, whatever the sounds or stars allow."""
    assert reading("pass the fork", WORDS) is None
    assert reading("pass the f**k", WORDS) == "pass the fuck"  # the worst reading of a disguise


def test_spaced_letters_are_segmented_into_the_fewest_words() -> None:
    assert segmented("whatthefuck", WORDS) == "what the fuck"
    assert segmented("fuuk", WORDS) == "fuuk"  # a piece is no word: one token, read as such


def test_reading_a_hostile_text_is_linear() -> None:
    """Every scan starts where a run of its characters starts, and a token is compared with the
    words of its own length and first letter: long runs that almost match (100,000 letters
    without a mark, letters one apart, marks without a word, lone digits) are read in one
    pass, well inside a generous deadline (a scan quadratic in a run takes minutes)."""
    text = "a" * 100_000 + " " + "f u " * 20_000 + "x*" * 50_000 + " " + "1 " * 20_000
    t0 = time.monotonic()
    assert reading(text, WORDS) is not None  # (`f u f u ...` joined)
    assert time.monotonic() - t0 < 5.0


# -- `profanity`, the shipped model ------------------------------------------------------------

DISGUISED = [
    "What the f*ck is this",
    "What the f**k is this",
    "What the f*** is this",
    "This is sh!t.",
    "You are an a$$hole.",
    "Shut up b1tch",
    "f u c k off",
    "f.u.c.k off",
    "f\nu\nc\nk\noff",
    "fuuuuuck off",
    "phuck off",
    "What the f\u03c5\u0441\u03ba",  # Greek upsilon and kappa, Cyrillic es
    base64.b64encode(b"You are a stupid fucking idiot").decode(),
    codecs.encode("You are a stupid fucking idiot and a moron", "rot13"),
    "toidi gnikcuf diputs a era uoY",
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def _scores(texts: list[str]) -> list[float]:
    det = detectors.build("profanity", {"min_score": 0.0})
    try:
        return [d[0].score if d else 0.0 for d in await det.detect(texts)]
    finally:
        await det.close()


@pytest.mark.parametrize("text", DISGUISED)
async def test_profanity_flags_a_disguised_swear_word(text: str) -> None:
    (score,) = await _scores([text])
    assert score >= 0.5, text


async def test_profanity_does_not_flag_ordinary_text_with_marks_inside_words() -> None:
    benign = [
        "Multiply 2*3 and 4*5, then add $10.",
        "Use **bold** for the title and *italics* for the rest.",
        "The S.H.I.E.L.D. agents met at 7am on the 1st.",
        "I O U five dollars.",
        "That was sooooo good, thank you!",
        "Philosophy and physics are my favourite subjects.",
        "Email jo@example.com or call 555-123-4567.",
        "Set PATH=$HOME/bin:$PATH and run ./build.sh",
    ]
    assert [s < 0.5 for s in await _scores(benign)] == [True] * len(benign)
