"""The sentence chunker: NLTK Punkt's boundaries (checked against `span_tokenize`), exact
results on the classic hard cases, early emission, the max_chars safety cut, bounded buffers."""

from __future__ import annotations

import sys

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
from test_chunkers import ATOMS, feed_all, texts, trim_min

import chunkers
from chunkers import Span
from chunkers import punkt_stream as ps
from chunkers.punkt_stream import TOKENIZER

SENTENCE = chunkers.build({"type": "sentence"})
#: NLTK's tokenizer as shipped (its patterns behind nltk.redos' timeout wrapper), with the same
#: English parameters: the reference the chunker, whose tokenizer unwraps them, must equal.
STOCK = PunktSentenceTokenizer(TOKENIZER._params)
UNLIMITED = chunkers.SentenceChunker(max_chars=sys.maxsize)


def sentences(text: str, chunker: chunkers.Chunker = SENTENCE) -> list[str]:
    return [s.text for s in chunker.chunk(text)]


def nltk_cuts(text: str) -> list[int]:
    """Sentence ends as NLTK reports them, but the last (which is the end of the text)."""
    end = len(text.rstrip())
    return [e for _, e in STOCK.span_tokenize(text) if e < end]


# -- same boundaries as NLTK -----------------------------------------------------------------

words_and_punctuation = st.lists(
    st.sampled_from([*ATOMS, "Inc.", "a.m.", "Jan.", "i.e.", "A.", "!!", "?!", ".)", '."']),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(words_and_punctuation, texts))
def test_cuts_equal_nltk_span_tokenize(text: str) -> None:
    assert [s.end for s in UNLIMITED.chunk(text)][:-1] == nltk_cuts(text)


PROSE = [
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were "
    "perfectly normal, thank you very much. They were the last people you'd expect to be "
    "involved in anything strange or mysterious, because they just didn't hold with such "
    "nonsense. Mr. Dursley was the director of a firm called Grunnings, which made drills.",
    "The meeting is at 3 p.m. on Jan. 5 in Washington, D.C. and Dr. Jones will attend. "
    'She said: "We expect a 2.5% rise." Nobody disagreed. Is that surprising? Not really! '
    "The U.S. economy grew, e.g. in manufacturing, by 3.1 percent (see p. 4). Prices rose...",
    "It was late. The streets were empty.\nA dog barked somewhere far away.\n\n"
    "In the morning, everything looked different. Prof. Smith arrived early; St. Mary's bells "
    "were ringing. \"Good morning,\" he said. 'Is anyone here?' No one answered.",
]


@pytest.mark.parametrize("text", PROSE)
def test_prose_equals_plain_punkt(text: str) -> None:
    """On ordinary prose the chunks, stripped, are exactly NLTK's sentences."""
    assert [s.strip() for s in sentences(text)] == STOCK.tokenize(text)
    assert feed_all(SENTENCE, [text[i : i + 3] for i in range(0, len(text), 3)]) == (
        SENTENCE.chunk(text)
    )


