"""The cap on concurrent streams: beyond it a request gets 429 with Retry-After instead of
degrading every stream already running, and while draining it gets 503.

Every request that judges or generates text holds a slot while it is served: the streams and
unary generations (handlers/serving.py), and the detection endpoints that run no pipeline
(content, chat, context, generated; generation-detection across its generation and its
judging). A detection request is a share of every detector's queue like a stream is: were it
not counted, a flood of them would run past the server's overload protection. A slot is taken
before any work for the request: a refused request costs no engine round trip and no detector
call. The pipeline is attached to its slot once built, so a
drain that ends every running stream (server.py) reaches one that was still being prepared."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

from ..api.errors import ApiError, ErrorType
from ..errors import SHUTDOWN
from ..state import AppState
from ..tenants import Caller


class TooManyStreams(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(429, ErrorType.OVERLOADED, f"too many concurrent streams (limit {limit})")
        self.retry_after_s = 1


class Stoppable(Protocol):
    def shut_down(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


class StreamSlot:
    """One taken slot, in `AppState.streams` while held; `shut_down()` (a drain that ran out)
    reaches the attached pipeline, or the one attached later."""

    def __init__(self) -> None:
        self._stream: Stoppable | None = None
        self._shut_down = False

    def attach(self, stream: S) -> S:
        self._stream = stream
        if self._shut_down:
            stream.shut_down()
        return stream

    def shut_down(self) -> None:
        self._shut_down = True
        if self._stream is not None:
            self._stream.shut_down()


@contextmanager
def stream_slot(state: AppState, caller: Caller | None = None) -> Iterator[StreamSlot]:
    """A slot of the server's and, with a `caller`, of its tenant's max_concurrent_streams."""
    limit = state.config.server.max_concurrent_streams
    if state.draining:
        state.metrics.rejected_streams.labels("draining").inc()
        raise ApiError.of(SHUTDOWN)
    if state.active_streams >= limit:
        state.metrics.rejected_streams.labels("overloaded").inc()
        raise TooManyStreams(limit)
    with tenant_slot(state, caller), _server_slot(state) as slot:
        yield slot


@contextmanager
def tenant_slot(state: AppState, caller: Caller | None) -> Iterator[None]:
    """A slot of the caller's tenant's max_concurrent_streams alone ("its requests served at
    once"), taken with the server's by `stream_slot`."""
    if caller is None:
        yield
        return
    try:
        caller.gate.take_stream(caller.tenant.id)
    except ApiError:
        state.metrics.rejected_streams.labels("overloaded").inc()
        raise
    try:
        yield
    finally:
        caller.gate.release_stream()


@contextmanager
def _server_slot(state: AppState) -> Iterator[StreamSlot]:
    slot = StreamSlot()
    state.active_streams += 1
    state.idle.clear()
    state.metrics.active_streams.inc()
    state.streams.add(slot)
    try:
        yield slot
    finally:
        state.streams.discard(slot)
        state.active_streams -= 1
        if state.active_streams == 0:
            state.idle.set()
        state.metrics.active_streams.dec()
