"""The one way a test waits: for a condition to hold or an awaitable to finish, under a generous
deadline that only turns a hang into a failure that says what did not happen.

No test asserts how long anything took (COMMON rules: tests never depend on the clock), so the
deadline is never a window a correct run could miss on 2 busy cores: 30 s unless a caller
knows the wait is longer (an engine process that loads torch, a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEADLINE_S = 30.0


def _failure(what: str, deadline_s: float) -> AssertionError:
    return AssertionError(f"{what} did not happen within {deadline_s:g} s")


async def until(
    cond: Callable[[], Any],
    deadline_s: float = DEADLINE_S,
    what: str = "the condition",
    poll_s: float = 0.01,
) -> Any:
    """Poll `cond` until it returns something truthy, and return that; `cond` may be a plain
    function or a coroutine function (an HTTP poll), and may do a step of work each call."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(what, deadline_s)
        await asyncio.sleep(poll_s)


async def finished(
    awaitable: Awaitable[T] | asyncio.Event,
    deadline_s: float = DEADLINE_S,
    what: str = "the awaited step",
) -> T | bool:
    """Await `awaitable` (or an event being set) under the deadline; its result."""
    async with within(deadline_s, what):
        if isinstance(awaitable, asyncio.Event):
            return await awaitable.wait()
        return await awaitable


@contextlib.asynccontextmanager
async def within(deadline_s: float = DEADLINE_S, what: str = "the block") -> AsyncIterator[None]:
    """`asyncio.timeout` that fails the test saying what did not finish."""
    try:
        async with asyncio.timeout(deadline_s):
            yield
    except TimeoutError:
        raise _failure(what, deadline_s) from None


def until_sync(
    cond: Callable[[], T],
    deadline_s: float = DEADLINE_S,
    what: str = "the condition",
    poll_s: float = 0.05,
) -> T:
    """`until` for synchronous tests (threads, subprocesses): polls with time.sleep."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(what, deadline_s)
        time.sleep(poll_s)
