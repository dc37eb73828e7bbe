"""Raw HTTP over a socket, for the tests that attack a service's HTTP layer (the orchestrator's,
the detector service's, the engine's): a request sent as bytes, the reply read to the server's
close, and the reply parsed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.wait_support import within

DEADLINE_S = 10.0  # generous: the bounds under test are well under a second


class Reply:
    """A raw HTTP reply: status line, headers (lower-cased names), body."""

    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status_line = lines[0]
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}

    def json(self) -> Any:
        return json.loads(self.body)


async def exchange_at(port: int, data: bytes) -> bytes:
    """Sends `data` to 127.0.0.1:`port` and reads until the server closes the connection
    (within DEADLINE_S)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with within(DEADLINE_S):
            return await reader.read()  # to EOF: the server must close
    finally:
        writer.close()


def post_head(path: str, length: int, ctype: str = "application/json", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()
