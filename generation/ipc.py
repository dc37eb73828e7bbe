"""Frames between the engine's API process and its engine-core process (issue 35).

One frame = a 4-byte big-endian length, then one orjson document (a JSON array whose first item
names the message). Both ends read and write them on asyncio streams over one Unix socketpair
created by the API process before it starts the core, so neither event loop ever blocks on the
other: a slow reader only fills the socket's buffer.

Why this and not zmq/msgpack (vLLM's choice) or `multiprocessing.Connection`: orjson is already
the engine's encoder (dataclasses and enums natively, in C: the core's per-step cost is one call
for all rows), a socketpair needs no broker or extra dependency and gives EOF when the peer dies
(the API process's signal that the core is gone, and the core's that its API process is), and
`multiprocessing.Connection` pickles and only offers blocking `recv` on a loop.

Messages (`kind` first):
- API -> core: `["submit", rid, job]`, `["cancel", rid]`, `["stop"]`.
- core -> API: `["hello", facts]` once the engine serves, `["step", [[rid, [event, ...]], ...]]`
  once per worker delivery (every row's events of the step in one frame), `["bye"]` once the
  core has stopped its engine (every unfinished stream got its error first).
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import orjson

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30  # a corrupt length, never a real frame: the peer is treated as gone


def encode(message: Any) -> bytes:
    """One frame. orjson, or json for what orjson refuses (an integer past 64 bits)."""
    try:
        body = orjson.dumps(message)
    except TypeError:
        body = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


async def read(reader: asyncio.StreamReader) -> Any | None:
    """The next message, or None when the peer closed the socket (or died)."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        if size > MAX_FRAME:
            return None
        return orjson.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
