"""A clock that moves only when a test moves it, for the places where time is the subject of
the orchestrator's code: the replica pool's quarantine (`ReplicaPool.clock`), the stall
timeout of engine streams (`orchestrator.clients.stall_timeout.stall_clock`), the
`request_timeout_s` of streamed requests (`orchestrator.streaming.request_deadline`) and the
`timeout_s` of detector and judge calls (`orchestrator.clients.detector_timeout`). With it a test declares a
silent replica stalled, or a quarantine over, at the moment it chooses, and a slow machine can
neither fire a stall early nor end a quarantine early.

    clock = manual_stall_clock(monkeypatch)  # streams opened from now on use it
    ...
    await expire_stalls(clock, lambda: stream.migrations == 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orchestrator.clients import detector_timeout, stall_timeout
from orchestrator.streaming import request_deadline
from tests.wait_support import until


class ManualTimer:
    """What `loop.call_at` returns, as far as the stall timer uses it."""

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self._when = when
        self.callback = callback
        self.cancelled = False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Callable as a clock (`ReplicaPool(clock=...)`), and the `time()`/`call_at()` pair of the
    stall timer. Timers fire only inside `advance()`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[ManualTimer] = []

    def __call__(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> ManualTimer:
        timer = ManualTimer(when, callback)
        self._timers.append(timer)
        return timer

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> ManualTimer:
        """The `deadline_clock` side: a request's deadline, `delay` from now."""
        return self.call_at(self.now + delay, lambda: callback(*args))

    @property
    def armed(self) -> int:
        return sum(not t.cancelled for t in self._timers)

    def armed_within(self, seconds: float) -> bool:
        """A timer is due within `seconds` from now: a reader waits out a bound that short (the
        grace after a finish event), not the stall timeout."""
        return any(not t.cancelled and t.when() <= self.now + seconds for t in self._timers)

    def advance(self, seconds: float) -> None:
        """Move on by `seconds` and run the timers that are due, in order."""
        self.now += seconds
        self._timers = [t for t in self._timers if not t.cancelled]
        due = sorted((t for t in self._timers if t.when() <= self.now), key=ManualTimer.when)
        self._timers = [t for t in self._timers if t.when() > self.now]
        for timer in due:
            if not timer.cancelled:
                timer.callback()


class TickingClock(ManualClock):
    """A manual clock that moves on by `tick_s` each time it is read: time passes only as fast
    as a stream looks at it, so a test counts in reads what it would otherwise wait out in
    seconds. A replica that sends an event per read is stalled after a few reads unless its
    events re-arm the stall timeout, however fast or slow the machine runs the test."""

    def __init__(self, tick_s: float) -> None:
        super().__init__()
        self.tick_s = tick_s

    def time(self) -> float:
        self.now += self.tick_s
        return self.now


def ticking_stall_clock(monkeypatch: pytest.MonkeyPatch, tick_s: float) -> TickingClock:
    """Engine streams opened from now on time their stall timeout on a clock that moves `tick_s`
    at every read of it (TickingClock); its timers fire only in `advance()`."""
    clock = TickingClock(tick_s)
    monkeypatch.setattr(stall_timeout, "stall_clock", clock)
    return clock


def manual_stall_clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """Engine streams opened from now on (native and OpenAI protocol alike) time their stall
    timeout on a manual clock: no stream stalls until the test says so."""
    clock = ManualClock()
    monkeypatch.setattr(stall_timeout, "stall_clock", clock)
    return clock


def manual_deadline_clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """Streamed requests started from now on (generation and stream-content) time their
    `request_timeout_s` on a manual clock: none runs out of time until the test moves it."""
    clock = ManualClock()
    monkeypatch.setattr(request_deadline, "deadline_clock", clock)
    return clock


def manual_detector_clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """Detector and judge calls made from now on time their `timeout_s` on a manual clock: none
    times out until the test moves it (each call arms one timer, cancelled when it ends)."""
    clock = ManualClock()
    monkeypatch.setattr(detector_timeout, "detector_clock", clock)
    return clock


async def expire_stalls(
    clock: ManualClock, done: Callable[[], bool], *, deadline_s: float = 30.0
) -> None:
    """Declare every stream that waits for its replica stalled, again and again, until `done()`.

    Call it only once every replica that must not stall has nothing left to send that the test
    depends on (the faulty one went silent, the others have not been dispatched to): a stall is
    declared whatever the replica is doing. `done()` is checked right before each step, so a
    condition such as "the stream migrated" stops it before the next replica's stream exists."""
    await run_out(clock, done, "a stall ending the wait", deadline_s=deadline_s)


async def run_out(
    clock: ManualClock, done: Callable[[], bool], what: str, *, deadline_s: float = 30.0
) -> None:
    """Move `clock` an hour on, again and again, until `done()`: every timer armed on it runs
    out (a stall, a detector call's timeout), whatever it was waiting for."""

    def step() -> bool:
        if done():
            return True
        clock.advance(3600.0)
        return False

    await until(step, deadline_s, what)
