"""The timeout of a detector call (orchestrator/clients/detector_timeout.py) on a manual clock:
it ends the call when its time runs out and not before, leaves no timer behind a call that
ended, and lets a cancellation from elsewhere through as a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.clients.detector_timeout import detector_timeout
from tests.fakes.clock import manual_detector_clock
from tests.wait_support import until


async def test_the_call_ends_in_timeout_when_its_time_runs_out(monkeypatch) -> None:
    clock = manual_detector_clock(monkeypatch)
    entered = asyncio.Event()

    async def call() -> None:
        async with detector_timeout(2.0):
            entered.set()
            await asyncio.Event().wait()  # a detector that never answers

    task = asyncio.create_task(call())
    await entered.wait()
    clock.advance(1.5)
    assert clock.armed == 1 and not task.done()
    clock.advance(0.5)
    with pytest.raises(TimeoutError):
        await task
    assert clock.armed == 0


async def test_a_call_that_ends_leaves_no_timer(monkeypatch) -> None:
    clock = manual_detector_clock(monkeypatch)
    async with detector_timeout(2.0):
        assert clock.armed == 1
    assert clock.armed == 0
    clock.advance(3600.0)  # nothing left to fire into a block that is over


async def test_a_cancellation_from_elsewhere_stays_a_cancellation(monkeypatch) -> None:
    """A client that leaves cancels its detector calls: that is no timeout (no detector_error
    naming a detector that did nothing wrong)."""
    clock = manual_detector_clock(monkeypatch)
    entered = asyncio.Event()

    async def call() -> None:
        async with detector_timeout(2.0):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(call())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: clock.armed == 0, what="the call's timer cancelled")
