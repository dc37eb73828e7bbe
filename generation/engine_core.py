"""The engine-core process of a replica split in two (`python -m generation serve`, issue 35).

The API process (server.py's `create_api_app`) owns the clients' HTTP: parsing, validation,
tokenization, every stream's encoding and socket writes. This process owns the worker (scheduler,
model runner, output processing) and hands it the API's requests; what the worker emits in one
step, for every row, goes back as ONE frame (ipc.py), so the worker's process holds no per-stream
work between steps and the GIL the worker needs is not spent on clients' sockets.

The routes that are not per token (`/health`, `/metrics`, judge sessions, `/v1/tokenize`,
`/v1/models`, 404/405 answers) stay the engine's own app (server.py's `create_app`), served here
on a private Unix socket the API process forwards them to: one implementation of each, exact
with the in-process replica.

Lifetime: the core dies with its API process (PR_SET_PDEATHSIG, and EOF on the socketpair where
that is not available), so a SIGKILL of the replica's pid leaves no engine behind; a SIGTERM of
the API process reaches here as a `stop`: the engine ends its unfinished streams in-band first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from typing import Any

from aiohttp import web

from servicekit.parent_death import die_with_parent

from . import ipc
from .jobs import EngineDelta, EngineUnavailable, Job, StepSink, StreamError
from .sampling import SamplingParams
from .scheduler import Engine
from .server import STATE, freeze_startup_heap

log = logging.getLogger("guardstream.engine.core")


def job_from_spec(spec: dict[str, Any], loop: asyncio.AbstractEventLoop, sink: StepSink) -> Job:
    """The `Job` the API process sent (core_client.job_spec): every field but its loop and
    sink, which are this process's."""
    fields = dict(spec)
    fields["sampling"] = SamplingParams(**spec["sampling"])
    # deadline: a time.monotonic() value of the API process; CLOCK_MONOTONIC is one per machine
    return Job(**fields, loop=loop, queue=sink)


