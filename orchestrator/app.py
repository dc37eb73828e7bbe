"""The aiohttp application: routes, middlewares, start-up and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from .api.errors import ApiError, ErrorBody, ErrorType
from .clients.backends import build_model_backends
from .clients.detectors import DetectorCallError
from .clients.generation import GenerationError
from .clients.registry import ChunkerRegistry, DetectorRegistry
from .config import Config
from .handlers import (
    content_detection,
    health,
    metrics,
    openapi,
    stream_content,
    streaming_generation,
    unary_generation,
)
from .handlers.stream_slots import TooManyStreams
from .metrics import OrchestratorMetrics
from .state import STATE, AppState
from .streaming.fanout import ChunkerFailure
from .streaming.guarded_generation import first_error

log = logging.getLogger("guardstream")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

STREAMING_PATH = "/api/v1/task/server-streaming-classification-with-text-generation"
UNARY_PATH = "/api/v1/task/classification-with-text-generation"
CONTENT_PATH = "/api/v2/text/detection/content"
STREAM_CONTENT_PATH = "/api/v2/text/detection/stream-content"


def _error_response(body: ErrorBody, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(body.dump(), status=body.code, headers=headers)


def error_for(exc: BaseException) -> ErrorBody:
    """The API error body for anything a handler raised; client mistakes map to 4xx."""
    exc = first_error(exc)
    if isinstance(exc, ApiError):
        return exc.body()
    if isinstance(exc, DetectorCallError):
        if exc.invalid_params:
            return ErrorBody(code=422, details=str(exc), type=ErrorType.INVALID_REQUEST)
        return ErrorBody(code=502, details=str(exc), type=ErrorType.DETECTOR_ERROR)
    if isinstance(exc, ChunkerFailure):
        return ErrorBody(code=500, details=str(exc), type=ErrorType.CHUNKER_ERROR)
    if isinstance(exc, GenerationError):
        return ErrorBody(code=exc.code, details=str(exc), type=ErrorType(exc.error_type))
    if isinstance(exc, web.HTTPException):
        if exc.status == 404:
            return ErrorBody(code=404, details="no such endpoint", type=ErrorType.NOT_FOUND)
        if exc.status == 413:
            return ErrorBody(
                code=413, details="request body too large", type=ErrorType.INVALID_REQUEST
            )
        if exc.status < 500:
            return ErrorBody(code=exc.status, details=exc.reason, type=ErrorType.INVALID_REQUEST)
    return ErrorBody(code=500, details="internal error", type=ErrorType.SERVER_ERROR)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    incoming = request.headers.get("x-request-id", "")
    request["request_id"] = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
    return await handler(request)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if "request_id" in request:
        response.headers["x-request-id"] = request["request_id"]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        raise
    except BaseException as exc:  # ExceptionGroups from task groups included
        body = error_for(exc)
        if body.code >= 500 and body.type == ErrorType.SERVER_ERROR:
            log.error("request %s failed", request.get("request_id"), exc_info=exc)
        headers = {"Retry-After": "1"} if isinstance(first_error(exc), TooManyStreams) else None
        if body.code == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return _error_response(body, headers)


def auth_middleware(keys: list[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    encoded = [k.encode() for k in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/api/"):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            given = token.strip().encode()
            # compare against every key so timing does not tell which one came close
            ok = False
            for key in encoded:
                ok |= hmac.compare_digest(given, key)
            if scheme.lower() != "bearer" or not ok:
                raise ApiError(401, ErrorType.UNAUTHORIZED, "missing or invalid API key")
        return await handler(request)

    return check


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        request.app[STATE].metrics.requests.labels(endpoint, str(status)).inc()


def _api_keys(config: Config) -> list[str] | None:
    env = config.server.api_keys_env
    if not env:
        return None
    keys = [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    if not keys:
        raise ValueError(f"server.api_keys_env: environment variable {env} holds no key")
    return keys


def create_app(config: Config, *, device: str = "auto") -> web.Application:
    keys = _api_keys(config)
    middlewares: list[Callable[..., Awaitable[web.StreamResponse]]] = [
        request_id_middleware,
        metrics_middleware,
        error_middleware,
    ]
    if keys is not None:
        middlewares.append(auth_middleware(keys))
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_request_bytes)
    state = AppState(
        config=config, metrics=OrchestratorMetrics(), chunkers=ChunkerRegistry(config.chunkers)
    )
    app[STATE] = state
    app[health.DETECTOR_HEALTH] = health.DetectorHealth(state)
    app.on_response_prepare.append(_add_request_id)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        state.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        state.detectors = DetectorRegistry(config, state.session, device=device)
        state.backends = build_model_backends(
            config.models, state.session, registry=state.metrics.registry
        )
        for backend in state.backends.values():
            await backend.start()
        poller = asyncio.create_task(app[health.DETECTOR_HEALTH].run())
        try:
            yield
        finally:
            state.draining = True
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            for backend in state.backends.values():
                await backend.close()
            await state.detectors.close()
            await state.session.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(STREAMING_PATH, streaming_generation.handle)
    app.router.add_post(UNARY_PATH, unary_generation.handle)
    app.router.add_post(CONTENT_PATH, content_detection.handle)
    app.router.add_post(STREAM_CONTENT_PATH, stream_content.handle)
    app.router.add_get("/health", health.health)
    app.router.add_get("/info", health.info)
    app.router.add_get("/metrics", metrics.handle)
    app.router.add_get("/openapi.json", openapi.handle)
    return app
