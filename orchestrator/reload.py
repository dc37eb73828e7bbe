"""Reloading the config without a restart (SIGHUP, `POST /admin/reload`): tenants, their keys,
limits and guardrails, models, detectors and chunkers, and the server's key variables.

The file is read again and checked in one pass, like at start-up (schema, references, keys in
the environment), and against what a reload can change: the other server settings (host, port,
workers, TLS, ...) are bound at start-up, and one that differs is an error naming it, since
applying only part of a file would leave the service running a config nobody wrote. A bad file
changes nothing.

A good one is built beside the running one before anything is swapped: a detector or chunker
whose settings did not change is kept (the same client, its model not loaded again); a changed
or new one is built off the loop, and an in-process detector loads its model and judges once
(its warm-up) before any request can reach it; a model whose settings (but its guardrails) did
not change keeps its backend, while a changed or new one gets a new backend, started (engines
healthy) before it is swapped in. Every tenant's and model's enforced guardrails are resolved
again. Then all of it is swapped in at once: new requests resolve their key, their model and
their detectors against the new config (so does a request admitted before the swap whose
pipeline is built after it: its body came late, and its tenant is resolved again then), while a
running pipeline keeps the snapshot it was built with (a running stream finishes under its
policy, on its backend). What was replaced (a removed or changed detector's client, a removed or changed
model's backend) is closed once every request admitted before the swap has ended. Each
tenant's counters (streams running, token buckets) carry over by tenant id."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from servicekit.auth import KeyRing

from .clients.backend import ModelBackend
from .clients.backends import build_model_backends
from .clients.detectors import DetectorClient, InProcessDetectorClient
from .clients.registry import ChunkerRegistry, DetectorRegistry, EnforcedGuardrails
from .config import (
    Config,
    ConfigError,
    ManagedBackend,
    ModelConfig,
    ServerConfig,
    as_read,
    config_source,
    load_config,
    secret_env_names,
    with_source,
)
from .handlers.health import WARMUP_TEXT
from .state import Admitted, AppState
from .tenants import Tenants, admin_keys, tenant_ids, tenant_keys

log = logging.getLogger("guardstream")

RELOADABLE = (
    "tenants, models, detectors, chunkers, detection_cache, server.api_keys_env and "
    "server.admin_keys_env reload; anything else needs a restart"
)


@dataclass
class _Built:
    """What a reload built beside the running config, not yet swapped in."""

    config: Config
    chunkers: ChunkerRegistry
    detectors: DetectorRegistry
    backends: dict[str, ModelBackend]  # every model's: kept ones and new ones
    new_backends: dict[str, ModelBackend]
    new_clients: dict[str, DetectorClient]

    async def discard(self) -> None:
        """A reload that failed after building: what it built is closed, nothing else."""
        await _close_all(
            [b.close for b in self.new_backends.values()]
            + [c.close for c in self.new_clients.values()]
        )


async def reload_config(state: AppState, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Reads the config file again and applies it: [] when applied, else every error (and
    nothing changed). One reload at a time."""
    async with state.reloading:
        path = config_source(state.config)
        if path is None:
            return ["(no file): this service was not started from a config file"]
        try:
            # reading and validating builds chunkers and checks detector settings: off the loop
            new = await asyncio.to_thread(load_config, path)
        except ConfigError as exc:
            return exc.errors
        old = as_read(state.config)
        errors = fixed_settings_changed(old, new)
        if state.workers > 1:
            errors += managed_engines_changed(old, new)
        keys = admins = None
        try:
            keys = tenant_keys(new, environ)
            admins = admin_keys(new, environ)
        except ConfigError as exc:
            errors += exc.errors
        if not errors and (state.tenants is not None and state.tenants.auth) != (keys is not None):
            errors.append(
                "server.api_keys_env, tenants: a reload cannot turn authentication on or off "
                "(restart to change it)"
            )
        if errors:
            return errors
        built = await _build(state, old, new)
        if isinstance(built, list):
            return built
        running = built.config
        with_source(running, path, new)
        try:
            enforced = EnforcedGuardrails.of_models(running, built.detectors)
            tenants = Tenants.build(running, built.detectors, enforced, keys)
        except BaseException:  # checked by load_config: a bug, but nothing may stay half-built
            await built.discard()
            raise
        replaced = _replaced(state, built)
        # no await from here to the swap: it is one step for every request
        state.config, state.chunkers, state.detectors = running, built.chunkers, built.detectors
        state.backends, state.enforced, state.tenants = built.backends, enforced, tenants
        state.admin_keys = KeyRing((k, True) for k in admins or [])
        state.metrics.add_tenants(tenant_ids(running, keys))
        # kept verdicts: keyed by detector client and config entry, so a changed detector's
        # old verdicts are never met again; a removed tenant's partition goes now
        state.build_verdicts(running.detection_cache)
        if state.verdicts is not None:
            state.verdicts.retain(tenant_ids(running, keys))
        before, state.admitted = state.admitted, Admitted()
        state.retiring = asyncio.create_task(_retire(state.retiring, before, replaced))
        log.info(
            "config reloaded from %s: %d tenant(s); built %s; replaced %s",
            path,
            len(tenants.tenants),
            _names(built.new_backends, built.new_clients) or "nothing",
            ", ".join(replaced.names) or "nothing",
        )
        return []


