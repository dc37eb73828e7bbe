"""The API process's handle on its engine-core process (engine_core.py; issue 35).

It stands where an in-process `Engine` stands for the generate handler (`submit`, `cancel`,
`healthy`): a request becomes a `submit` frame; each `step` frame from the core carries every
row's events of one worker delivery, handed here to each stream's sink (server.py's `_Stream`
encodes and writes them) on this process's loop, so per-stream work never holds the worker's GIL.

If the core dies, every open stream ends with an in-band `generation_unavailable` error (what a
client of a dead replica does with it: migrate) and `on_lost` runs: the API process exits, so the
supervisor sees the replica die as it would an in-process one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from . import ipc
from .jobs import EngineDelta, EngineUnavailable, FinishReason, Job, StreamError

log = logging.getLogger("guardstream.engine")

LOST = "the engine process stopped"


class CoreStartError(RuntimeError):
    """The core exited (or closed its socket) before serving; `returncode` is its status."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__(f"the engine core exited before serving (status {returncode})")
        self.returncode = returncode


def _event(raw: dict[str, Any]) -> EngineDelta | StreamError:
    if "code" in raw:
        return StreamError(raw["code"], raw["type"], raw["message"])
    reason = raw["finish_reason"]
    return EngineDelta(
        raw["token_ids"],
        raw["text"],
        raw["generated_token_count"],
        FinishReason(reason) if reason is not None else None,
    )


def job_spec(job: Job) -> dict[str, Any]:
    """A `Job` as the core rebuilds it (engine_core.job_from_spec): every field but its loop,
    its sink and `cancelled` (a cancel is its own message)."""
    spec = {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name not in LOCAL}
    spec["sampling"] = dataclasses.asdict(job.sampling)
    return spec


LOCAL = frozenset({"loop", "queue", "cancelled"})  # a Job's fields that stay in this process


