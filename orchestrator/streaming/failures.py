"""The one place that turns an exception into what a client is told (DESIGN section 4): the
error middleware (before the first byte), the pipeline's `failed`/`error` terminal events and
the stream-content error line all ask `describe` for the `Failure` triple, and each surface
renders that triple as it is (never a body converted back), so they cannot disagree."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..api.errors import ApiError, ErrorType, Failure
from ..clients.backend import GenerationError
from ..clients.detectors import DetectorCallError
from .fanout import ChunkerFailure

log = logging.getLogger("guardstream.failures")


def first_error(exc: BaseException) -> BaseException:
    """The exception that explains a TaskGroup failure (the others are its cancellations)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def describe(exc: BaseException) -> Failure:
    """Client mistakes map to 4xx; a dependency's failure names the dependency; anything else is
    an opaque 500 (logged by the caller, never shown)."""
    exc = first_error(exc)
    if isinstance(exc, ApiError):
        return exc.failure
    if isinstance(exc, DetectorCallError):
        if exc.invalid_params:
            return Failure(422, ErrorType.INVALID_REQUEST, str(exc))
        if exc.overloaded:
            # this request arrived into a full detector: it may retry; others are unaffected
            return Failure(429, ErrorType.OVERLOADED, str(exc))
        return Failure(502, ErrorType.DETECTOR_ERROR, str(exc))
    if isinstance(exc, ChunkerFailure):
        return Failure(500, ErrorType.CHUNKER_ERROR, str(exc))
    if isinstance(exc, GenerationError):
        try:
            etype = ErrorType(exc.error_type)
        except ValueError:
            etype = ErrorType.GENERATION_ERROR
        if etype == ErrorType.INVALID_REQUEST:
            # an engine's own 4xx that slipped past validation is still the client's mistake
            return Failure(422, etype, str(exc))
        return Failure(exc.code, etype, str(exc))
    if isinstance(exc, TimeoutError):
        return Failure(504, ErrorType.TIMEOUT, "the request timed out")
    if isinstance(exc, web.HTTPException):
        if exc.status == 404:
            return Failure(404, ErrorType.NOT_FOUND, "no such endpoint")
        if exc.status == 413:
            return Failure(413, ErrorType.INVALID_REQUEST, "request body too large")
        if exc.status < 500:
            return Failure(exc.status, ErrorType.INVALID_REQUEST, exc.reason)
    return Failure(500, ErrorType.SERVER_ERROR, "internal error")


def is_unexpected(failure: Failure) -> bool:
    """A bug rather than a client's or a dependency's failure: worth a traceback in the log."""
    return failure.type == ErrorType.SERVER_ERROR
