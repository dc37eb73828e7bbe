"""Micro-batching: concurrent requests to one model become one forward pass, served fairly.

Every peer runs detector models one text at a time; under many concurrent streams that wastes most
of a GPU and much of a CPU. A MicroBatcher never waits for company: when the model is idle, a
submitted item goes to it at once (with whatever else was submitted in the same turn of the event
loop). The items that queue while a batch runs are taken together, up to `max_batch_size`, as the
next forward pass. So an idle detector adds no latency, and under load batches grow by themselves
to match the arrival rate. The batch function runs in a worker thread, never on the event loop,
and each caller gets its own slice of the results.

Fair across callers (DESIGN 4.6b): each `submit` is a caller with its own sub-queue, and every
forward pass is filled round-robin from the callers that wait, one item each in turn, starting
after the caller the previous pass ended with. A caller with 50,000 items therefore gets its share
of each pass (all of it when alone) and waits for the rest, while a one-sentence caller arriving
behind it is in the very next pass: one request cannot take a detector away from the others.

Bounded: `max_queue` counts, per waiting caller, the items it can have in the next pass (at most
`max_batch_size`), not all the items it brought: a big caller's backlog is its own (the texts it
already holds) and only makes that caller wait. A new caller that would push the count past
`max_queue` (about max_queue concurrent single-item callers, or max_queue / max_batch_size big
ones) is refused at once with Overloaded: the refusal falls on the request that arrived into a
full detector, never on those already waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .errors import DetectorError, Overloaded

log = logging.getLogger(__name__)

T = TypeVar("T")
_BACKGROUND: set[asyncio.Task[None]] = set()  # strong references to running workers
R = TypeVar("R")


@dataclass(eq=False)
class _Caller(Generic[T, R]):
    """One `submit`: its items, how far the batches have taken them, and its answers."""

    items: list[T]
    future: asyncio.Future[list[R]]
    share: int  # what it counts against max_queue
    taken: int = 0  # items handed to a batch so far (a prefix of `items`)
    answered: int = 0
    results: list[R | None] = field(default_factory=list)

    @property
    def waiting(self) -> int:
        return len(self.items) - self.taken


@dataclass(eq=False)
class _Slice(Generic[T, R]):
    """A contiguous run of one caller's items inside a batch."""

    caller: _Caller[T, R]
    start: int
    end: int

    @property
    def items(self) -> list[T]:
        return self.caller.items[self.start : self.end]


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
        self._ring: deque[_Caller[T, R]] = deque()  # callers with items not yet in a batch
        self._outstanding = 0
        self._admitted = 0
        self._callers = 0
        self._worker: asyncio.Task[None] | None = None
        self._closed = False

    # --- public -----------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Items accepted and not yet answered, every caller's backlog included."""
        return self._outstanding

    @property
    def admitted(self) -> int:
        """What `max_queue` bounds: per waiting caller, min(its items, max_batch_size)."""
        return self._admitted

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
        share = min(n, self.max_batch_size)
        # the first caller is always admitted, so a max_queue below max_batch_size still serves
        if self._admitted + share > self.max_queue and self._admitted > 0:
            raise Overloaded(
                f"{self.name}: queue full ({self._callers} requests waiting, "
                f"{self._admitted} of {self.max_queue} queue slots in use)"
            )
        self._outstanding += n
        self._admitted += share
        self._callers += 1
        try:
            if not self.enabled:
                return await self._run_direct(loop, items)
            caller: _Caller[T, R] = _Caller(list(items), loop.create_future(), share)
            caller.results = [None] * n
            self._ring.append(caller)
            self._ensure_worker(loop)
            # a cancelled caller's future is cancelled too: the worker drops its items
            return await caller.future
        finally:
            self._outstanding -= n
            self._admitted -= share
            self._callers -= 1

    async def close(self) -> None:
        """Fails waiting callers and stops the worker; further submits fail."""
        self._closed = True
        worker, self._worker = self._worker, None
        for caller in self._ring:
            if not caller.future.done():
                caller.future.set_exception(DetectorError(f"{self.name}: closed"))
        self._ring.clear()
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
            self._ring = deque()
            self._outstanding = 0
            self._admitted = 0
            self._callers = 0
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
            # what a model raised can quote the text it was given (a tokenizer error): the
            # log has it whole, the message that reaches clients names its type only
            log.exception("%s: batched call on %d items failed", self.name, len(items))
            raise DetectorError(f"{self.name}: model call failed ({type(exc).__name__})") from exc
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
        """Takes a fair batch of what waits and runs it; repeats while callers wait; exits when
        nothing does."""
        loop = asyncio.get_running_loop()
        while True:
            batch = self._take()
            if not batch:
                return
            await self._dispatch(loop, batch)

    def _take(self) -> list[_Slice[T, R]]:
        """Up to max_batch_size items, one per waiting caller in ring order, round after round
        (water-filling: a lone caller fills the pass, N callers get ~1/N each). Callers served
        move to the back of the ring, so the next pass starts with those this one did not
        reach; callers whose items are all taken leave the ring."""
        ring = self._ring
        live = [c for c in ring if not c.future.done() and c.waiting > 0]
        if not live:
            ring.clear()
            return []
        counts = [0] * len(live)
        room = self.max_batch_size
        # whole rounds at once: every caller still waiting gets min(its rest, the round's size)
        while room > 0:
            wanting = [i for i, c in enumerate(live) if c.waiting > counts[i]]
            if not wanting:
                break
            each = max(1, room // len(wanting))
            for i in wanting:
                if room == 0:
                    break
                got = min(each, live[i].waiting - counts[i], room)
                counts[i] += got
                room -= got
        batch: list[_Slice[T, R]] = []
        served: list[_Caller[T, R]] = []
        for caller, count in zip(live, counts, strict=True):
            if count:
                batch.append(_Slice(caller, caller.taken, caller.taken + count))
                caller.taken += count
                served.append(caller)
        served_ids = {id(c) for c in served}
        unserved = [c for c in live if id(c) not in served_ids]
        ring.clear()
        ring.extend(unserved)
        ring.extend(c for c in served if c.waiting > 0)
        return batch

    def _fail(self, caller: _Caller[T, R], exc: BaseException) -> None:
        if not caller.future.done():
            caller.future.set_exception(exc)

    def _answer(self, piece: _Slice[T, R], results: list[R]) -> None:
        caller = piece.caller
        if caller.future.done():
            return
        caller.results[piece.start : piece.end] = results
        caller.answered += len(results)
        if caller.answered == len(caller.items):
            caller.future.set_result(caller.results)  # type: ignore[arg-type]

    async def _dispatch(self, loop: asyncio.AbstractEventLoop, batch: list[_Slice[T, R]]) -> None:
        items = [item for piece in batch for item in piece.items]
        self._count(len(items))
        try:
            results = await self._call(loop, items)
        except asyncio.CancelledError:
            for piece in batch:
                self._fail(piece.caller, DetectorError(f"{self.name}: closed"))
            raise
        except DetectorError as exc:
            if len(batch) == 1:
                self._fail(batch[0].caller, exc)
                return
            # Isolate the culprit: run each caller's items on their own, so one poisonous input
            # (or a batch too big for the device) fails only the requests it belongs to.
            for piece in batch:
                if piece.caller.future.done():
                    continue
                self._count(len(piece.items))
                try:
                    part = await self._call(loop, piece.items)
                except DetectorError as one_exc:
                    self._fail(piece.caller, one_exc)
                else:
                    self._answer(piece, part)
            return
        offset = 0
        for piece in batch:
            size = piece.end - piece.start
            self._answer(piece, results[offset : offset + size])
            offset += size
