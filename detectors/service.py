"""The detector service: built-in detectors behind the detector API (DESIGN 6).

`POST /api/v1/text/contents` (routed by the `detector-id` header), `GET /health`, `GET /registry`,
`GET /metrics`. Every error is `{"code": <status>, "message": ...}`: 401 without a valid API key
(when the config names `server.api_keys_env`; only `GET /health` and `GET /metrics` are open
then: probes and Prometheus carry no key, and metrics hold counters, never text), 404 unknown or
missing detector id, 422 malformed body or bad detector_params (including any param a request
may not set: paths, batching, patterns unless the config allows them), 413 too many or too long
contents, 408 when a request body does not arrive within `body_timeout_s` (and a connection
whose request head is not complete within `header_timeout_s` is closed: servicekit.connections),
503 (with Retry-After) when the detector's micro-batch queue is full or `max_concurrent_requests`
requests are in progress, 500 only for a failure of the service itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from pydantic import ValidationError

from servicekit.auth import (
    CHALLENGE,
    UNAUTHORIZED_MESSAGE,
    ApiKeysError,
    BearerKeys,
    api_keys_from_env,
)
from servicekit.connections import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    BodyTimeout,
    close_after,
    read_body,
    runner_options,
)
from servicekit.tracing import annotate

from . import build
from .api import ContentsRequest, Detection, dump_reply
from .base import (
    ORCHESTRATOR_PARAM_KEYS,
    Detector,
    DetectorError,
    InvalidParams,
    Overloaded,
    param_error_lines,
)
from .tracing import TRACING

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Request bounds; past them the service answers 413 (408 for a body that does not arrive
    in time) instead of doing unbounded work, or holding a connection for ever."""

    max_contents: int = 1024
    max_content_chars: int = 200_000
    max_total_chars: int = 1_000_000
    max_body_bytes: int = 4 * 1024 * 1024
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    # contents requests in progress at once; past it 503 with Retry-After, the body unread: each
    # holds its body and parsed contents while it waits for a scan thread or a model, so without
    # a bound memory grew with the clients' connections (a detector's own queue bounds its
    # model's work, not the requests waiting to reach it, and the regex scans have none)
    max_concurrent_requests: int = 256


class ConfigError(ValueError):
    """A config the service cannot serve; `errors` holds one `yaml.path: message` per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def load_config(path: str | Path) -> dict[str, Any]:
    """The YAML document at `path` (only its `detectors:` section matters here)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: invalid YAML: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the document must be a mapping"])
    return data


def detectors_from_config(
    config: Mapping[str, Any], *, device: str = "auto"
) -> dict[str, Detector]:
    """Builds every `builtin:` entry of the config's `detectors:` section, keyed by detector id.
    Entries with `url:` (remote detectors) and all other sections are ignored. Raises ConfigError
    listing every bad entry with its YAML path."""
    section = config.get("detectors") or {}
    if not isinstance(section, Mapping):
        raise ConfigError(["detectors: must be a mapping of detector id to settings"])
    built: dict[str, Detector] = {}
    errors: list[str] = []
    for detector_id, entry in section.items():
        path = f"detectors.{detector_id}"
        if not isinstance(entry, Mapping):
            errors.append(f"{path}: must be a mapping")
            continue
        builtin = entry.get("builtin")
        if builtin is None:
            continue
        params = entry.get("params") or {}
        if not isinstance(params, Mapping):
            errors.append(f"{path}.params: must be a mapping")
            continue
        params = {k: v for k, v in params.items() if k not in ORCHESTRATOR_PARAM_KEYS}
        try:
            built[str(detector_id)] = build(str(builtin), params, device=device)
        except InvalidParams as exc:
            errors.extend(param_error_lines(f"{path}.params", exc))
        except ValueError as exc:
            errors.append(f"{path}.builtin: {exc}")
    if errors:
        raise ConfigError(errors)
    return built


