"""`ReleasedStops` (streaming/released_stops.py): stop sequences matched on released frames, for
requests whose output guardrails redact or block. Whatever the frames, the text that leaves is
the joined text cut where the first stop sequence completes (the stop sequence not included),
nothing past the cut ever leaves, and every detection rides whole on the frame that holds it."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.streaming.findings import Finding
from orchestrator.streaming.released_stops import ReleasedStops
from orchestrator.streaming.stream_judgement import Release


def finding(start: int, end: int, text: str = "") -> Finding:
    return Finding(start, end, text or "x" * (end - start), "pii", "pii", "pii", 1.0)


def releases(pieces: list[str], final: bool = True) -> list[Release]:
    out, pos = [], 0
    for i, piece in enumerate(pieces):
        out.append(Release(pos, pos + len(piece), piece, final=final and i == len(pieces) - 1))
        pos += len(piece)
    return out


def run(stops: list[str], given_releases: list[Release]) -> tuple[list[Release], ReleasedStops]:
    matcher = ReleasedStops(stops)
    out = [r for r in map(matcher.take, given_releases) if r is not None]
    return out, matcher


def expected_cut(text: str, stops: list[str]) -> int | None:
    """The reference: the first character at which some stop sequence is complete; the cut is
    where the longest one complete there starts."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return end - max(map(len, done))
    return None


def test_a_stop_split_between_two_frames_matches_and_its_prefix_never_leaves() -> None:
    out, matcher = run(["END"], releases(["one two E", "ND three"]))
    assert [(r.start, r.end, r.text, r.final) for r in out] == [
        (0, 8, "one two ", False),
        (8, 8, "", True),
    ]
    assert matcher.stopped


def test_a_held_prefix_that_is_not_a_stop_goes_out_with_the_next_frame() -> None:
    out, matcher = run(["END"], releases(["one E", "NV two"]))
    assert [(r.start, r.end, r.text, r.final) for r in out] == [
        (0, 4, "one ", False),
        (4, 11, "ENV two", True),
    ]
    assert not matcher.stopped


def test_the_final_frame_lets_a_possible_prefix_out() -> None:
    out, matcher = run(["END"], releases(["one", " EN"]))
    assert "".join(r.text for r in out) == "one EN" and out[-1].final
    assert not matcher.stopped


def test_the_stop_completed_first_wins_and_the_longest_one_there() -> None:
    assert run(["abcd", "bc"], releases(["xabcd"]))[0][-1].text == "xa"
    assert run(["bc", "abc"], releases(["xabc"]))[0][-1].text == "x"


def test_a_detection_rides_whole_on_a_frame_and_is_clipped_at_the_stop() -> None:
    # the replacement starts at the stop: the client never receives it, nor its detection
    out, _ = run(["[ph"], [Release(0, 10, "my [phone]", [finding(3, 10, "[phone]")], final=True)])
    assert [(r.text, r.final, r.detections) for r in out] == [("my ", True, [])]

    # a detection on a held tail waits with it
    out, _ = run(["55"], [Release(0, 6, "call 5", [finding(5, 6, "5")]), Release(6, 9, "6. ")])
    assert [(r.start, r.end, r.text, r.detections) for r in out] == [
        (0, 5, "call ", []),
        (5, 9, "56. ", [finding(5, 6, "5")]),
    ]

    # a detection straddling a held tail is held whole, then clipped where the stop cuts it
    first = Release(0, 8, "call 567", [finding(5, 8, "567")])
    out, _ = run(["7."], [first, Release(8, 9, ".")])
    assert [(r.text, r.final, r.detections) for r in out] == [
        ("call ", False, []),
        ("56", True, [finding(5, 7, "56")]),
    ]


def test_nothing_goes_out_after_the_stop() -> None:
    matcher = ReleasedStops(["x"])
    assert matcher.take(Release(0, 3, "axb")) == Release(0, 1, "a", [], final=True)
    assert matcher.take(Release(3, 4, "c", final=True)) is None


ALPHABET = "ab."


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(ALPHABET, max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    ends_here=st.booleans(),
    spans=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), max_size=4),
)
def test_any_frames_give_the_joined_text_cut_at_the_first_stop(
    text: str,
    cuts: list[int],
    stops: list[str],
    ends_here: bool,
    spans: list[tuple[int, int]],
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    given_releases = releases(pieces, final=ends_here)
    # detections, each on the frame that holds it whole
    for start, size in spans:
        end = min(start + size, len(text))
        for r in given_releases:
            if r.start <= start and end <= r.end and start < len(text):
                r.detections = sorted([*r.detections, finding(start, end, text[start:end])],
                                      key=lambda d: (d.start, d.end))  # fmt: skip
                break
    out, matcher = run(stops, given_releases)

    cut = expected_cut(text, stops)
    got = "".join(r.text for r in out)
    assert matcher.stopped == (cut is not None)
    if cut is not None:
        assert got == text[:cut]  # nothing past the cut, ever
        assert out[-1].final
    elif ends_here:
        assert got == text and out[-1].final
    else:  # the stream goes on: only a possible stop's start is still held
        assert text.startswith(got)
        assert len(text) - len(got) <= max(map(len, stops)) - 1 or any(
            r.detections for r in given_releases
        )
        assert not any(r.final for r in out)
    pos = 0
    for r in out:  # contiguous, indices into the released text, detections inside their frame
        assert (r.start, r.end, r.text) == (pos, pos + len(r.text), text[pos : r.end])
        assert all(r.start <= d.start <= d.end <= r.end for d in r.detections)
        assert r.detections == sorted(r.detections, key=lambda d: (d.start, d.detector_id))
        pos = r.end
    sent = [d for r in out for d in r.detections]
    wanted = [
        d for r in given_releases for d in r.detections if d.end <= len(got) or d.start < len(got)
    ]
    if cut is not None or ends_here:  # every detection on text the client got, clipped to it
        assert sorted((d.start, d.end) for d in sent) == sorted(
            (d.start, min(d.end, len(got))) for d in wanted
        )