# -- hard cases, exactly -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Dr. Smith arrived at 5 p.m. on Tuesday. He was late.",
         ["Dr. Smith arrived at 5 p.m. on Tuesday.", " He was late."]),
        ("Many fruits, e.g. apples and pears, grow here. The U.S. exports them.",
         ["Many fruits, e.g.", " apples and pears, grow here.", " The U.S. exports them."]),
        ("The U.S. Army arrived. Pi is 3.14. It never ends.",
         ["The U.S. Army arrived.", " Pi is 3.14.", " It never ends."]),
        ("Is it 3 p.m. Already?", ["Is it 3 p.m.", " Already?"]),
        ("Mr. and Mrs. Jones left. They went home.",
         ["Mr. and Mrs. Jones left.", " They went home."]),
        ("Wait... what? I don't know... Maybe.", ["Wait... what?", " I don't know... Maybe."]),
        ("It was great!!! Really.", ["It was great!!!", " Really."]),
        ("Hello there! How are you? Fine.", ["Hello there!", " How are you?", " Fine."]),
        ('He said "Stop." Then left.', ['He said "Stop."', " Then left."]),
        ("(This is a test.) Next sentence here.", ["(This is a test.)", " Next sentence here."]),
        ("She asked 'Why?' and left. Nobody followed.",
         ["She asked 'Why?'", " and left.", " Nobody followed."]),
        ("1. First\n2. Second", ["1.", " First\n2.", " Second"]),
        ("First line.\nSecond line.\n\nNew paragraph.",
         ["First line.", "\nSecond line.", "\n\nNew paragraph."]),
        ("x = a.b(c); y.z()", ["x = a.b(c); y.z()"]),
        ("  Leading spaces. And trailing.  \n", ["  Leading spaces.", " And trailing.  \n"]),
        ("你好。世界！ Hello. שלום. مرحبا.", ["你好。世界！ Hello.", " שלום.", " مرحبا."]),
        ("Look 👩‍👩‍👧. Then 🇫🇷!", ["Look 👩‍👩‍👧.", " Then 🇫🇷!"]),
        ("The end.", ["The end."]),
    ],
)  # fmt: skip
def test_hard_cases(text: str, expected: list[str]) -> None:
    assert sentences(text) == expected
    assert [s.strip() for s in expected] == [s.strip() for s in STOCK.tokenize(text)]
    assert [s.text for s in feed_all(SENTENCE, list(text))] == expected


# -- early emission ------------------------------------------------------------------------


def emitted_at(text: str) -> dict[str, str]:
    """Feed one character at a time: which chunk appears after which prefix."""
    state = SENTENCE.incremental()
    seen: dict[str, str] = {}
    for i, ch in enumerate(text):
        for span in state.feed(ch):
            seen[span.text] = text[: i + 1]
    for span in state.flush():
        seen[span.text] = "<flush>"
    return seen


def test_sentence_emitted_once_the_next_token_is_complete() -> None:
    # Punkt decides from the whole next token, so the space after "How" settles it.
    assert emitted_at("Hello there. How are") == {
        "Hello there.": "Hello there. How ",
        " How are": "<flush>",
    }
    state = SENTENCE.incremental()
    assert state.feed("Hello there") == []
    assert state.feed(".") == []
    assert state.feed(" How") == []
    assert state.feed(" are") == [Span(0, 12, "Hello there.")]
    assert state.flush() == [Span(12, 20, " How are")]


def test_abbreviation_not_emitted_early() -> None:
    assert emitted_at("Dr. Smith went home. He") == {
        "Dr. Smith went home.": "<flush>",  # "He" might still grow
        " He": "<flush>",
    }
    assert emitted_at("Dr. Smith went home. He left") == {
        "Dr. Smith went home.": "Dr. Smith went home. He ",
        " He left": "<flush>",
    }


def test_closing_quote_waits_for_following_text() -> None:
    # Until text follows, `"` plus spaces could be the end of the stream.
    assert emitted_at('He said "Stop." Then left') == {
        'He said "Stop."': 'He said "Stop." T',
        " Then left": "<flush>",
    }


# -- max_chars ---------------------------------------------------------------------------------


def test_long_sentence_cut_at_whitespace() -> None:
    words = [f"word{i % 10}" for i in range(2000)]
    text = " ".join(words)  # 11,999 characters, no punctuation
    assert len(text) > 10_000
    spans = SENTENCE.chunk(text)
    assert "".join(s.text for s in spans) == text
    assert all(len(s.text) <= 500 for s in spans)  # the default max_chars
    assert [len(s.text) for s in spans] == [497] + [498] * 23 + [48]
    assert all(not s.text.endswith(" ") for s in spans)
    assert all(s.text.startswith(" ") for s in spans[1:])
    assert feed_all(SENTENCE, [text[i : i + 4] for i in range(0, len(text), 4)]) == spans


