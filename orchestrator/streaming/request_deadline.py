"""The clock of `request_timeout_s` for the streamed pipelines (DESIGN 4): the event loop's.

A module attribute, as `clients.stall_timeout.stall_clock` is for the stall timeout, so that a
test can put a manual clock in `deadline_clock` and end a request's time at the moment it
chooses (tests/fakes/clock.py) instead of waiting for a real window that a slow machine could
miss. A stream keeps the clock it started with.
"""

from __future__ import annotations

from ..clients.loop_clock import Cancellable, LoopClock

__all__ = ["Cancellable", "deadline_clock"]

deadline_clock = LoopClock()
