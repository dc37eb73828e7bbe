"""servicekit.parent_death: a child started by a process that is SIGKILLed gets its signal, in
both shapes (a spawn's preexec_fn, a call inside the child)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.wait_support import until_sync

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The parent prints its child's pid and then waits to be killed. The child traps `sig` into an
# exit status it writes to a file (whole, by a rename), so the test sees which signal arrived.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    status, mode = sys.argv[1], sys.argv[2]
    def got(sig, frame):
        # written then renamed: the test reads the file as soon as it exists (a flake: it
        # once read it between its creation and the write, "")
        with open(status + ".tmp", "w") as f:
            f.write(signal.Signals(sig).name)
        os.replace(status + ".tmp", status)
        os._exit(0)
    signal.signal(signal.SIGTERM, got)
    if mode == "call":
        from servicekit.parent_death import die_with_parent
        die_with_parent(signal.SIGTERM)
    open(status + ".ready", "w").write("1")
    time.sleep(120)
    """
)
PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from servicekit.parent_death import preexec_die_with_parent
    child, mode, status = sys.argv[1:4]
    kw = {"preexec_fn": preexec_die_with_parent(signal.SIGTERM)} if mode == "preexec" else {}
    p = subprocess.Popen([sys.executable, "-c", child, status, mode], **kw)
    print(p.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("mode", ["preexec", "call"])
def test_the_child_of_a_sigkilled_parent_gets_its_signal(tmp_path, mode):
    status = tmp_path / "status"
    env = {**os.environ, "PYTHONPATH": ROOT}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, mode, str(status)], stdout=subprocess.PIPE, env=env
    )
    child_pid = int(parent.stdout.readline())
    try:
        until_sync(lambda: (tmp_path / "status.ready").exists(), what="the child's start")
        assert not status.exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        until_sync(status.exists, what="the child's SIGTERM")
        assert status.read_text() == "SIGTERM"
        until_sync(lambda: not psutil.pid_exists(child_pid) or _zombie(child_pid))
    finally:
        parent.kill()
        parent.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