def test_max_chars_examples() -> None:
    small = chunkers.build({"type": "sentence", "max_chars": 10})
    assert sentences("aaaa bbbb cccc dddd. Ee.", small) == ["aaaa bbbb", " cccc", " dddd.", " Ee."]
    assert sentences("abcdefghijklmnopqrstuvwxyz", small) == ["abcdefghij", "klmnopqrst", "uvwxyz"]
    assert sentences("ab   cdefghijklm", small) == ["ab", "   cdefghi", "jklm"]
    assert sentences("Hi.          \n", small) == ["Hi.", "          ", "\n"]
    # a sentence of exactly max_chars is not cut
    assert sentences("Abc defgh. Ij", small) == ["Abc defgh.", " Ij"]


def test_max_chars_piece_emitted_before_the_sentence_ends() -> None:
    state = chunkers.build({"type": "sentence", "max_chars": 10}).incremental()
    assert state.feed("aaaa bbbb c") == [Span(0, 9, "aaaa bbbb")]
    assert state.feed("ccc dddd. Ee") == [Span(9, 14, " cccc")]
    assert state.flush() == [Span(14, 20, " dddd."), Span(20, 23, " Ee")]


# -- cost and memory ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        " ".join(PROSE) * 40,  # prose: only the unresolved tail is kept
        "x" * 100_000,  # no whitespace at all
        "Hi.\u00a0There.\u00a0" * 8000,  # a chain of candidates with no ASCII space
        "你好。世界！" * 10_000,
    ],
    ids=["prose", "no-space", "nbsp-chain", "cjk"],
)
def test_buffer_stays_bounded(text: str) -> None:
    """Amortised O(delta): the state keeps a bounded tail, whatever the stream length."""
    for config in ({"type": "sentence"}, {"type": "words"}):
        chunker = chunkers.build(config)
        state = chunker.incremental()
        spans: list[Span] = []
        peak = 0
        for i in range(0, len(text), 4):
            spans += state.feed(text[i : i + 4])
            peak = max(peak, len(state._buf.text))  # type: ignore[attr-defined]
        spans += state.flush()
        assert peak < 6000
        assert spans == chunker.chunk(text)


def test_long_context_without_ascii_space_is_capped() -> None:
    """Documented deviation: NLTK's previous-word context is capped at MAX_CONTEXT characters
    (it only gets that long in text without ASCII whitespace). Incremental == batch still."""
    text = "\u00a0".join(["Dr."] * 600) + " Next. One"
    with trim_min(1):
        assert feed_all(SENTENCE, [text[i : i + 5] for i in range(0, len(text), 5)]) == (
            SENTENCE.chunk(text)
        )


def test_punkt_does_not_grow_its_tables() -> None:
    before = len(TOKENIZER._params.ortho_context)
    SENTENCE.chunk("Zyxwv. qwertz uiop. Asdfgh jkl. Mnbvc.")
    assert len(TOKENIZER._params.ortho_context) == before


def test_stdlib_patterns_match_nltk_regex_engine() -> None:
    """The scanner uses stdlib `re` with NLTK's whitespace and non-word classes spelled out;
    they must agree with NLTK's `regex` engine on every code point."""
    every = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    assert ps._RE_WS.findall(every) == regex.findall(r"\s", every)
    assert ps._RE_NONWORD.findall(every) == regex.findall(
        PunktLanguageVars()._re_non_word_chars, every
    )
    closers = regex.findall(r'["\')\]}\u2018\u2019\u201c\u201d\xab\xbb]', every)
    assert "".join(closers) == "".join(
        c for c in closers if not ps._RE_NON_CLOSER.match(c)
    ) and PunktLanguageVars.re_boundary_realignment.pattern.startswith(
        "[\"\\')\\]}\\u2018\\u2019\\u201c\\u201d\\xab\\xbb]"
    )
