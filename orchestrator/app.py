"""The aiohttp application: routes, middlewares, start-up and shutdown.

Each route is one row of `ROUTES`: its path, its handler and its surface (errors.py), the shape
of its HTTP error responses (the FMS `ErrorBody` or OpenAI's `{"error": ...}`, which the SDKs
parse). The error middleware renders the `Failure` that `describe` made of the exception in the
shape of the request's route; nothing is guessed from a list of paths kept elsewhere, and
nothing converts one body into another."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from servicekit.auth import CHALLENGE, UNAUTHORIZED_MESSAGE, KeyRing
from servicekit.connections import close_after

from . import tracing as traces
from .api.errors import ApiError, ErrorType, Failure
from .clients.backends import build_model_backends
from .clients.migration import MigrationMetrics
from .clients.registry import ChunkerRegistry, DetectorRegistry, EnforcedGuardrails
from .config import Config, secret_env_names
from .errors import Surface, describe, first_error, is_http_error, is_unexpected
from .handlers import (
    admin,
    content_detection,
    fms_detection,
    fms_stream,
    fms_unary,
    generation_detection,
    health,
    metrics,
    models,
    openai_chat,
    openai_completions,
    openai_responses,
    openapi,
    stream_content,
    usage,
)
from .handlers.body import UnreadBody
from .handlers.metrics import METRICS_PATH
from .http_protocol import SERVER_NAME
from .logs import REQUEST_ID
from .metrics import OrchestratorMetrics
from .state import STATE, AppState
from .streaming.loop_lag import LoopLag
from .tenants import CALLER, Tenant, Tenants, admin_keys, tenant_ids, tenant_keys

log = logging.getLogger("guardstream")
access_log = logging.getLogger("guardstream.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

STREAMING_PATH = "/api/v1/task/server-streaming-classification-with-text-generation"
UNARY_PATH = "/api/v1/task/classification-with-text-generation"
CONTENT_PATH = "/api/v2/text/detection/content"
CHAT_DETECTION_ONLY_PATH = "/api/v2/text/detection/chat"
CONTEXT_DETECTION_PATH = "/api/v2/text/detection/context"
GENERATED_DETECTION_PATH = "/api/v2/text/detection/generated"
GENERATION_DETECTION_PATH = "/api/v2/text/generation-detection"
COMPLETIONS_DETECTION_PATH = "/api/v2/text/completions-detection"
STREAM_CONTENT_PATH = "/api/v2/text/detection/stream-content"
CHAT_PATH = openai_chat.CHAT_PATH
CHAT_DETECTION_PATH = openai_chat.CHAT_DETECTION_PATH
RESPONSES_PATH = openai_responses.RESPONSES_PATH
MODELS_PATH = "/v1/models"
USAGE_PATH = usage.USAGE_PATH


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handle: Handler
    surface: Surface  # the shape of its error responses
    span: str | None = None  # the `guardstream.surface` of its request span (tracing)


ROUTES = (
    Route("POST", STREAMING_PATH, fms_stream.handle, Surface.FMS, "fms_stream"),
    Route("POST", UNARY_PATH, fms_unary.handle, Surface.FMS, "fms_unary"),
    Route("POST", CONTENT_PATH, content_detection.handle, Surface.FMS, "detection_content"),
    Route("POST", CHAT_DETECTION_ONLY_PATH, fms_detection.chat, Surface.FMS, "detection_chat"),
    Route("POST", CONTEXT_DETECTION_PATH, fms_detection.context, Surface.FMS, "detection_context"),
    Route(
        "POST",
        GENERATED_DETECTION_PATH,
        fms_detection.generated,
        Surface.FMS,
        "detection_generated",
    ),
    Route(
        "POST",
        GENERATION_DETECTION_PATH,
        generation_detection.handle,
        Surface.FMS,
        "generation_detection",
    ),
    Route(
        "POST",
        STREAM_CONTENT_PATH,
        stream_content.handle,
        Surface.FMS,
        "detection_stream_content",
    ),
    Route(
        "POST",
        COMPLETIONS_DETECTION_PATH,
        openai_completions.handle,
        Surface.FMS,  # the FMS orchestrator's error body, as its completions-detection
        "completions_detection",
    ),
    Route("POST", CHAT_PATH, openai_chat.handle, Surface.OPENAI, "chat_completions"),
    Route("POST", CHAT_DETECTION_PATH, openai_chat.handle, Surface.OPENAI, "chat_completions"),
    Route("POST", RESPONSES_PATH, openai_responses.handle, Surface.OPENAI, "responses"),
    Route("GET", MODELS_PATH, models.handle, Surface.OPENAI, "models"),
    Route("GET", USAGE_PATH, usage.handle, Surface.OPENAI, "usage"),
    Route("POST", admin.RELOAD_PATH, admin.reload, Surface.FMS, "admin_reload"),
    Route("GET", "/health", health.health, Surface.FMS),
    Route("GET", "/info", health.info, Surface.FMS),
    Route("GET", METRICS_PATH, metrics.handle, Surface.FMS),
    Route("GET", "/openapi.json", openapi.handle, Surface.FMS),
)
_SURFACE_OF = {route.path: route.surface for route in ROUTES}
# the `guardstream.surface` of each endpoint's request span (tracing)
SPAN_SURFACES = {route.path: route.span for route in ROUTES if route.span is not None}


def surface_of(path: str) -> Surface:
    """The surface of the route at `path`: any method, so a 405 there is in its shape too. A
    path that routes nowhere gets the FMS body."""
    return _SURFACE_OF.get(path, Surface.FMS)


def error_response(
    request: web.Request, failure: Failure, headers: dict[str, str] | None = None
) -> web.Response:
    """`failure` in the shape of the request's route."""
    body = surface_of(request.path).error_body(failure)
    return web.json_response(body, status=failure.code, headers=headers)


