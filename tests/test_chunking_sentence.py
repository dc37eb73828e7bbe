"""Sentence chunking edge cases with exact expected chunks, when the incremental form emits a
sentence, the `max_chars` safety cut, and invalid chunker settings.

The expectations are NLTK Punkt's English behaviour (checked against `span_tokenize` by the
property tests), quirks included: Punkt ends a sentence after "e.g." when the next word is
lower-case and not a known continuation, and after a list number such as "1."."""

from __future__ import annotations

from typing import Any

import pytest

import chunkers


def sentences(text: str, **settings: Any) -> list[str]:
    return [s.text for s in chunkers.build({"type": "sentence", **settings}).chunk(text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Dr. Smith arrived at 5 p.m. on Monday. He left early.",
            ["Dr. Smith arrived at 5 p.m. on Monday.", " He left early."],
        ),
        (
            "The U.S. economy grew. It was 3.14 percent.",
            ["The U.S. economy grew.", " It was 3.14 percent."],
        ),
        (
            "Use e.g. apples or pears. Then stop.",
            ["Use e.g.", " apples or pears.", " Then stop."],
        ),
        ("Wait... What happened? Nothing!", ["Wait... What happened?", " Nothing!"]),
        (
            'He said "Stop." Then he left. (It was late.) Next day came.',
            ['He said "Stop."', " Then he left.", " (It was late.)", " Next day came."],
        ),
        (
            "1. First item\n2. Second item\n3. Third item",
            ["1.", " First item\n2.", " Second item\n3.", " Third item"],
        ),
        (
            "Line one.\nLine two.\n\nNew paragraph here.",
            ["Line one.", "\nLine two.", "\n\nNew paragraph here."],
        ),
        ("x = a.b(c); y.z() returns 1.5. Done.", ["x = a.b(c); y.z() returns 1.5.", " Done."]),
        ("  Leading space. Trailing space.  ", ["  Leading space.", " Trailing space.  "]),
        ("No punctuation at all", ["No punctuation at all"]),
        ("你好。世界！", ["你好。世界！"]),
    ],
    ids=[
        "abbreviations",
        "initialism-decimal",
        "eg-lowercase",
        "ellipsis",
        "quotes-brackets",
        "numbered-list",
        "newlines",
        "code",
        "outer-whitespace",
        "no-punctuation",
        "cjk",
    ],
)
def test_sentence_edge_cases(text: str, expected: list[str]) -> None:
    assert sentences(text) == expected


def emitted(deltas: list[str]) -> list[list[str]]:
    """What each feed emitted, then what flush emitted."""
    state = chunkers.build({"type": "sentence"}).incremental()
    out = [[s.text for s in state.feed(d)] for d in deltas]
    return [*out, [s.text for s in state.flush()]]


def test_a_sentence_is_emitted_once_the_next_word_settles_it() -> None:
    assert emitted(["Hello there.", " How", " are", " you?"]) == [
        [],
        [],
        ["Hello there."],  # " How" is a whole word only once " are" starts after it
        [],
        [" How are you?"],
    ]


def test_an_abbreviation_is_not_emitted_as_a_sentence() -> None:
    assert emitted(["Dr.", " Smith", " is", " in.", " Yes.", " "]) == [
        [],
        [],
        [],
        [],
        [],  # "Yes." might still grow ("Yes.." is another token type): undecided
        ["Dr. Smith is in."],  # never "Dr." alone
        [" Yes. "],
    ]


def test_a_closing_quote_stays_with_its_sentence() -> None:
    # "Stop." is no abbreviation, so once a word starts after the quote the break is certain
    assert emitted(['He said "Stop.', '"', " Then", " left."]) == [
        [],
        [],
        ['He said "Stop."'],
        [],
        [" Then left."],
    ]


def test_a_runaway_sentence_is_cut_at_whitespace_within_max_chars() -> None:
    text = " ".join(f"w{i:04d}" for i in range(1667))  # 10,001 characters, no punctuation
    assert len(text) == 10_001
    chunks = sentences(text)
    assert "".join(chunks) == text
    assert all(len(c) <= 2000 for c in chunks)
    # each cut falls on the last whitespace within the limit: 333 words of 6 characters
    assert [len(c) for c in chunks] == [1997, 1998, 1998, 1998, 1998, 12]
    assert all(c.startswith(" ") for c in chunks[1:])
    state = chunkers.build({"type": "sentence"}).incremental()
    streamed = [s.text for i in range(0, len(text), 7) for s in state.feed(text[i : i + 7])]
    assert streamed + [s.text for s in state.flush()] == chunks
    assert streamed == chunks[:-1]  # full chunks leave while the sentence is still running


def test_max_chars_without_whitespace_is_a_hard_cut() -> None:
    assert sentences("x" * 25, max_chars=10) == ["x" * 10, "x" * 10, "x" * 5]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"type": "haiku"}, "type: unknown chunker type 'haiku'"),
        ({}, "type: field required"),
        ({"type": "words", "max_words": 0}, "max_words: must be >= 1"),
        ({"type": "words", "max_words": "x"}, "max_words:"),
        ({"type": "sentence", "max_chars": 0}, "max_chars: must be >= 1"),
        ({"type": "sentence", "language": "klingon"}, "language: must be one of: 'english'"),
        ({"type": "paragraph", "colour": "red"}, "colour: unknown field"),
    ],
)
def test_invalid_settings_name_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        chunkers.build(settings)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_config_errors_carry_the_yaml_path() -> None:
    from orchestrator.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config({"chunkers": {"w": {"type": "words", "max_words": 0}}})
    assert info.value.errors == ["chunkers.w.max_words: must be >= 1"]
