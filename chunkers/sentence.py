"""`sentence`: NLTK Punkt sentences (English parameters), with a `max_chars` safety cut."""

from __future__ import annotations

from .base import Emitter, Pipeline, Span, TextBuffer
from .punkt_stream import PunktCutter


class SentenceChunker:
    """Sentences as NLTK's `span_tokenize` finds them, each chunk running from the end of the
    previous sentence (so it starts with the whitespace before it) to the end of its own; the
    last chunk keeps any trailing whitespace. A chunk longer than `max_chars` is split at the last
    whitespace within the limit (hard cut if there is none).

    Incrementally a sentence is emitted once the text after it settles NLTK's decision: normally
    when the word after the following whitespace is complete ("Hello there. How " emits
    "Hello there."), since Punkt looks at that word's case and type (abbreviations,
    collocations, sentence starters) and at closing quotes/brackets."""

    __slots__ = ("max_chars",)

    def __init__(self, max_chars: int = 500) -> None:
        self.max_chars = max_chars

    def incremental(self) -> Pipeline:
        buf = TextBuffer()
        cutter = PunktCutter(buf)
        return Pipeline(buf, [cutter], Emitter(buf, cutter, self.max_chars))

    def chunk(self, text: str) -> list[Span]:
        """The batch form is the incremental one fed everything at once, so the two cannot
        disagree."""
        state = self.incremental()
        return state.feed(text) + state.flush()

    def __repr__(self) -> str:
        return f"SentenceChunker(max_chars={self.max_chars})"