# Headers for every call made downstream (engines, remote detectors) on behalf of the current
# request: its x-request-id and the client headers `server.forward_headers` allows. Set by the
# request-id middleware; asyncio copies it into every task the handler starts.
DOWNSTREAM_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar(
    "guardstream_downstream_headers", default=None
)
# Never forwarded even when allowlisted: they describe the hop, not the request, and would
# corrupt the downstream call (wrong length, host, framing) or its routing (detector-id).
_HOP_HEADERS = frozenset(
    {
        "connection",
        "content-encoding",
        "content-length",
        "content-type",
        "detector-id",
        "expect",
        "host",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "x-request-id",
    }
)


def forwardable(names: list[str]) -> frozenset[str]:
    """The allowlist of `server.forward_headers`, lower-cased, minus hop-by-hop headers."""
    allowed = {n.strip().lower() for n in names if n.strip()}
    dropped = sorted(allowed & _HOP_HEADERS - {"x-request-id"})
    if dropped:
        log.warning("server.forward_headers: never forwarded: %s", ", ".join(dropped))
    return frozenset(allowed - _HOP_HEADERS)


def request_id_middleware(forward: frozenset[str] = frozenset()) -> Middleware:
    """Gives every request an id (the client's `x-request-id` when it is a sane token, else a
    fresh one), returns it in the response, puts it on every log line of the request and on
    every downstream call, together with the allowlisted client headers; writes the access line."""

    @web.middleware
    async def request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
        incoming = request.headers.get("x-request-id", "")
        rid = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        request["request_id"] = rid
        downstream = {"x-request-id": rid}
        for name, value in request.headers.items():
            if name.lower() in forward:
                downstream.setdefault(name.lower(), value)
        rid_token = REQUEST_ID.set(rid)
        hdr_token = DOWNSTREAM_HEADERS.set(downstream)
        started = time.monotonic()
        status = 499  # nginx's "client closed request": the handler was cancelled
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            # probes and scrapes come every few seconds: kept out of the access log unless
            # they fail or debug logging is on
            quiet = request.path in OPEN_PATHS and status < 400
            caller = request.get(CALLER)
            access_log.log(
                logging.DEBUG if quiet else logging.INFO,
                "%s %s %d",
                request.method,
                request.path,
                status,
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": status,
                    "duration_ms": round((time.monotonic() - started) * 1000, 1),
                    "tenant": caller.tenant.id if caller is not None else None,
                },
            )
            DOWNSTREAM_HEADERS.reset(hdr_token)
            REQUEST_ID.reset(rid_token)

    return request_id


async def _inject_downstream_headers(
    session: aiohttp.ClientSession,
    ctx: SimpleNamespace,
    params: aiohttp.TraceRequestStartParams,
) -> None:
    """Adds the current request's downstream headers to an outgoing call. A header the client
    code set itself (detector-id, an engine's Authorization) is never overridden. Runs for every
    backend and detector client on the shared session, so none of them has to pass it along."""
    headers: CIMultiDict[str] = params.headers
    if traces.TRACER is not None:
        traces.inject(headers)  # traceparent of the attempt or detector call
    for name, value in (DOWNSTREAM_HEADERS.get() or {}).items():
        if name not in headers:
            headers[name] = value


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME  # aiohttp's default names its and Python's versions
    if "request_id" in request:
        response.headers["x-request-id"] = request["request_id"]
    caller = request.get(CALLER)
    if caller is not None:  # every request that named a tenant's key (all, with auth off)
        response.headers[TENANT_HEADER] = caller.tenant.id
        response.headers[POLICY_HEADER] = caller.policy


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        raise
    except BaseException as exc:  # ExceptionGroups from task groups included
        failure = describe(exc)
        sent = request.writer is not None and request.writer.output_size > 0
        if not is_http_error(failure, sent=sent):
            # the reply already started: an error response cannot follow it, and nothing is
            # left to render it in-band. aiohttp logs the exception and closes the connection,
            # so the client sees a cut stream, not a hang and not a second status line
            raise
        if is_unexpected(failure):
            log.error("request %s failed", request.get("request_id"), exc_info=exc)
        response = error_response(request, failure, _error_headers(first_error(exc), failure))
        if isinstance(first_error(exc), UnreadBody):
            await close_after(request, response)
        elif failure.code == 413:
            # the body is not read: the connection cannot carry another request after it
            response.force_close()
        return response


