"""The stall timeout (config `models.*.migration.stall_timeout_s`, DESIGN section 7): a replica
that sends nothing that says something (a token, text, a tool call, a finish reason, a reasoning
model's thinking) for this long is treated as dead, and the request migrates: keep-alives, empty
items and events without a choice do not count.

It is enforced by the line reader every HTTP engine stream reads through
(`line_transport.LineReader`, one lazily re-armed timer per stream); this module holds the clock
it runs on, so that tests can stop time for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class StallClock:
    """The time and the timers of the stall timeout: the event loop's. A module attribute, so a
    test can put a manual clock in `stall_clock` and declare a silent replica stalled when it
    chooses instead of waiting for it (tests/fakes/clock.py); a reader keeps the one it started
    with."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


stall_clock = StallClock()
