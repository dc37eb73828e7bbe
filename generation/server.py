"""The engine's aiohttp application (DESIGN section 7).

Handlers validate everything before the first response byte (4xx with the JSON error shape), then
stream NDJSON items from the request's queue, fed by the worker thread. Model work never runs on
the event loop; tokenization (chat templates included) runs on one dedicated thread.

Limits: `GET /v1/models` advertises the context (`max_model_len`) and the accepted range of every
parameter, read off protocol.py's schema. A prompt of `max_model_len` tokens or more, and a prompt
whose tokens plus `max_new_tokens` exceed the context, are rejected with 422 before any byte, as
vLLM rejects them (it answers 400); the budget is never silently clamped, so a client learns that
it asked for more than the model can give.

Connections (servicekit.connections): a body that has not arrived within `body_timeout_s`
(`--body-timeout-s`) is a 408 that closes the connection; `python -m generation serve` closes a
connection whose request head is not complete within `--header-timeout-s`.

Bounds on waiting work (a keyed caller, or an orchestrator gone wrong, must not queue without
end): a generate request is refused with 429 `too_many_requests` and `Retry-After`, before any
byte, when the engine already holds its slots (`max_batch_size`) plus `max_waiting_requests`
(`--max-waiting-requests`) generate requests; and any request whose text would take the
tokenizer thread's queue past `max_tokenizer_chars` characters (`--max-tokenizer-chars`; chat
templates and tokenization of big prompts are its work). One request on an idle tokenizer is
always taken (the body size bounds it). The defaults are far above what an orchestrator sends:
it holds at most `server.max_concurrent_streams` (1024) streams per worker, and treats a 429 as
a busy replica (tried elsewhere, never quarantined).

Auth (`api_keys`, from `--api-keys-env`): every path needs `Authorization: Bearer <key>` except
`/health` (liveness probes, the orchestrator's supervisor) and `/metrics` (Prometheus scrapers;
counters only, never text), the same open set as the orchestrator's. An unknown path without a
key is a 401, not a 404, so a caller without a key learns nothing about the routes. With
`--enable-fault-injection` (tests only, never a deployment), `/admin/faults` is open too: a test
arms faults on managed engines whose key only their orchestrator knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from servicekit.auth import CHALLENGE, UNAUTHORIZED_MESSAGE, BearerKeys
from servicekit.connections import BODY_TIMEOUT_S, BodyTimeout, close_after, read_body
from servicekit.tracing import annotate, event

from . import judge_routes, models
from .control_tokens import encode_conversation
from .detokenizer import make_decoder
from .faults import Fault, FaultInjector
from .jobs import EngineDelta, EngineUnavailable, Job, StreamError
from .metrics import EngineCollector
from .models import LoadedModel
from .protocol import (
    MAX_TOKENIZER_CHARS,
    MAX_WAITING_REQUESTS,
    FaultRequest,
    GenerateRequest,
    Message,
    TokenizeRequest,
    advertised_parameters,
    describe_validation_error,
    error_body,
)
from .sampling import SamplingParams, random_seed
from .scheduler import GPU_MEMORY_FRACTION, Engine
from .tool_calls import ToolCallParser, template_messages, tool_call_format, visible_prefix
from .tracing import TRACING

if TYPE_CHECKING:
    from .core_client import CoreClient

log = logging.getLogger("guardstream.engine")

NDJSON = "application/x-ndjson"
CLIENT_MAX_SIZE = 4 * 1024 * 1024
DISCONNECT_POLL_S = 0.1  # how often the app checks whether quiet streams' clients left
RETRY_AFTER = {"Retry-After": "1"}
OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without a key (see the docstring)
FAULTS_PATH = "/admin/faults"


class ClientError(Exception):
    """A request problem reported before any response byte, as `{"code", "details", "type"}`."""

    def __init__(
        self,
        status: int,
        details: str,
        type_: str = "invalid_request",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(details)
        self.status = status
        self.details = details
        self.type = type_
        self.headers = headers


@dataclass
class EngineState:
    """Everything the handlers share, stored on the app."""

    loaded: LoadedModel
    engine: Engine | CoreClient  # CoreClient: the API process of a split replica
    faults: FaultInjector | None
    # the chat template's tool-call format (tool_calls.py), None: no tool support
    tool_format: str | None = None
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="guardstream-tokenizer")
    )
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    streams: set[_Stream] = field(default_factory=set)  # open generate responses
    watcher: asyncio.Task[None] | None = None  # `_watch_disconnects`
    core_http: Any = None  # API process: the aiohttp.ClientSession to the core's own app
    body_timeout_s: float = BODY_TIMEOUT_S  # a request body must arrive within this
    max_waiting_requests: int = MAX_WAITING_REQUESTS
    max_tokenizer_chars: int = MAX_TOKENIZER_CHARS
    generating: int = 0  # generate requests held, from admission to the stream's end
    tokenizer_chars: int = 0  # characters of the texts queued or being tokenized

    async def run_tokenizer(self, fn: Any, *args: Any, chars: int = 0) -> Any:
        """`fn(*args)` on the tokenizer thread; `chars` (the text it renders and tokenizes)
        count toward `max_tokenizer_chars` until it is done: past it, 429 before queueing."""
        if (
            chars
            and self.tokenizer_chars
            and self.tokenizer_chars + chars > self.max_tokenizer_chars
        ):
            raise ClientError(
                429,
                f"the tokenizer has {self.tokenizer_chars} characters queued: {chars} more "
                f"would pass its {self.max_tokenizer_chars} (--max-tokenizer-chars): retry later",
                "too_many_requests",
                headers=dict(RETRY_AFTER),
            )
        self.tokenizer_chars += chars
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.tokenizer_pool, fn, *args)
        finally:
            self.tokenizer_chars -= chars

    @contextlib.contextmanager
    def generate_place(self) -> Iterator[None]:
        """Hold one of the engine's generate places (its slots plus `max_waiting_requests`)
        for the block: 429 when none is free."""
        slots = self.engine.max_batch_size
        if self.generating >= slots + self.max_waiting_requests:
            raise ClientError(
                429,
                f"the engine holds {self.generating} generate requests, its {slots} slots and "
                f"{self.max_waiting_requests} waiting places (--max-waiting-requests): "
                "retry later",
                "too_many_requests",
                headers=dict(RETRY_AFTER),
            )
        self.generating += 1
        try:
            yield
        finally:
            self.generating -= 1


STATE = web.AppKey("guardstream_engine_state", EngineState)


def create_app(
    loaded: LoadedModel | None = None,
    *,
    model: str = "tiny-random",
    device: str = "auto",
    dtype: str = "auto",
    batch_invariant: bool = False,
    fault_injection: bool = False,
    max_batch_size: int | None = None,
    threads: int | None = None,
    prefill_chunk_tokens: int | None = None,
    static_decode: bool | None = None,
    static_buckets: bool | None = None,
    gpu_memory_fraction: float = GPU_MEMORY_FRACTION,
    overlap: bool | None = None,
    compile_step: bool = False,
    prefill_buckets: bool | None = None,
    warm_prefill: bool | None = None,
    static_prefill: bool | None = None,
    static_judge: bool | None = None,
    judge_pool_at_start: bool | None = None,
    client_max_size: int = CLIENT_MAX_SIZE,
    api_keys: Sequence[str] | None = None,
    max_judge_sessions: int | None = None,
    max_judge_tokens: int | None = None,
    judge_idle_timeout_s: float | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    max_waiting_requests: int = MAX_WAITING_REQUESTS,
    max_tokenizer_chars: int = MAX_TOKENIZER_CHARS,
) -> web.Application:
    """The engine app. Pass a `LoadedModel` to share one model between apps (tests), or a spec.
    With `api_keys` (non-empty), every path but OPEN_PATHS (and the fault route of a test
    engine) needs one of them as a Bearer key."""
    if loaded is None:
        loaded = models.load(model, device=device, dtype=dtype, batch_invariant=batch_invariant)
    app = web.Application(
        client_max_size=client_max_size, middlewares=_middlewares(api_keys, fault_injection)
    )
    state = EngineState(
        loaded=loaded,
        engine=Engine(
            loaded,
            max_batch_size=max_batch_size,
            threads=threads,
            prefill_chunk_tokens=prefill_chunk_tokens,
            static_decode=static_decode,
            static_buckets=static_buckets,
            gpu_memory_fraction=gpu_memory_fraction,
            overlap=overlap,
            compile_step=compile_step,
            prefill_buckets=prefill_buckets,
            warm_prefill=warm_prefill,
            static_prefill=static_prefill,
            static_judge=static_judge,
            judge_pool_at_start=judge_pool_at_start,
        ),
        faults=FaultInjector() if fault_injection else None,
        tool_format=tool_call_format(getattr(loaded.frontend_tokenizer, "chat_template", None)),
        body_timeout_s=body_timeout_s,
        max_waiting_requests=max_waiting_requests,
        max_tokenizer_chars=max_tokenizer_chars,
    )
    judges = state.engine.judges  # judge sessions (judge_routes.py)
    if max_judge_sessions is not None:
        judges.max_sessions = max_judge_sessions
    if max_judge_tokens is not None:
        judges.max_tokens = max_judge_tokens
    if judge_idle_timeout_s is not None:
        judges.idle_timeout_s = judge_idle_timeout_s
    state.registry.register(EngineCollector(lambda: state.engine))
    app[STATE] = state
    app.router.add_post("/v1/generate", handle_generate)
    app.router.add_post("/v1/tokenize", handle_tokenize)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    judge_routes.add_routes(app, judge_routes.Server(STATE, ClientError, _read_model, text_size))
    if fault_injection:
        app.router.add_post(FAULTS_PATH, handle_faults)
        app.router.add_delete(FAULTS_PATH, handle_clear_faults)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app


def _middlewares(api_keys: Sequence[str] | None, fault_injection: bool) -> list[Any]:
    """Errors in the engine's shape, then auth; tracing outermost (error answers belong to the
    span too). The same for the one-process app and the API process's."""
    middlewares: list[Any] = [_error_middleware]
    if TRACING.tracer is not None:
        middlewares.insert(0, TRACING.middleware())
    if api_keys is not None:
        if not api_keys:
            raise ValueError("api_keys is empty: no client could ever authenticate")
        open_paths = OPEN_PATHS | ({FAULTS_PATH} if fault_injection else set())
        middlewares.append(_auth_middleware(api_keys, open_paths))
    return middlewares


