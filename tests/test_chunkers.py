"""Chunkers: spans cover the text, incremental == batch for any split into deltas, settings
validation, and the paragraph / words / whole_doc semantics (sentence specifics are in
test_chunkers_sentence.py)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chunkers
from chunkers import Span, base
from chunkers.punkt_stream import TOKENIZER

# Pieces that exercise every rule: sentence punctuation and abbreviations, quotes and brackets
# (Punkt's realignment), line breaks of every kind, exotic whitespace (NBSP, ideographic space,
# U+001C which NLTK's regex engine does not count as whitespace but str.isspace does),
# multi-code-point emoji, CJK and right-to-left text.
ATOMS = [
    "Hello", "there", "the", "cat", "Dr.", "Mr.", "e.g.", "U.S.", "p.m.", "3.14", "He", "It",
    "However", "I", "J.", "and", "Stop.", "St.", "vs.", "No.",
    ".", ". ", "? ", "! ", "...", "!", "?", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\r",
    " \n \n ", "\u00a0", "\u3000", "\x1c", '"', "'", "(", ")", "[", "]", "{", "}", "\u201c",
    "\u201d", "\u2019", "\xab", "\xbb", "--", "-", ",", ";", ":",
    "👩‍👩‍👧", "🇫🇷", "你好。世界！", "שלום. مرحبا.", "x = a.b(c); y.z()", "1. First\n2. Second",
]  # fmt: skip

texts = st.lists(st.one_of(st.sampled_from(ATOMS), st.text(max_size=3)), max_size=40).map("".join)


@st.composite
def text_and_deltas(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A text and a split of it at arbitrary code points (inside words and emoji sequences,
    between \\r and \\n), with empty deltas allowed."""
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=15)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


CONFIGS: list[dict[str, Any]] = [
    {"type": "sentence"},
    {"type": "sentence", "max_chars": 7},
    {"type": "sentence", "max_chars": 1},
    {"type": "paragraph"},
    {"type": "paragraph", "max_chars": 7},
    {"type": "paragraph", "max_chars": 1},
    {"type": "words", "max_words": 1},
    {"type": "words", "max_words": 3, "max_chars": 10},
    {"type": "whole_doc"},
]
IDS = [",".join(f"{v}" for v in c.values()) for c in CONFIGS]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def feed_all(chunker: chunkers.Chunker, deltas: list[str]) -> list[Span]:
    state = chunker.incremental()
    spans: list[Span] = []
    for delta in deltas:
        spans += state.feed(delta)
    return spans + state.flush()


@contextmanager
def trim_min(value: int) -> Iterator[None]:
    """Make buffers drop consumed text as early as possible, to exercise every offset shift."""
    old = base.TRIM_MIN
    base.TRIM_MIN = value
    try:
        yield
    finally:
        base.TRIM_MIN = old


def with_cuts(spans: list[Span]) -> list[tuple[Span, bool, bool]]:
    """Spans with their `natural_end` flag, which Span equality leaves out."""
    return [(s, s.natural_end) for s in spans]


def assert_covers(text: str, spans: list[Span]) -> None:
    assert "".join(s.text for s in spans) == text
    pos = 0
    for s in spans:
        assert s.start == pos < s.end
        assert s.text == text[s.start : s.end]
        pos = s.end
    assert pos == len(text)


# -- properties of every chunker -------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@FAST
@given(text=texts)
def test_spans_are_contiguous_and_cover_the_text(config: dict[str, Any], text: str) -> None:
    assert_covers(text, chunkers.build(config).chunk(text))


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@FAST
@given(text=texts)
def test_a_chunk_says_whether_it_ends_at_a_natural_cut(config: dict[str, Any], text: str) -> None:
    """`natural_end` is `natural_cut` at the chunk's end, whichever stage cut there (a chunk
    that starts after the sentence's final punctuation, a hard cut before its closers, does not
    end one); the last chunk's end is the text's, which nothing follows."""
    spans = chunkers.build(config).chunk(text)
    want = [chunkers.natural_cut(text, s.end, s.start) for s in spans]
    assert [s.natural_end for s in spans] == want
    assert not spans or not spans[-1].natural_end


