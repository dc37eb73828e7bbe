"""ReadPacer: how long the engine reader waits before its next read, on a clock the test moves;
LoopLag: whether the loop is busy enough for pacing."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.streaming.loop_lag import LoopLag
from orchestrator.streaming.read_pacing import MIN_DELAY_S, ReadPacer
from tests.wait_support import within


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced(tokens: float = 5) -> tuple[Clock, ReadPacer]:
    """A pacer on a clock the test moves (a 50 ms cap)."""
    clock = Clock()
    return clock, ReadPacer(clock, tokens=tokens, max_delay_s=0.05)


def test_the_first_read_never_waits() -> None:
    """Time to first token is not a per-token time."""
    clock, pacer = paced()
    clock.now += 2.0  # a long prefill
    assert pacer.after_read(1) == 0.0


def test_a_paced_stream_is_read_once_per_tokens_time() -> None:
    clock, pacer = paced(tokens=3)
    pacer.after_read(1)
    clock.now += 0.010  # one token in 10 ms
    assert pacer.after_read(1) == pytest.approx(0.030)
    clock.now += 0.030  # the wait, then three tokens were there
    assert pacer.after_read(3) == pytest.approx(0.030)


def test_the_wait_never_exceeds_the_cap() -> None:
    clock, pacer = paced()
    pacer.after_read(1)
    clock.now += 0.100
    assert pacer.after_read(1) == 0.05


def test_a_burst_is_read_without_waiting() -> None:
    """Tokens already buffered (a fast engine, a backlog after a migration) come 64 to a read
    with no time between reads: release must never wait on a timer."""
    clock, pacer = paced()
    pacer.after_read(64)
    for _ in range(10):
        clock.now += 0.0001
        assert pacer.after_read(64) == 0.0


def test_a_stream_that_speeds_up_stops_waiting() -> None:
    clock, pacer = paced()
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
    clock, pacer = paced()
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


def test_an_inactive_pacer_reads_at_once_and_keeps_its_estimate() -> None:
    """The orchestrator paces only while its loop is busy: when it becomes busy, the estimate of
    the stream's pace is already there."""
    clock, busy = Clock(), [False]
    pacer = ReadPacer(clock, tokens=3, max_delay_s=0.05, active=lambda: busy[0])
    pacer.after_read(1)
    for _ in range(3):
        clock.now += 0.010
        assert pacer.after_read(1) == 0.0
    busy[0] = True
    clock.now += 0.010
    assert pacer.after_read(1) == pytest.approx(0.030)


def test_loop_lag_is_busy_once_the_smoothed_lag_passes_the_threshold() -> None:
    lag = LoopLag(busy_lag_s=0.002)
    assert not lag.busy()
    lag.record(0.0015)
    assert not lag.busy()
    for _ in range(5):
        lag.record(0.010)
    assert lag.busy()
    for _ in range(30):
        lag.record(0.0)
    assert not lag.busy()
    assert LoopLag(busy_lag_s=0).busy()  # read_coalesce_min_lag_ms 0: pace always


async def test_loop_lag_sees_a_blocked_loop() -> None:
    """The loop is blocked (time.sleep) far past the probe's due time, so the first probe runs
    late by at least the difference, whatever the machine's speed."""
    samples: list[tuple[float, bool]] = []  # (lateness, busy after it)
    probed = asyncio.Event()

    class Recording(LoopLag):
        def record(self, lag_s: float) -> None:
            super().record(lag_s)
            samples.append((lag_s, self.busy()))
            probed.set()

    lag = Recording(busy_lag_s=0.002, interval_s=0.01)
    lag.start()
    try:
        time.sleep(0.3)  # noqa: ASYNC251 -- blocks the loop on purpose: the probe is due at 0.01 s
        async with within(10):  # a guard, not a window
            await probed.wait()
        late, busy = samples[0]
        assert late >= 0.29
        assert busy  # one smoothed sample: 0.3 x 0.29 s, far above 2 ms
    finally:
        lag.stop()