def create_api_app(
    core: CoreClient,
    loaded: LoadedModel,
    tool_format: str | None,
    *,
    fault_injection: bool = False,
    client_max_size: int = CLIENT_MAX_SIZE,
    api_keys: Sequence[str] | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    max_waiting_requests: int = MAX_WAITING_REQUESTS,
    max_tokenizer_chars: int = MAX_TOKENIZER_CHARS,
) -> web.Application:
    """The API process's app of a split replica (engine_core.py, issue 35): the same middlewares
    (errors, auth, tracing) and generate handler as `create_app`, its jobs relayed to the core
    by `core` (a started `CoreClient`); `loaded` holds the core's facts and a tokenizer, no
    weights. Faults are armed here, where the streams are. Every other route is forwarded to the
    core's own app over its Unix socket (`core.socket_path`): one implementation of each."""
    app = web.Application(
        client_max_size=client_max_size, middlewares=_middlewares(api_keys, fault_injection)
    )
    app[STATE] = EngineState(
        loaded=loaded,
        engine=core,
        faults=FaultInjector() if fault_injection else None,
        tool_format=tool_format,
        body_timeout_s=body_timeout_s,
        max_waiting_requests=max_waiting_requests,
        max_tokenizer_chars=max_tokenizer_chars,
    )
    app.router.add_post("/v1/generate", handle_generate)
    if fault_injection:
        app.router.add_post(FAULTS_PATH, handle_faults)
        app.router.add_delete(FAULTS_PATH, handle_clear_faults)
    app.router.add_route("*", "/{tail:.*}", _forward)
    app.on_startup.append(_on_api_startup)
    app.on_shutdown.append(_on_api_shutdown)
    app.on_cleanup.append(_on_api_cleanup)
    return app


