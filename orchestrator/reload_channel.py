"""The reload channel between the supervisor and its workers (`server.workers` > 1).

Why: `POST /admin/reload` reaches one worker, the kernel's pick. It applies the file there, and
every other worker must apply it too. They were sent SIGHUP and the answer did not wait for
them, so a worker that could not apply the file (a new detector's model that did not load
there, out of memory) was a log line while the client read `"reloaded": true`, and the service
ran two configs. Now the answer waits for every worker's own result, under a deadline, and
names each worker that did not apply the file.

One socket pair per worker (made by the supervisor, its end passed to the worker as an open
descriptor), one JSON object a line:

    worker -> supervisor   {"ask": n}                      POST n applied the file here: have
                                                           every other worker apply it
    supervisor -> worker   {"reload": r}                   apply the file (order r)
    worker -> supervisor   {"reloaded": r, "errors": [..]} what order r did here ([]: applied)
    supervisor -> worker   {"answer": n, "errors": [..]}   every other worker's problems, a line
                                                           each naming the worker ([]: all did)

A stream per worker instead of signals: a signal carries no answer, and two reloads at once
could not be told apart. The supervisor's SIGHUP and a restarted worker's catching up (it
starts from the file read at start-up) are orders too, their results logged by the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("guardstream")

# how long the supervisor waits for one worker's result; the asking worker waits this long and
# a grace for the supervisor's answer. A reload may load detector models: minutes, on a busy host
ORDER_GRACE_S = 30.0
# a line on the channel (the errors of a file: a line each, bounded by the file's size)
LINE_LIMIT = 1 << 24

Reload = Callable[[], Awaitable[list[str]]]


class _Link:
    """One end of a worker's channel: lines out, and the replies awaited by number."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._numbers = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[list[str]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = asyncio.Event()

    def send(self, message: dict[str, Any]) -> None:
        if not self._writer.is_closing():
            self._writer.write(json.dumps(message).encode() + b"\n")

    async def request(self, key: str, timeout_s: float, gone: str, late: str) -> list[str]:
        """Sends `{key: n}` and waits for the reply to n: its errors, or `[gone]` when the
        channel closes first, `[late]` past `timeout_s`."""
        n = next(self._numbers)
        reply: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = reply
        try:
            if self.closed.is_set():
                return [gone]
            self.send({key: n})
            async with asyncio.timeout(timeout_s):
                return await reply
        except TimeoutError:
            return [late]
        except ConnectionError:
            return [gone]
        finally:
            self._waiting.pop(n, None)

    def _replied(self, n: Any, errors: Any) -> list[str] | None:
        """Hands the reply to its request; the errors when no one waits for it any more."""
        ok = isinstance(errors, list) and all(isinstance(e, str) for e in errors)
        errors = errors if ok else ["a malformed reply on the reload channel"]
        reply = self._waiting.get(n) if isinstance(n, int) else None
        if reply is None or reply.done():
            return errors
        reply.set_result(errors)
        return None

    def spawn(self, step: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(step)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def messages(self) -> Any:
        """Every message until the other end closes; then every waiting request is told."""
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # a line past LINE_LIMIT: dropped, the rest still read
                    continue
                except ConnectionError:
                    break
                if not line:
                    break
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if isinstance(message, dict):
                        yield message
        finally:
            self.closed.set()
            for reply in self._waiting.values():
                if not reply.done():
                    reply.set_exception(ConnectionError())

    def close(self) -> None:
        self._writer.close()
        for task in list(self._tasks):
            task.cancel()


async def _connect(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(sock=sock, limit=LINE_LIMIT)


class SupervisorLink(_Link):
    """A worker's end: it answers the supervisor's orders with `reload` (the file applied
    here) and asks the supervisor to reload every other worker after its own POST applied."""

    @classmethod
    async def open(cls, fd: int) -> SupervisorLink:
        return cls(*await _connect(socket.socket(fileno=fd)))

    async def serve(self, reload: Reload) -> None:
        """Until the supervisor closes the channel: each order reloads here (one reload at a
        time: reload.py's lock) and is answered with its errors."""
        async for message in self.messages():
            if "reload" in message:
                self.spawn(self._order(message["reload"], reload))
            elif "answer" in message:
                self._replied(message["answer"], message.get("errors"))

    async def _order(self, n: Any, reload: Reload) -> None:
        errors = await reload()
        for line in errors:
            log.error("config not reloaded (the supervisor's order): %s", line)
        self.send({"reloaded": n, "errors": errors})

    async def reload_others(self, timeout_s: float) -> list[str]:
        """Every other worker's problems applying the file ([]: all of them applied it)."""
        return await self.request(
            "ask",
            timeout_s + ORDER_GRACE_S,
            "the supervisor closed the reload channel: the other workers' result is unknown",
            f"the supervisor did not answer within {timeout_s + ORDER_GRACE_S:g} s: the other "
            "workers' result is unknown",
        )


class WorkerLink(_Link):
    """The supervisor's end of one worker's channel."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int
    ) -> None:
        super().__init__(reader, writer)
        self.pid = pid

    @classmethod
    async def open(cls, sock: socket.socket, pid: int) -> WorkerLink:
        return cls(*await _connect(sock), pid)

    async def reload(self, timeout_s: float) -> list[str]:
        """This worker applies the file: its errors, each naming it."""
        errors = await self.request(
            "reload",
            timeout_s,
            "exited before it answered (its replacement reloads the file once it listens)",
            f"did not answer within {timeout_s:g} s (still reloading: the supervisor logs "
            "its result)",
        )
        return [f"worker {self.pid}: {e}" for e in errors]

    async def serve(self, others: Callable[[int], Awaitable[list[str]]]) -> None:
        """Until the worker closes its end: each `ask` is answered with `others(pid)` (every
        other worker's problems applying the file), each result goes to the order it answers."""
        async for message in self.messages():
            if "reloaded" in message:
                late = self._replied(message["reloaded"], message.get("errors"))
                if late is not None:  # past its deadline: the answer went without it
                    _log_late(self.pid, late)
            elif "ask" in message:
                self.spawn(self._answer(message["ask"], others))

    async def _answer(self, n: Any, others: Callable[[int], Awaitable[list[str]]]) -> None:
        self.send({"answer": n, "errors": await others(self.pid)})


def _log_late(pid: int, errors: list[str]) -> None:
    """A worker's result that no answer carries (its deadline passed)."""
    if not errors:
        log.info("worker %d reloaded the config (after its deadline)", pid)
    for line in errors:
        log.error("worker %d: config not reloaded: %s", pid, line)


async def reload_all(links: list[WorkerLink], timeout_s: float) -> list[str]:
    """Every worker of `links` applies the file, at once: their problems, a line each."""
    results = await asyncio.gather(*(link.reload(timeout_s) for link in links))
    return [line for errors in results for line in errors]
