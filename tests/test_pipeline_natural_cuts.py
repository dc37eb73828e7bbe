"""Seam windows only where a cut is not natural, and only for span detectors (issue 33 item 8).

A chunk boundary is looked across (a seam window, DESIGN 4.6a) so that an entity cut in two by
it is still found whole. A natural cut (whitespace after a sentence end, or a line break:
`chunkers.natural_cut`) splits no built-in regex kind, so the regex detector needs no window
there; every other cut (a `max_chars` cut inside a run, a word-count cut, a cut with no
whitespace after it) keeps its window, and so does every cut for a detector whose spans may
cross one (custom patterns, remote detectors). A classifier judges its chunks alone.

The first property is the one everything rests on: no built-in match, in any text (hostile
Unicode, right-to-left overrides and closers included), crosses a natural cut. The seam
properties of tests/test_pipeline_redaction_seams.py and tests/test_pipeline_span_integrity.py
hold unchanged on top of it (streams); the second property here is their whole-text form.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chunkers
import detectors
from detectors.service import create_app
from orchestrator.clients.detectors import HttpDetectorClient, InProcessDetectorClient
from orchestrator.clients.registry import RequestedDetector
from orchestrator.config import DetectorConfig
from orchestrator.streaming import text_judgement
from orchestrator.streaming.detector_queue import seam_ends
from orchestrator.streaming.text_judgement import judge_text
from tests import test_pipeline_redaction_seams as seams
from tests.test_pipeline_redaction_seams import CountingRegex, registry, run_stream

REGEX = detectors.build("regex")

ENTITIES = [
    *seams.ENTITIES,
    "555.123.4567",
    "555 123 4567",
    "+1 555 123 4567",
    "1 (555) 123-4567",
    "+44 (20) 7946 0958",
    "+44 20 7946 0958",
    "4111.1111.1111.1111",
    "078 05 1120",
    "2001:db8::1",
    "555-123-4567 ext. 123",  # `ext. ` is a natural cut: the number is found without it
    "0421 96 07 23 ext 45",
]
# what a sentence end, a closer, whitespace of other scripts, an override or a mark can add
GLUE = [
    ". ", "? ", "! ", ".) ", '." ', ".] ", "?' ", ".\n", "\n", "\n\n", "\r\n", " ", "  ",
    "\t", "\u00a0", "\u2009", "\u3000", "\u2028", ".\u00a0", ".\u3000", "(", ")", ".", "-",
    "+", "1", "55", "@", "a", "A", "x.", "\u200b", "\u00ad", "\u202e", "\u202c", "\u0301",
    "\u3002", "\uff0e",
]  # fmt: skip

texts = st.lists(
    st.one_of(st.sampled_from(ENTITIES), st.sampled_from(GLUE), st.text("5 .()-\n+@a", max_size=4)),
    min_size=1,
    max_size=16,
).map("".join)


@settings(max_examples=600, deadline=None)
@given(text=texts)
def test_no_builtin_match_crosses_a_natural_cut(text: str) -> None:
    """What lets the regex detector go without windows at natural cuts: none of its matches
    (logical or display order, through the view) holds a natural cut inside it."""
    [hits] = asyncio.run(REGEX.detect([text], {}))
    # every natural cut any chunk could end at (a chunk from 0 walks back furthest)
    cuts = [i for i in range(1, len(text)) if chunkers.natural_cut(text, i)]
    crossing = [(h.start, h.end, h.text) for h in hits for i in cuts if h.start < i < h.end]
    assert crossing == [], (text, cuts)


def regex_detector(on_detection: str = "block", chunker: str = "s", **params: Any) -> Any:
    """The built-in regex detector as a request uses it (with custom `patterns` if given)."""
    built = detectors.build("regex", params) if params else REGEX
    client = InProcessDetectorClient("pii", DetectorConfig(builtin="regex"), built)
    return RequestedDetector("pii", client, chunker, 0.5, on_detection, {})  # type: ignore[arg-type]


def seam_recorder(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The boundaries text_judgement opens a seam window at."""
    at: list[int] = []
    real = text_judgement._seam

    def seam(text: str, start: int, end: int, boundary: int) -> Any:
        at.append(boundary)
        return real(text, start, end, boundary)

    monkeypatch.setattr(text_judgement, "_seam", seam)
    return at


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    text=texts,
    max_chars=st.sampled_from([1, 5, 9, 16, 40, 500]),
    chunker=st.sampled_from(["s", "p", "w"]),
    annotating=st.booleans(),
)
def test_every_match_of_the_whole_text_is_found_with_windows_only_at_unnatural_cuts(
    monkeypatch: pytest.MonkeyPatch, text: str, max_chars: int, chunker: str, annotating: bool
) -> None:
    """An input (blocking) or the content endpoint's annotations, any chunker and `max_chars`:
    the windows judged are exactly those at the chunk ends that are no natural cut, and on an
    input each match the detector finds in the whole text is seen (a finding overlaps it: a
    chunk of a run of glued values can parse it differently, as before), and no finding twice. (Annotations drop a detection that covers a whole window, a text no longer than an
    entity and its window: left as it was.)"""
    at = seam_recorder(monkeypatch)
    at.clear()  # (hypothesis runs every example with the one fixture)
    reg = registry(max_chars)
    det = regex_detector("annotate" if annotating else "block", chunker)
    found = asyncio.run(judge_text(text, [det], reg, annotating=annotating))
    [whole] = asyncio.run(REGEX.detect([text], {}))
    spans = [(f.start, f.end, f.detection) for f in found]
    assert len(set(spans)) == len(spans)
    if not annotating:  # no match of the whole text goes unseen
        missed = [h for h in whole if not any(f.start < h.end and h.start < f.end for f in found)]
        assert missed == [], (text, found)
    chunks = reg.get(chunker).chunk(text)
    assert at == [c.end for c in chunks[:-1] if not c.natural_end]


