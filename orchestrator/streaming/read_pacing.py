"""How often the pipeline reads a paced engine stream: once per few tokens, not once per token.

An engine that streams at its own pace (a token every 10 ms, say) wakes a reader that waits on it
once per token: a socket read, the SSE parse, an inbox message and a consumer wake-up, for a
token that almost never completes a chunk. `ReadPacer` estimates the stream's time per token from
what the reads delivered and, while it is paced, lets `tokens` tokens' worth of time pass before
the next read, so one wake-up handles several tokens (the kernel and the HTTP client buffer them
meanwhile).

What it costs: a frame's release is delayed by at most that wait, `tokens` token-times and never
more than `max_delay_s` (at 10 ms a token, 5 tokens: p50 28 ms, p99 56 ms, measured by
`bench/openai_overhead.py`). So the orchestrator paces only while its event loop is busy
(`LoopLag`): there the wait replaces a queueing delay that is larger, and an idle loop reads
every token at once. A burst (tokens already buffered: a fast GPU engine, a backlog after a
migration) has a per-token time near zero, so it is read without any wait and release is never
starved. The first read (time to first token is not a per-token time) never waits."""

from __future__ import annotations

from collections.abc import Callable

#: Below this wait a timer costs more than the wake-ups it saves.
MIN_DELAY_S = 0.001
#: Weight of the newest read in the per-token time estimate.
SMOOTHING = 0.25


class ReadPacer:
    def __init__(
        self,
        clock: Callable[[], float],
        *,
        tokens: float = 5.0,
        max_delay_s: float = 0.05,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        """`active` says whether to pace now (the orchestrator: while its loop is busy, see
        LoopLag); the estimate is kept up to date either way."""
        self._clock = clock
        self._active = active
        self._tokens = tokens
        self._max_delay_s = max_delay_s
        self._last_read: float | None = None
        self._per_token_s: float | None = None

    def after_read(self, items: int) -> float:
        """Seconds to wait before the next read, given that the read that just returned
        delivered `items` tokens."""
        now = self._clock()
        last, self._last_read = self._last_read, now
        if last is None or self._tokens <= 0:
            return 0.0
        per_token = (now - last) / max(items, 1)
        estimate = self._per_token_s
        self._per_token_s = (
            per_token if estimate is None else estimate + SMOOTHING * (per_token - estimate)
        )
        if not self._active():
            return 0.0
        delay = min(self._max_delay_s, self._tokens * self._per_token_s)
        return delay if delay >= MIN_DELAY_S else 0.0

    def held_back(self) -> None:
        """The reader waited for something else (detectors behind, a full inbox): that wait says
        nothing about the engine's pace, so the next read starts a new interval."""
        self._last_read = None
