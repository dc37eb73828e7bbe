"""Micro-batching: concurrent requests to one model become one forward pass.

Every peer runs detector models one text at a time; under many concurrent streams that wastes most
of a GPU and much of a CPU. A MicroBatcher never waits for company: when the model is idle, a
submitted item goes to it at once (with whatever else was submitted in the same turn of the event
loop). The items that queue while a batch runs are taken together, up to `max_batch_size`, as the
next forward pass. So an idle detector adds no latency, and under load batches grow by themselves
to match the arrival rate. The batch function runs in a worker thread, never on the event loop,
and each caller gets its own slice of the results.

The queue is bounded (`max_queue` items accepted and not yet answered): past it, `submit` raises
Overloaded at once instead of letting memory and latency grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from .base import DetectorError, Overloaded

log = logging.getLogger(__name__)

T = TypeVar("T")
_BACKGROUND: set[asyncio.Task[None]] = set()  # strong references to running workers
R = TypeVar("R")


@dataclass(eq=False)
class _Piece(Generic[T, R]):
    """At most `max_batch_size` items of one caller, answered through `future`."""

    items: list[T]
    future: asyncio.Future[list[R]]


class MicroBatcher(Generic[T, R]):
    """Merges concurrent `submit(items)` calls into batched calls of `fn(items) -> results`.

    `fn` must return one result per item, in order, and is only ever called from `executor` (the
    default executor when None), one batch at a time. With `enabled=False` every call runs on its
    own (the comparison point of the benchmark) but still in the executor and still bounded.
    One event loop at a time: a batcher reused from a new loop starts afresh on it.
    """

    def __init__(
        self,
        fn: Callable[[list[T]], list[R]],
        *,
        max_batch_size: int = 32,
        max_queue: int = 1024,
        enabled: bool = True,
        executor: Executor | None = None,
        name: str = "batcher",
    ) -> None:
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be >= 1")
        self._fn = fn
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.enabled = enabled
        self.name = name
        self._executor = executor
        self.forward_passes = 0
        self.items_processed = 0
        self.largest_batch = 0
        self._observers: list[Callable[[int], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: deque[_Piece[T, R]] = deque()
        self._pending_items = 0
        self._outstanding = 0
        self._worker: asyncio.Task[None] | None = None
        self._closed = False

    # --- public -----------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Items accepted and not yet answered (what `max_queue` bounds)."""
        return self._outstanding

    def add_observer(self, callback: Callable[[int], None]) -> None:
        """`callback(batch_size)` after each batched call is dispatched (metrics)."""
        self._observers.append(callback)

    async def submit(self, items: list[T]) -> list[R]:
        """Results for `items`, computed together with whatever else is waiting."""
        if not items:
            return []
        if self._closed:
            raise DetectorError(f"{self.name}: closed")
        loop = asyncio.get_running_loop()
        self._bind(loop)
        n = len(items)
        # A request larger than the whole queue is admitted only when nothing else waits, so it
        # can make progress instead of being refused forever.
        if self._outstanding + n > self.max_queue and self._outstanding > 0:
            raise Overloaded(
                f"{self.name}: queue full ({self._outstanding} of {self.max_queue} items waiting)"
            )
        self._outstanding += n
        try:
            if not self.enabled:
                return await self._run_direct(loop, items)
            futures: list[asyncio.Future[list[R]]] = []
            for i in range(0, n, self.max_batch_size):
                piece: _Piece[T, R] = _Piece(
                    items[i : i + self.max_batch_size], loop.create_future()
                )
                self._pending.append(piece)
                self._pending_items += len(piece.items)
                futures.append(piece.future)
            self._ensure_worker(loop)
            try:
                parts = await asyncio.gather(*futures)
            except BaseException:
                for fut in futures:  # pieces not dispatched yet are dropped by the worker
                    fut.cancel()
                raise
            return [r for part in parts for r in part]
        finally:
            self._outstanding -= n

    async def close(self) -> None:
        """Fails waiting callers and stops the worker; further submits fail."""
        self._closed = True
        worker, self._worker = self._worker, None
        for piece in self._pending:
            if not piece.future.done():
                piece.future.set_exception(DetectorError(f"{self.name}: closed"))
        self._pending.clear()
        self._pending_items = 0
        if worker is None or worker.done():
            return
        worker_loop = worker.get_loop()
        if worker_loop is asyncio.get_running_loop():
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
        elif not worker_loop.is_closed():
            worker_loop.call_soon_threadsafe(worker.cancel)

    # --- internals --------------------------------------------------------------------------

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loop-bound state is created on first use from a loop (and again on a new loop)."""
        if self._loop is not loop:
            self._loop = loop
            self._pending = deque()
            self._pending_items = 0
            self._outstanding = 0
            self._worker = None

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        """The worker runs while there is work and exits when the queue is empty, so an idle
        or forgotten detector leaves no task behind. A new worker takes its first batch on the
        loop's next turn: no timer is involved."""
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work(), name=f"microbatcher-{self.name}")
            _BACKGROUND.add(self._worker)
            self._worker.add_done_callback(_BACKGROUND.discard)

    async def _run_direct(self, loop: asyncio.AbstractEventLoop, items: list[T]) -> list[R]:
        out: list[R] = []
        for i in range(0, len(items), self.max_batch_size):
            chunk = items[i : i + self.max_batch_size]
            self._count(len(chunk))
            out.extend(await self._call(loop, chunk))
        return out

    async def _call(self, loop: asyncio.AbstractEventLoop, items: list[T]) -> list[R]:
        try:
            results = await loop.run_in_executor(self._executor, self._fn, items)
        except DetectorError:
            raise
        except Exception as exc:
            log.exception("%s: batched call on %d items failed", self.name, len(items))
            raise DetectorError(f"{self.name}: model call failed: {exc}") from exc
        if len(results) != len(items):
            raise DetectorError(
                f"{self.name}: model returned {len(results)} results for {len(items)} items"
            )
        return results

    def _count(self, size: int) -> None:
        self.forward_passes += 1
        self.items_processed += size
        self.largest_batch = max(self.largest_batch, size)
        for callback in self._observers:
            try:
                callback(size)
            except Exception:  # a metrics hook must never break inference
                log.exception("%s: batch observer failed", self.name)

    async def _work(self) -> None:
        """Takes whatever waits (up to max_batch_size items) and runs it; repeats while items
        queued during that pass; exits when nothing waits."""
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self._pending:
                return
            batch = self._take()
            if batch:
                await self._dispatch(loop, batch)

    def _drop_cancelled(self) -> None:
        while self._pending and self._pending[0].future.done():
            self._pending_items -= len(self._pending.popleft().items)

    def _take(self) -> list[_Piece[T, R]]:
        """Whole pieces, oldest first, up to max_batch_size items (a first piece always fits)."""
        batch: list[_Piece[T, R]] = []
        size = 0
        while self._pending:
            piece = self._pending[0]
            if piece.future.done():  # its caller went away before we got to it
                self._pending.popleft()
                self._pending_items -= len(piece.items)
                continue
            if batch and size + len(piece.items) > self.max_batch_size:
                break
            self._pending.popleft()
            self._pending_items -= len(piece.items)
            batch.append(piece)
            size += len(piece.items)
        return batch

    async def _dispatch(self, loop: asyncio.AbstractEventLoop, batch: list[_Piece[T, R]]) -> None:
        items = [item for piece in batch for item in piece.items]
        self._count(len(items))
        try:
            results = await self._call(loop, items)
        except asyncio.CancelledError:
            for piece in batch:
                if not piece.future.done():
                    piece.future.set_exception(DetectorError(f"{self.name}: closed"))
            raise
        except DetectorError as exc:
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(exc)
                return
            # Isolate the culprit: run each caller's items on their own, so one poisonous input
            # (or a batch too big for the device) fails only the requests it belongs to.
            for piece in batch:
                if piece.future.done():
                    continue
                self._count(len(piece.items))
                try:
                    part = await self._call(loop, piece.items)
                except DetectorError as one_exc:
                    if not piece.future.done():
                        piece.future.set_exception(one_exc)
                else:
                    if not piece.future.done():
                        piece.future.set_result(part)
            return
        offset = 0
        for piece in batch:
            part = results[offset : offset + len(piece.items)]
            offset += len(piece.items)
            if not piece.future.done():
                piece.future.set_result(part)
