"""Teardown of a pipeline's background tasks that cannot hang the reply.

A task that swallows its cancellation (Python 3.11's `asyncio.wait_for` did, bpo-42130) would make
a teardown that awaits it wait for ever, and the client's reply would never end. The teardown
waits a bounded grace instead and names a task that outlived it, so such a bug is a logged error
rather than a silent stall."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("guardstream.pipeline")

#: How long a cancelled task may take to end; normally it ends at its next step.
CANCEL_GRACE_S = 5.0


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[None]], grace_s: float = CANCEL_GRACE_S
) -> None:
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    ended, stuck = await asyncio.wait(pending, timeout=grace_s)
    for task in ended:  # retrieved: a failure was already reported through the inbox
        if not task.cancelled():
            task.exception()
    for task in stuck:
        frames = "; ".join(
            f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack()
        )
        log.error("task %s did not end %g s after its cancellation (at %s)", task, grace_s, frames)