def api_keys_from_config(
    config: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> list[str] | None:
    """The keys named by the config's `server.api_keys_env` (comma-separated), or None when it
    names none. A named variable that is unset or holds no key is a ConfigError: the service
    must never start open by accident."""
    server = config.get("server") or {}
    env = server.get("api_keys_env") if isinstance(server, Mapping) else None
    if not env:
        return None
    if not isinstance(env, str):
        raise ConfigError(["server.api_keys_env: must be the name of an environment variable"])
    try:
        return api_keys_from_env(env, "server.api_keys_env", environ)
    except ApiKeysError as exc:
        raise ConfigError([str(exc)]) from None


def _auth_middleware(keys: Sequence[str]) -> Any:
    """Bearer keys (servicekit.auth) on everything but `GET /health` and `GET /metrics` (liveness
    probes and Prometheus scrapers carry no key, as on the orchestrator and the engine). A
    missing header, another scheme and a wrong key get the same 401, in this service's error
    shape (DESIGN section 6: `{code, message}`)."""
    accepted = BearerKeys(keys)

    @web.middleware
    async def check(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in ("/health", "/metrics") and request.method in ("GET", "HEAD"):
            return await handler(request)
        if not accepted.accepts(request.headers):
            return error_response(401, UNAUTHORIZED_MESSAGE, **CHALLENGE)
        return await handler(request)

    return check


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status, headers=headers)


class _Metrics:
    """Prometheus metrics in a registry of the app's own (two apps in a process never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "detector_requests",
            "Detector API requests by detector and HTTP status",
            ["detector_id", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "detector_request_seconds",
            "Time to answer a contents request",
            ["detector_id"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.contents = Histogram(
            "detector_request_contents",
            "Contents per request",
            ["detector_id"],
            registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
        )
        self.batch_size = Histogram(
            "detector_batch_size",
            "Items per batched model call (micro-batching)",
            ["detector_id"],
            registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )


@dataclass
class _State:
    detectors: dict[str, Detector]
    owned: bool
    limits: Limits
    metrics: _Metrics
    warmup: bool
    in_progress: int = 0  # contents requests admitted and not answered yet


STATE = web.AppKey("detector_service_state", _State)


def _is_detector_map(value: Mapping[str, Any]) -> bool:
    """Ready detectors by id (a config dict has mappings as values: `detectors:`, `server:`)."""
    return all(isinstance(v, Detector) for v in value.values())


def create_app(
    detectors: Mapping[str, Detector] | Mapping[str, Any],
    *,
    limits: Limits | None = None,
    device: str = "auto",
    warmup: bool = True,
    api_keys: Sequence[str] | None = None,
) -> web.Application:
    """The service app for ready detectors (closed by their owner) or for a config dict (its
    `detectors:` section is built here, and those detectors are closed with the app; its
    `server.api_keys_env` turns auth on, see api_keys_from_config). `api_keys` turns Bearer
    auth on explicitly."""
    if _is_detector_map(detectors):
        dets: dict[str, Detector] = dict(detectors)  # type: ignore[arg-type]
        owned = False
    else:
        if api_keys is None:
            api_keys = api_keys_from_config(detectors)
        dets = detectors_from_config(detectors, device=device)
        owned = True
    limits = limits or Limits()
    metrics = _Metrics()
    for detector_id, det in dets.items():
        if det.batcher is not None:
            hist = metrics.batch_size.labels(detector_id)
            det.batcher.add_observer(hist.observe)
    middlewares: list[Any] = [_errors]
    if TRACING.tracer is not None:  # outermost: error answers belong to the span too
        middlewares.insert(0, TRACING.middleware())
    if api_keys is not None:
        if not api_keys:
            raise ValueError("api_keys: at least one key (None turns auth off)")
        middlewares.append(_auth_middleware(api_keys))
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=middlewares)
    app[STATE] = _State(dets, owned, limits, metrics, warmup)
    app.router.add_post("/api/v1/text/contents", _contents)
    app.router.add_get("/health", _health)
    app.router.add_get("/registry", _registry)
    app.router.add_get("/metrics", _metrics)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app


async def _startup(app: web.Application) -> None:
    state = app[STATE]
    if state.warmup and state.detectors:
        t0 = time.perf_counter()
        await asyncio.gather(*(d.warmup() for d in state.detectors.values()))
        log.info("detector models ready in %.1f s", time.perf_counter() - t0)


async def _cleanup(app: web.Application) -> None:
    state = app[STATE]
    if state.owned:
        for det in state.detectors.values():
            await det.close()


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error leaves as `{"code", "message"}` JSON, aiohttp's own included (404, 405, 413)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status in (404, 405):
            message = f"{exc.reason}: {request.method} {request.path}"
        elif exc.text and not exc.text.startswith(str(exc.status)):
            message = exc.text
        else:
            message = exc.reason
        return error_response(exc.status, message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # what a detector raised can quote the text it judged: the log has it, the client the
        # exception's type only
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error ({type(exc).__name__})")


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _registry(request: web.Request) -> web.Response:
    state = request.app[STATE]
    listing = [
        {"detector_id": detector_id, "type": "text_contents", **det.describe()}
        for detector_id, det in sorted(state.detectors.items())
    ]
    return web.json_response({"detectors": listing})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field (expected contents, detector_params)"
    return f"{where}: {err['msg']}"


def _check_limits(contents: list[str], limits: Limits) -> None:
    if len(contents) > limits.max_contents:
        raise ApiError(413, f"too many contents: {len(contents)} (at most {limits.max_contents})")
    total = 0
    for i, content in enumerate(contents):
        if len(content) > limits.max_content_chars:
            raise ApiError(
                413,
                f"contents.{i}: {len(content)} characters (at most {limits.max_content_chars})",
            )
        total += len(content)
    if total > limits.max_total_chars:
        raise ApiError(
            413, f"contents: {total} characters in total (at most {limits.max_total_chars})"
        )


# Parsing and validating a 4 MiB body takes tens of milliseconds, and encoding a reply of tens
# of thousands of detections as long; past these sizes that runs in a thread so the loop keeps
# serving /health and the other requests (the orchestrator does the same: issue 20, item 4).
BULK_BODY_BYTES = 64 * 1024
BULK_DETECTIONS = 512

T = TypeVar("T")


async def _off_loop_if(bulk: bool, fn: Callable[[], T]) -> T:
    """`fn()` in the default executor when `bulk`, inline otherwise (a hand-off costs more than
    a small body's parse)."""
    if not bulk:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def _parse_contents(raw: bytes) -> ContentsRequest:
    """The request body, or a 422 for every way it can be wrong. A body nested deeper than the
    interpreter's recursion limit is a client mistake like any other malformed body."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(422, f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise ApiError(422, "malformed JSON body: nested too deeply") from None
    try:
        return ContentsRequest.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, _first_error(exc)) from None


def _reply_json(detector_id: str, reply: list[list[Detection]]) -> str:
    """The reply as JSON proper. `json.dumps` writes NaN and infinities as bare `NaN` and
    `Infinity` (not JSON: a strict client cannot read the reply); the model detectors fail a
    call whose output is not finite (`require_finite`), and anything that still slips through
    (a score or metadata computed after the model) is this detector failing: a 500."""
    try:
        return json.dumps(dump_reply(reply), allow_nan=False)
    except ValueError:
        log.error("detector %s: its reply holds a NaN or an infinity", detector_id)
        raise ApiError(
            500, f"detector `{detector_id}` failed: its reply holds a number that is not finite"
        ) from None


async def _contents(request: web.Request) -> web.Response:
    state = request.app[STATE]
    detector_id = request.headers.get("detector-id", "").strip()
    det = state.detectors.get(detector_id)
    label = detector_id if det is not None else "_unknown"
    t0 = time.perf_counter()
    status = 500
    admitted = False  # counted in `in_progress` (and its body read)
    try:
        if not detector_id:
            raise ApiError(404, "missing detector-id header")
        if det is None:
            raise ApiError(404, f"detector `{detector_id}` not found")
        if state.in_progress >= state.limits.max_concurrent_requests:
            raise ApiError(
                503,
                f"{state.in_progress} requests in progress (at most max_concurrent_requests = "
                f"{state.limits.max_concurrent_requests}): retry later",
            )
        state.in_progress += 1
        admitted = True
        try:
            raw = await read_body(request, state.limits.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413, f"request body larger than {state.limits.max_body_bytes} bytes"
            ) from None
        except BodyTimeout as exc:
            raise ApiError(408, str(exc)) from None
        body = await _off_loop_if(len(raw) > BULK_BODY_BYTES, lambda: _parse_contents(raw))
        params = body.detector_params or None
        if params:
            try:
                # the built-in's request allowlist (validate_request_params): no path, no
                # batching setting, no regex unless the config allows it; nothing is opened
                det.check_request(params)
            except InvalidParams as exc:
                raise ApiError(422, f"detector_params: {exc}") from None
        _check_limits(body.contents, state.limits)
        state.metrics.contents.labels(label).observe(len(body.contents))
        if TRACING.tracer is not None:
            annotate(
                request,
                {
                    "guardstream.detector.id": detector_id,
                    "guardstream.detector.contents": len(body.contents),
                    "guardstream.detector.chars": sum(len(c) for c in body.contents),
                },
            )
        try:
            reply = await det.detect(body.contents, params)
        except InvalidParams as exc:
            raise ApiError(422, f"detector_params: {exc}") from None
        except Overloaded as exc:
            raise ApiError(503, f"detector `{detector_id}` overloaded: {exc}") from None
        except DetectorError as exc:
            log.error("detector %s failed: %s", detector_id, exc)
            raise ApiError(500, f"detector `{detector_id}` failed: {exc}") from None
        if len(reply) != len(body.contents):
            raise ApiError(
                500,
                f"detector `{detector_id}` returned {len(reply)} results for "
                f"{len(body.contents)} contents",
            )
        status = 200
        if TRACING.tracer is not None:
            detections = sum(len(r) for r in reply)
            annotate(request, {"guardstream.detector.detections": detections})
        big = sum(len(r) for r in reply) > BULK_DETECTIONS
        text = await _off_loop_if(big, lambda: _reply_json(detector_id, reply))
        return web.Response(text=text, content_type="application/json")
    except ApiError as exc:
        status = exc.status
        headers = {"Retry-After": "1"} if exc.status == 503 else {}
        response = error_response(exc.status, exc.message, **headers)
        if exc.status == 408:  # the body stalled: nothing more on this connection
            await close_after(request, response)
        elif exc.status == 503 and not admitted:
            # its body unread: aiohttp reads and drops it (at most its 10 s lingering time),
            # then closes; closing at once could reset the connection under the reply
            response.force_close()
        return response
    finally:
        if admitted:
            state.in_progress -= 1
        state.metrics.requests.labels(label, str(status)).inc()
        state.metrics.latency.labels(label).observe(time.perf_counter() - t0)


async def serve(
    config: Mapping[str, Any],
    *,
    host: str = "0.0.0.0",
    port: int = 8080,
    device: str = "auto",
    limits: Limits | None = None,
    warmup: bool = True,
    ready: Callable[[str, int, list[str]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Runs the service until `stop` is set (or forever); `ready(host, port, ids)` once bound
    (port 0 binds a free port, reported here)."""
    limits = limits or Limits()
    app = create_app(config, limits=limits, device=device, warmup=warmup)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, **runner_options(limits.header_timeout_s)
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        bound = sockets[0].getsockname()[1] if sockets else port
        if ready is not None:
            ready(host, bound, sorted(app[STATE].detectors))
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
