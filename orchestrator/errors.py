"""How a failure becomes what a client is told (DESIGN section 4).

An error is a `Failure` (api/errors.py) from the moment it is known to the moment it is
written. Here, once each:

- `describe` maps any exception to its `Failure` (the error middleware, the pipelines'
  terminal events and the stream-content error line all ask it);
- the failures several places report (`SHUTDOWN`, the timeouts) are constants, so the same
  event cannot be worded two ways;
- `is_http_error` decides whether a failure is answered as an HTTP error or said in-band, for
  the serving loop (streams and folds alike) and the error middleware;
- `Surface` renders a route's HTTP error body.

What each wire format says in-band (the FMS `error` event, a chat chunk's `{"error": ...}`, the
Responses `error` event, the stream-content error line) is its writer's: a writer only renders.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum

from aiohttp import web

from .api.errors import ApiError, ErrorBody, ErrorType, Failure
from .api.openai_chat import OpenAIErrorBody
from .clients.backend import GenerationError
from .clients.detectors import DetectorCallError
from .streaming.fanout import ChunkerFailure

SHUTDOWN = Failure(503, ErrorType.SERVER_SHUTDOWN, "the server is shutting down")
# a deadline inside a client (TimeoutError) with nothing more specific to say
TIMED_OUT = Failure(504, ErrorType.TIMEOUT, "the request timed out")
# request_timeout_s ran out: while the detectors judged a complete text, and while a streamed
# body (stream-content) was still arriving (the client's slowness: 408, not 504)
DETECTORS_TIMED_OUT = Failure(
    504, ErrorType.TIMEOUT, "the detectors did not answer within request_timeout_s"
)
REQUEST_TIMED_OUT = Failure(504, ErrorType.TIMEOUT, "the request exceeded request_timeout_s")
BODY_TIMED_OUT = Failure(
    408, ErrorType.TIMEOUT, "the request body did not arrive within request_timeout_s"
)
INTERNAL = Failure(500, ErrorType.SERVER_ERROR, "internal error")


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
        return TIMED_OUT
    if isinstance(exc, web.HTTPException):
        if exc.status == 404:
            return Failure(404, ErrorType.NOT_FOUND, "no such endpoint")
        if exc.status == 413:
            return Failure(413, ErrorType.INVALID_REQUEST, "request body too large")
        if exc.status < 500:
            return Failure(exc.status, ErrorType.INVALID_REQUEST, exc.reason)
    return INTERNAL


def is_unexpected(failure: Failure) -> bool:
    """A bug rather than a client's or a dependency's failure: worth a traceback in the log."""
    return failure.type == ErrorType.SERVER_ERROR


# What a reply can still say in-band about a failure while none of it was sent: a stream's
# wire format before its first byte (OpenResponses' `error` event for a server-side failure),
# a unary object that already holds output (a Responses object then says `failed`).
InBand = Callable[[Failure], bool]


def never(failure: Failure) -> bool:
    """A reply with no in-band way to say a failure before its first byte."""
    return False


def is_http_error(failure: Failure, *, sent: bool, in_band: InBand = never) -> bool:
    """The one decision between an HTTP error response and an in-band error: an HTTP error
    while none of the reply was sent and the reply has no in-band way to say it; in-band
    (or, with nothing to render it, a cut connection) after the first byte."""
    return not sent and not in_band(failure)


class Surface(Enum):
    """The shape of a route's HTTP error responses: the FMS `ErrorBody` (DESIGN section 4), or
    OpenAI's `{"error": ...}`, which OpenAI SDKs parse (4.8, 4.9)."""

    FMS = "fms"
    OPENAI = "openai"

    def error_body(self, failure: Failure) -> dict[str, object]:
        if self is Surface.OPENAI:
            return OpenAIErrorBody.for_request(failure).dump()
        return ErrorBody.from_failure(failure).dump()
