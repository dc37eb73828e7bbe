"""TLS contexts for calls to remote engines and detectors, and for the server itself."""

from __future__ import annotations

import ssl

from ..config import ClientTlsConfig, TlsConfig


def client_ssl_context(tls: ClientTlsConfig | None) -> ssl.SSLContext | bool | None:
    """None: aiohttp's default verification; False: verification explicitly disabled."""
    if tls is None:
        return None
    if tls.insecure_skip_verify and not tls.cert_path:
        return False
    ctx = ssl.create_default_context(cafile=tls.ca_path)
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.cert_path:
        ctx.load_cert_chain(tls.cert_path, tls.key_path)
    return ctx


def server_ssl_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """Server certificate, and client-certificate verification when `client_ca_path` is set."""
    if tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert_path, tls.key_path)
    if tls.client_ca_path:
        ctx.load_verify_locations(cafile=tls.client_ca_path)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