@pytest.mark.parametrize(
    ("text", "at", "cut"),
    [
        ("Call me. 555", 8, True),
        ("Call me?\t555", 8, True),
        ('He said "stop!") Then', 16, True),
        ("yes\nno", 3, True),
        ("yes\rno", 3, True),
        # a line that ends in a lone digit or a number word: a number written a digit a line
        # goes on across it (detectors/number_spellings.py), as may a spaced e-mail's ` . `
        ("one\ntwo", 3, False),
        ("Call:\n5\n5", 7, False),
        # ... or a number word of German, French, Spanish, Italian or Portuguese, accents and
        # all (detectors/number_spellings.py FOREIGN_DIGIT_WORDS)
        ("f\u00fcnf\nsechs", 4, False),
        ("fu\u0308nf\nsechs", 5, False),
        ("z\u00e9ro\nun", 4, False),
        ("tr\u00eas\nquatro", 4, False),
        ("Cinque\nsei", 6, False),
        ("fun\nnext", 3, True),
        ("Step 12\nnext", 7, True),
        ("version 1.5\nnext", 11, True),
        ("jo . smith", 4, False),
        ("one.\u3000two", 4, True),  # any whitespace (the view folds it to whitespace)
        ("a\u202eb. c", 4, False),  # after a right-to-left override
        ("a\u202eb\nc", 3, False),
        ("Call (555) 123-4567", 10, False),  # `)` closes a group of digits, no sentence
        ("Call me.\u200b 555", 9, False),  # what is between is no closer
        ("Call me. 555", 7, False),  # no whitespace after the cut
        ("jo.@example.com", 3, False),
        ("word word", 4, False),
        ("Call me.", 8, False),  # the end of the text: what follows is not known
    ],
)
def test_natural_cut_examples(text: str, at: int, cut: bool) -> None:
    assert chunkers.natural_cut(text, at) is cut


def test_every_number_word_of_the_detectors_makes_no_natural_cut_before_a_line_break() -> None:
    """The chunkers keep their own list (they import no detector); it must hold every word the
    number view reads, or a number written a word a line is cut into lines judged apart."""
    from detectors.number_spellings import DIGIT_WORDS

    cut = [w for w in DIGIT_WORDS if chunkers.natural_cut(f"x {w}\nnext", len(w) + 2)]
    assert cut == []


@FAST
@given(text=texts)
def test_natural_cuts_split_a_text_where_natural_cut_says(text: str) -> None:
    """`natural_cuts` (one pass) is `natural_cut` asked at every offset, each piece starting at
    the cut before it."""
    want, start = [], 0
    for i in range(1, len(text)):
        if chunkers.natural_cut(text, i, start):
            want.append(i)
            start = i
    assert chunkers.natural_cuts(text) == want


def test_natural_cuts_examples() -> None:
    text = 'He said "stop!") Then.\n\nDr. Smith came.\u3000Ok a\u202eb. c'
    assert chunkers.natural_cuts(text) == [16, 22, 23, 27, 39]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@FAST
@given(case=text_and_deltas())
def test_incremental_equals_batch_for_any_split(
    config: dict[str, Any], case: tuple[str, list[str]]
) -> None:
    text, deltas = case
    chunker = chunkers.build(config)
    expected = chunker.chunk(text)
    assert with_cuts(feed_all(chunker, deltas)) == with_cuts(expected)
    with trim_min(1):
        assert with_cuts(feed_all(chunker, deltas)) == with_cuts(expected)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@settings(max_examples=8, deadline=None)
@given(
    pieces=st.lists(st.sampled_from([*ATOMS, "x" * 300, "\u00a0y." * 40]), max_size=120),
    step=st.integers(1, 9),
)
def test_incremental_equals_batch_on_long_text(
    config: dict[str, Any], pieces: list[str], step: int
) -> None:
    """Texts of a few thousand characters, so buffers are trimmed many times over."""
    text = "".join(pieces)
    chunker = chunkers.build(config)
    deltas = [text[i : i + step] for i in range(0, len(text), step)]
    with trim_min(1):
        assert feed_all(chunker, deltas) == chunker.chunk(text)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_empty_and_whitespace_only_text(config: dict[str, Any]) -> None:
    """Empty text: no chunk. Whitespace only: one chunk, the whitespace (when it fits)."""
    chunker = chunkers.build(config)
    assert chunker.chunk("") == []
    assert feed_all(chunker, ["", ""]) == []
    if config.get("max_chars", 500) >= 4:
        assert chunker.chunk(" \n\n ") == [Span(0, 4, " \n\n ")]
    else:  # the safety cut applies to whitespace too
        assert [s.text for s in chunker.chunk(" \n\n ")] == [" ", "\n", "\n", " "]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_states_are_independent_and_chunkers_reusable(config: dict[str, Any]) -> None:
    chunker = chunkers.build(config)
    a_text = "Hello there. How are you?\n\nFine, thanks. And you? Good."
    b_text = "Dr. Smith went home. He was tired.\n\nThe U.S. is large."
    a, b = chunker.incremental(), chunker.incremental()
    got_a: list[Span] = []
    got_b: list[Span] = []
    for i in range(0, max(len(a_text), len(b_text)), 3):
        got_a += a.feed(a_text[i : i + 3])
        got_b += b.feed(b_text[i : i + 3])
    got_a += a.flush()
    got_b += b.flush()
    assert got_a == chunker.chunk(a_text)
    assert got_b == chunker.chunk(b_text)
    assert chunker.chunk(a_text) == chunkers.build(config).chunk(a_text)


