"""Tenants (config `tenants`, DESIGN 3a): who is calling, what it may see and use, and which
policy judges it.

Each API key belongs to exactly one tenant; the auth middleware resolves a request's key to its
tenant by comparing it with every configured key (servicekit.auth.KeyRing: no early exit, so the
timing does not say whose key came close). What a tenant gets is resolved once at start-up (and
at each reload), like the models' enforced guardrails: per (tenant, model) the model's enforced
guardrails tightened by the tenant's, and a short hash of them (the `x-guardstream-policy`
header), so the request path only looks things up.

`Tenants` is one immutable snapshot of all that: a reload builds a new one and swaps it in, and
a request keeps the snapshot it started with (running streams finish under the old policy).
The tenants' counters of the moment (streams running, token buckets) live in `TenantGate`s, kept
across reloads by tenant id, so a reload does not hand a tenant a fresh budget."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from servicekit.auth import UNAUTHORIZED_MESSAGE, ApiKeysError, Compare, KeyRing, api_keys_from_env

from .api.errors import ApiError, ErrorType
from .clients.registry import DetectorRegistry, EnforcedGuardrails, RequestedDetector
from .config import ALL_MODELS, DEFAULT_TENANT, Config, ConfigError, TenantLimits
from .rate_limits import Clock, TokenBucket

POLICY_HASH_CHARS = 12
# A prompt's tokens as a request's hold estimates them before any engine has counted them:
# about four characters a token, what English text averages under BPE tokenizers (the request is
# charged the engine's count when it ends)
PROMPT_CHARS_PER_TOKEN = 4


class RateLimited(ApiError):
    """A tenant's limit: 429 `overloaded` with Retry-After, before any byte."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(429, ErrorType.OVERLOADED, message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Tenant:
    id: str
    limits: TenantLimits
    # by model id, only the models this tenant sees: the model's guardrails tightened by its own
    enforced: Mapping[str, EnforcedGuardrails]
    policies: Mapping[str, str]  # by model id: the hash of `enforced[model]`
    policy: str  # over every model it sees: the header on routes that name no model

    def sees(self, model_id: str) -> bool:
        return model_id in self.enforced


def per_worker(limits: TenantLimits, workers: int) -> TenantLimits:
    """A worker's share of a tenant's limits with `server.workers` > 1: each worker counts only
    what it serves (its own process), so each gets 1/N of the streams and the per-minute rates,
    rounded up and at least 1; together the workers admit the limit, at most N - 1 more
    (rounding), rather than N times it. The kernel spreads connections evenly, not requests
    exactly, so a tenant may meet one worker's share a little before the whole limit.
    max_new_tokens and max_detection_chars bound one request: not divided."""
    if workers <= 1:
        return limits

    def share(value: int | None) -> int | None:
        return None if value is None else max(1, math.ceil(value / workers))

    return limits.model_copy(
        update={
            "max_concurrent_streams": share(limits.max_concurrent_streams),
            "requests_per_minute": share(limits.requests_per_minute),
            "tokens_per_minute": share(limits.tokens_per_minute),
        }
    )


