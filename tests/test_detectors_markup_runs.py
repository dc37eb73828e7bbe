"""What markup hides, for the seam windows' walks (DESIGN 4.6a, 4.6b), at C speed on tag-dense
text, and exactly as before.

On 7c96083 a 1 MiB input of `<b>` cost about 16 s of CPU in `judge_text` (bench/markup_cost.py):
not the view (`normalise`, 0.27 s), but the walks of its seam windows, each of which decoded
every markup match in up to SEAM_RAW_CHARS around it one at a time (`markup_hidden`), both sides
of every `max_chars` cut: each tag about 40 times. Now a run of tags back to back is one C match
(a piece at a time), a long text's markup is scanned once (`_MarkupIndex`), and a walk steps over
a hidden run at once.

The references below are the per-match scan and the per-character walks these replaced: the
new ones must give exactly their answers (a walk's ends are where windows start and end, and
what a window holds decides what a detector sees whole)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detectors import normalise
from detectors.normalise import MARKUP, MARKUP_MOST, _decoded, is_plain, markup_hidden
from orchestrator.streaming import detector_queue
from orchestrator.streaming.detector_queue import (
    SEAM_RAW_CHARS,
    _back,
    _forward,
    _invisible_run,
    _visible,
)
from orchestrator.streaming.text_judgement import judge_text
from tests.test_pipeline_natural_cuts import regex_detector
from tests.test_pipeline_redaction_seams import registry


def reference_hidden(text: str, lo: int, hi: int) -> frozenset[int]:
    """7c96083's `markup_hidden`: every match decoded alone."""
    hidden: set[int] = set()
    for m in MARKUP.finditer(text, max(0, lo - MARKUP_MOST), hi + MARKUP_MOST):
        shown = _decoded(m)
        if shown is not None and m.end() > lo and m.start() < hi:
            hidden.update(range(max(lo, m.start() + len(shown)), min(hi, m.end())))
    return frozenset(hidden)


def reference_back(text: str, i: int, count: int, floor: int, *, run: bool) -> Any:
    """7c96083's `_back`: one character at a time, markup looked up in a set."""
    if not run:
        j = max(floor, i - count)
        if is_plain(text[j:i]):
            return j, i - count >= floor, False
    limit = max(floor, i - SEAM_RAW_CHARS)
    hidden = reference_hidden(text, limit, i)
    skip = _invisible_run(text, limit, i)
    back = text[limit:i][::-1] if skip is not None else ""
    j, seen = i, 0
    while j > limit and seen < count:
        if skip is not None and (m := skip.match(back, i - j)) is not None:
            j -= m.end() - m.start()
            continue
        ch = text[j - 1]
        if run and ch.isspace() and j - 1 not in hidden:
            return j, False, False
        j -= 1
        if _visible(ch) and j not in hidden:
            seen += 1
    raw = seen < count and j == limit and limit > floor
    return j, seen >= count or raw, raw


def reference_forward(text: str, i: int, count: int, ceiling: int, *, run: bool) -> Any:
    """7c96083's `_forward`."""
    if not run:
        j = min(ceiling, i + count)
        if is_plain(text[i:j]):
            return j, i + count <= ceiling, False
    limit = min(ceiling, i + SEAM_RAW_CHARS)
    hidden = reference_hidden(text, i, limit)
    skip = _invisible_run(text, i, limit)
    j, seen = i, 0
    while j < limit and seen < count:
        if skip is not None and (m := skip.match(text, j, limit)) is not None:
            j = m.end()
            continue
        ch = text[j]
        if run and ch.isspace() and j not in hidden:
            return j, False, False
        if _visible(ch) and j not in hidden:
            seen += 1
        j += 1
    raw = seen < count and j == limit and limit < ceiling
    return j, seen >= count or raw, raw


# markup of every kind MARKUP decodes (block tags, comments, attributes holding other markup, a
# Markdown target holding tags, names past 16 letters, tags cut open), long ones (a link's
# look-ahead, attributes and comments near their bounds), and what lies between
PIECES = [
    *("<b>", "</b>", "<br>", "<BR/>", "<p class='x'>", "</P>", "<h1>", "<brx>", "<wbr>"),
    *("<!-- c -->", "<!---->", '<span a="&#97; **">', "<" + "a" * 17 + ">", "<b", "b>", "<!--"),
    *("-->", "&#97;", "&amp;", "&#x6a;", "&bogus;", "%41", "\\u0041", "\\@", "**", "*", "~~"),
    *("`", "[x](y)", "](z<b>)", "[", "]", "(", ")", "<", ">", "-", "@", "a", "5", " ", "\n"),
    *("\t", "\u200b", "\u00ad", "\u0301", "x" * 40),
    *("[" + "a" * 60, "](" + "b" * 250 + ")", "<i " + "c" * 250 + ">", "<!--" + "d" * 250 + "-->"),
    "](" + "<b>" * 80 + ")",  # tags inside a Markdown link's target: one match, not a run
]
markup = st.lists(
    st.one_of(st.sampled_from(PIECES), st.sampled_from(["<b>", "<br>", "a"]).map(lambda p: p * 50)),
    min_size=1,
    max_size=60,
).map("".join)


