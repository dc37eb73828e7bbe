"""Bearer API keys, checked one way by every service.

A missing header, another scheme and a wrong key are the same failure, so a caller learns nothing
about which part was wrong; each service answers it with its own 401 body (the orchestrator's and
the engine's `{code, details, type}`, the detector service's `{code, message}`: DESIGN 4, 6, 7),
with the same message and the same `WWW-Authenticate` challenge. The keys are read one way too
(`api_keys_from_env`): comma-separated, from an environment variable the service is told the name
of, never from a file or a flag that `ps` shows.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

UNAUTHORIZED_MESSAGE = "missing or invalid API key"
CHALLENGE = {"WWW-Authenticate": "Bearer"}
T = TypeVar("T")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


Compare = Callable[[bytes, bytes], bool]


class KeyRing(Generic[T]):
    """Keys and whom each belongs to (the orchestrator's tenants), as sha256 digests. Fixed-length
    digests are compared: compare_digest on the raw keys would return early on a length mismatch
    and tell a caller how long the keys are; and EVERY key is compared, with no early exit, so
    timing does not tell which key, or which owner's key, came close. `compare` is injectable
    so a test can count the comparisons (a timing test would be flaky and prove little)."""

    def __init__(self, keys: Iterable[tuple[str, T]], compare: Compare | None = None) -> None:
        self._entries = [(_digest(k.encode("utf-8")), owner) for k, owner in keys]
        self._compare = compare

    def __len__(self) -> int:
        return len(self._entries)

    def owner(self, headers: Mapping[str, str]) -> T | None:
        """The owner of the key in `Authorization: Bearer <key>`, else None."""
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        given = _digest(token.strip().encode("utf-8", "surrogateescape"))
        found: T | None = None
        compare = self._compare or hmac.compare_digest
        for digest, owner in self._entries:
            if compare(given, digest):  # keys are unique: at most one matches
                found = owner
        return found if scheme.lower() == "bearer" else None


class BearerKeys:
    """The accepted keys of a service with one set of callers (the engine, the detector
    service): a `KeyRing` whose keys all belong to the same caller."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._ring = KeyRing((k, True) for k in keys)

    def accepts(self, headers: Mapping[str, str]) -> bool:
        """Whether `Authorization: Bearer <one of the keys>` is among these request headers."""
        return self._ring.owner(headers) is not None


class ApiKeysError(ValueError):
    """A variable named as holding the keys is unset or holds none. Each service reports it as
    its own start-up error (a config error, or the engine's exit 2)."""


def api_keys_from_env(
    name: str | None, setting: str, environ: Mapping[str, str] = os.environ
) -> list[str] | None:
    """The keys in the environment variable `name`, comma-separated (blanks around each and
    empty entries dropped), or None when `name` is None: auth off. `setting` says what named the
    variable (`server.api_keys_env`, `--api-keys-env`) and starts each error. A named variable
    that is unset or holds no key is an ApiKeysError: a service must never start open by
    accident."""
    if name is None:
        return None
    raw = environ.get(name)
    if raw is None:
        raise ApiKeysError(f"{setting}: environment variable {name} is not set")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if not keys:
        raise ApiKeysError(f"{setting}: environment variable {name} holds no key")
    return keys