class TenantGate:
    """A tenant's counters of the moment in this process: its streams and its buckets (limits
    as of the last reload, this worker's share of them: `per_worker`; a bucket whose rate
    changed starts from its old level, capped)."""

    def __init__(self, limits: TenantLimits, clock: Clock, workers: int = 1) -> None:
        self.streams = 0
        self._clock = clock
        self._workers = workers
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.configured = limits  # the tenant's, as configured (AppState.caller compares it)
        self.limits = limits  # this worker's share
        self.apply(limits)

    def apply(self, limits: TenantLimits) -> None:
        self.configured = limits
        limits = self.limits = per_worker(limits, self._workers)
        self.requests = self._bucket(self.requests, limits.requests_per_minute)
        self.tokens = self._bucket(self.tokens, limits.tokens_per_minute)

    def _bucket(self, old: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if per_minute is None:
            return None
        if old is not None and old.capacity == per_minute:
            return old
        new = TokenBucket(per_minute, self._clock)
        if old is not None:
            new.charge(new.capacity - min(old.level(), new.capacity))
        return new

    def admit_request(self, tenant_id: str) -> None:
        if self.requests is not None:
            wait = self.requests.take()
            if wait is not None:
                raise RateLimited(
                    f"tenant `{tenant_id}`: over its limit of "
                    f"{self.configured.requests_per_minute} requests per minute"
                    f"{self._share(self.limits.requests_per_minute)}",
                    wait,
                )

    def admit_tokens(self, tenant_id: str) -> None:
        if self.tokens is not None:
            wait = self.tokens.positive()
            if wait is not None:
                raise RateLimited(
                    f"tenant `{tenant_id}`: over its budget of "
                    f"{self.configured.tokens_per_minute} tokens per minute"
                    f"{self._share(self.limits.tokens_per_minute)}",
                    wait,
                )

    def charge_tokens(self, tokens: int) -> None:
        if self.tokens is not None and tokens > 0:
            self.tokens.charge(tokens)

    def hold_tokens(self, amount: int) -> TokenHold | None:
        """Takes `amount` from the token bucket now, for a request just admitted (None without
        a token budget): `TokenHold` settles it when the request ends."""
        if self.tokens is None or amount <= 0:
            return None
        self.tokens.charge(amount)
        return TokenHold(self, amount)

    def take_stream(self, tenant_id: str) -> None:
        limit = self.limits.max_concurrent_streams
        if limit is not None and self.streams >= limit:
            configured = self.configured.max_concurrent_streams
            raise RateLimited(
                f"tenant `{tenant_id}`: too many concurrent streams (limit {configured}"
                f"{self._share(limit)})",
                1,
            )
        self.streams += 1

    def _share(self, value: int | None) -> str:
        """What a refusal adds with `server.workers` > 1: the share this worker enforces."""
        return f", {value} on each of {self._workers} workers" if self._workers > 1 else ""

    def release_stream(self) -> None:
        self.streams -= 1


class TokenHold:
    """What a running request holds of its tenant's token budget: its max_new_tokens and an
    estimate of its prompt (`PROMPT_CHARS_PER_TOKEN`), taken when it is admitted. Charging only
    what a stream spent when it ended let every stream started together pass a bucket none of
    them had touched yet: a tenant's budget bounded its streams one after another, not at once.
    The request then pays what it spent (`settle`), or, ended before generating anything,
    gives the hold back (`release`); either order, once each."""

    def __init__(self, gate: TenantGate, amount: int) -> None:
        self._gate = gate
        self.amount = amount
        self._settled = False
        self._released = False

    def settle(self, spent: int) -> None:
        """The request's tokens, counted when its stream ended (or its client left)."""
        if self._settled:
            return
        self._settled = True
        held = 0 if self._released else self.amount
        self._released = True
        if self._gate.tokens is not None:  # the bucket of now: a reload may have replaced it
            self._gate.tokens.charge(spent - held)

    def release(self) -> None:
        """The request has ended: a hold it did not settle (refused, or no stream ran) goes
        back."""
        if self._released:
            return
        self._released = True
        if self._gate.tokens is not None:
            self._gate.tokens.charge(-self.amount)


@dataclass
class Caller:
    """The tenant of one request (on the request as `CALLER`): the snapshot it was admitted
    with (a generation request's is renewed when its pipeline is built: `current`), its gate,
    and the policy that judged it (a generation request names its model's)."""

    tenant: Tenant
    gate: TenantGate
    policy: str = field(default="")
    # the tenant the request's key names in the config in force now (None: no longer any)
    resolve_again: Callable[[], Tenant | None] | None = None
    # what its generation holds of the tenant's token budget until it ends (`hold_tokens`)
    held: TokenHold | None = None

    def __post_init__(self) -> None:
        self.policy = self.policy or self.tenant.policy

    def hold_tokens(self, max_new_tokens: int, prompt_chars: int) -> None:
        """Admits the generation against its tenant's token budget (429 while the bucket is
        not positive) and holds its worst case in the bucket until it ends: `max_new_tokens`
        and its prompt's characters over PROMPT_CHARS_PER_TOKEN."""
        self.gate.admit_tokens(self.tenant.id)
        if self.held is None:
            estimate = max_new_tokens + prompt_chars // PROMPT_CHARS_PER_TOKEN
            self.held = self.gate.hold_tokens(estimate)

    def settle_tokens(self, spent: int) -> None:
        """The tokens its stream spent (its hold given back), or just charged without one."""
        if self.held is not None:
            self.held.settle(spent)
        else:
            self.gate.charge_tokens(spent)

    def release_tokens(self) -> None:
        """The request has ended: a hold its stream did not settle goes back."""
        if self.held is not None:
            self.held.release()

    def current(self) -> Tenant | None:
        """The tenant as the config in force now has it: what a pipeline built now must judge
        with. A request is admitted at its head and may send its body long after (up to the
        request timeout): a reload in between must not leave it the policy it replaced, nor
        the limits (its gate takes the new ones now, not at the tenant's next request head: a
        tenant that sent no new request had its pre-opened ones counted by the old limits).
        None when the key no longer names this tenant (its gate counts this tenant's streams)."""
        if self.resolve_again is None:
            return self.tenant
        tenant = self.resolve_again()
        if tenant is None or tenant.id != self.tenant.id:
            return None
        self.tenant = tenant
        if self.gate.configured is not tenant.limits:
            self.gate.apply(tenant.limits)
        return tenant


CALLER = web.RequestKey("guardstream_caller", Caller)


def confirm_caller(request: web.Request) -> Tenant | None:
    """The request's tenant as the config in force now has it, once its body has come (a
    reload may have happened while it was on its way): 401 when its key no longer names that
    tenant, on every endpoint alike. None where the request has no tenant (an open path)."""
    caller = request.get(CALLER)
    if caller is None:
        return None
    tenant = caller.current()
    if tenant is None:
        raise ApiError(401, ErrorType.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
    return tenant


@dataclass(frozen=True)
class Tenants:
    """Every tenant and key of one config (a snapshot: a reload makes a new one)."""

    tenants: Mapping[str, Tenant]
    keys: KeyRing[str] | None  # None: auth is off, every request is the tenant `default`

    @property
    def auth(self) -> bool:
        return self.keys is not None

    def resolve(self, headers: Mapping[str, str]) -> Tenant | None:
        """The tenant whose key the request carries (every key is compared), else None."""
        if self.keys is None:
            return self.tenants[DEFAULT_TENANT]
        owner = self.keys.owner(headers)
        return None if owner is None else self.tenants[owner]

    @classmethod
    def build(
        cls,
        config: Config,
        registry: DetectorRegistry,
        models: Mapping[str, EnforcedGuardrails],
        keys: list[tuple[str, str]] | None,
        compare: Compare | None = None,
    ) -> Tenants:
        """`models`: the models' enforced guardrails (EnforcedGuardrails.of_models); `keys`:
        (key, tenant id) pairs (`tenant_keys`)."""
        tenants: dict[str, Tenant] = {}
        if keys is None or config.server.api_keys_env:
            tenants[DEFAULT_TENANT] = _tenant(DEFAULT_TENANT, TenantLimits(), models)
        for tenant_id, tc in config.tenants.items():
            visible = models if tc.models == ALL_MODELS else {m: models[m] for m in tc.models}
            everywhere = tc.guardrails.get(ALL_MODELS)
            own: dict[str, EnforcedGuardrails] = {}
            for model_id, enforced in visible.items():
                path = f"tenants.{tenant_id}.guardrails"
                if everywhere is not None:
                    enforced = enforced.tightened_by(
                        EnforcedGuardrails.of(registry, everywhere, f"{path}.{ALL_MODELS}")
                    )
                if model_id in tc.guardrails:
                    enforced = enforced.tightened_by(
                        EnforcedGuardrails.of(
                            registry, tc.guardrails[model_id], f"{path}.{model_id}"
                        )
                    )
                own[model_id] = enforced
            tenants[tenant_id] = _tenant(tenant_id, tc.limits, own)
        return cls(tenants, None if keys is None else KeyRing(keys, compare))


def _tenant(
    tenant_id: str, limits: TenantLimits, enforced: Mapping[str, EnforcedGuardrails]
) -> Tenant:
    policies = {m: policy_hash(e) for m, e in enforced.items()}
    overall = _short(json.dumps(sorted(policies.items())))
    return Tenant(tenant_id, limits, dict(enforced), policies, overall)


def policy_hash(enforced: EnforcedGuardrails) -> str:
    """A short, stable hash of the guardrails that judge a request: every setting that changes
    a verdict (detector, action, threshold, replacement, params, what it judges at once: its
    chunker, and what of the output it applies to), so a client can tell which policy judged
    it, and an operator can tell two policies apart, without seeing either."""

    def entry(d: RequestedDetector) -> list[object]:
        return [
            d.detector_id,
            d.on_detection,
            d.threshold,
            d.redact_with,
            d.params,
            d.chunker_id,
            list(d.applies_to),
        ]

    doc = {
        "input": [entry(d) for d in enforced.input],
        "output": [entry(d) for d in enforced.output],
    }
    return _short(json.dumps(doc, sort_keys=True, default=str))


def _short(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:POLICY_HASH_CHARS]


def tenant_ids(config: Config, keys: list[tuple[str, str]] | None) -> list[str]:
    """Every tenant id of `config` (the only label values of the per-tenant series)."""
    default = [DEFAULT_TENANT] if keys is None or config.server.api_keys_env else []
    return [*default, *config.tenants]


def tenant_keys(
    config: Config, environ: Mapping[str, str] = os.environ
) -> list[tuple[str, str]] | None:
    """(key, tenant id) for every configured key, or None when auth is off (no
    `server.api_keys_env`, no tenants). A variable that is unset or holds no key, and a key in
    two tenants, are config errors (all of them, in one pass; a key itself is never printed):
    a service must never start open, or let one tenant's key pass as another's."""
    sources: list[tuple[str, str | None, str]] = []
    if config.server.api_keys_env:
        sources.append((DEFAULT_TENANT, config.server.api_keys_env, "server.api_keys_env"))
    for tenant_id, tc in config.tenants.items():
        sources.append((tenant_id, tc.keys_env, f"tenants.{tenant_id}.keys_env"))
    if not sources:
        admin_keys(config, environ)  # still checked: a named variable must hold keys
        return None
    errors: list[str] = []
    owner_of: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    for tenant_id, env, setting in sources:
        try:
            keys = api_keys_from_env(env, setting, environ) or []
        except ApiKeysError as exc:
            errors.append(str(exc))
            continue
        for key in dict.fromkeys(keys):
            other = owner_of.setdefault(key, tenant_id)
            if other != tenant_id:
                errors.append(
                    f"{setting}: a key in {env} is also a key of the tenant '{other}' "
                    "(a key belongs to exactly one tenant)"
                )
            else:
                pairs.append((key, tenant_id))
    try:
        admins = admin_keys(config, environ) or []
    except ConfigError as exc:
        errors.extend(exc.errors)
        admins = []
    for key in admins:
        if key in owner_of:
            errors.append(
                f"server.admin_keys_env: a key in {config.server.admin_keys_env} is also a key "
                f"of the tenant '{owner_of[key]}' (an admin key must be only that)"
            )
    if errors:
        raise ConfigError(errors)
    return pairs


def admin_keys(config: Config, environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The keys of `server.admin_keys_env` (None: unset)."""
    try:
        return api_keys_from_env(
            config.server.admin_keys_env or None, "server.admin_keys_env", environ
        )
    except ApiKeysError as exc:
        raise ConfigError([str(exc)]) from None
