"""What a client may be told about a failed call to an engine or a remote detector: the kind of
failure, never the address. aiohttp's messages name the host and port ("Cannot connect to host
10.0.3.7:8080 ssl:default [Connect call failed ('10.0.3.7', 8080)]"), which maps the internal
network for whoever can make a call fail; the full exception goes to the log instead."""

from __future__ import annotations

import ssl

import aiohttp


def connection_failure(exc: BaseException) -> str:
    """A short, address-free reason for a connection-level failure."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "TLS certificate verify failed"
    if isinstance(exc, aiohttp.ClientSSLError | ssl.SSLError):
        return "TLS handshake failed"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "cannot resolve the host"
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error, ConnectionRefusedError):
            return "cannot connect (connection refused)"
        if isinstance(os_error, TimeoutError):
            return "cannot connect (timed out)"
        return "cannot connect"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "connection lost mid-stream"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(exc, aiohttp.ClientResponseError):
        # our calls never raise_for_status: this is aiohttp failing to parse the peer's reply
        # (a header past its bound, an encoding it cannot decode), its `status` (400) its own
        return "unreadable HTTP reply"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__
