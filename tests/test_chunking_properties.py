"""Invariants of every chunker (DESIGN section 5), by property: spans are contiguous, cover the
text and concatenate to it; the incremental form yields exactly the batch result for any split of
the text into deltas (inside words, emoji sequences, CRLF pairs, CJK and RTL text); and the
sentence chunker agrees with NLTK's own Punkt `span_tokenize`, an independent oracle."""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
from punkt.data import english

import chunkers

PIECES = [
    "Hello",
    " world",
    ". ",
    "? ",
    "! ",
    "...",
    "Dr.",
    " Smith",
    " e.g.",
    " U.S.",
    " p.m.",
    " 3.14",
    '"',
    ")",
    " (",
    "1.",
    "\n",
    "\n\n",
    "\r\n",
    " ",
    "\t",
    "A",
    "b",
    " The",
    " he",
    "👩‍👩‍👧",
    "🇫🇷",
    "你好。",
    "世界！",
    "שלום.",
    " مرحبا.",
]
texts = st.lists(st.sampled_from(PIECES), max_size=40).map("".join) | st.text(max_size=60)

CONFIGS: list[dict[str, Any]] = [
    {"type": "sentence"},
    {"type": "sentence", "max_chars": 12},
    {"type": "paragraph"},
    {"type": "words", "max_words": 1},
    {"type": "words", "max_words": 3},
    {"type": "whole_doc"},
]
IDS = ["sentence", "sentence-12", "paragraph", "words-1", "words-3", "whole_doc"]


def splits(text: str) -> st.SearchStrategy[list[str]]:
    """Any split of `text` into deltas at code-point positions, empty deltas included."""
    cuts = st.lists(st.integers(0, len(text)), max_size=12).map(sorted)
    return cuts.map(lambda cs: [text[a:b] for a, b in zip([0, *cs], [*cs, len(text)], strict=True)])


def run_incremental(chunker: Any, deltas: list[str]) -> list[chunkers.Span]:
    state = chunker.incremental()
    out: list[chunkers.Span] = []
    for delta in deltas:
        out += state.feed(delta)
    return out + state.flush()


def assert_tiles(spans: list[chunkers.Span], text: str) -> None:
    at = 0
    for span in spans:
        assert span.start == at
        assert span.end > span.start
        assert span.text == text[span.start : span.end]
        at = span.end
    assert at == len(text)
    assert "".join(s.text for s in spans) == text


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_incremental_equals_batch_for_any_split(config: dict[str, Any], data: Any) -> None:
    chunker = chunkers.build(config)
    text = data.draw(texts)
    batch = chunker.chunk(text)
    assert_tiles(batch, text)
    deltas = data.draw(splits(text))
    assert run_incremental(chunker, deltas) == batch


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_empty_and_whitespace_only_text(config: dict[str, Any]) -> None:
    chunker = chunkers.build(config)
    assert chunker.chunk("") == []
    assert run_incremental(chunker, ["", ""]) == []
    assert chunker.chunk(" \n\n ") == [chunkers.Span(0, 4, " \n\n ")]


def _nltk_tokenizer() -> PunktSentenceTokenizer:
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    return PunktSentenceTokenizer(params)


NLTK = _nltk_tokenizer()


def nltk_chunks(text: str) -> list[tuple[int, int]]:
    """NLTK's sentences, with the whitespace between two given to the following one."""
    ends = [end for _, end in NLTK.span_tokenize(text)]
    cuts = [0, *ends[:-1], len(text)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


@settings(max_examples=400, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES[:20]), min_size=1, max_size=40).map("".join))
def test_sentence_chunks_are_nltk_punkt_sentences(text: str) -> None:
    if not text.strip():
        return
    chunker = chunkers.build({"type": "sentence", "max_chars": 1_000_000})
    assert [(s.start, s.end) for s in chunker.chunk(text)] == nltk_chunks(text)


@settings(max_examples=150, deadline=None)
@given(text=texts, max_words=st.integers(1, 5))
def test_words_chunks_hold_at_most_max_words_and_respect_sentence_ends(
    text: str, max_words: int
) -> None:
    spans = chunkers.build({"type": "words", "max_words": max_words}).chunk(text)
    assert all(len(s.text.split()) <= max_words for s in spans)
    sentence_ends = {s.end for s in chunkers.build({"type": "sentence"}).chunk(text)}
    word_ends = {s.end for s in spans}
    assert sentence_ends <= word_ends


def paragraph_cuts(text: str) -> list[int]:
    """Where paragraphs start: each whitespace run holding two or more line breaks (CRLF counts
    once), except a run at the very start or end of the text."""
    cuts = []
    for run in re.finditer(r"\s+", text):
        breaks = len(re.findall(r"\r\n|\r|\n", run.group()))
        if breaks >= 2 and run.start() > 0 and run.end() < len(text):
            cuts.append(run.start())
    return cuts


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_paragraphs_split_exactly_at_blank_lines(text: str) -> None:
    spans = chunkers.build({"type": "paragraph"}).chunk(text)
    assert [s.start for s in spans[1:]] == paragraph_cuts(text)


def test_two_incremental_states_do_not_interfere() -> None:
    chunker = chunkers.build({"type": "sentence"})
    a, b = chunker.incremental(), chunker.incremental()
    out_a: list[chunkers.Span] = []
    out_b: list[chunkers.Span] = []
    for da, db in zip(
        ["One is ", "here. Two ", "is there. "], ["Alpha ", "beta. Gamma ", "delta. "], strict=True
    ):
        out_a += a.feed(da)
        out_b += b.feed(db)
    out_a += a.flush()
    out_b += b.flush()
    assert [s.text for s in out_a] == ["One is here.", " Two is there. "]
    assert [s.text for s in out_b] == ["Alpha beta.", " Gamma delta. "]
