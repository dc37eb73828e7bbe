"""The single mailbox of one pipeline: generation chunks, detector verdicts and control signals
arrive here, and the pipeline's one consumer loop takes them in arrival order.

Only generation chunks are bounded: the engine reader waits while `max_chunks` of them are
unconsumed, so a client that stops reading stops the engine read (backpressure). Verdicts and
control messages never wait (they are bounded by the chunks that caused them), so a detector can
never deadlock against a full mailbox.

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

    def put(self, item: Any) -> None:
        """A verdict or control message: never waits."""
        self._items.append(item)
        self._ready.set()

    async def put_chunk(self, item: Any) -> None:
        """A generation chunk: waits while the consumer is `max_chunks` behind."""
        await self._wait_space()
        self._chunks += 1
        self._items.append(item)
        self._ready.set()

    async def put_chunks(self, batch: list[Any]) -> None:
        """Generation chunks that arrived together, as ONE message (the list itself): waits
        while the consumer is `max_chunks` behind, then counts every chunk of the batch."""
        await self._wait_space()
        self._chunks += len(batch)
        self._items.append(batch)
        self._ready.set()

    def has_space(self) -> bool:
        """Whether a chunk put now goes in without waiting."""
        return self._chunks < self._max_chunks

    async def _wait_space(self) -> None:
        while self._chunks >= self._max_chunks:
            self._space.clear()
            await self._space.wait()

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
