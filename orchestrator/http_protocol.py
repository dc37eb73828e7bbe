"""The HTTP connection layer under the app: requests aiohttp's parser refuses are answered with
the API's error body, and connections that never finish a request are closed.

aiohttp answers a request it cannot parse (a request line or header over 8190 bytes, more than
128 headers, a bad chunk size, Content-Length with Transfer-Encoding) itself, before any handler
or middleware: in plain text that quotes part of the input back, and logs it with a traceback.
Its only hook for that answer is RequestHandler.handle_error, hence the subclass (and the
Server/AppRunner subclasses that make aiohttp use it)."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestHandler

from .api.errors import ErrorBody, ErrorType
from .handlers.body import UNSUPPORTED_ENCODING

log = logging.getLogger("guardstream.http")

# The parser's limits (aiohttp's defaults, set explicitly so the messages below stay true)
MAX_LINE_BYTES = 8190
MAX_HEADERS = 128
SERVER_NAME = "guardstream"

# What a client is told for each refusal: fixed text, never the parser's message, which quotes
# the offending bytes back (a reflected-content vector, and noise in clients' logs).
_REFUSALS: list[tuple[type[HttpProcessingError], str]] = [
    (LineTooLong, f"request line or header too long (limit {MAX_LINE_BYTES} bytes)"),
    (BadHttpMethod, "malformed request line"),
    (BadStatusLine, "malformed request line"),
    (InvalidURLError, "malformed request target"),
    (InvalidHeader, "malformed header"),
    (TransferEncodingError, "malformed chunked body"),
    (ContentLengthError, "malformed Content-Length body"),
]


def refusal(exc: BaseException | None) -> str:
    """The client-facing reason for a request the HTTP parser refused."""
    for kind, text in _REFUSALS:
        if isinstance(exc, kind):
            return text
    # llhttp's errors are all BadHttpMessage: told apart by their (input-free) opening words
    message = str(getattr(exc, "message", "") or "").lower()
    if message.startswith("too many headers"):
        return f"too many headers (limit {MAX_HEADERS})"
    if "content-length" in message and "transfer-encoding" in message:
        return "Content-Length and Transfer-Encoding together"
    if "chunk" in message:
        return "malformed chunked body"
    if "header" in message:
        return "malformed header"
    return "malformed HTTP request"


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol, answering its own errors with the API's JSON body."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # the reply started: only closing is left
            raise ConnectionError("response already started")
        if status >= 500:
            # a bug that escaped the error middleware (it answers everything it can)
            log.error("request failed outside the app", exc_info=exc)
            body = ErrorBody(
                code=status,
                details="the request timed out" if status == 504 else "internal error",
                type=ErrorType.TIMEOUT if status == 504 else ErrorType.SERVER_ERROR,
            )
        elif isinstance(exc, ContentEncodingError):
            # br or zstd, whose decoders are not installed: refused before a route is known,
            # so the answer has the service's error body on every path
            status = 415
            body = ErrorBody(
                code=status, details=UNSUPPORTED_ENCODING, type=ErrorType.INVALID_REQUEST
            )
        else:
            # a client's mistake or a scanner: one line, no traceback, nothing it sent
            log.info("refused a malformed HTTP request: %s", type(exc).__name__)
            body = ErrorBody(code=status, details=refusal(exc), type=ErrorType.INVALID_REQUEST)
        response = web.json_response(body.dump(), status=status)
        response.headers["Server"] = SERVER_NAME
        response.force_close()
        return response


class GuardedServer(web.Server):
    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose connections use GuardedRequestHandler. `header_timeout_s` becomes
    aiohttp's keep-alive timeout, which closes a connection still waiting for a complete
    request head that long after it opened or after its previous response (aiohttp 3.14's
    default is 3630 s); that covers an idle keep-alive connection and a half-sent request line
    alike."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(
            app,
            keepalive_timeout=header_timeout_s,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_LINE_BYTES,
            max_headers=MAX_HEADERS,
            **kwargs,
        )

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return GuardedServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
