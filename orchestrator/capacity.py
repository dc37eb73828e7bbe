"""What one orchestrator process can hold open: file descriptors, the listen queue, streams.

Why this exists (issue 26): one worker at 1024 streams reset its clients' connections. Each
stream holds at least two descriptors (the client's connection and the engine's, plus one per
remote detector call in flight), and a process starts with the soft RLIMIT_NOFILE, often 1024
(systemd, many container runtimes) while the hard limit is far higher. Once descriptors run out,
accept() fails with EMFILE, and the event loop (libuv under uvloop) accepts and closes pending
connections to keep going: the client sees a reset. Outgoing connections to the engine fail as
well, and the replica is reported unhealthy. So at start-up the process raises its soft limit to
the hard one, logs both, and if even that cannot hold `server.max_concurrent_streams` streams,
lowers the cap to what fits: excess streams then get 429 with Retry-After, never a reset.
"""

from __future__ import annotations

import logging
import resource
from pathlib import Path

from .config import ENGINE_JUDGE_TYPE, Config

log = logging.getLogger("guardstream")

# descriptors the process needs besides its streams: the interpreter and its libraries, the
# event loop, log files, the metrics files of server.workers, probes, scrapes, and connections
# that are being answered 429 (each holds a descriptor until its reply is written)
RESERVED_FDS = 128
NR_OPEN = Path("/proc/sys/fs/nr_open")
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def raise_open_file_limit() -> tuple[int, int, int]:
    """Raises the soft RLIMIT_NOFILE to the hard limit (an unlimited hard limit: to the
    kernel's fs.nr_open). Returns (soft before, soft now, hard); a refusal keeps the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = _read_int(NR_OPEN) or 1_048_576
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("open files: cannot raise the soft limit %d to %d: %s", soft, target, exc)
        return soft, soft, hard
    return soft, target, hard


def fds_per_stream(config: Config) -> int:
    """Descriptors one stream may hold at once: the client's connection, the engine's, and one
    per remote detector (a call in flight each)."""
    return 2 + sum(1 for d in config.detectors.values() if d.url is not None)


def streams_that_fit(config: Config, open_files: int) -> int:
    """How many streams `open_files` descriptors hold next to RESERVED_FDS."""
    if open_files == resource.RLIM_INFINITY:
        return config.server.max_concurrent_streams
    return max(1, (open_files - RESERVED_FDS) // fds_per_stream(config))


def fit_to_process_limits(config: Config) -> Config:
    """Raises the open-file limit and logs both limits; returns `config`, with
    max_concurrent_streams lowered to what the descriptors hold when they cannot hold it
    (a warning says so). Also warns when the kernel caps the listen backlog below
    server.listen_backlog (net.core.somaxconn)."""
    before, soft, hard = raise_open_file_limit()
    log.info(
        "open files: soft limit %s (was %s), hard limit %s",
        _show(soft),
        _show(before),
        _show(hard),
    )
    server = config.server
    somaxconn = _read_int(SOMAXCONN)
    if somaxconn is not None and somaxconn < server.listen_backlog:
        log.warning(
            "server.listen_backlog %d: the kernel caps it at net.core.somaxconn = %d",
            server.listen_backlog,
            somaxconn,
        )
    fits = streams_that_fit(config, soft)
    if fits >= server.max_concurrent_streams:
        return config
    log.warning(
        "server.max_concurrent_streams %d needs about %d open files (%d per stream + %d), the "
        "limit is %d: taking at most %d streams (raise the hard limit: ulimit -n, LimitNOFILE=, "
        "docker run --ulimit nofile=N:N)",
        server.max_concurrent_streams,
        server.max_concurrent_streams * fds_per_stream(config) + RESERVED_FDS,
        fds_per_stream(config),
        RESERVED_FDS,
        soft,
        fits,
    )
    return config.model_copy(
        update={"server": server.model_copy(update={"max_concurrent_streams": fits})}
    )


# the judge sessions one engine holds at once by default (generation/judge_sessions.py
# MAX_SESSIONS, `--max-judge-sessions`): 429 beyond
ENGINE_JUDGE_SESSIONS = 256


def judge_session_warnings(config: Config) -> list[str]:
    """An engine judge holds one session per stream it judges, and its engines hold
    ENGINE_JUDGE_SESSIONS each: more streams than that (the default max_concurrent_streams,
    1024, against one engine's 256) are admitted, and those its judge cannot open a session
    for end `overloaded`. Valid (a judge may judge only some streams' text), so a warning
    for check-config and the serve log, not an error."""
    workers = config.server.workers if isinstance(config.server.workers, int) else 1
    streams = config.server.max_concurrent_streams * workers
    out = []
    for detector_id, det in config.detectors.items():
        if det.type != ENGINE_JUDGE_TYPE:
            continue
        engines = len(det.urls) if det.urls is not None else det.replicas or 1
        sessions = engines * ENGINE_JUDGE_SESSIONS
        if streams > sessions:
            out.append(
                f"server.max_concurrent_streams: {streams} streams, but detector "
                f"`{detector_id}` holds at most {sessions} judge sessions ({engines} "
                f"engine(s), {ENGINE_JUDGE_SESSIONS} each): a stream it judges past them ends "
                "`overloaded` (429); start more of its engines or lower max_concurrent_streams"
            )
    return out


def _show(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
