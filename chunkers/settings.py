"""Validation of one entry of the config's `chunkers:` section, and `build`."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .base import Chunker
from .paragraph import ParagraphChunker
from .sentence import SentenceChunker
from .whole_doc import WholeDocChunker
from .words import WordsChunker


class _Settings(BaseModel):
    # strict: YAML `max_words: "5"` or `true` is a mistake worth reporting, not coercing.
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True
    )


# The hold-back bound (DESIGN 5): text without a boundary (code, tables, lists, run-ons, other
# scripts) is judged and released at least every `max_chars` code points. 500 for sentences:
# English sentences average 75-150 characters and very few exceed 500, so detectors still see
# whole sentences, while an answer without a period reaches the client every ~100-125 tokens
# (about a second at common decode speeds) instead of at its end. 2000 for paragraphs, whose
# detectors are configured for more context (most paragraphs are 300-1500 characters).
SENTENCE_MAX_CHARS = 500
PARAGRAPH_MAX_CHARS = 2000


class SentenceSettings(_Settings):
    """Sentences (NLTK Punkt with shipped parameters); a sentence is complete once the text after
    its end shows it cannot grow."""

    type: Literal["sentence"]
    """`sentence`."""
    max_chars: int = Field(SENTENCE_MAX_CHARS, ge=1)
    """An open chunk that reaches this many characters without a sentence end is closed at its
    last whitespace (or here when it has none): held-back text stays bounded."""
    language: Literal["english"] = "english"
    """The Punkt parameters (English is the one shipped)."""


class ParagraphSettings(_Settings):
    """Paragraphs, split at blank lines."""

    type: Literal["paragraph"]
    """`paragraph`."""
    max_chars: int = Field(PARAGRAPH_MAX_CHARS, ge=1)
    """An open paragraph that reaches this many characters is closed at its last whitespace."""


class WordsSettings(_Settings):
    """Windows of at most max_words words, also cut at sentence ends."""

    type: Literal["words"]
    """`words`."""
    max_words: int = Field(50, ge=1)
    """Words per chunk at most."""
    max_chars: int = Field(2000, ge=1)
    """Characters per chunk at most (a very long word is cut)."""


class WholeDocSettings(_Settings):
    """One chunk, the whole text, at the end of a stream (what the reserved
    `whole_doc_chunker` is; detectors name it without configuring it)."""

    type: Literal["whole_doc"]
    """`whole_doc`."""


ChunkerSettings = Annotated[
    SentenceSettings | ParagraphSettings | WordsSettings | WholeDocSettings,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(ChunkerSettings)
TYPES = ("paragraph", "sentence", "whole_doc", "words")
_BY_TYPE: dict[str, type[_Settings]] = {
    "sentence": SentenceSettings,
    "paragraph": ParagraphSettings,
    "words": WordsSettings,
    "whole_doc": WholeDocSettings,
}


def parse_settings(settings: Any) -> Any:
    """The validated settings model; `ValueError` with a one-line message that starts with the
    offending field name (`max_words: must be >= 1`), which the config loader prefixes with the
    YAML path."""
    if not isinstance(settings, dict):
        raise ValueError(f"chunker settings must be a mapping, got {type(settings).__name__}")
    try:
        return _ADAPTER.validate_python(settings)
    except ValidationError as exc:
        raise SettingsError([_message(e) for e in exc.errors()]) from None


class SettingsError(ValueError):
    """Every problem of one chunker's settings, one message each (`str()` joins them)."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("; ".join(messages))
        self.messages = messages


def _closest(word: Any, choices: list[str]) -> str:
    """` (did you mean 'x'?)`, else ` (expected one of: ...)`: a typo is the common mistake.
    (difflib, as the orchestrator's config errors do; this library imports nothing of theirs.)"""
    close = difflib.get_close_matches(word, choices, n=1) if isinstance(word, str) else []
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (expected one of: {', '.join(choices)})"


def _message(error: Any) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    loc = error["loc"]
    field = ".".join(str(part) for part in loc[1:]) or "type"  # loc[0] is the union tag
    if kind == "union_tag_not_found":
        return "type: field required"
    if kind == "union_tag_invalid":
        return f"type: unknown chunker type {ctx.get('tag')!r}" + _closest(ctx.get("tag"), TYPES)
    if kind == "missing":
        return f"{field}: field required"
    if kind == "extra_forbidden":
        model = _BY_TYPE.get(str(loc[0])) if loc else None
        known = sorted(model.model_fields) if model else []
        return f"{field}: unknown field" + (_closest(str(loc[-1]), known) if known else "")
    if kind == "greater_than_equal":
        return f"{field}: must be >= {ctx.get('ge')}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{field}: must be an integer, got {error.get('input')!r}"
    if kind == "literal_error":
        return f"{field}: must be one of: {ctx.get('expected')}, got {error.get('input')!r}"
    return f"{field}: {error['msg']}"


def build(settings: dict[str, Any]) -> Chunker:
    """A chunker from one `chunkers:` entry, e.g. `{"type": "words", "max_words": 50}`."""
    parsed = parse_settings(settings)
    if isinstance(parsed, SentenceSettings):
        return SentenceChunker(max_chars=parsed.max_chars)
    if isinstance(parsed, WordsSettings):
        return WordsChunker(max_words=parsed.max_words, max_chars=parsed.max_chars)
    if isinstance(parsed, ParagraphSettings):
        return ParagraphChunker(max_chars=parsed.max_chars)
    return WholeDocChunker()
