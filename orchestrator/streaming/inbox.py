"""The single mailbox of one pipeline: generation chunks, detector verdicts and control signals
arrive here, and the pipeline's one consumer loop takes them in arrival order.

Only the engine reader ever waits here: while `max_chunks` generation chunks, or as many
messages of any kind, are unconsumed, so a client that stops reading stops the engine read
(backpressure). Counting every message matters where the reader feeds the chunkers itself and
only verdicts reach the mailbox. Verdicts and control messages never wait (they are bounded by
the chunks that caused them), so a detector can never deadlock against a full mailbox.

`take_all` hands over everything that arrived since the last call: under a burst the consumer
wakes once per batch, not once per token, and can join consecutive chunks before chunking them.
The engine reader posts what one read delivered as one list (`put_chunks`), so a burst costs a
message per read, not per token.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Inbox:
    def __init__(self, max_chunks: int = 64) -> None:
        self._items: deque[Any] = deque()
        self._chunks = 0
        self._max_chunks = max_chunks
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self.reader_held = False  # the engine reader is waiting for the consumer now

    def put(self, item: Any) -> None:
        """A verdict or control message: never waits."""
        self._items.append(item)
        self._ready.set()

    async def put_chunk(self, item: Any) -> None:
        """A generation chunk: waits while the consumer is `max_chunks` behind."""
        await self.wait_space()
        self._chunks += 1
        self._items.append(item)
        self._ready.set()

    async def put_chunks(self, batch: list[Any]) -> None:
        """Generation chunks that arrived together, as ONE message (the list itself): waits
        while the consumer is `max_chunks` behind, then counts every chunk of the batch."""
        await self.wait_space()
        self._chunks += len(batch)
        self._items.append(batch)
        self._ready.set()

    def has_space(self) -> bool:
        """Whether the consumer is less than `max_chunks` chunks and messages behind (a chunk
        put now goes in without waiting)."""
        return self._chunks < self._max_chunks and len(self._items) < self._max_chunks

    async def wait_space(self) -> None:
        """Waits until `has_space`: the engine reader's backpressure."""
        while not self.has_space():
            self._space.clear()
            self.reader_held = True
            try:
                await self._space.wait()
            finally:
                self.reader_held = False

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