FORWARDED_REQUEST_HEADERS = ("Content-Type", "Accept")
FORWARDED_RESPONSE_HEADERS = ("Content-Type", "Allow", "Retry-After", "WWW-Authenticate")


async def _forward(request: web.Request) -> web.Response:
    """A route of the core's own app (`/health`, `/metrics`, judge sessions, ...): relayed
    whole (none of them streams). The core unreachable: 503, as a replica without an engine."""
    import aiohttp

    state = request.app[STATE]
    # over client_max_size: 413, as the core's app would answer
    body = await _read_body(request)
    headers = {k: v for k in FORWARDED_REQUEST_HEADERS if (v := request.headers.get(k))}
    try:
        async with state.core_http.request(
            request.method,
            f"http://core{request.path_qs}",
            data=body,
            headers=headers,
            allow_redirects=False,
        ) as resp:
            data = await resp.read()
            out = {k: v for k in FORWARDED_RESPONSE_HEADERS if (v := resp.headers.get(k))}
            return web.Response(status=resp.status, body=data, headers=out)
    except aiohttp.ClientError as exc:
        details = f"the engine is not reachable: {exc}"
        raise ClientError(503, details, "generation_unavailable") from None


async def _on_api_startup(app: web.Application) -> None:
    import aiohttp

    state = app[STATE]
    core = state.engine
    assert not isinstance(core, Engine)
    state.core_http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=core.socket_path))
    state.watcher = asyncio.get_running_loop().create_task(_watch_disconnects(state))


async def _on_api_shutdown(app: web.Application) -> None:
    """As `_on_shutdown`: the core stops its engine, unfinished streams get their error."""
    state = app[STATE]
    state.closing.set()
    core = state.engine
    assert not isinstance(core, Engine)
    await core.stop()


