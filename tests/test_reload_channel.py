"""The reload channel (orchestrator/reload_channel.py) over real socket pairs: a worker whose
POST /admin/reload applied the file hears from the supervisor only once every other worker
answered its order, with a line naming each one that did not apply the file (it failed, or
exited before it answered). Each worker's reload is a gate the test opens: no clock.

The multi-worker test (tests/test_orchestrator_workers.py) runs the same channel between real
processes; a worker whose reload fails cannot be had there on cue (each worker reads the same
file, environment and models), so the failures are made here, at the channel's ends."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from orchestrator.reload_channel import SupervisorLink, WorkerLink, reload_all
from tests.wait_support import finished

DEADLINE_S = 60.0  # no answer is late in these tests: the deadline only turns a hang into a failure


@asynccontextmanager
async def workers(
    reloads: dict[int, Callable[[], Awaitable[list[str]]]],
) -> AsyncIterator[tuple[dict[int, SupervisorLink], dict[int, WorkerLink]]]:
    """A channel per worker pid, both ends served as the supervisor and each worker serve
    theirs (workers.py `_reload_others`: an ask is answered with every other worker's result)."""
    ours: dict[int, WorkerLink] = {}
    theirs: dict[int, SupervisorLink] = {}
    tasks: list[asyncio.Task[None]] = []

    async def others(asked: int) -> list[str]:
        return await reload_all([link for pid, link in ours.items() if pid != asked], DEADLINE_S)

    for pid, reload in reloads.items():
        a, b = socket.socketpair()
        ours[pid] = await WorkerLink.open(a, pid)
        theirs[pid] = await SupervisorLink.open(b.detach())
        tasks.append(asyncio.create_task(ours[pid].serve(others)))
        tasks.append(asyncio.create_task(theirs[pid].serve(reload)))
    try:
        yield theirs, ours
    finally:
        for link in [*ours.values(), *theirs.values()]:
            link.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_answer_waits_for_every_worker_and_names_each_that_did_not_apply() -> None:
    applying, applied = asyncio.Event(), asyncio.Event()
    ordered = {pid: asyncio.Event() for pid in (11, 12, 13)}
    gone: list[SupervisorLink] = []

    async def unasked() -> list[str]:
        raise AssertionError("the asking worker is not ordered again")

    async def slow() -> list[str]:
        ordered[11].set()
        applying.set()
        await applied.wait()
        return []

    async def failing() -> list[str]:
        ordered[12].set()
        return ["detectors.pii: could not start: OSError: no model there"]

    async def exiting() -> list[str]:
        ordered[13].set()
        gone[0].close()  # the worker exits: its end of the channel closes, no answer
        await asyncio.Event().wait()
        return []

    reloads = {10: unasked, 11: slow, 12: failing, 13: exiting}
    async with workers(reloads) as (theirs, _):
        gone.append(theirs[13])
        asking = asyncio.create_task(theirs[10].reload_others(DEADLINE_S))
        await finished(applying, what="worker 11's order")
        for pid in (12, 13):
            await finished(ordered[pid], what=f"worker {pid}'s order")
        assert not asking.done()  # worker 11 is still applying the file: no answer yet
        applied.set()
        errors = await finished(asking, what="the supervisor's answer")
    assert errors == [
        "worker 12: detectors.pii: could not start: OSError: no model there",
        "worker 13: exited before it answered (its replacement reloads the file once it listens)",
    ]


async def test_every_other_worker_applied_the_file_is_an_empty_answer() -> None:
    orders: list[int] = []

    def applies(pid: int) -> Callable[[], Awaitable[list[str]]]:
        async def reload() -> list[str]:
            orders.append(pid)
            return []

        return reload

    async with workers({pid: applies(pid) for pid in (20, 21, 22)}) as (theirs, ours):
        assert await finished(theirs[21].reload_others(DEADLINE_S)) == []
        assert sorted(orders) == [20, 22]  # each other worker once, the asking one not
        # the supervisor's own order (SIGHUP, a restarted worker): every worker, once more
        assert await finished(reload_all(list(ours.values()), DEADLINE_S)) == []
        assert sorted(orders) == [20, 20, 21, 22, 22]


async def test_a_supervisor_that_is_gone_is_an_unknown_result_not_a_hang() -> None:
    async def applies() -> list[str]:
        return []

    async with workers({30: applies}) as (theirs, ours):
        ours[30].close()  # the supervisor's end closes
        await finished(theirs[30].closed.wait(), what="the channel closed")
        errors = await finished(theirs[30].reload_others(DEADLINE_S))
    assert errors == [
        "the supervisor closed the reload channel: the other workers' result is unknown"
    ]