def _error_headers(exc: BaseException, failure: Failure) -> dict[str, str] | None:
    retry_after = getattr(exc, "retry_after_s", None)  # TooManyStreams, a tenant's RateLimited
    if isinstance(retry_after, int):
        return {"Retry-After": str(retry_after)}
    if failure.type == ErrorType.OVERLOADED:
        return {"Retry-After": "1"}
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return {"Allow": ", ".join(sorted(exc.allowed_methods))}
    if failure.type == ErrorType.SERVER_SHUTDOWN:
        # the client should retry elsewhere, and not on this connection
        return {"Retry-After": "1", "Connection": "close"}
    if failure.code == 401:
        return dict(CHALLENGE)
    return None


# Open without a key: liveness and readiness probes (kubelet, load balancers) carry no API key,
# and none of these reveal a prompt or a generation (/info shows statuses only without a key).
# /metrics names replicas and detectors: open only with `server.public_metrics`. Every other
# path requires one (deny by default: the /api/ endpoints spend model time and see user text,
# and a path that routes nowhere answers 401 rather than telling what exists).
OPEN_PATHS = frozenset({"/health", "/info", METRICS_PATH, "/openapi.json"})
PROBE_PATHS = frozenset({"/health", "/info", "/openapi.json"})
# set by the auth middleware: the request carried a valid key (absent when auth is off)
AUTHENTICATED = health.AUTHENTICATED


# answered to an admin key only (server.admin_keys_env), which the handler checks
ADMIN_PATHS = frozenset({admin.RELOAD_PATH})
TENANT_HEADER = "x-guardstream-tenant"
POLICY_HEADER = "x-guardstream-policy"


def auth_middleware(state: AppState, open_paths: frozenset[str] = PROBE_PATHS) -> Middleware:
    """Resolves the request's Bearer key to its tenant (every configured key is compared:
    tenants.py) and puts the tenant on the request (`CALLER`); every path but `open_paths`
    needs a key. A missing header, another scheme and a wrong key all get the same 401, so a
    caller learns nothing about which part failed. With auth off every request is the tenant
    `default`. A tenant's requests_per_minute is taken here, before any other work."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in ADMIN_PATHS or (
            request.path == METRICS_PATH and metrics.admin_only(state)
        ):  # an admin key, not a tenant's: checked there
            return await handler(request)
        tenants = state.tenants
        assert tenants is not None  # built at start-up, before the first request
        tenant = tenants.resolve(request.headers)
        # open paths answer anyway; /info shows its details only to a caller with a key
        request[AUTHENTICATED] = tenant is not None
        if tenant is None:
            if request.path not in open_paths:
                raise ApiError(401, ErrorType.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
            return await handler(request)
        caller = request[CALLER] = state.caller(tenant)

        def resolve_again() -> Tenant | None:
            # a reload before its pipeline is built: judged by the policy in force then
            assert state.tenants is not None
            return state.tenants.resolve(request.headers)

        caller.resolve_again = resolve_again
        if request.path not in OPEN_PATHS:  # probes and scrapes are not a tenant's usage
            caller.gate.admit_request(tenant.id)
        # counted under the config its tenant came from: a reload closes what it replaced
        # once these have ended (reload.py)
        admitted = state.admitted
        admitted.enter()
        try:
            return await handler(request)
        finally:
            caller.release_tokens()  # a hold its stream did not settle (refused, never run)
            admitted.leave()

    return check


def expect_handler(
    max_request_bytes: int, authorized: Callable[[web.BaseRequest], bool] | None
) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """`Expect: 100-continue`: the client waits for `100 Continue` before it sends the body.
    It is sent only to a request that will read it: not when the Content-Length is over
    `max_request_bytes` or the key is missing (the handler then answers 413 or 401 before
    reading, and the body is never sent). aiohttp's default says `100 Continue` to anything,
    and answers another Expect in plain text, echoing it."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.version != aiohttp.HttpVersion11:
            return None  # HTTP/1.0 has no 100 Continue
        if request.headers.get("Expect", "").strip().lower() != "100-continue":
            failure = Failure(417, ErrorType.INVALID_REQUEST, "unsupported Expect header")
            return error_response(request, failure)
        if (request.content_length or 0) > max_request_bytes:
            return None
        if authorized is not None and not authorized(request):
            return None
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the reply itself has not started
        return None

    return expect


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except (asyncio.CancelledError, ConnectionResetError, aiohttp.ClientConnectionResetError):
        # the client went away (nginx's "client closed request", as the access log says): not a
        # server error, or alerts on 5xx would fire on every impatient user
        status = 499
        raise
    finally:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        caller = request.get(CALLER)
        tenant = caller.tenant.id if caller is not None and request.path not in OPEN_PATHS else None
        request.app[STATE].metrics.count_request(endpoint, status, tenant)


