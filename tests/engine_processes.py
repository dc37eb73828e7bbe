"""Start an engine replica as a real subprocess, for tests of the engine and of its clients.

with start_engine_subprocess("tiny-random", fault_injection=True) as engine:
    ... engine.url ...   # http://127.0.0.1:PORT; engine.stop() or leaving the block ends it
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from aiohttp import web

from generation.__main__ import LISTENING_PREFIX

# one implementation of "a port that was free a moment ago": the one managed engines use
from orchestrator.clients.managed import free_port as free_port


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus `extra`, with the repository root put in front of
    PYTHONPATH, not in place of it: where the dependencies come from PYTHONPATH (the GPU
    machine's bundle under /tmp/site), a child without them fails to import."""
    env = {**os.environ, **(extra or {})}
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class EngineProcess:
    """A running `python -m generation serve`; `output` keeps its last log lines."""

    url: str
    port: int
    process: subprocess.Popen[str]
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful: open streams get an in-band error), then SIGKILL after `timeout`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the replica dies abruptly, like a crashed machine."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_engine_subprocess(
    model: str = "tiny-random",
    port: int = 0,
    fault_injection: bool = False,
    *,
    host: str = "127.0.0.1",
    device: str = "cpu",
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    on_start_line: Callable[[str], None] | None = None,
) -> EngineProcess:
    """Start a replica and wait until it listens. `port=0` lets it pick a free port.
    `on_start_line`: called with each line the replica prints before it listens, as it prints
    it (a benchmark echoes its start-up live: one cut by a time limit shows how far it got).
    Interrupted while waiting (Ctrl-C, a SIGTERM turned into SystemExit), it kills the replica:
    none outlives its caller holding a GPU."""
    command = [
        sys.executable,
        "-m",
        "generation",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        *extra_args,
    ]
    if fault_injection:
        command.append("--enable-fault-injection")
    child_env = child_environment({"PYTHONUNBUFFERED": "1", **(env or {})})
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    output: collections.deque[str] = collections.deque(maxlen=200)
    ready = threading.Event()
    found: list[str] = []

    def pump() -> None:  # drain the pipe for the process's whole life so it never blocks
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line.rstrip("\n"))
            if ready.is_set():
                continue
            if line.startswith(LISTENING_PREFIX):
                found.append(line[len(LISTENING_PREFIX) :].strip())
                ready.set()
            elif on_start_line is not None:
                on_start_line(line.rstrip("\n"))
        ready.set()

    threading.Thread(target=pump, name=f"engine-log-{process.pid}", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while not ready.wait(0.05):
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not start in time:\n" + "\n".join(output))
    except BaseException:
        process.kill()
        process.wait(5)
        raise
    if not found:
        process.wait(5)
        raise RuntimeError(
            f"engine exited with {process.returncode} before listening:\n" + "\n".join(output)
        )
    url = found[0]
    return EngineProcess(url=url, port=int(url.rsplit(":", 1)[1]), process=process, output=output)


class ThreadedServer:
    """An aiohttp app served from its own event loop in a background thread.

    For synchronous tests (hypothesis properties) and for tests that want one real server for a
    whole session without a subprocess: `url` is set once `start()` returns.
    """

    def __init__(self, app_factory: Callable[[], web.Application], host: str = "127.0.0.1") -> None:
        self._factory = app_factory
        self._host = host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.url = ""
        self.app: web.Application | None = None

    def start(self, timeout: float = 120.0) -> ThreadedServer:
        self._thread = threading.Thread(target=self._main, name="engine-test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("threaded server did not start")
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._cleanup())
        loop.close()

    async def _setup(self) -> None:
        self.app = self._factory()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, 0)
        await site.start()
        self.url = f"http://{self._host}:{self._runner.addresses[0][1]}"

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
