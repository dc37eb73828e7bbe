"""Token buckets: a tenant's requests and tokens per minute (config `tenants.*.limits`).

A bucket holds up to `capacity` and refills continuously at `capacity` per minute, so a tenant
gets a burst of its whole minute and then a steady rate, and a refusal can say exactly when to
come back (Retry-After). The clock is injected (`AppState.clock`): tests set it, never wait.
Hand-written rather than a library: the token budget is charged after the fact (a stream's
tokens are known when it ends, so the level may go below zero), which the usual limiters
(aiolimiter, limits) do not model, and the whole of it is a few lines."""

from __future__ import annotations

import math
from collections.abc import Callable

Clock = Callable[[], float]  # monotonic seconds


class TokenBucket:
    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.capacity = float(per_minute)
        self._clock = clock
        self._level = self.capacity
        self._at = clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.capacity / 60)
        self._at = now
        return self._level

    def _seconds(self, deficit: float) -> float:
        return deficit * 60 / self.capacity  # not deficit / (capacity / 60): exact for 1 / 2

    def take(self, amount: float = 1.0) -> int | None:
        """Takes `amount` if the bucket holds it: None; else the whole seconds until it will."""
        level = self.level()
        if level >= amount:
            self._level = level - amount
            return None
        return max(1, math.ceil(self._seconds(amount - level)))

    def positive(self) -> int | None:
        """None while the bucket holds anything; else the whole seconds until it will (the
        first whole second at which the level is above zero)."""
        level = self.level()
        if level > 0:
            return None
        return math.floor(self._seconds(-level)) + 1

    def charge(self, amount: float) -> None:
        """Takes `amount` after the fact: the level may go below zero (the next requests wait)."""
        self._level = self.level() - amount
