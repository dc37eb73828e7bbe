"""ReadPacer: how long the engine reader waits before its next read, on a clock the test moves."""

from __future__ import annotations

import pytest

from orchestrator.streaming.read_pacing import MIN_DELAY_S, ReadPacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_read_never_waits() -> None:
    """Time to first token is not a per-token time."""
    clock = Clock()
    pacer = ReadPacer(clock, tokens=5, max_delay_s=0.05)
    clock.now += 2.0  # a long prefill
    assert pacer.after_read(1) == 0.0


def test_a_paced_stream_is_read_once_per_tokens_time() -> None:
    clock = Clock()
    pacer = ReadPacer(clock, tokens=3, max_delay_s=0.05)
    pacer.after_read(1)
    clock.now += 0.010  # one token in 10 ms
    assert pacer.after_read(1) == pytest.approx(0.030)
    clock.now += 0.030  # the wait, then three tokens were there
    assert pacer.after_read(3) == pytest.approx(0.030)


def test_the_wait_never_exceeds_the_cap() -> None:
    clock = Clock()
    pacer = ReadPacer(clock, tokens=5, max_delay_s=0.05)
    pacer.after_read(1)
    clock.now += 0.100
    assert pacer.after_read(1) == 0.05


def test_a_burst_is_read_without_waiting() -> None:
    """Tokens already buffered (a fast engine, a backlog after a migration) come 64 to a read
    with no time between reads: release must never wait on a timer."""
    clock = Clock()
    pacer = ReadPacer(clock, tokens=5, max_delay_s=0.05)
    pacer.after_read(64)
    for _ in range(10):
        clock.now += 0.0001
        assert pacer.after_read(64) == 0.0


def test_a_stream_that_speeds_up_stops_waiting() -> None:
    clock = Clock()
    pacer = ReadPacer(clock, tokens=5, max_delay_s=0.05)
    pacer.after_read(1)
    clock.now += 0.010
    assert pacer.after_read(1) > 0
    delays = []
    for _ in range(30):
        clock.now += 0.0001
        delays.append(pacer.after_read(64))
    assert delays[-1] == 0.0 and delays == sorted(delays, reverse=True)
    assert all(d == 0.0 or d >= MIN_DELAY_S for d in delays)


def test_time_held_back_by_the_detectors_is_not_the_engines_pace() -> None:
    clock = Clock()
    pacer = ReadPacer(clock, tokens=5, max_delay_s=0.05)
    pacer.after_read(64)
    clock.now += 0.0001
    assert pacer.after_read(64) == 0.0
    pacer.held_back()
    clock.now += 5.0  # the reader waited for slow detectors
    assert pacer.after_read(64) == 0.0
    clock.now += 0.0001
    assert pacer.after_read(64) == 0.0


def test_zero_tokens_turns_pacing_off() -> None:
    clock = Clock()
    pacer = ReadPacer(clock, tokens=0, max_delay_s=0.05)
    for _ in range(3):
        clock.now += 0.5
        assert pacer.after_read(1) == 0.0
