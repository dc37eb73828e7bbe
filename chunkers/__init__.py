"""Chunkers: text into contiguous spans for detectors (DESIGN section 5).

`build(settings)` makes a chunker from one entry of the config's `chunkers:` section. A chunker has
`chunk(text) -> list[Span]` and `incremental()`, a fresh per-stream state with `feed(delta)` (the
chunks the text so far proves complete) and `flush()` (the rest). For every chunker and every split
of a text into deltas, the incremental chunks equal the batch ones; spans are code-point offsets,
contiguous, and concatenate to the text; whitespace between chunks belongs to the following chunk
and trailing whitespace to the last; empty text has no chunks, whitespace-only text one.
"""

from .base import Chunker, IncrementalChunker, Span, natural_cut, natural_cuts
from .paragraph import ParagraphChunker
from .sentence import SentenceChunker
from .settings import TYPES, build, parse_settings
from .whole_doc import WholeDocChunker
from .words import WordsChunker

__all__ = [
    "TYPES",
    "Chunker",
    "IncrementalChunker",
    "ParagraphChunker",
    "SentenceChunker",
    "Span",
    "WholeDocChunker",
    "WordsChunker",
    "build",
    "natural_cut",
    "natural_cuts",
    "parse_settings",
]
