"""Keeps every core busy until stopped: `make test-stress` runs the suite next to it, so a test that
depends on timing fails here instead of on a slow CI machine.

    python tests/cpu_hog.py [--procs N]   # N spinning processes (default: one per usable core)

It stops on SIGTERM or SIGINT, and its spinners stop when it is gone, even after a SIGKILL.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys


def spin(parent: int) -> None:
    """Pure-Python busy work at normal priority; checks now and then that its parent lives."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    x = 0
    while True:
        for _ in range(1_000_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        if os.getppid() != parent:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    ctx = multiprocessing.get_context("fork")
    spinners = [
        ctx.Process(target=spin, args=(os.getpid(),), daemon=True) for _ in range(args.procs)
    ]
    for p in spinners:
        p.start()
    print(f"cpu_hog: {args.procs} spinning processes (pid {os.getpid()})", file=sys.stderr)

    def stop(signum: int, frame: object) -> None:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.join()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