async def _build(state: AppState, old: Config, new: Config) -> _Built | list[str]:
    """The new config's chunkers, detectors and backends, reusing what did not change; the
    errors when something new cannot be built or started (and then nothing is left of it)."""
    assert state.detectors is not None and state.session is not None
    running = state.detectors.clients()
    keep_chunkers = {
        cid: state.chunkers.get(cid)
        for cid, settings in new.chunkers.items()
        if old.chunkers.get(cid) == settings
    }
    keep_clients = {
        d: running[d] for d, det in new.detectors.items() if old.detectors.get(d) == det
    }
    session, on_call = state.session, state.metrics.record_detector_call

    def build() -> tuple[ChunkerRegistry, DetectorRegistry]:
        # chunkers may load models (sentence splitters); built-ins check their params
        chunkers = ChunkerRegistry(new.chunkers, keep=keep_chunkers)
        detectors = DetectorRegistry(
            new, session, device=state.device, on_call=on_call, keep=keep_clients
        )
        return chunkers, detectors

    try:
        chunkers, detectors = await asyncio.to_thread(build)
    except ConfigError as exc:  # e.g. a remote detector's key variable is unset
        return exc.errors
    except Exception as exc:
        return [f"detectors, chunkers: could not be built: {type(exc).__name__}: {exc}"]
    new_clients = {d: c for d, c in detectors.clients().items() if d not in keep_clients}
    kept_models = {
        m: model for m, model in new.models.items() if _same_model(old.models.get(m), model)
    }
    models = {
        m: state.config.models[m].model_copy(update={"guardrails": model.guardrails})
        if m in kept_models
        else model
        for m, model in new.models.items()
    }
    backends = {m: state.backends[m] for m in kept_models}
    new_backends: dict[str, ModelBackend] = {}
    built = _Built(
        new.model_copy(update={"server": _server(state, new), "models": models}),
        chunkers,
        detectors,
        backends,
        new_backends,
        new_clients,
    )
    errors: list[str] = []
    try:
        new_backends.update(
            build_model_backends(
                {m: model for m, model in models.items() if m not in kept_models},
                session,
                metrics=state.migration_metrics,
                hidden_env=secret_env_names(new),
            )
        )
    except ConfigError as exc:
        errors = exc.errors
    if not errors:
        # the new detectors load their models (as at start-up: in their worker threads) and
        # the new backends start their engines, together; the running ones serve meanwhile
        warm = [
            _started(f"detectors.{d}", c.warm_up(WARMUP_TEXT))
            for d, c in new_clients.items()
            if isinstance(c, InProcessDetectorClient)
        ]
        starts = [_started(f"models.{m}.backends", b.start()) for m, b in new_backends.items()]
        errors = [e for e in await asyncio.gather(*warm, *starts) if e is not None]
    if errors:
        await built.discard()
        return errors
    backends.update(new_backends)
    return built