class CoreClient:
    """Starts the core (`command` plus `--core-fd N --core-steps-fd M --core-socket PATH`), then
    relays jobs. The core reads requests from the first socketpair and writes everything (its
    worker writes each step's frame itself) to the second; either one closing means it is gone."""

    def __init__(
        self,
        command: Sequence[str],
        socket_path: str,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.command = list(command)
        self.socket_path = socket_path
        self.on_lost = on_lost
        self.process: asyncio.subprocess.Process | None = None
        self._channel: ipc.FrameProtocol | None = None  # requests to the core
        self._steps: ipc.FrameProtocol | None = None  # all the core sends (engine_core.run_core)
        self._hello: asyncio.Future[dict[str, Any]] | None = None
        self._closed = asyncio.Event()  # the core closed its end (bye, or death)
        self._jobs: dict[int, Job] = {}
        self._rids: dict[Job, int] = {}
        self._ids = itertools.count(1)
        self._serving = False
        self.max_batch_size = 0  # the core's slots (its facts), known once it serves
        self._stopping = False  # this process asked the core to stop
        self._core_stopping = False  # the core said it is stopping (its own SIGTERM)

    async def start(self) -> dict[str, Any]:
        """Spawn the core and wait until its engine serves; its facts (engine_core.facts)."""
        self._hello = asyncio.get_running_loop().create_future()
        mine, theirs = socket.socketpair()  # requests to the core
        steps_mine, steps_theirs = socket.socketpair()  # every frame from it (its worker's steps)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command,
                "--core-fd",
                str(theirs.fileno()),
                "--core-steps-fd",
                str(steps_theirs.fileno()),
                "--core-socket",
                self.socket_path,
                pass_fds=(theirs.fileno(), steps_theirs.fileno()),
            )
        finally:
            theirs.close()
            steps_theirs.close()
        # the core's end: EOF on the steps socket, which it closes last (after `bye`) and which
        # its death closes too; the request socket's EOF can come first, with the last steps
        # still unread, so it is not the signal
        self._channel = await ipc.connect(mine, self._on_messages, lambda: None)
        self._steps = await ipc.connect(steps_mine, self._on_messages, self._lost)
        closed = asyncio.ensure_future(self._closed.wait())
        await asyncio.wait({self._hello, closed}, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if not self._hello.done():
            self._hello.cancel()
            raise CoreStartError(await self.process.wait())
        self._serving = True
        facts = self._hello.result()
        self.max_batch_size = int(facts["max_batch_size"])
        return facts

    @property
    def healthy(self) -> bool:
        return self._serving and not self._stopping and not self._core_stopping

    def submit(self, job: Job) -> None:
        if not self.healthy or self._channel is None:
            raise EngineUnavailable("the engine is shutting down")
        rid = next(self._ids)
        self._jobs[rid] = job
        self._rids[job] = rid
        self._channel.send(["submit", rid, job_spec(job)])

    def cancel(self, job: Job) -> None:
        """Abort a request (no-op for a finished one)."""
        job.cancelled = True
        rid = self._rids.pop(job, None)
        if rid is None:
            return
        self._jobs.pop(rid, None)
        if self._channel is not None:
            self._channel.send(["cancel", rid])

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the core to stop (its unfinished streams get their error first), then reap it."""
        if self.process is None:
            return
        if not self._stopping:
            self._stopping = True
            if self._channel is not None:
                self._channel.send(["stop"])
        try:
            async with asyncio.timeout(timeout_s):
                await self._closed.wait()
                await self.process.wait()
        except TimeoutError:
            log.warning("the engine core did not stop in %.0f s: killed", timeout_s)
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()

    def _on_messages(self, messages: list[Any]) -> None:
        """What one read of the socket brought: the steps go out together (a stream behind by
        several steps gets their tokens in one write)."""
        steps = []
        for message in messages:
            kind = message[0]
            if kind == "step":
                steps.append(message[1])
            elif kind == "stopping":  # new requests: 503 before any byte (server.py)
                self._core_stopping = True
            elif kind == "hello" and self._hello is not None and not self._hello.done():
                self._hello.set_result(dict(message[1]))
            elif kind == "bye":  # the last frame: `_lost` follows
                for channel in (self._channel, self._steps):
                    if channel is not None and channel.transport is not None:
                        channel.transport.close()
        if len(steps) == 1:
            self._deliver(steps[0])
        elif steps:
            merged: dict[Any, list[Any]] = {}
            for step in steps:
                for rid, events in step:
                    if rid in merged:
                        merged[rid].extend(events)
                    else:
                        merged[rid] = list(events)
            self._deliver(list(merged.items()))

    def _deliver(self, batch: list[list[Any]]) -> None:
        """One worker delivery: each row's events to its stream, in order."""
        jobs = self._jobs
        for rid, raw in batch:
            job = jobs.get(rid)
            if job is None:
                continue  # cancelled here: what the core emitted meanwhile is dropped
            events = [_event(e) for e in raw]
            last = events[-1]
            if isinstance(last, StreamError) or last.finish_reason is not None:
                del jobs[rid]
                self._rids.pop(job, None)
            try:
                job.queue.put_many(events)  # type: ignore[union-attr]  # server streams: sinks
            except Exception:  # a sink must not raise; if one does, the others still get theirs
                log.exception("stream sink failed")
                self.cancel(job)

    def _lost(self) -> None:
        """The core is gone (or said bye): streams still open fail as a dead replica's would."""
        if self._channel is not None and self._channel.transport is not None:
            self._channel.transport.close()
        self._serving = False
        self._closed.set()
        jobs, self._jobs = self._jobs, {}
        self._rids = {}
        for job in jobs.values():
            with contextlib.suppress(Exception):
                job.queue.put_many([StreamError(503, "generation_unavailable", LOST)])  # type: ignore[union-attr]
        if not self._stopping and self._hello is not None and self._hello.done():
            log.error("the engine core died: this replica stops")
            if self.on_lost is not None:
                self.on_lost()
