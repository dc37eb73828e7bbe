"""What every guarded pipeline is built on (the generation pipeline, guarded_generation.py, and
stream-content's, content_stream.py): one inbox, background tasks whose failure is a message,
a deadline, a drain's shutdown signal, and a teardown that cannot hang.

Background tasks (an input reader, one per detector queue) only post to the inbox; the owner's
single consumer loop takes what arrived. A task that raises posts `Crashed` instead of dying
silently, the deadline posts `DEADLINE` and a drain that ran out posts `DRAIN`, so every way
a stream can end reaches the consumer the same way: as a message, in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from . import request_deadline
from .cancellation import cancel_and_wait
from .inbox import Inbox


@dataclass(frozen=True, slots=True)
class Crashed:
    """A background task raised: the stream fails with what `describe` makes of it."""

    exc: BaseException


class Signal:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


DEADLINE = Signal("deadline passed")
DRAIN = Signal("drain ran out")


class PipelineCore:
    """The inbox, the tasks and the deadline of one pipeline; a subclass is its consumer loop.
    `_start()` arms the deadline when the consumer starts; `_stop_tasks()` ends both."""

    def __init__(self, *, max_buffered: int, timeout_s: float, task_name: str) -> None:
        self._inbox = Inbox(max_buffered)
        self._timeout_s = timeout_s
        self._task_name = task_name
        self._tasks: set[asyncio.Task[None]] = set()
        self._deadline: request_deadline.Cancellable | None = None
        self._shutting_down = False

    def shut_down(self) -> None:
        """A drain ran out: the consumer ends the stream (errors.SHUTDOWN)."""
        self._shutting_down = True
        self._inbox.put(DRAIN)

    def _start(self) -> None:
        # request_deadline's clock: a test moves it (tests never depend on the clock)
        self._deadline = request_deadline.deadline_clock.call_later(
            self._timeout_s, self._inbox.put, DEADLINE
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(self._guard(coro), name=self._task_name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._inbox.put(Crashed(exc))

    async def _stop_tasks(self) -> None:
        """Cancels the deadline and every background task, and waits (bounded) for them."""
        if self._deadline is not None:
            self._deadline.cancel()
        await cancel_and_wait(list(self._tasks))
