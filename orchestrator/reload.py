"""Reloading the config without a restart (SIGHUP, `POST /admin/reload`): tenants, their keys,
limits and guardrails, the models' guardrails, and the server's key variables.

The file is read again and checked in one pass, like at start-up (schema, references, keys in
the environment), and against what a reload can change: anything else that differs (models'
backends and limits, detectors, chunkers, other server settings) is an error naming it, since
applying only part of a file would leave the service running a config nobody wrote. A bad file
changes nothing. A good one is resolved whole (every tenant's guardrails per model), then
swapped in at once: new requests resolve their key against the new tenants, while a request
already running keeps the tenant snapshot and the pipeline it started with, so a running stream
finishes under the policy that started it. Each tenant's counters (streams running, token
buckets) carry over by tenant id."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from servicekit.auth import KeyRing

from .clients.registry import EnforcedGuardrails
from .config import Config, ConfigError, as_read, config_source, load_config, with_source
from .state import AppState
from .tenants import Tenants, admin_keys, tenant_ids, tenant_keys

log = logging.getLogger("guardstream")

RELOADABLE = (
    "tenants, models.<id>.guardrails, server.api_keys_env and server.admin_keys_env reload; "
    "anything else needs a restart"
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
        errors = fixed_settings_changed(as_read(state.config), new)
        try:
            keys = tenant_keys(new, environ)
            admins = admin_keys(new, environ)
        except ConfigError as exc:
            errors += exc.errors
        if errors:
            return errors
        running = state.config.model_copy(
            update={
                "server": state.config.server.model_copy(
                    update={
                        "api_keys_env": new.server.api_keys_env,
                        "admin_keys_env": new.server.admin_keys_env,
                    }
                ),
                "models": {
                    model_id: model.model_copy(
                        update={"guardrails": new.models[model_id].guardrails}
                    )
                    for model_id, model in state.config.models.items()
                },
                "tenants": new.tenants,
            }
        )
        with_source(running, path, new)
        if (state.tenants is not None and state.tenants.auth) != (keys is not None):
            return [
                "server.api_keys_env, tenants: a reload cannot turn authentication on or off "
                "(restart to change it)"
            ]
        assert state.detectors is not None
        enforced = EnforcedGuardrails.of_models(running, state.detectors)
        tenants = Tenants.build(running, state.detectors, enforced, keys)
        # nothing above awaited after the checks: the swap is one step for every request
        state.config, state.enforced, state.tenants = running, enforced, tenants
        state.admin_keys = KeyRing((k, True) for k in admins or [])
        state.metrics.add_tenants(tenant_ids(running, keys))
        log.info("config reloaded from %s: %d tenant(s)", path, len(tenants.tenants))
        return []


def fixed_settings_changed(old: Config, new: Config) -> list[str]:
    """What differs between `old` and `new` outside what a reload applies, by YAML path."""

    def fixed(config: Config) -> dict[str, Any]:
        data = config.model_dump(mode="json")
        data.pop("tenants")
        for name in ("api_keys_env", "admin_keys_env"):
            data["server"].pop(name)
        for model in data["models"].values():
            model.pop("guardrails")
        return data

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