async def _on_api_cleanup(app: web.Application) -> None:
    state = app[STATE]
    await _stop_watcher(state)
    if state.core_http is not None:
        await state.core_http.close()
    core = state.engine
    assert not isinstance(core, Engine)
    await core.stop()
    state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def freeze_startup_heap() -> int:
    """Move every object alive after start-up out of the collector's reach; return how many.

    torch, transformers and the model leave ~200k objects that live as long as the process;
    frozen, Python's full collections stop walking them (~90 ms each on a CPU core, with the
    GIL held: the decode thread and the token writes stall; at 256 streams ~2.7 us per row per
    step, bench/engine_host.py). Garbage made at start-up is collected first. Same as the
    orchestrator's `freeze_startup_heap`. For a serving process (`python -m generation serve`,
    the bench's server), not for tests: what is frozen is never freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _on_startup(app: web.Application) -> None:
    state = app[STATE]
    # Off the loop: on CUDA the start allocates the static KV cache and captures the graphs.
    await asyncio.to_thread(state.engine.start)
    state.watcher = asyncio.get_running_loop().create_task(_watch_disconnects(state))
    # The engine may hold less context than the model (a KV cache sized from GPU memory).
    state.loaded = state.engine.loaded


async def _on_shutdown(app: web.Application) -> None:
    """Unfinished streams end with an in-band `generation_unavailable` error (migratable)."""
    state = app[STATE]
    state.closing.set()
    await asyncio.to_thread(state.engine.stop)


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE]
    await _stop_watcher(state)
    await asyncio.to_thread(state.engine.stop)
    state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


async def _stop_watcher(state: EngineState) -> None:
    if state.watcher is not None:
        state.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state.watcher


# ----- errors and bodies ------------------------------------------------------------------------


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ClientError as exc:
        response = web.json_response(
            error_body(exc.status, exc.details, exc.type), status=exc.status, headers=exc.headers
        )
        if exc.status == 408:  # a body not read to its end: nothing more on this connection
            await close_after(request, response)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found" if exc.status == 404 else "invalid_request"
        if exc.status >= 500:
            kind = "server_error"
        details = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow",)}
        return web.json_response(
            error_body(exc.status, details, kind), status=exc.status, headers=headers
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(error_body(500, "internal error", "server_error"), status=500)


def _auth_middleware(keys: Sequence[str], open_paths: frozenset[str]) -> Any:
    """Bearer keys (servicekit.auth) on every path but `open_paths`. A missing header, another
    scheme and a wrong key get the same 401, in the engine's error shape `{code, details, type}`."""
    accepted = BearerKeys(keys)

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in open_paths and not accepted.accepts(request.headers):
            raise ClientError(401, UNAUTHORIZED_MESSAGE, "unauthorized", headers=dict(CHALLENGE))
        return await handler(request)

    return check


BODY_SIZE = "guardstream_body_size"  # the request's body, in bytes (`text_size`)


async def _read_body(request: web.Request) -> bytes:
    """The body within the app's `body_timeout_s`, else a 408 (that closes the connection)."""
    try:
        body = await read_body(request, request.app[STATE].body_timeout_s)
    except BodyTimeout as exc:
        raise ClientError(408, str(exc), "timeout") from None
    request[BODY_SIZE] = len(body)
    return body


def text_size(request: web.Request) -> int:
    """What a request gives the tokenizer thread, as `max_tokenizer_chars` counts it: its
    body's size, which holds every text it renders and tokenizes (prompt, messages, tools,
    template), at least one byte for each of their characters, known without a walk of the
    parsed body on the event loop."""
    return int(request.get(BODY_SIZE, 0))


async def _read_model(request: web.Request, schema: type[BaseModel]) -> Any:
    content_type = request.headers.get("Content-Type")
    if content_type is not None:
        mime = request.content_type.lower()
        if not (mime == "application/json" or mime.endswith("+json")):
            raise ClientError(415, f"Content-Type must be application/json, not {mime!r}")
    raw = await _read_body(request)  # over client_max_size: HTTPRequestEntityTooLarge → 413
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ClientError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # nesting past the interpreter's limit: bad input, not a 500
        raise ClientError(400, "request body is not valid JSON: nested too deeply") from None
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise ClientError(422, describe_validation_error(exc.errors())) from None


