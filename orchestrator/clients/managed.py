"""Engine processes the orchestrator starts and supervises (`type: managed` backends).

Each slot runs `python -m generation serve` on a free local port, is ready once `/health`
answers 200, and is restarted with exponential backoff when it exits; the slot (its replica
name and, when possible, its port) survives restarts. Children run in their own session, so a
Ctrl-C at the orchestrator's terminal does not kill them under in-flight streams, and on Linux
they die with the orchestrator. Their output goes to the orchestrator's log, one prefixed record per line.

Every slot has its own random API key, generated at start-up and never written anywhere: the
child reads it from its environment (`--api-keys-env`, so it is not on the command line that
`ps` shows), and the slot's client sends it, so nothing else on the machine can use the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import aiohttp

from servicekit.parent_death import preexec_die_with_parent

log = logging.getLogger("guardstream.managed")
engine_log = logging.getLogger("guardstream.engine")

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 30.0  # a process healthy this long resets the backoff
STOP_GRACE_S = 10.0

CommandFactory = Callable[[int], list[str]]
# The variable a managed engine reads its key from (set in the child's environment only).
ENGINE_API_KEYS_ENV = "GUARDSTREAM_ENGINE_API_KEYS"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_command(
    model: str,
    device: str,
    enable_fault_injection: bool = False,
    api_keys_env: str | None = None,
    *,
    dtype: str = "auto",
    batch_invariant: bool = False,
    prefill_chunk_tokens: int | None = None,
    overlap: bool | None = None,
    compile_step: bool = False,
) -> CommandFactory:
    """The engine CLI of DESIGN section 2, for a given port; with `api_keys_env`, the engine
    requires the key that EngineProcess puts in that variable."""

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "generation", "serve", "--model", model]
        cmd += ["--device", device, "--port", str(port)]
        if dtype != "auto":
            cmd += ["--dtype", dtype]
        if batch_invariant:
            cmd.append("--batch-invariant")
        if prefill_chunk_tokens is not None:
            cmd += ["--prefill-chunk-tokens", str(prefill_chunk_tokens)]
        if overlap is not None:
            cmd.append("--overlap" if overlap else "--no-overlap")
        if compile_step:
            cmd.append("--compile")
        if api_keys_env:
            cmd += ["--api-keys-env", api_keys_env]
        if enable_fault_injection:
            cmd.append("--enable-fault-injection")
        return cmd

    return command


def engine_environment(
    hidden: frozenset[str] = frozenset(), base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment a managed engine starts with: this process's (or `base`), minus the
    variables that hold the orchestrator's keys (`hidden`: config.secret_env_names). The
    engine's own key is added by EngineProcess."""
    source = os.environ if base is None else base
    return {k: v for k, v in source.items() if k not in hidden}


class EngineProcess:
    """One supervised engine slot. `api_key` (a fresh random one unless given) is put in the
    child's environment as ENGINE_API_KEYS_ENV; the command decides whether the engine uses it.
    The child's environment is `env` (default: this process's) without `hidden_env`."""

    def __init__(
        self,
        name: str,
        command: CommandFactory,
        session: aiohttp.ClientSession,
        *,
        start_timeout_s: float = 300.0,
        on_status: Callable[[str], None] = lambda status: None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        output: TextIO | None = None,
        api_key: str | None = None,
        hidden_env: frozenset[str] = frozenset(),
    ) -> None:
        self.name = name
        self._command = command
        self._session = session
        self.start_timeout_s = start_timeout_s
        self.on_status = on_status
        self.port = port or free_port()
        self._env = env
        self._hidden_env = hidden_env  # variables never passed on (the orchestrator's keys)
        self._output = output  # where child output goes; None: our stderr
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.restarts = 0
        self.ready = asyncio.Event()  # set while a started process is healthy
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self._first_attempt_done = asyncio.Event()
        self._log_tasks: set[asyncio.Task[None]] = set()
        self.last_exit: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def info(self) -> dict[str, Any]:
        return {"pid": self.pid if self.running else None, "restarts": self.restarts}

    async def start(self) -> bool:
        """Launch the slot and wait until its first process is healthy (or failed to start);
        the supervisor keeps trying either way. True when it is healthy."""
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(self._supervise(), name=f"engine-{self.name}")
        await self._first_attempt_done.wait()
        return self.ready.is_set()

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.ready.wait()
        return self.ready.is_set()

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after grace_s; the slot is not restarted."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(grace_s):
                    await proc.wait()
            except TimeoutError:
                log.warning("engine %s (pid %s) ignored SIGTERM; killing it", self.name, proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        self._set_status("UNHEALTHY")

    # -- supervision ----------------------------------------------------------------------------

    def _set_status(self, status: str) -> None:
        if status == "HEALTHY":
            self.ready.set()
        else:
            self.ready.clear()
        self.on_status(status)

    async def _supervise(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                proc = await self._spawn()
                started = time.monotonic()
                healthy = await self._wait_healthy(proc)
                self._first_attempt_done.set()
                if healthy:
                    log.info("engine %s ready on %s (pid %d)", self.name, self.url, proc.pid)
                    self._set_status("HEALTHY")
                elif proc.returncode is None:
                    log.error(
                        "engine %s (pid %d) not healthy after %g s; killing it",
                        self.name,
                        proc.pid,
                        self.start_timeout_s,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                rc = await proc.wait()
                self.last_exit = rc
                self._set_status("UNHEALTHY")
                if self._stopping:
                    return
                if healthy and time.monotonic() - started >= STABLE_AFTER_S:
                    failures = 0
                failures += 1
                if not healthy:
                    self.port = free_port()  # the port may be what kept it from starting
                delay = min(BACKOFF_BASE_S * 2 ** (failures - 1), BACKOFF_MAX_S)
                log.warning(
                    "engine %s (pid %d) exited with %s; restarting in %.1f s",
                    self.name,
                    proc.pid,
                    rc,
                    delay,
                )
                await asyncio.sleep(delay)
                self.restarts += 1
        finally:
            self._first_attempt_done.set()
            proc = self._proc
            if self._stopping and proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # spawned while stop() was under way

    async def _spawn(self) -> asyncio.subprocess.Process:
        cmd = self._command(self.port)
        env = engine_environment(self._hidden_env, self._env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env[ENGINE_API_KEYS_ENV] = self.api_key
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=preexec_die_with_parent(),
            limit=1 << 20,
        )
        self._proc = proc
        log.info("engine %s started: pid %d, port %d", self.name, proc.pid, self.port)
        task = asyncio.create_task(self._forward_output(proc), name=f"engine-log-{self.name}")
        self._log_tasks.add(task)
        task.add_done_callback(self._log_tasks.discard)
        return proc

    async def _forward_output(self, proc: asyncio.subprocess.Process) -> None:
        """Child output, one line at a time: to `output` when given (tests), else to the log."""
        assert proc.stdout is not None
        prefix = f"[engine {self.name} pid {proc.pid}] "
        while True:
            try:
                line = await proc.stdout.readline()
            except ValueError:  # a line over the limit: pass it on in pieces
                line = await proc.stdout.read(1 << 16)
            except Exception:
                return
            if not line:
                return
            text = line.decode("utf-8", "replace")
            if self._output is not None:
                self._output.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
            else:
                # through logging, so the orchestrator's JSON log format covers engine lines too
                engine_log.info(
                    "%s%s", prefix, text.rstrip("\n"), extra={"engine": self.name, "pid": proc.pid}
                )

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                return False
            try:
                async with self._session.get(
                    self.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=2),
                    allow_redirects=False,  # a peer we do not trust (DESIGN 6)
                ) as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        return False
