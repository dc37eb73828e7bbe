"""A child process that dies with the process that started it: no orphans after a SIGKILL.

Linux's PR_SET_PDEATHSIG asks the kernel to signal a child when its parent thread exits. Every
process guardstream starts uses it: the orchestrator's engines and serving workers (SIGTERM, so
that they drain) and an engine replica's core (SIGKILL: its API process is the replica's pid, and
its in-band ending of streams happens there). Elsewhere the callers fall back on EOF of a pipe or
socket, a little later. One implementation, in the two shapes the callers need: a `preexec_fn`
for subprocess spawns and a call for a child that is already running Python.

The race: a parent that dies before the child's request leaves a request that never fires. A
child that made the request compares its parent pid with the one it was started by and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, or None off Linux or where it cannot be had."""
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Called in the child: `sig` when the parent dies; exit now if it already has."""
    prctl = _prctl()
    if prctl is None:
        return
    parent = os.getppid()
    prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request: the signal will never come
        os._exit(1)


def preexec_die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess`/`asyncio` spawns: the child gets `sig` when this process
    dies. prctl is resolved here, in the parent: the child between fork and exec may not load
    libraries. The parent's pid is taken here too: a child whose parent died between the fork
    and the request exits at once (`os._exit` is what a preexec_fn may call)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
