"""`server.workers`: one serving process, or a supervisor of N of them.

With `server.workers` > 1 (or "auto") the process that `serve` starts is a supervisor: it starts
the managed engines ONCE (not per worker), then N worker processes that each run the app on the
same port (SO_REUSEPORT: the kernel spreads connections over them) and reach the managed engines
as `native` backends, with each engine's key in an environment variable only they get. Their
metrics go to files in a directory the supervisor creates and removes (prometheus-client's
multiprocess mode), so any worker's `/metrics` shows the sum over all of them. SIGTERM or SIGINT
to the supervisor drains every worker (a second signal cuts the drains short), then stops the
engines. A worker that dies is restarted. Each worker (and a single process) serves with
server.py. A reload (the supervisor's SIGHUP, a worker's POST /admin/reload) reaches every
worker over its reload channel (reload_channel.py), and each one's result comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from servicekit.parent_death import preexec_die_with_parent

from .clients.backends import default_command
from .clients.managed import EngineProcess
from .clients.tls import server_ssl_context
from .config import (
    Config,
    ManagedBackend,
    config_source,
    parse_config,
    secret_env_names,
    with_source,
)
from .reload_channel import WorkerLink, reload_all
from .server import (
    CLEANUP_GRACE_S,
    SHUTDOWN_GRACE_S,
    bind_socket,
    run_event_loop,
    serve_process,
)
from .tenants import tenant_keys
from .tracing import engine_env

log = logging.getLogger("guardstream")


async def run_server(
    config: Config,
    host: str,
    port: int,
    *,
    device: str = "auto",
    log_format: str = "json",
    log_level: str = "INFO",
    ready_hint: Callable[[int], str] | None = None,
) -> int:
    """Serves until SIGTERM or SIGINT, then drains; a second signal cuts the drain short. With
    `server.workers` > 1 this process supervises that many workers (the logging settings are
    theirs). `ready_hint(port)`: text printed once the service is ready (`make run`'s examples:
    printed earlier, they failed while the engines were still loading)."""
    workers = worker_count(config.server.workers)
    if workers > 1:
        supervisor = Supervisor(
            config, host, port, workers, device=device, log_format=log_format, log_level=log_level
        )
        supervisor.ready_hint = ready_hint
        return await supervisor.run()
    return await serve_process(config, host, port, device=device, ready_hint=ready_hint)


# -- server.workers ---------------------------------------------------------------------------

# a worker that has not listened after this long failed to start
WORKER_START_TIMEOUT_S = 300.0
WORKER_BACKOFF_MAX_S = 30.0
# after the drain deadline, how long a worker still gets before it is killed
WORKER_EXIT_GRACE_S = SHUTDOWN_GRACE_S + CLEANUP_GRACE_S + 10.0
# the variable that holds the key of managed engine slot i, in the workers' environment only
MANAGED_KEY_ENV = "GUARDSTREAM_MANAGED_ENGINE_KEY_{}"
_WORKER_CODE = "import sys; from orchestrator.workers import worker_main; sys.exit(worker_main())"


def worker_count(setting: int | str) -> int:
    """`server.workers`: a number, or "auto" for one per CPU this process may run on."""
    if setting == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)
    return int(setting)


class _PinnedEngine(EngineProcess):
    """A managed engine whose port never changes: the workers were given its URL. (A plain
    EngineProcess moves to a fresh port when a restart never became healthy.)"""

    @property  # type: ignore[override]
    def port(self) -> int:
        return self._pinned_port

    @port.setter
    def port(self, value: int) -> None:
        if not hasattr(self, "_pinned_port"):
            self._pinned_port = value


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to the port the workers will share, with SO_REUSEPORT:
    it turns port 0 into a real number, fails early when the port is taken, and holds the port
    until the workers listen. A socket that does not listen gets no connections."""
    return bind_socket(host, port, reuse_port=True)