@contextmanager
def scales(indexed: bool, piece: int) -> Iterator[None]:
    """The index for every text (not only long ones) and pieces of runs this long: the paths a
    long text takes, on texts hypothesis can shrink."""
    with pytest.MonkeyPatch.context() as patch:
        if indexed:
            patch.setattr(normalise, "_INDEXED_CHARS", 1)
        patch.setattr(normalise, "_RUN_PIECE", piece)
        normalise._index.cache_clear()
        yield


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=markup,
    where=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    indexed=st.booleans(),
    piece=st.sampled_from([8, 40, 512]),
)
def test_markup_hidden_is_the_per_match_scan(
    text: str, where: tuple[float, float], indexed: bool, piece: int
) -> None:
    lo, hi = sorted(int(w * len(text)) for w in where)
    with scales(indexed, piece):
        got = markup_hidden(text, lo, hi)
        runs = normalise.markup_hidden_runs(text, lo, hi)
    assert got == reference_hidden(text, lo, hi)
    # sorted, disjoint and not touching: a walk steps over each whole
    assert all(a < b for a, b in runs)
    assert all(b < a for (_, b), (a, _) in itertools.pairwise(runs))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=markup,
    at=st.floats(0, 1),
    count=st.sampled_from([1, 5, 64, 1024]),
    bound=st.floats(0, 1),
    run=st.booleans(),
    indexed=st.booleans(),
    piece=st.sampled_from([8, 512]),
)
def test_the_walks_are_the_per_character_walks(
    text: str, at: float, count: int, bound: float, run: bool, indexed: bool, piece: int
) -> None:
    i = int(at * len(text))
    floor, ceiling = int(bound * i), i + int(bound * (len(text) - i))
    with scales(indexed, piece):
        back = _back(text, i, count, floor, run=run)
        forward = _forward(text, i, count, ceiling, run=run)
    assert back == reference_back(text, i, count, floor, run=run)
    assert forward == reference_forward(text, i, count, ceiling, run=run)


def test_a_walk_over_a_long_run_of_tags_decodes_no_tag_alone() -> None:
    """Work, not time: the seam windows' walks over 256 KiB of `<b>` (a blocking regex input
    guardrail, 500-character cuts: 524 windows, four walks each) decode a handful of matches one
    at a time; 7c96083's decoded 3.2 million (each tag about 40 times). (The view the detector
    judges decodes each tag once per content it is in, as before.)"""
    decoded = 0
    walking = False
    real_decoded, real_runs = normalise._decoded, detector_queue.markup_hidden_runs

    def counting(m: Any) -> Any:
        nonlocal decoded
        decoded += walking
        return real_decoded(m)

    def runs(text: str, lo: int, hi: int) -> Any:
        nonlocal walking
        walking = True
        try:
            return real_runs(text, lo, hi)
        finally:
            walking = False

    text = "<b>" * (256 * 1024 // 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(normalise, "_decoded", counting)
        patch.setattr(detector_queue, "markup_hidden_runs", runs)
        normalise._index.cache_clear()
        found = asyncio.run(judge_text(text, [regex_detector("block")], registry(500)))
    # (a run of hidden characters a window had to cut is refused: it fails closed, as before)
    assert {f.detection for f in found} == {detector_queue.OBFUSCATED}
    assert decoded < 1000, decoded


def reference_unmarked(text: str) -> normalise.View | None:
    """7c96083's `_unmarked`: every match decoded alone."""
    view_at: list[int] = []
    orig_at: list[int] = []
    ends: dict[int, int] = {}
    pieces: list[str] = []
    at = delta = 0
    for m in MARKUP.finditer(text):
        shown = _decoded(m)
        if shown is None:
            continue
        i, j = m.start(), m.end()
        pieces += (text[at:i], shown)
        at = j
        vpos = i + delta + len(shown)
        if shown:
            ends[i] = j
        if view_at and view_at[-1] == vpos:
            view_at.pop()
            orig_at.pop()
        view_at.append(vpos)
        orig_at.append(j)
        delta += len(shown) - (j - i)
    if not pieces:
        return None
    pieces.append(text[at:])
    return normalise.View(text, "".join(pieces), view_at, orig_at, set(), ends)


def the_map(view: normalise.View | None) -> Any:
    if view is None:
        return None
    return (view.text, view._view_at, view._orig_at, view._ends)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=markup, piece=st.sampled_from([8, 40, 512]), spans=st.lists(st.floats(0, 1), max_size=6)
)
def test_the_view_is_the_per_match_view(text: str, piece: int, spans: list[float]) -> None:
    """The markup view (what every built-in detector judges, and its map back to the source,
    where detections are redacted or blocked): the same text, breakpoints and spans."""
    with scales(False, piece):
        got = normalise._unmarked(text)
    want = reference_unmarked(text)
    assert the_map(got) == the_map(want)
    if got is not None and want is not None:
        cuts = sorted(int(f * len(got.text)) for f in spans)
        for a, b in itertools.pairwise(cuts):
            assert got.span(a, b) == want.span(a, b)


@pytest.mark.parametrize("piece", [8, 512])
def test_a_stretch_that_starts_inside_a_match_scans_on_its_own_until_in_step(piece: int) -> None:
    """Known cases for the index (`_MarkupIndex.synced`): stretches whose scan starts inside a
    match of the whole text's scan, which a scan from there reads otherwise (the tags inside a
    Markdown link's target, entities inside a tag's attributes, the middle of a run of `*`);
    every start, against the per-match scan. (No case found makes the two scans differ at or
    after `lo`: every match is shorter than MARKUP_MOST, so the scan that starts that far
    before `lo` is back in step by then; `synced` does not rely on that.)"""
    texts = [
        "x" * 400 + "](" + "<b>" * 80 + ")" + "y" * 400,
        "x" * 400 + '<span title="' + "&#97;" * 40 + '">' + "<b>" * 100 + "y" * 400,
        "x" * 400 + "a" + "*" * 301 + "b" + "<b>" * 100,
    ]
    for text in texts:
        with scales(True, piece):
            for lo in range(0, len(text), 3):
                for hi in (lo + 5, lo + 100, len(text)):
                    assert markup_hidden(text, lo, hi) == reference_hidden(text, lo, hi), (lo, hi)
