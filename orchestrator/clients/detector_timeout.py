"""The timeout of one detector call (config `detectors.*.timeout_s`, DESIGN 6): the whole call,
built-in or remote, connection and reply included, ends in a `TimeoutError` when it runs out.

This module holds the clock it runs on, as `stall_timeout.stall_clock` is for the stall timeout,
so that a test can put a manual clock in `detector_clock` and end a detector's time at the moment
it chooses (tests/fakes/clock.py) instead of waiting out a real second that a slow machine
could stretch, or a fast one reach before the call under test is even in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .loop_clock import LoopClock

detector_clock = LoopClock()


@asynccontextmanager
async def detector_timeout(seconds: float) -> AsyncIterator[None]:
    """`asyncio.timeout(seconds)` on `detector_clock`: when its timer fires, the block is
    cancelled and `TimeoutError` raised, with asyncio.timeout's own care for a cancellation
    that comes from elsewhere (that one propagates as it is)."""
    clock = detector_clock
    async with asyncio.timeout(None) as bound:

        def expire() -> None:
            bound.reschedule(asyncio.get_running_loop().time())

        timer = clock.call_later(seconds, expire)
        try:
            yield
        finally:
            timer.cancel()