async def _started(where: str, step: Awaitable[None]) -> str | None:
    """None once `step` is done, else the error, named by its place in the config."""
    try:
        await step
    except Exception as exc:
        return f"{where}: could not start: {type(exc).__name__}: {exc}"
    return None


def _server(state: AppState, new: Config) -> ServerConfig:
    """The running server settings (a worker's, fitted to the process limits), with the new
    key variables: nothing else of `server` reloads."""
    return state.config.server.model_copy(
        update={
            "api_keys_env": new.server.api_keys_env,
            "admin_keys_env": new.server.admin_keys_env,
        }
    )


def _same_model(old: ModelConfig | None, new: ModelConfig) -> bool:
    """Whether a model keeps its backend: every setting but its guardrails is unchanged."""
    if old is None:
        return False
    return old.model_dump(exclude={"guardrails"}) == new.model_dump(exclude={"guardrails"})


@dataclass
class _Replaced:
    closers: list[Callable[[], Awaitable[None]]]
    names: list[str]


def _replaced(state: AppState, built: _Built) -> _Replaced:
    """The running backends and detector clients the new config no longer uses."""
    assert state.detectors is not None
    kept_backends = {id(b) for b in built.backends.values()}
    kept_clients = {id(c) for c in built.detectors.clients().values()}
    out = _Replaced([], [])
    for m, backend in state.backends.items():
        if id(backend) not in kept_backends:
            out.closers.append(backend.close)
            out.names.append(f"models.{m}")
    for d, client in state.detectors.clients().items():
        if id(client) not in kept_clients:
            out.closers.append(client.close)
            out.names.append(f"detectors.{d}")
    return out


def _names(backends: Mapping[str, object], clients: Mapping[str, object]) -> str:
    return ", ".join([*(f"models.{m}" for m in backends), *(f"detectors.{d}" for d in clients)])


async def _retire(previous: asyncio.Task[None] | None, admitted: Admitted, what: _Replaced) -> None:
    """Closes what a reload replaced once every request admitted before it has ended: those of
    earlier configs too (`previous`, the reload before, waits for them), since a request
    admitted under one config may have picked its model after a later swap. Cancelled (the
    service stops): closed at once."""
    try:
        if previous is not None:
            await previous
        await admitted.ended.wait()
    finally:
        await _close_all(what.closers)


async def _close_all(closers: list[Callable[[], Awaitable[None]]]) -> None:
    """Calls every closer, whatever one raises (a closed client must not keep the rest open)."""
    for close in closers:
        try:
            await close()
        except Exception:
            log.exception("closing what a reload replaced")


def managed_engines_changed(old: Config, new: Config) -> list[str]:
    """With `server.workers` > 1 the supervisor started the managed engines once for every
    worker: a worker cannot start or stop them, so a model with one cannot change."""
    errors = []
    for m in sorted(set(old.models) | set(new.models)):
        before, after = old.models.get(m), new.models.get(m)
        if before is not None and after is not None and _same_model(before, after):
            continue
        managed = [b for model in (before, after) if model is not None for b in model.backends]
        if any(isinstance(b, ManagedBackend) for b in managed):
            errors.append(
                f"models.{m}: a model with a managed backend cannot change while "
                "server.workers > 1 (the supervisor starts its engines once for every worker; "
                "restart for this)"
            )
    return errors


def fixed_settings_changed(old: Config, new: Config) -> list[str]:
    """What differs between `old` and `new` outside what a reload applies, by YAML path."""

    def fixed(config: Config) -> dict[str, Any]:
        data = config.model_dump(mode="json")
        server = data["server"]
        for name in ("api_keys_env", "admin_keys_env"):
            server.pop(name)
        return {"server": server}

    return [
        f"{path}: changed (a reload applies only {RELOADABLE.split(' reload;')[0]}; restart "
        "for this)"
        for path in _differences(fixed(old), fixed(new), "")
    ]


def _differences(old: Any, new: Any, path: str) -> list[str]:
    """The paths where two parsed configs differ: down to a section's entries (a model, a
    detector, a server setting), not to every leaf."""
    if isinstance(old, dict) and isinstance(new, dict) and path.count(".") < 2:
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                out.append(sub)
            else:
                out += _differences(old[key], new[key], sub)
        return out
    return [] if old == new else [path]
