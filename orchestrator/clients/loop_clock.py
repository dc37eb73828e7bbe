"""The event loop as a clock of timers, for the bounds a test must be able to run out at will:
a module keeps one in an attribute (`request_deadline.deadline_clock`,
`detector_timeout.detector_clock`) that a test swaps for a manual clock (tests/fakes/clock.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class LoopClock:
    """Arms a timer on the running loop."""

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback, *args)