class CoreSession:
    """The core's side of the socketpairs: requests in, each step's events out as one frame.

    It is every core job's sink (a `StepSink` marked `direct`): the worker's `flush`
    (output_processor.py) hands it a step's events for all rows in one call ON THE WORKER
    THREAD, which become one frame `[[rid, [event]], ...]` encoded by one orjson call (the
    events are dataclasses: orjson encodes them in C) and written by a blocking send on the
    steps socket (`ipc.StepWriter`): the core's loop is neither woken nor run per step, so the
    worker never waits for the GIL while the loop delivers. Per row, only a dict look-up and a
    finish check. The API process falling behind fills that socket and so blocks the worker
    between steps (the backpressure; the engine runs no further ahead than the socket holds).

    `jobs`/`rids` are shared by two threads: the loop adds (`submit`) and removes (`cancel`)
    entries, the worker removes finished ones (`put_step`). Each side holds `_lock` for its
    look-ups and changes (a few dict operations per step; never while sending), so a job
    cancelled on the loop is either in the worker's frame or not, never half-forgotten."""

    direct = True  # `put_step` is thread-safe: the worker calls it itself (no mailbox)

    def __init__(
        self, engine: Engine, loop: asyncio.AbstractEventLoop, steps: ipc.StepWriter
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.steps = steps  # every frame to the API process goes here, in order
        self.done = asyncio.Event()  # the API process said `stop`, or went away
        self.jobs: dict[int, Job] = {}
        self.rids: dict[Job, int] = {}
        self._lock = threading.Lock()  # `jobs` and `rids` (see the class's docstring)

    def put_step(self, events: list[tuple[Job, EngineDelta | StreamError]]) -> None:
        """On the worker thread (or the loop, for a refused submit). Never raises: the API
        process gone, the send fails and `on_lost` ends the core."""
        frame = []
        append = frame.append
        with self._lock:
            rids = self.rids
            for job, event in events:
                rid = rids.get(job)
                if rid is None:  # cancelled meanwhile: the API process has dropped the stream
                    continue
                append((rid, (event,)))
                if event.__class__ is StreamError or event.finish_reason is not None:  # type: ignore[union-attr]
                    self._forget(rid)
        if frame:
            self.steps.send(["step", frame])

    def _forget(self, rid: int) -> Job | None:
        """With `_lock` held."""
        job = self.jobs.pop(rid, None)
        if job is not None:
            del self.rids[job]
        return job

    def submit(self, rid: int, spec: dict[str, Any]) -> None:
        job = job_from_spec(spec, self.loop, self)
        with self._lock:
            self.jobs[rid] = job
            self.rids[job] = rid
        try:
            self.engine.submit(job)
        except EngineUnavailable as exc:  # the API process checked first; a race with a stop
            error = [(job, StreamError(503, "generation_unavailable", str(exc)))]
            # in a thread: the send may wait for the worker's (the lock) or a full socket, and
            # this runs on the loop, which must never block
            self.loop.run_in_executor(None, self.put_step, error)

    def cancel(self, rid: int) -> None:
        with self._lock:
            job = self._forget(rid)
        if job is not None:
            self.engine.cancel(job)

    def on_messages(self, messages: list[Any]) -> None:
        for message in messages:
            kind = message[0]
            if kind == "submit":
                self.submit(message[1], message[2])
            elif kind == "cancel":
                self.cancel(message[1])
            elif kind == "stop":
                self.done.set()

    def on_lost(self) -> None:
        if not self.done.is_set():
            log.warning("the API process went away: stopping")
            self.done.set()


def facts(app: web.Application) -> dict[str, Any]:
    """What the API process needs to validate and tokenize requests as this engine would."""
    state = app[STATE]
    loaded = state.loaded
    return {
        "name": loaded.name,
        "path": str(loaded.path),
        "max_context": loaded.max_context,
        "max_batch_size": state.engine.max_batch_size,  # its slots: the API process's bound
        "vocab_size": loaded.vocab_size,
        "has_chat_template": loaded.has_chat_template,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "batch_invariant": loaded.batch_invariant,
        "tool_format": state.tool_format,
    }


async def run_core(app: web.Application, fd: int, socket_path: str, steps_fd: int) -> int:
    """Serve `app` (the engine's own, `create_app`) on `socket_path` for the API process's
    forwarded routes, and its engine's streams over the socketpair ends `fd` (requests in) and
    `steps_fd` (every frame out); return the exit status once the API process has said `stop`
    (or died)."""
    die_with_parent()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the API process stops us
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    # the API process logs its clients' requests: the forwarded copies would repeat them
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10.0, access_log=None)
    await runner.setup()  # the app's start-up: the engine starts (graphs captured on CUDA)
    await web.UnixSite(runner, socket_path).start()
    freeze_startup_heap()
    lost: list[CoreSession] = []  # the writer's `on_lost` needs the session it is built for
    steps = ipc.StepWriter(socket.socket(fileno=steps_fd), loop, lambda: lost[0].on_lost())
    session = CoreSession(app[STATE].engine, loop, steps)
    lost.append(session)
    channel = await ipc.connect(socket.socket(fileno=fd), session.on_messages, session.on_lost)
    # the loop's frames go where the worker's do (the lock keeps them whole and in order), each
    # sent from a thread (`send_from_loop`): the loop never blocks on the socket
    await steps.send_from_loop(["hello", facts(app)])
    stopped = loop.create_task(stop.wait())
    await asyncio.wait(
        {loop.create_task(session.done.wait()), stopped}, return_when=asyncio.FIRST_COMPLETED
    )
    # the API process first (frames keep their order: it reads this before any stream's error),
    # so the requests it gets from now on are refused with a 503 status, not a 200 whose only
    # line is the error a submit racing the stop would get
    if not await steps.send_from_loop(["stopping"]):
        # an API process alive but not reading (stopped, stuck): break the sends, the worker's
        # included, so the engine can stop (its streams' errors then go nowhere)
        steps.close()
    await runner.cleanup()  # the engine stops: unfinished streams get their in-band error
    await steps.send_from_loop(["bye"])
    steps.close()  # what was sent stays readable, then EOF
    if channel.transport is not None:
        channel.transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):
                await channel.closed.wait()
    return 0
