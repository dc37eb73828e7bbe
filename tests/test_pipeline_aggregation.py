"""The aggregation rule of DESIGN 4.4 on its own: exact frames for hand-made cases, and invariants
under random chunk boundaries per detector and random arrival orders."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.streaming.aggregation import (
    AggregationError,
    DetectorResult,
    FrameAggregator,
)


def R(d: str, start: int, end: int, *dets: str) -> DetectorResult[str]:
    return DetectorResult(d, start, end, tuple(dets))


def test_one_detector_releases_each_result_as_a_frame() -> None:
    agg: FrameAggregator[str] = FrameAggregator(["a"])
    agg.push(R("a", 0, 5, "x"))
    [frame] = agg.pop_ready()
    assert (frame.start, frame.end, frame.results) == (0, 5, (R("a", 0, 5, "x"),))
    agg.push(R("a", 5, 9))
    assert [(f.start, f.end) for f in agg.pop_ready()] == [(5, 9)]


def test_waits_for_every_detector_then_releases_up_to_the_largest_head() -> None:
    # sentence detector (a) and paragraph detector (b)
    agg: FrameAggregator[str] = FrameAggregator(["a", "b"])
    agg.push(R("a", 0, 10))
    assert agg.pop_ready() == []  # b has nothing yet
    agg.push(R("a", 10, 20, "hit"))
    agg.push(R("b", 0, 30, "para"))
    assert agg.pop_ready() == []  # R = 30, a has judged only 20
    agg.push(R("a", 20, 30))
    [frame] = agg.pop_ready()
    assert (frame.start, frame.end) == (0, 30)
    assert frame.results == (
        R("a", 0, 10),
        R("a", 10, 20, "hit"),
        R("a", 20, 30),
        R("b", 0, 30, "para"),
    )
    assert agg.released == 30


def test_a_result_straddling_r_stays_queued_for_the_next_frame() -> None:
    agg: FrameAggregator[str] = FrameAggregator(["a", "b"])
    agg.push(R("a", 0, 10))
    agg.push(R("b", 0, 4))
    agg.push(R("b", 4, 12))
    # R = max(10, 4) = 10; b judged up to 12 >= 10; b's [4,12) stays queued
    [frame] = agg.pop_ready()
    assert (frame.start, frame.end) == (0, 10)
    assert frame.results == (R("a", 0, 10), R("b", 0, 4))
    agg.push(R("a", 10, 12))
    [frame] = agg.pop_ready()
    assert (frame.start, frame.end, frame.results) == (10, 12, (R("a", 10, 12), R("b", 4, 12)))


def test_finished_detector_no_longer_gates() -> None:
    agg: FrameAggregator[str] = FrameAggregator(["a", "b"])
    agg.push(R("a", 0, 3))
    agg.finish("b")  # b judged nothing (e.g. empty text for its chunker)
    [frame] = agg.pop_ready()
    assert (frame.start, frame.end) == (0, 3)
    agg.finish("a")
    assert agg.done


def test_out_of_order_result_is_rejected() -> None:
    agg: FrameAggregator[str] = FrameAggregator(["a"])
    agg.push(R("a", 0, 3))
    with pytest.raises(AggregationError):
        agg.push(R("a", 4, 6))
    with pytest.raises(AggregationError):
        agg.push(R("zz", 0, 1))


@st.composite
def scenario(draw: st.DrawFn) -> tuple[int, dict[str, list[tuple[int, int]]], list[str]]:
    n = draw(st.integers(0, 120))
    k = draw(st.integers(1, 4))
    partitions: dict[str, list[tuple[int, int]]] = {}
    for i in range(k):
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=12))) if n > 1 else []
        bounds = [0, *[c for c in cuts if 0 < c < n], n] if n else []
        partitions[f"d{i}"] = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    # a random interleaving of every detector's pushes, each followed at some point by finish
    events = [d for d, spans in partitions.items() for _ in range(len(spans) + 1)]
    order = draw(st.permutations(events))
    return n, partitions, list(order)


@settings(max_examples=400, deadline=None)
@given(scenario())
def test_random_boundaries_and_arrivals_give_contiguous_frames_each_result_once(
    case: tuple[int, dict[str, list[tuple[int, int]]], list[str]],
) -> None:
    n, partitions, order = case
    agg: FrameAggregator[str] = FrameAggregator(partitions)
    cursor = dict.fromkeys(partitions, 0)
    delivered: list[DetectorResult[str]] = []
    released = 0
    for d in order:
        spans = partitions[d]
        if cursor[d] < len(spans):
            start, end = spans[cursor[d]]
            agg.push(R(d, start, end, f"{d}@{start}"))
        else:
            agg.finish(d)
        cursor[d] += 1
        for frame in agg.pop_ready():
            assert frame.start == released, "frames are contiguous"
            assert frame.end >= frame.start
            for other in partitions:
                # no frame beyond what any detector still working has judged
                if cursor[other] <= len(partitions[other]):
                    assert agg.judged(other) >= frame.end
            for result in frame.results:
                assert result.end <= frame.end
            delivered.extend(frame.results)
            released = frame.end
    assert released == n, "everything is released once every detector finished"
    assert agg.done
    expected = sorted((d, a, b) for d, spans in partitions.items() for a, b in spans)
    assert sorted((r.detector_id, r.start, r.end) for r in delivered) == expected