def test_state_lifecycle() -> None:
    state = chunkers.build({"type": "sentence"}).incremental()
    assert state.feed("One. Two") == []
    assert [s.text for s in state.flush()] == ["One.", " Two"]
    assert state.flush() == []
    with pytest.raises(RuntimeError):
        state.feed("more")
    whole = chunkers.build({"type": "whole_doc"}).incremental()
    whole.flush()
    with pytest.raises(RuntimeError):
        whole.feed("more")


def test_span_is_a_frozen_slotted_value() -> None:
    span = Span(0, 2, "hi")
    assert span == Span(0, 2, "hi")
    assert not hasattr(span, "__dict__")
    with pytest.raises(AttributeError):
        span.start = 1  # type: ignore[misc]


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"type": "foo"}, "type: unknown chunker type 'foo' (expected one of: paragraph, "
                          "sentence, whole_doc, words)"),
        ({"type": "sentense"}, "type: unknown chunker type 'sentense' (did you mean 'sentence'?)"),
        ({}, "type: field required"),
        ({"max_words": 3}, "type: field required"),
        ({"type": "words", "max_words": 0}, "max_words: must be >= 1"),
        ({"type": "words", "colour": "red"},
         "colour: unknown field (expected one of: max_chars, max_words, type)"),
        ({"type": "paragraph", "max_words": 5},
         "max_words: unknown field (did you mean 'max_chars'?)"),
        ({"type": "paragraph", "max_chars": 0}, "max_chars: must be >= 1"),
        ({"type": "paragraph", "max_chars": "9"}, "max_chars: must be an integer, got '9'"),
        ({"type": "words", "max_words": "x"}, "max_words: must be an integer, got 'x'"),
        ({"type": "words", "max_words": True}, "max_words: must be an integer, got True"),
        ({"type": "words", "max_words": 2.5}, "max_words: must be an integer, got 2.5"),
        ({"type": "sentence", "max_chars": 0}, "max_chars: must be >= 1"),
        ({"type": "sentence", "language": "french"},
         "language: must be one of: 'english', got 'french'"),
    ],
)  # fmt: skip
def test_invalid_settings_name_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        chunkers.build(config)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_valid_settings_and_defaults() -> None:
    sentence = chunkers.build({"type": "sentence", "language": "english"})
    assert isinstance(sentence, chunkers.SentenceChunker) and sentence.max_chars == 500
    words = chunkers.build({"type": "words"})
    assert isinstance(words, chunkers.WordsChunker)
    assert (words.max_words, words.max_chars) == (50, 2000)
    paragraph = chunkers.build({"type": "paragraph"})
    assert isinstance(paragraph, chunkers.ParagraphChunker) and paragraph.max_chars == 2000
    assert isinstance(chunkers.build({"type": "whole_doc"}), chunkers.WholeDocChunker)
    with pytest.raises(ValueError, match="must be a mapping"):
        chunkers.build(["sentence"])  # type: ignore[arg-type]


# -- paragraph -----------------------------------------------------------------------------


def paragraph_reference(text: str) -> list[str]:
    """Split before each whitespace run holding two or more line breaks (not at the ends)."""
    cuts = [
        m.start()
        for m in re.finditer(r"\s+", text)
        if len(re.findall(r"\r\n|\r|\n", m.group())) >= 2 and 0 < m.start() and m.end() < len(text)
    ]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@FAST
@given(text=texts)
def test_paragraph_matches_reference(text: str) -> None:
    assert [s.text for s in chunkers.build({"type": "paragraph"}).chunk(text)] == (
        paragraph_reference(text)
    )