def worker_config(
    config: Config, engines: dict[tuple[str, int], list[EngineProcess]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The config a worker runs: `workers: 1`, and every managed backend replaced by its
    engines as `native` backends (URL, and the key in an environment variable); with that
    environment."""
    data = config.model_dump(mode="json")
    data["server"]["workers"] = 1
    env: dict[str, str] = {}
    for model_id, model in data["models"].items():
        backends: list[dict[str, Any]] = []
        for index, backend in enumerate(model["backends"]):
            if backend["type"] != "managed":
                backends.append(backend)
                continue
            for process in engines[(model_id, index)]:
                name = MANAGED_KEY_ENV.format(len(env))
                env[name] = process.api_key
                backends.append({"type": "native", "url": process.url, "api_key_env": name})
        model["backends"] = backends
    return data, env


def worker_main() -> int:
    """A worker process: its settings come as JSON on stdin (see Supervisor)."""
    spec = json.loads(sys.stdin.read())
    from .logs import configure_logging

    configure_logging(spec["log_format"], spec["log_level"])
    config = with_source(
        parse_config(spec["config"]), spec.get("source"), parse_config(spec["as_read"])
    )
    return run_event_loop(
        serve_process(
            config,
            spec["host"],
            spec["port"],
            device=spec["device"],
            worker=True,
            workers=spec["workers"],
            control_fd=spec.get("control_fd"),
        )
    )


class Supervisor:
    """Starts managed engines once and `workers` worker processes on one port, restarts a
    worker that dies, and on SIGTERM/SIGINT drains them all, then stops the engines."""

    def __init__(
        self,
        config: Config,
        host: str,
        port: int,
        workers: int,
        *,
        device: str = "auto",
        log_format: str = "json",
        log_level: str = "INFO",
    ) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.workers = workers
        self.device = device
        self.log_format = log_format
        self.log_level = log_level
        self.engines: list[EngineProcess] = []
        self.procs: dict[int, asyncio.subprocess.Process] = {}  # worker index -> process
        self._metrics_dir = ""
        self._slots: dict[tuple[str, int], list[EngineProcess]] = {}
        self._spec: dict[str, Any] = {}
        self._env: dict[str, str] = {}
        self._told: set[int] = set()  # pids of workers sent SIGTERM
        self._tasks: set[asyncio.Task[None]] = set()  # stdout readers, reload channels, orders
        self.ready_hint: Callable[[int], str] | None = None
        # the workers reloaded the file since they started: a restarted one reloads it too (it
        # starts from the config read at start-up)
        self._reloaded = False
        self._listening: set[int] = set()  # pids of the workers that said they listen
        self._links: dict[int, WorkerLink] = {}  # each worker's reload channel, by pid

    def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM: a worker drains on the first and cuts its drain short on a second."""
        self._told.add(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    async def run(self) -> int:
        # what would stop every worker is reported once, here, before anything starts
        server_ssl_context(self.config.server.tls)
        tenant_keys(self.config)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                log.warning("%s again: every worker ends its streams now", sig.name)
            else:
                log.info("%s: draining %d worker(s)", sig.name, len(self.procs))
                stop.set()
            for proc in list(self.procs.values()):
                self._terminate(proc)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)

        def on_hangup() -> None:
            # every worker reloads the file itself (orchestrator/reload.py)
            self._reloaded = True
            log.info("SIGHUP: %d worker(s) reload the config", len(self.procs))
            self._spawn_task(self._reload_logged(self._listening_links()))

        loop.add_signal_handler(signal.SIGHUP, on_hangup)
        self._metrics_dir = tempfile.mkdtemp(prefix="guardstream-metrics-")
        session = aiohttp.ClientSession()
        reserved: socket.socket | None = None
        try:
            reserved = reserve_port(self.host, self.port)
            port = reserved.getsockname()[1]
            await self._start_engines(session)
            self._spec_for(port)
            started = await self._start_workers(stop)
            reserved.close()
            reserved = None
            if started:
                scheme = "https" if self.config.server.tls else "http"
                url = f"{scheme}://{self.host}:{port}"
                log.info("guardstream listening on %s with %d workers", url, self.workers)
                print(f"guardstream listening on {url}", flush=True)
                if self.ready_hint is not None:  # workers are ready when they say they listen
                    print(self.ready_hint(self.port), flush=True)
                await self._supervise(stop)
            return 0 if started or stop.is_set() else 1
        finally:
            if reserved is not None:
                reserved.close()
            await self._stop_workers()
            await asyncio.gather(*(e.stop() for e in self.engines))
            await session.close()
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            log.info("stopped")

    # -- managed engines ------------------------------------------------------------------------

    async def _start_engines(self, session: aiohttp.ClientSession) -> None:
        """Every managed engine of every model, started (and supervised) here, once."""
        slots = self._slots
        for model_id, model in self.config.models.items():
            replicas = 0
            for index, backend in enumerate(model.backends):
                if not isinstance(backend, ManagedBackend):
                    replicas += 1
                    continue
                processes = []
                for _ in range(backend.replicas):
                    process = _PinnedEngine(
                        f"{model_id}/managed-{replicas}",
                        default_command(backend),
                        session,
                        start_timeout_s=backend.start_timeout_s,
                        # engines trace like the workers (config's server.tracing included)
                        env={**os.environ, **engine_env(self.config.server.tracing)},
                        hidden_env=secret_env_names(self.config),
                    )
                    replicas += 1
                    processes.append(process)
                slots[(model_id, index)] = processes
                self.engines.extend(processes)
        if not self.engines:
            return
        healthy = await asyncio.gather(*(e.start() for e in self.engines))
        up = {e.name.partition("/")[0] for e, ok in zip(self.engines, healthy, strict=True) if ok}
        for model_id, model in self.config.models.items():
            managed_only = all(isinstance(b, ManagedBackend) for b in model.backends)
            if managed_only and model_id not in up:
                raise RuntimeError(
                    f"model `{model_id}`: no managed engine became healthy; see the "
                    "[engine ...] lines above"
                )

    # -- workers --------------------------------------------------------------------------------

    def _spec_for(self, port: int) -> None:
        config, env = worker_config(self.config, self._slots)
        self._spec = {
            "config": config,
            # what SIGHUP reads again, and what it said at start-up
            "source": config_source(self.config),
            "as_read": self.config.model_dump(mode="json"),
            "host": self.host,
            "port": port,
            "device": self.device,
            "workers": self.workers,  # each enforces its share of tenants' limits
            "log_format": self.log_format,
            "log_level": self.log_level,
        }
        package_root = str(Path(__file__).resolve().parents[1])
        path = os.environ.get("PYTHONPATH")
        self._env = {
            **os.environ,
            **env,
            "PROMETHEUS_MULTIPROC_DIR": self._metrics_dir,
            "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
        }

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        """Worker `index`, once it listens; RuntimeError when it exits or hangs first."""
        ours, theirs = socket.socketpair()  # its reload channel (reload_channel.py)
        fd = theirs.fileno()  # the same number in the worker (pass_fds)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _WORKER_CODE,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=self._env,
                start_new_session=True,  # a Ctrl-C reaches the supervisor only, which drains them
                preexec_fn=preexec_die_with_parent(),
                pass_fds=(fd,),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        assert proc.stdin is not None and proc.stdout is not None
        self.procs[index] = proc
        link = self._links[proc.pid] = await WorkerLink.open(ours, proc.pid)
        self._spawn_task(link.serve(self._reload_others))
        spec = {**self._spec, "control_fd": fd}
        proc.stdin.write(json.dumps(spec).encode())
        with contextlib.suppress(ConnectionError):  # it died at once: reported below
            await proc.stdin.drain()
        proc.stdin.close()
        ready = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                ready = await self._wait_ready(proc.stdout)
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            self._forget(index, proc)
            raise RuntimeError(
                f"worker {index} (pid {proc.pid}) did not start (exit {proc.returncode})"
            )
        self._listening.add(proc.pid)
        if self._reloaded:  # it serves what the others reloaded, not the file read at start
            self._spawn_task(self._reload_logged([link]))
        # its stdout is read to the end so that a chatty library never blocks it
        self._spawn_task(self._drain(proc.stdout))
        log.info("worker %d started: pid %d", index, proc.pid)
        return proc

    def _spawn_task(self, step: Any) -> None:
        task = asyncio.ensure_future(step)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _wait_ready(stdout: asyncio.StreamReader) -> bool:
        """Until the worker's `{"ready": pid}` line; other output goes to stderr."""
        while line := await stdout.readline():
            with contextlib.suppress(ValueError):
                if "ready" in json.loads(line):
                    return True
            sys.stderr.write(line.decode("utf-8", "replace"))
        return False

    @staticmethod
    async def _drain(stdout: asyncio.StreamReader) -> None:
        """A worker's stdout after "ready", dropped (a chatty library must never block it)."""
        while True:
            try:
                line = await stdout.readline()
            except ValueError:  # a line over the reader's limit: dropped, the rest still read
                continue
            if not line:
                return

    def _listening_links(self, but: int | None = None) -> list[WorkerLink]:
        """The channels of the workers that listen (but the pid `but`). One still starting
        gets no order: `_spawn` sends it one once it listens, since `_reloaded` is set."""
        return [link for pid, link in self._links.items() if pid in self._listening and pid != but]

    async def _reload_others(self, asked: int) -> list[str]:
        """Worker `asked`'s POST /admin/reload applied the file there: every other worker
        applies it; their problems, a line each naming the worker ([]: all did)."""
        self._reloaded = True
        links = self._listening_links(but=asked)
        log.info("worker %d reloaded: %d other worker(s) reload", asked, len(links))
        errors = await reload_all(links, self.config.server.request_timeout_s)
        for line in errors:
            log.error("config not reloaded by every worker: %s", line)
        return errors

    async def _reload_logged(self, links: list[WorkerLink]) -> None:
        """An order nobody answers (SIGHUP, a restarted worker's catching up): logged."""
        timeout_s = self.config.server.request_timeout_s
        results = await asyncio.gather(*(link.reload(timeout_s) for link in links))
        for link, errors in zip(links, results, strict=True):
            if not errors:
                log.info("worker %d reloaded the config", link.pid)
            for line in errors:
                log.error("config not reloaded: %s", line)

    async def _start_workers(self, stop: asyncio.Event) -> bool:
        """All workers, listening; False when one failed (`run` stops the others)."""
        failure: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                for index in range(self.workers):
                    group.create_task(self._spawn(index))
        except* RuntimeError as failed:
            failure = failed.exceptions[0]
        if failure is not None and not stop.is_set():
            log.error("%s", failure)
        return failure is None

    async def _supervise(self, stop: asyncio.Event) -> None:
        """Until a signal: a worker that exits is restarted (with a growing backoff)."""
        failures = 0
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                waits = {asyncio.ensure_future(p.wait()): i for i, p in self.procs.items()}
                done, _ = await asyncio.wait([stopped, *waits], return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if stop.is_set():
                    return
                for w in done - {stopped}:
                    index = waits[w]
                    proc = self.procs[index]
                    self._forget(index, proc)
                    failures += 1
                    delay = min(0.5 * 2 ** (failures - 1), WORKER_BACKOFF_MAX_S)
                    log.error(
                        "worker %d (pid %d) exited with %s; restarting in %.1f s",
                        index,
                        proc.pid,
                        proc.returncode,
                        delay,
                    )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await asyncio.shield(stopped)
                    if stop.is_set():
                        return
                    try:
                        await self._spawn(index)
                    except RuntimeError as exc:
                        log.error("%s", exc)
        finally:
            stopped.cancel()

    def _forget(self, index: int, proc: asyncio.subprocess.Process) -> None:
        """A worker is gone: its live gauges leave the aggregate."""
        from prometheus_client import multiprocess

        if self.procs.get(index) is proc:
            del self.procs[index]
        self._listening.discard(proc.pid)
        link = self._links.pop(proc.pid, None)
        if link is not None:
            link.close()
        multiprocess.mark_process_dead(proc.pid, self._metrics_dir)

    async def _stop_workers(self) -> None:
        """SIGTERM to every worker not told yet (on a signal the handler told them), then wait
        for their drains; kill what outlives the drain deadline."""
        procs = dict(self.procs)
        for proc in procs.values():
            if proc.returncode is None and proc.pid not in self._told:
                self._terminate(proc)
        deadline = self.config.server.drain_timeout_s + WORKER_EXIT_GRACE_S
        waits = [asyncio.ensure_future(p.wait()) for p in procs.values()]
        if waits:
            _, late = await asyncio.wait(waits, timeout=deadline)
            for index, proc in procs.items():
                if proc.returncode is None:
                    log.warning("worker %d (pid %d) did not stop; killing it", index, proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            if late:
                await asyncio.wait(late)
        for index, proc in procs.items():
            self._forget(index, proc)