def create_app(
    config: Config,
    *,
    device: str = "auto",
    span_exporter: traces.SpanExporter | None = None,
    workers: int = 1,
) -> web.Application:
    """`span_exporter` turns tracing on with that exporter (tests: an InMemorySpanExporter);
    `workers`: how many workers serve together (each enforces its share of tenants' limits)."""
    keys = tenant_keys(config)  # an unset variable or a key in two tenants stops start-up
    admins = admin_keys(config)
    middlewares: list[Middleware] = [
        request_id_middleware(forwardable(config.server.forward_headers)),
        metrics_middleware,
        error_middleware,
    ]
    if traces.configure(config.server.tracing, exporter=span_exporter):
        # outermost: the access log line and every error response belong to the request span
        middlewares.insert(0, traces.middleware(SPAN_SURFACES, OPEN_PATHS))
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_request_bytes)
    series = OrchestratorMetrics()
    state = AppState(
        config=config,
        metrics=series,
        chunkers=ChunkerRegistry(config.chunkers),
        loop_lag=LoopLag(
            busy_lag_s=config.server.read_coalesce_min_lag_ms / 1000,
            on_probe=series.on_loop_probe,
        ),
        workers=workers,
        device=device,
    )
    app[STATE] = state
    state.build_verdicts(config.detection_cache)
    state.admin_keys = KeyRing((k, True) for k in admins or [])
    open_paths = OPEN_PATHS if keys is None or config.server.public_metrics else PROBE_PATHS
    app.middlewares.append(auth_middleware(state, open_paths))
    series.add_tenants(tenant_ids(config, keys))
    app[health.DETECTOR_HEALTH] = health.DetectorHealth(state)
    app.on_response_prepare.append(_add_request_id)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        tracing = aiohttp.TraceConfig()
        tracing.on_request_start.append(_inject_downstream_headers)
        state.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            trace_configs=[tracing],
        )
        state.detectors = DetectorRegistry(
            config, state.session, device=device, on_call=state.metrics.record_detector_call
        )
        await state.detectors.start()  # an engine judge's managed engines
        state.enforced = EnforcedGuardrails.of_models(config, state.detectors)
        state.tenants = Tenants.build(config, state.detectors, state.enforced, keys)
        state.migration_metrics = MigrationMetrics(state.metrics.registry)
        state.backends = build_model_backends(
            config.models,
            state.session,
            metrics=state.migration_metrics,
            hidden_env=secret_env_names(config),
        )
        for backend in state.backends.values():
            await backend.start()
        poller = asyncio.create_task(app[health.DETECTOR_HEALTH].run())
        # in-process detectors load and judge once before /info says ready, so the first
        # request neither pays the load nor fails on a model that cannot load
        warmup = asyncio.create_task(app[health.DETECTOR_HEALTH].warm_up())
        state.loop_lag.start()
        gc_timer = state.metrics.gc_pause_timer()
        gc.callbacks.append(gc_timer)
        try:
            yield
        finally:
            gc.callbacks.remove(gc_timer)
            state.loop_lag.stop()
            state.draining = True
            warmup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warmup
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            if state.retiring is not None:  # what a reload replaced: closed now
                state.retiring.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await state.retiring
            for backend in state.backends.values():
                await backend.close()
            await state.detectors.close()
            await state.session.close()
            traces.shutdown()  # flushes the last spans

    app.cleanup_ctx.append(lifecycle)

    def authorized(request: web.BaseRequest) -> bool:
        return state.tenants is not None and state.tenants.resolve(request.headers) is not None

    expect = expect_handler(config.server.max_request_bytes, authorized if keys else None)
    for route in ROUTES:
        if route.method == "GET":  # and HEAD
            app.router.add_get(route.path, route.handle, expect_handler=expect)
        else:
            app.router.add_route(route.method, route.path, route.handle, expect_handler=expect)
    return app
