"""TLS contexts for calls to remote engines and detectors, and for the server itself.

A certificate, key or CA that cannot be loaded is a ConfigError naming the YAML path, raised at
start-up, never a traceback or a failure at the first request."""

from __future__ import annotations

import ssl

from ..config import ClientTlsConfig, ConfigError, TlsConfig


def _load_error(where: str, field: str, path: str | None, exc: Exception) -> ConfigError:
    reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
    return ConfigError([f"{where}.{field}: cannot load {path}: {reason}"])


def client_ssl_context(
    tls: ClientTlsConfig | None, *, where: str = "tls"
) -> ssl.SSLContext | bool | None:
    """None: aiohttp's default verification (system CAs); False: verification explicitly
    disabled. `ca_path` replaces the system CAs (a private CA), `cert_path`/`key_path` is the
    client certificate for servers that require one (mTLS). `where` is the YAML path of `tls`."""
    if tls is None:
        return None
    if tls.insecure_skip_verify and not tls.cert_path:
        return False
    if tls.key_path and not tls.cert_path:
        raise ConfigError([f"{where}.key_path: given without cert_path"])
    try:
        ctx = ssl.create_default_context(cafile=tls.ca_path)
    except (OSError, ssl.SSLError) as exc:
        raise _load_error(where, "ca_path", tls.ca_path, exc) from None
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.cert_path:
        try:
            ctx.load_cert_chain(tls.cert_path, tls.key_path)
        except (OSError, ssl.SSLError) as exc:
            raise _load_error(where, "cert_path", tls.cert_path, exc) from None
    return ctx


def server_ssl_context(
    tls: TlsConfig | None, *, where: str = "server.tls"
) -> ssl.SSLContext | None:
    """Server certificate, and client-certificate verification when `client_ca_path` is set:
    then a client without a certificate signed by that CA fails the handshake."""
    if tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert_path, tls.key_path)
    except (OSError, ssl.SSLError) as exc:
        raise _load_error(where, "cert_path", tls.cert_path, exc) from None
    if tls.client_ca_path:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_path)
        except (OSError, ssl.SSLError) as exc:
            raise _load_error(where, "client_ca_path", tls.client_ca_path, exc) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