SENTENCE = "Mail jo@example.com or call 555-123-4567 today. "


def test_an_input_of_sentences_has_no_windows_for_the_regex_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every sentence end here is a natural cut: the detector judges the 50 sentences and
    nothing else (it judged 99 items before: a window at each boundary)."""
    at = seam_recorder(monkeypatch)
    found = asyncio.run(judge_text(SENTENCE * 50, [regex_detector()], registry(500)))
    assert len(found) == 100 and at == []


TICKET_TEXT = "See T-42. Then more. And the end."


def test_a_custom_pattern_may_cross_a_sentence_end_so_every_cut_is_windowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A custom pattern may match across `. `: every boundary keeps its window, and the match
    across the sentence end is found."""
    at = seam_recorder(monkeypatch)
    det = regex_detector(patterns={"ticket": r"T-[0-9]+\. [A-Z]"})
    found = asyncio.run(judge_text(TICKET_TEXT, [det], registry(500)))
    chunks = registry(500).get("s").chunk(TICKET_TEXT)
    assert [c.natural_end for c in chunks] == [True, True, False]
    assert at == [chunks[0].end, chunks[1].end]
    assert [(f.start, f.end, f.text) for f in found] == [(4, 11, "T-42. T")]


async def test_a_remote_span_detector_is_windowed_at_every_cut(
    aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator does not know a remote detector's patterns (here the detector service
    with the same custom pattern): every boundary keeps its window."""
    ticket = detectors.build("regex", {"patterns": {"ticket": r"T-[0-9]+\. [A-Z]"}})
    server = await aiohttp_server(create_app({"pii": ticket}, warmup=False))
    at = seam_recorder(monkeypatch)
    async with aiohttp.ClientSession() as session:
        client = HttpDetectorClient(
            "pii", DetectorConfig(url=f"http://127.0.0.1:{server.port}"), session
        )
        det = RequestedDetector("pii", client, "s", 0.5, "block", {})
        found = await judge_text(TICKET_TEXT, [det], registry(500))
    chunks = registry(500).get("s").chunk(TICKET_TEXT)
    assert at == [chunks[0].end, chunks[1].end]
    assert [(f.start, f.end, f.text) for f in found] == [(4, 11, "T-42. T")]


def test_seam_ends_by_kind_of_detector() -> None:
    """A classifier: at the ends that are no natural cut (a phrase cut by `max_chars` or a word
    count), none when it redacts (it redacts exactly its chunks); a span detector: at the ends
    that are no natural cut, or at every end when its spans may cross one."""
    natural = chunkers.Span(0, 3, "Hi.", natural_end=True)
    cut = chunkers.Span(0, 3, "Hi ")
    for action in ("block", "annotate"):
        classifier = seam_ends(
            RequestedDetector(
                "hap", regex_detector().client, "s", 0.5, action, {}, judges_chunks=True
            )
        )
        assert classifier is not None and (classifier(natural), classifier(cut)) == (False, True)
    redacting = RequestedDetector(
        "hap", regex_detector().client, "s", 0.5, "redact", {}, judges_chunks=True
    )
    assert seam_ends(redacting) is None
    regex = seam_ends(regex_detector())
    assert regex is not None and (regex(natural), regex(cut)) == (False, True)
    custom = seam_ends(regex_detector(patterns={"x": "x"}))
    assert custom is not None and (custom(natural), custom(cut)) == (True, True)


@pytest.mark.parametrize("annotating", [True, False], ids=["content", "input"])
def test_a_words_chunker_cut_inside_a_phone_number_is_one_finding(annotating: bool) -> None:
    """Word-count cuts put two boundaries inside `+1 555 123 4567`. The content endpoint looked
    across `max_chars` safety cuts only, so its annotations missed it; an input had a window at
    each boundary and reported it twice (both on c2003a7)."""
    text = "Call +1 555 123 4567 now."
    det = regex_detector("annotate" if annotating else "block", "w")
    assert [c.text for c in registry(500).get("w").chunk(text)] == [
        "Call +1",
        " 555 123",
        " 4567 now.",
    ]
    found = asyncio.run(judge_text(text, [det], registry(500), annotating=annotating))
    assert [(f.start, f.end, f.text, f.detection) for f in found] == [
        (5, 20, "+1 555 123 4567", "phone")
    ]


@pytest.mark.parametrize("on_detection", ["redact", "block"])
def test_a_stream_of_sentences_is_judged_once(on_detection: str) -> None:
    """A redacting or blocking regex detector on a stream of sentences neither carries a tail
    into the next call nor looks across a sentence end: each character is judged once
    (c2003a7's redacting queue judged 3.1x and its blocking one 4.8x the text)."""
    text = SENTENCE.replace("jo@example.com", "nobody").replace("555-123-4567", "me") * 40
    counting = CountingRegex()
    client = InProcessDetectorClient("pii", DetectorConfig(builtin="regex"), counting)
    det = RequestedDetector("pii", client, "s", 0.5, on_detection, {})  # type: ignore[arg-type]
    frames = asyncio.run(
        run_stream([text[i : i + 7] for i in range(0, len(text), 7)], [det], registry(500))
    )
    assert "".join(f.text for f in frames) == text
    assert counting.judged == len(text)


async def test_a_blocking_classifier_sees_a_phrase_a_word_count_cut_in_two() -> None:
    """An injection cut in two by a chunker's word count (no sentence end there) reads benign
    in each half; a blocking classifier judges across the cut too, on the input and on the
    output: the prompt never reaches the engine, and no word of the phrase leaves."""
    from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
    from tests.fakes.engine import FakeEngine
    from tests.orchestrator_support import Orchestrator, frames, generation_body, native_config

    dets = FakeDetectorServer()
    dets.add("cls", DetectorBehaviour(words={"go away": 0.9}, detection="injection"))
    await dets.start()
    engine = FakeEngine(script=["Please", " go", " away", " now"])
    await engine.start()
    cls = {
        "type": "text_contents",
        "url": dets.url,
        "chunker_id": "two",
        "judges": "chunks",
        "on_detection": "block",
    }
    config = native_config(
        engine.url, detectors={"cls": cls}, chunkers={"two": {"type": "words", "max_words": 2}}
    )
    try:
        async with Orchestrator(config) as orch:
            refused = await orch.stream(generation_body("Please go away now", input={"cls": {}}))
            assert engine.requests == []
            assert refused[-1].data["incomplete_details"] == {"reason": "content_filter"}
            blocked = await orch.stream(generation_body("Hi", output={"cls": {}}))
    finally:
        await engine.close()
        await dets.close()
    released = "".join(f.data["generated_text"] for f in frames(blocked))
    assert "go" not in released and "away" not in released, released
    assert blocked[-1].data["incomplete_details"] == {"reason": "content_filter"}


@pytest.mark.parametrize("chunker", ["s", "p", "w"])
def test_an_override_in_an_earlier_piece_still_orders_a_later_one(
    monkeypatch: pytest.MonkeyPatch, chunker: str
) -> None:
    """A right-to-left override reverses what follows it to the paragraph's end, across every
    chunk after it: the whole text reads `32 70 69` (a phone) where the logical order has
    `96 07 23` glued to `com0421`. Each chunk and window is read after the overrides open where
    it starts (`open_overrides`); on 3e29c34 hypothesis found a blocking input's chunks and
    windows missing that phone (a reader of the whole text saw it), at 96 of 234 settings."""
    seam_recorder(monkeypatch)
    email = "jo@example.com"
    text = email * 2 + "\u202e(555) 123-4567" + email * 4 + "0421 96 07 23."
    [whole] = asyncio.run(REGEX.detect([text], {}))
    assert (104, 112, "96 07 23") in [(h.start, h.end, h.text) for h in whole]
    for max_chars in (5, 40, 500):
        found = asyncio.run(
            judge_text(text, [regex_detector("block", chunker)], registry(max_chars))
        )
        assert any(f.start < 112 and 104 < f.end for f in found), (max_chars, found)


def test_open_overrides_are_the_controls_a_reader_still_applies() -> None:
    from detectors.normalise import open_overrides

    rlo, lro, pdf, lri, pdi = "\u202e", "\u202d", "\u202c", "\u2066", "\u2069"
    text = f"a{rlo}b{lro}c{pdf}d\ne{lri}{rlo}f{pdi}g"
    #        0 1   2 3   4 5   6 7 8 9   10  11 12  13
    assert open_overrides(text, [0, 2, 4, 6, 8, 11, 13]) == [
        "",
        rlo,
        rlo + lro,
        rlo,
        "",
        lri + rlo,
        "",
    ]
    assert open_overrides("plain", [0, 3]) == ["", ""]


def test_open_overrides_nest_no_deeper_than_uax9_allows() -> None:
    """Repro: every unclosed override stayed open, and each piece of the text was read after
    all of them, so 262,144 `\\u202ea` pairs (a 1 MiB body) in 500-character sentence chunks
    gave the detectors 137 million characters of controls (0.27 s and 34 million for a quarter
    of that: quadratic). UAX #9 ignores a control past depth 125 (and the control closing it):
    so do these, and a piece is read after at most 125 of them."""
    from detectors.normalise import MAX_DEPTH, open_overrides, reversed_runs

    rlo, lre, pdf, lri, pdi = "\u202e", "\u202a", "\u202c", "\u2066", "\u2069"
    text = (rlo + "a") * 262_144
    starts = list(range(0, len(text), 500))
    opened = open_overrides(text, starts)
    assert MAX_DEPTH == 125
    assert max(map(len, opened)) == 125 and opened[-1] == rlo * 125
    # the 126th and later are ignored: as many closing controls cancel them first
    deep = lre * 125 + rlo * 3 + "x" + pdf * 3 + "y" + pdf * 124 + "z" + pdf + "w"
    at = [deep.index(c) for c in "xyzw"]
    assert open_overrides(deep, at) == ["", "", "", ""]  # the override never opened
    assert reversed_runs(deep) == []
    shallow = lre * 124 + rlo + "x" + pdf + "y"
    assert open_overrides(shallow, [shallow.index("x"), shallow.index("y")]) == [
        lre * 124 + rlo,
        "",
    ]
    # an isolate past the limit is ignored too, and its PDI with it
    isolated = lre * 125 + lri + pdi + "x"
    assert open_overrides(isolated + rlo, [len(isolated)]) == [""]
    nested = rlo + lre * 124 + lri + pdi + "x"
    assert open_overrides(nested, [nested.index("x")]) == [rlo + lre * 124]
