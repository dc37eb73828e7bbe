"""The single mailbox of one pipeline: released frames, detector verdicts and control signals
arrive here, and the pipeline's one consumer loop takes them in arrival order.

It is also the pipeline's one backpressure channel. Only the reader of the pipeline's input (the
engine, a request body) ever waits here (`wait_space`): while `max_chunks` items, or as many
messages of any kind, are unconsumed (a client that stops reading stops the engine read), and
while its owner says the stage after the reader is `behind` (the generation pipeline: the slowest
output detector has MAX_UNJUDGED_CHARS it has not answered). Whatever can change either answer
frees space: the consumer taking messages, a detector answering (`answered`). Verdicts and
control messages never wait (they are bounded by the text that caused them), so a detector can
never deadlock against a full mailbox.

`take_all` hands over everything that arrived since the last call: under a burst the consumer
wakes once per batch, not once per token. The engine reader posts what one read released as one
list (`put_batch`), so a burst costs a message per read, not per token.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class Inbox:
    def __init__(self, max_chunks: int = 64) -> None:
        self._items: deque[Any] = deque()
        self._chunks = 0
        self._max_chunks = max_chunks
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self.reader_held = False  # the reader is waiting in `wait_space` now
        # the owner's second reason to hold the reader (None: only the consumer's distance)
        self.behind: Callable[[], bool] | None = None

    def put(self, item: Any) -> None:
        """A verdict or control message: never waits."""
        self._items.append(item)
        self._ready.set()

    async def put_chunk(self, item: Any) -> None:
        """One counted item (a line of a request body): waits while there is no space."""
        await self.wait_space()
        self._chunks += 1
        self._items.append(item)
        self._ready.set()

    def put_batch(self, batch: list[Any], chunks: int) -> None:
        """Items that one read brought, as ONE message (the list itself), counted as the
        `chunks` it read (frames joined from several chunks weigh what they carry). Never
        waits: the reader waited for space before that read."""
        self._chunks += chunks
        self._items.append(batch)
        self._ready.set()

    def has_space(self) -> bool:
        """Whether the reader may go on now: the consumer is less than `max_chunks` items and
        messages behind, and the owner's stage is not `behind`."""
        if self._chunks >= self._max_chunks or len(self._items) >= self._max_chunks:
            return False
        behind = self.behind
        return behind is None or not behind()

    async def wait_space(self) -> None:
        """Waits until `has_space`: the reader's backpressure."""
        while not self.has_space():
            self._space.clear()
            self.reader_held = True
            try:
                await self._space.wait()
            finally:
                self.reader_held = False

    def answered(self) -> None:
        """A detector call returned: a reader held while the detectors were `behind` looks
        again (without waiting for the consumer, which may have nothing to take)."""
        self._space.set()

    async def take_all(self) -> list[Any]:
        """Everything that arrived, oldest first; waits until there is something."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        self._chunks = 0
        self._space.set()
        return items
