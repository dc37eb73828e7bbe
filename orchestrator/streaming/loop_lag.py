"""How far behind the event loop runs: the signal that the orchestrator is under load.

A probe asks to run every `interval_s` and records how late it ran; the smoothed lag says whether
the loop is busy. Read pacing (`ReadPacer`) coalesces engine reads only while it is: an idle
loop handles each token the moment it arrives (release adds no wait), a loaded one trades a few
tokens' wait for far fewer wake-ups, which is also what brings its queueing delay down."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: The loop counts as busy while its smoothed lag is at least this.
BUSY_LAG_S = 0.002
PROBE_INTERVAL_S = 0.1
SMOOTHING = 0.3


class LoopLag:
    def __init__(
        self,
        *,
        busy_lag_s: float = BUSY_LAG_S,
        interval_s: float = PROBE_INTERVAL_S,
        on_probe: Callable[[float], None] | None = None,
    ):
        """`on_probe` gets each probe's lateness in seconds (the orchestrator's metrics)."""
        self._busy_lag_s = busy_lag_s
        self._on_probe = on_probe
        self._interval_s = interval_s
        self._lag_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    @property
    def lag_s(self) -> float:
        return self._lag_s

    def busy(self) -> bool:
        return self._lag_s >= self._busy_lag_s

    def record(self, lag_s: float) -> None:
        """One probe's lateness (the probe calls it; tests call it directly), also handed to
        `on_probe`."""
        lag_s = max(lag_s, 0.0)
        self._lag_s += SMOOTHING * (lag_s - self._lag_s)
        if self._on_probe is not None:
            self._on_probe(lag_s)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self._interval_s
        self._handle = self._loop.call_at(self._due, self._probe)

    def _probe(self) -> None:
        assert self._loop is not None
        self.record(self._loop.time() - self._due)
        self._schedule()