def _encode_prompt(
    loaded: LoadedModel,
    prompt: str | None,
    chat: bool,
    messages: list[Message] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a prompt, of a prompt as one user message (`chat`), or of `messages` (with
    `tools`), both under the chat template with the generation prompt. Runs on the tokenizer
    thread."""
    tokenizer: Any = loaded.frontend_tokenizer
    if messages is not None or chat:
        field = "messages" if messages is not None else "chat"
        conversation = (
            template_messages([m.template_dict() for m in messages])
            if messages is not None
            else [{"role": "user", "content": prompt}]
        )
        try:
            return encode_conversation(tokenizer, conversation, tools)
        except Exception as exc:  # e.g. a template that insists on alternating roles
            raise ClientError(422, f"{field}: the model's chat template failed: {exc}") from None
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _check_template(loaded: LoadedModel, prompt: str | None, chat: bool, messages: Any) -> None:
    if messages is not None and not loaded.has_chat_template:
        raise ClientError(422, "messages: this model has no chat template")
    if chat and prompt is not None and not loaded.has_chat_template:
        raise ClientError(422, "chat: this model has no chat template")


def _check_tools(
    state: EngineState, tools: list[dict[str, Any]] | None, messages: list[Message] | None
) -> None:
    """422 for tools (or a conversation with tool calls) on a template without tool support:
    they would be dropped or mis-rendered, and the model's calls never parsed."""
    if state.tool_format is not None:
        return
    if tools is not None:
        field = "tools"
    elif messages is not None and any(m.uses_tools() for m in messages):
        field = "messages"
    else:
        return
    raise ClientError(
        422, f"{field}: model {state.loaded.name}'s chat template has no tool support"
    )


def _check_vocab(name: str, ids: list[int], vocab: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise ClientError(
                422, f"{name}[{i}] = {token} is out of vocabulary (valid ids are 0..{vocab - 1})"
            )


# ----- handlers ---------------------------------------------------------------------------------


async def handle_tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: TokenizeRequest = await _read_model(request, TokenizeRequest)
    _check_template(state.loaded, req.prompt, req.chat, req.messages)
    _check_tools(state, req.tools, req.messages)
    ids = await state.run_tokenizer(
        _encode_prompt,
        state.loaded,
        req.prompt,
        req.chat,
        req.messages,
        req.tools,
        chars=text_size(request),
    )
    return web.json_response({"token_ids": ids, "count": len(ids)})


async def handle_models(request: web.Request) -> web.Response:
    """The model, its context and the accepted parameter ranges (JSON-Schema keywords:
    `minimum`, `exclusiveMinimum`, `maximum`, `maxItems`, ...). `max_context` is the older
    name of `max_model_len` (vLLM's), kept for existing readers."""
    state = request.app[STATE]
    loaded = state.loaded
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": loaded.name,
                    "object": "model",
                    "owned_by": "guardstream",
                    "max_model_len": loaded.max_context,
                    "max_context": loaded.max_context,
                    "chat_template": loaded.has_chat_template,
                    # `tools` accepted (tool_calls.py); the format the calls are parsed in
                    "tools": state.tool_format is not None,
                    "tool_call_format": state.tool_format,
                    "dtype": str(loaded.dtype).removeprefix("torch."),
                    "batch_invariant": loaded.batch_invariant,
                    "parameters": advertised_parameters(),
                }
            ],
        }
    )


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    body = {
        "status": "ok" if engine.healthy else "unavailable",
        "model": state.loaded.name,
        "device": str(state.loaded.device),
        "dtype": str(state.loaded.dtype).removeprefix("torch."),
        "batch_invariant": state.loaded.batch_invariant,
        "active_requests": engine.active_requests,
        "running_batch_size": engine.running_batch_size,
        "prefilling_requests": engine.prefilling_requests,
        "max_batch_size_seen": engine.stats.max_batch_size_seen,
        "forward_passes": engine.stats.forward_passes,
        "tokens_generated": engine.stats.tokens_generated,
        "requests_cancelled": engine.stats.requests_cancelled,
        "max_context": state.loaded.max_context,
        "max_batch_size": engine.max_batch_size,
        # rows x capacity the KV cache holds, what it uses now, and how decode steps run
        # (cuda_graphs: replayed; static: the static step run eagerly; eager: the slot cache)
        "kv_cache": engine.cache_info(),
        # how whole prefills run (eager: into a DynamicCache; static: the static pass into the
        # decode slots, eagerly; cuda_graphs: replayed), its graphs, captures, replays and
        # passes not replayed (prefill_graphs.py)
        "prefill": engine.prefill_info(),
        # how judge passes run (packed; static: the pool run eagerly; cuda_graphs: replayed),
        # the pool's slots and capacity, its graphs, captures and replays (judge_graphs.py)
        "judge": engine.judges.info(),
        # where the worker thread's time went (admit, launch, device_wait, accept, deliver,
        # judge, idle) and the event loop's deliveries (jobs.WorkerTimes)
        "worker": engine.stats.worker.info(),
    }
    return web.json_response(body, status=200 if engine.healthy else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[STATE].registry)
    return web.Response(
        body=data, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def handle_faults(request: web.Request) -> web.Response:
    faults = request.app[STATE].faults
    assert faults is not None
    req: FaultRequest = await _read_model(request, FaultRequest)
    _check_vocab("token_ids", req.token_ids, request.app[STATE].loaded.vocab_size)
    faults.arm(req.after_tokens, req.mode, req.times, tuple(req.token_ids))
    return web.json_response({"armed": faults.pending})


async def handle_clear_faults(request: web.Request) -> web.Response:
    faults = request.app[STATE].faults
    assert faults is not None
    faults.clear()
    return web.json_response({"armed": 0})


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Validate (4xx before any byte), then stream NDJSON items ending with complete_final."""
    state = request.app[STATE]
    req: GenerateRequest = await _read_model(request, GenerateRequest)
    received = time.monotonic()
    with state.generate_place():
        return await _generate(request, state, req, received)


async def _generate(
    request: web.Request, state: EngineState, req: GenerateRequest, received: float
) -> web.StreamResponse:
    """`handle_generate` holding one of the engine's generate places."""
    loaded = state.loaded
    _check_tools(state, req.tools, req.messages)
    if req.prompt is not None or req.messages is not None:
        _check_template(loaded, req.prompt, req.chat, req.messages)
        prompt_ids = await state.run_tokenizer(
            _encode_prompt,
            loaded,
            req.prompt,
            req.chat,
            req.messages,
            req.tools,
            chars=text_size(request),
        )
    else:
        prompt_ids = list(req.input_ids or [])
        _check_vocab("input_ids", prompt_ids, loaded.vocab_size)
    if not prompt_ids:
        raise ClientError(422, "the prompt is empty: it has no tokens")
    resume_ids = list(req.resume.token_ids) if req.resume else []
    resume_text = req.resume.text if req.resume else ""
    _check_vocab("resume.token_ids", resume_ids, loaded.vocab_size)
    total = len(prompt_ids) + len(resume_ids)
    if total >= loaded.max_context:
        raise ClientError(
            422,
            f"the prompt has {len(prompt_ids)} tokens (+{len(resume_ids)} resumed): it must be "
            f"shorter than the model's context of {loaded.max_context} tokens",
        )
    if len(prompt_ids) + req.max_new_tokens > loaded.max_context:
        raise ClientError(
            422,
            f"max_new_tokens is {req.max_new_tokens} but the prompt has {len(prompt_ids)} "
            f"tokens: together they exceed the model's context of {loaded.max_context} tokens "
            f"(at most {loaded.max_context - len(prompt_ids)} new tokens fit)",
        )
    if resume_text:
        full = await state.run_tokenizer(make_decoder(loaded.frontend_tokenizer), resume_ids)
        if req.tools is not None:  # the client has the text around the calls, not their tags
            full = visible_prefix(full)
        if not full.startswith(resume_text):
            raise ClientError(422, "resume.text is not a prefix of the text of resume.token_ids")
    fault = state.faults.take() if state.faults is not None else None
    scripted: list[int] = []
    if fault is not None and fault.mode == "script":  # tests: the answer begins with these
        scripted = list(fault.token_ids)
        fault = Fault(fault.after_tokens, "close") if fault.after_tokens else None
        resume_ids = resume_ids + scripted
    # with tools, the resumed tokens' whole text goes through the call parser again (the
    # client's part of it is dropped there): a call under way must be parsed from its start
    calls = ToolCallParser(prompt_ids, skip=len(resume_text)) if req.tools is not None else None
    decoding = req.decoding
    greedy = decoding.method == "greedy" or decoding.temperature == 0.0
    seed = decoding.seed if decoding.seed is not None else random_seed()
    first_extra: dict[str, Any] = {"prompt_token_ids": prompt_ids}
    if not greedy:
        first_extra["seed"] = seed
    stream = _Stream(request, state, fault, len(prompt_ids), first_extra, calls)
    stream.scripted = scripted
    job = Job(
        prompt_ids=prompt_ids,
        max_new_tokens=req.max_new_tokens,
        sampling=SamplingParams(
            greedy=greedy,
            temperature=decoding.temperature if not greedy else 1.0,
            top_k=decoding.top_k,
            top_p=decoding.top_p,
            seed=seed,
            repetition_penalty=decoding.repetition_penalty,
        ),
        loop=asyncio.get_running_loop(),
        queue=stream,
        resume_ids=resume_ids,
        resume_text_len=len(resume_text) if calls is None else 0,
        min_new_tokens=req.min_new_tokens,
        stop_sequences=list(req.stop_sequences),
        deadline=received + req.max_time if req.max_time > 0 else None,
    )
    stream.attach(job)
    try:
        state.engine.submit(job)
    except EngineUnavailable as exc:
        raise ClientError(503, str(exc), "generation_unavailable") from None
    if TRACING.tracer is not None:
        annotate(
            request,
            {
                "guardstream.prompt_tokens": len(prompt_ids),
                "guardstream.resumed_tokens": len(resume_ids),
                "guardstream.max_new_tokens": req.max_new_tokens,
                "guardstream.decoding": "greedy" if greedy else "sampling",
            },
        )
    return await stream.run()


class _Stream:
    """One generate response, and its job's sink (`StreamSink`): items from the worker to the
    socket, faults, disconnects.

    Cost per token (issue 35): the worker hands the loop one list per step, and the loop calls
    each stream's `put_many` with its items; from the moment the response has started (headers
    sent), the stream encodes them (orjson) and writes them to its socket right there, in one
    write (several NDJSON lines in one chunk when the loop fell behind the worker). No future, no
    task wake-up and no timer per token: the handler's task waits once, for the stream's end.
    A client that leaves cancels the handler (`python -m generation serve` runs aiohttp with
    handler cancellation); without it (an app run by `web.run_app`'s defaults) a stream learns
    it from its next write, or, while quiet (queued, prefilling, held), from the app's one
    `_watch_disconnects` task.

    The socket's buffer takes what the client has not read yet (at most the stream's own output,
    as a queue would hold it)."""

    def __init__(
        self,
        request: web.Request,
        state: EngineState,
        fault: Fault | None,
        input_token_count: int,
        first_extra: dict[str, Any],
        calls: ToolCallParser | None = None,
    ) -> None:
        self.request = request
        self.state = state
        self.job: Job | None = None  # set by `attach`, before the job is submitted
        self.fault = fault
        self.input_token_count = input_token_count
        self.first_extra: dict[str, Any] | None = first_extra
        self.calls = calls
        self.scripted: list[int] = []  # a `script` fault's tokens: reported on the first item
        self.delivered = 0
        self.response = web.StreamResponse(
            headers={"Content-Type": NDJSON, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._pending: list[EngineDelta | StreamError] = []  # items before the response started
        self._transport: asyncio.Transport | None = None  # set once the headers are out
        self._chunked = False  # HTTP/1.1: each write is one chunk; HTTP/1.0: raw, close ends it
        # "end", "fault", "gone", "closed" (the handler returned) or a bug
        self._outcome: str | BaseException | None = None
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def attach(self, job: Job) -> None:
        self.job = job

    async def run(self) -> web.StreamResponse:
        self.state.streams.add(self)
        try:
            await self.response.prepare(self.request)  # sends the headers (StreamResponse does)
            if self.fault is not None and self.fault.after_tokens == 0:
                await self._inject()
                return self.response
            self._start_direct()
            await self._ended
            outcome = self._outcome
            if outcome == "fault":
                await self._inject()
            elif isinstance(outcome, BaseException):
                raise outcome
            return self.response
        except ConnectionError:  # the client left while we wrote
            return self.response
        except Exception as exc:  # a bug: end the stream in-band rather than with a broken socket
            log.exception("generate stream failed", exc_info=exc)
            with contextlib.suppress(Exception):
                await self._write(
                    {
                        "error": {
                            "code": 500,
                            "type": "generation_error",
                            "message": str(exc)[:500],
                        },
                        "complete_final": False,
                    }
                )
            return self.response
        finally:
            if self._outcome is None:  # cancelled (the client left) or failed before the end
                self._outcome = "closed"  # nothing more may reach a connection that moved on
            self._pending = []
            self.state.streams.discard(self)
            if TRACING.tracer is not None:
                annotate(self.request, {"guardstream.generated_tokens": self.delivered})
            if self.job is not None:
                self.state.engine.cancel(self.job)  # no-op for a finished job

    def _start_direct(self) -> None:
        """From now on items go to the socket as they come; those that came first go now."""
        transport = self.request.transport
        if self.response.compression:  # never set by this app: the direct path writes plain
            raise RuntimeError("the generate stream cannot be compressed")
        self._chunked = self.response.headers.get("Transfer-Encoding") == "chunked"
        self._transport = transport
        pending, self._pending = self._pending, []
        if transport is None or transport.is_closing():
            self._end("gone")
        elif pending:
            self.put_many(pending)

    def put_many(self, events: list[EngineDelta | StreamError]) -> None:
        """On the loop (the worker's delivery): encode `events` and write them in one go."""
        if self._outcome is not None:
            return  # ended: what the worker emitted before the job's cancellation is dropped
        transport = self._transport
        if transport is None:  # the response has not started yet
            self._pending.extend(events)
            return
        if transport.is_closing():
            self._end("gone")
            return
        try:
            lines: list[bytes] = []
            done = self._lines(events, lines)
            body = b"".join(lines)
            if body:
                transport.write(b"%x\r\n%b\r\n" % (len(body), body) if self._chunked else body)
            if done is not None:
                self._end(done)
        except Exception as exc:  # a bug: the handler's task reports it in-band
            self._end(exc)

    def _end(self, outcome: str | BaseException) -> None:
        self._outcome = outcome
        if not self._ended.done():
            self._ended.set_result(None)

    def gone(self) -> None:
        """The client left (`_watch_disconnects`): end the stream (its job is cancelled)."""
        if self._outcome is None:
            self._end("gone")

    def _lines(self, events: list[EngineDelta | StreamError], lines: list[bytes]) -> str | None:
        """Encode `events` into `lines`, in order; "end" when the stream is over (an error, or
        the final item and complete_final), "fault" when an armed fault cuts it here."""
        for item in events:
            if isinstance(item, StreamError):
                lines.append(_encode({"error": _error_dict(item), "complete_final": False}))
                return "end"
            lines.append(_encode({"data": self._data(item), "complete_final": False}))
            self.delivered += len(item.token_ids)
            if self.fault is not None and self.delivered >= self.fault.after_tokens:
                return "fault"
            if item.finish_reason is not None:
                if TRACING.tracer is not None:
                    reason = item.finish_reason.value
                    annotate(self.request, {"guardstream.finish_reason": reason})
                lines.append(_COMPLETE_FINAL)
                return "end"
        return None

    def _data(self, item: EngineDelta) -> dict[str, Any]:
        data: dict[str, Any] = {
            "token_ids": item.token_ids,
            "text": item.text,
            "generated_token_count": item.generated_token_count,
            "input_token_count": self.input_token_count,
            "finish_reason": item.finish_reason.value if item.finish_reason else None,
        }
        if self.first_extra is not None:
            data.update(self.first_extra)
            self.first_extra = None
        if self.scripted:
            data["token_ids"] = self.scripted + item.token_ids
            self.delivered += len(self.scripted)
            self.scripted = []
        if self.calls is not None:
            self._take_calls(item, data)
        return data

    def _take_calls(self, item: EngineDelta, data: dict[str, Any]) -> None:
        """A request with tools: the text goes through the call parser (tool_calls.py); the
        calls it completes go out as `tool_calls`, beside the text."""
        assert self.calls is not None
        text, calls = self.calls.feed(item.text)
        if item.finish_reason is not None:
            text += self.calls.finish()
        data["text"] = text
        if calls:
            data["tool_calls"] = [c.wire() for c in calls]

    async def _write(self, obj: dict[str, Any]) -> None:
        await self.response.write(_encode(obj))

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def _inject(self) -> None:
        assert self.fault is not None and self.job is not None
        mode = self.fault.mode
        log.warning("fault injection: %s after %d tokens", mode, self.delivered)
        if TRACING.tracer is not None:
            event(self.request, "fault", {"mode": mode, "after_tokens": self.delivered})
        self.state.engine.cancel(self.job)
        if mode == "error":
            await self._write(
                {
                    "error": {
                        "code": 503,
                        "type": "generation_unavailable",
                        "message": f"injected fault after {self.delivered} tokens",
                    },
                    "complete_final": False,
                }
            )
        elif mode == "close":
            transport = self.request.transport
            if transport is not None:
                transport.close()  # flushes what was written, then drops the connection
        else:  # stall: say nothing more, keep the connection until the client gives up
            while not self.client_gone() and not self.state.closing.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DISCONNECT_POLL_S):
                        await self.state.closing.wait()


_COMPLETE_FINAL = b'{"complete_final":true}\n'


def _encode(obj: dict[str, Any]) -> bytes:
    """One NDJSON line: orjson (UTF-8, compact, like json.dumps(ensure_ascii=False) with
    compact separators), json for what orjson refuses (an integer past 64 bits)."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _watch_disconnects(state: EngineState) -> None:
    """The one timer for every stream: each DISCONNECT_POLL_S, a stream whose client has left is
    ended (it then cancels its job). A running stream also learns it from its next write; a
    quiet one (queued, prefilling, held) only from here."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        for stream in list(state.streams):
            if stream.client_gone():
                stream.gone()


def _error_dict(error: StreamError) -> dict[str, Any]:
    return {"code": error.code, "type": error.type, "message": error.message}