def test_paragraph_examples() -> None:
    chunker = chunkers.build({"type": "paragraph"})
    text = "\n\nOne line\nstill one.  \n \t\n  Two\r\n\r\nThree\r\rFour\n\n"
    assert [s.text for s in chunker.chunk(text)] == [
        "\n\nOne line\nstill one.",
        "  \n \t\n  Two",
        "\r\n\r\nThree",
        "\r\rFour\n\n",
    ]
    # \r\n is one line break, even split across deltas
    assert [s.text for s in feed_all(chunker, ["a\r", "\nb"])] == ["a\r\nb"]
    assert [s.text for s in feed_all(chunker, ["a\r", "\n\r", "\nb"])] == ["a", "\r\n\r\nb"]


def test_paragraph_emitted_when_the_next_one_starts() -> None:
    state = chunkers.build({"type": "paragraph"}).incremental()
    assert state.feed("First.\n") == []
    assert state.feed("\n  ") == []  # the blank-line run could still end the text
    assert state.feed("S") == [Span(0, 6, "First.")]
    assert state.flush() == [Span(6, 11, "\n\n  S")]


@pytest.mark.parametrize("config", [c for c in CONFIGS if "max_chars" in c], ids=str)
@FAST
@given(case=text_and_deltas())
def test_no_chunk_exceeds_max_chars(config: dict[str, Any], case: tuple[str, list[str]]) -> None:
    """The hold-back bound (DESIGN 5): whatever the text, incrementally too."""
    _text, deltas = case
    spans = feed_all(chunkers.build(config), deltas)
    assert all(len(s.text) <= config["max_chars"] for s in spans)


def test_paragraph_max_chars_examples() -> None:
    small = chunkers.build({"type": "paragraph", "max_chars": 10})
    texts_of = lambda t: [s.text for s in small.chunk(t)]  # noqa: E731
    assert texts_of("aaaa bbbb cccc dddd\n\nEe") == ["aaaa bbbb", " cccc dddd", "\n\nEe"]
    assert texts_of("abcdefghijklmnopqrstuvwxyz") == ["abcdefghij", "klmnopqrst", "uvwxyz"]
    # a paragraph of exactly max_chars is not cut
    assert texts_of("Abc defghi\n\nJ") == ["Abc defghi", "\n\nJ"]
    # a chunk that ends at a paragraph break or a sentence end is cut naturally; a safety cut
    # inside a run of words or letters is not
    cuts_of = lambda t: [s.natural_end for s in small.chunk(t)]  # noqa: E731
    assert cuts_of("aaaa bbbb cccc dddd\n\nEe") == [False, True, False]
    assert cuts_of("abcdefghijklmnopqrstuvwxyz") == [False, False, False]
    assert cuts_of("Abc defghi\n\nJ") == [True, False]
    assert cuts_of("Abc. efghijk.") == [True, False]  # a safety cut at a sentence end


def test_paragraph_max_chars_piece_emitted_before_the_paragraph_ends() -> None:
    """Text without a blank line (code, a table, a run-on) still flows, every max_chars."""
    state = chunkers.build({"type": "paragraph", "max_chars": 10}).incremental()
    assert state.feed("aaaa bbbb") == []
    assert state.feed(" c") == [Span(0, 9, "aaaa bbbb")]
    # " cccc dddd" fits: a trailing whitespace run could still turn into a paragraph break
    # there, so the safety cut waits for the run's end
    assert state.feed("ccc dddd ") == []
    assert state.feed("   ") == []
    assert state.feed("e") == [Span(9, 19, " cccc dddd")]
    assert state.flush() == [Span(19, 24, "    e")]


@pytest.mark.parametrize("text", ["x" * 100_000, "word " * 20_000, "a,b;c\n" * 15_000])
def test_paragraph_buffer_stays_bounded_without_blank_lines(text: str) -> None:
    chunker = chunkers.build({"type": "paragraph"})
    state = chunker.incremental()
    spans: list[Span] = []
    peak = 0
    for i in range(0, len(text), 4):
        spans += state.feed(text[i : i + 4])
        peak = max(peak, len(state._buf.text))  # type: ignore[attr-defined]
    spans += state.flush()
    assert peak < 6000
    assert spans == chunker.chunk(text)
    assert all(len(s.text) <= 2000 for s in spans)


# -- words ---------------------------------------------------------------------------------


def punkt_cuts(text: str) -> list[int]:
    """Sentence ends as NLTK's span_tokenize reports them, but the last."""
    end = len(text.rstrip())
    return [e for _, e in TOKENIZER.span_tokenize(text) if e < end]


