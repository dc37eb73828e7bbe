"""The cap on concurrent streams: beyond it a request gets 429 with Retry-After instead of
degrading every stream already running."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..api.errors import ApiError, ErrorType
from ..state import AppState


class TooManyStreams(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(429, ErrorType.OVERLOADED, f"too many concurrent streams (limit {limit})")
        self.retry_after_s = 1


@contextmanager
def stream_slot(state: AppState, stream: Any = None) -> Iterator[None]:
    limit = state.config.server.max_concurrent_streams
    if state.draining:
        state.metrics.rejected_streams.labels("draining").inc()
        raise ApiError(503, ErrorType.SERVER_SHUTDOWN, "the server is shutting down")
    if state.active_streams >= limit:
        state.metrics.rejected_streams.labels("overloaded").inc()
        raise TooManyStreams(limit)
    state.active_streams += 1
    state.idle.clear()
    state.metrics.active_streams.inc()
    if stream is not None:
        state.streams.add(stream)
    try:
        yield
    finally:
        state.streams.discard(stream)
        state.active_streams -= 1
        if state.active_streams == 0:
            state.idle.set()
        state.metrics.active_streams.dec()