def words_reference(text: str, max_words: int) -> list[str]:
    cuts: list[int] = []
    start = 0
    for end in [*punkt_cuts(text), len(text)]:
        words = list(re.finditer(r"\S+", text[start:end]))
        cuts += [start + words[k - 1].end() for k in range(max_words, len(words), max_words)]
        cuts.append(end)
        start = end
    bounds = [0, *cuts]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@FAST
@given(text=texts, max_words=st.integers(1, 5))
def test_words_match_reference(text: str, max_words: int) -> None:
    chunker = chunkers.build({"type": "words", "max_words": max_words})
    assert [s.text for s in chunker.chunk(text)] == words_reference(text, max_words)


def test_words_examples() -> None:
    chunker = chunkers.build({"type": "words", "max_words": 3})
    text = "  one two three four five. Six seven\n eight nine ten eleven  "
    assert [s.text for s in chunker.chunk(text)] == [
        "  one two three",
        " four five.",
        " Six seven\n eight",
        " nine ten eleven  ",
    ]
    small = chunkers.build({"type": "words", "max_words": 2, "max_chars": 5})
    assert [s.text for s in small.chunk("abcdefgh ij")] == ["abcde", "fgh", " ij"]


def test_words_window_emitted_when_the_next_word_starts() -> None:
    state = chunkers.build({"type": "words", "max_words": 2}).incremental()
    assert state.feed("one two") == []
    assert state.feed(" ") == []
    assert state.feed("t") == [Span(0, 7, "one two")]
    assert state.feed("hree. Four") == []
    assert state.feed(" ") == [Span(7, 14, " three.")]
    assert state.flush() == [Span(14, 20, " Four ")]


class _CountingWords:
    """Stands in for the words chunker's word regex and counts the characters its calls scan
    (findall over a range scans all of it; finditer as far as it is consumed)."""

    def __init__(self, rx: re.Pattern[str]) -> None:
        self._rx = rx
        self.scanned = 0

    def findall(self, text: str, lo: int, hi: int) -> list[str]:
        self.scanned += hi - lo
        return self._rx.findall(text, lo, hi)

    def finditer(self, text: str, lo: int, hi: int) -> Iterator[re.Match[str]]:
        at = lo
        for m in self._rx.finditer(text, lo, hi):
            self.scanned += m.end() - at
            at = m.end()
            yield m


@pytest.mark.parametrize("unit", ["1 ", "John ", "+1 ", "a\n \n"])
def test_words_scan_of_a_long_text_without_sentence_ends_is_linear(monkeypatch, unit) -> None:
    """Repro: each window counted the words of the whole rest of the text (one C call) before
    walking to its end, so 1 MiB of short words with no sentence end cost ~n^2/100 character
    scans (10.6 s of CPU for 256 KiB of "1 ", minutes for 1 MiB, on the bulk executor). The
    count now covers only a stretch that could hold the missing words: each character is
    scanned a bounded number of times."""
    from chunkers import words

    counting = _CountingWords(words._RE_WORD)
    monkeypatch.setattr(words, "_RE_WORD", counting)
    text = unit * (131072 // len(unit))
    spans = chunkers.build({"type": "words", "max_words": 50}).chunk(text)
    assert "".join(s.text for s in spans) == text
    assert len(spans) == -(-text.count(unit) // 50)  # one window per 50 words
    assert counting.scanned <= 40 * len(text)


# -- whole_doc -----------------------------------------------------------------------------


def test_whole_doc_only_at_flush() -> None:
    chunker = chunkers.build({"type": "whole_doc"})
    state = chunker.incremental()
    assert state.feed("Hello. ") == []
    assert state.feed("World.\n\n") == []
    assert state.flush() == [Span(0, 15, "Hello. World.\n\n")]
    assert chunker.chunk("abc") == [Span(0, 3, "abc")]
    assert chunker.chunk("") == []


def test_one_chunker_shared_by_threads() -> None:
    """Chunkers (and the Punkt tables behind them) are read-only: threads can share one."""
    chunker = chunkers.build({"type": "words", "max_words": 4})
    text = "Dr. Smith went home. He was tired, e.g. after 3 p.m. on most days.\n\n" * 30
    expected = chunker.chunk(text)

    def run(step: int) -> list[Span]:
        return feed_all(chunker, [text[i : i + step] for i in range(0, len(text), step)])

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, [1, 2, 3, 5, 7, 11, 13, 64])) == [expected] * 8
