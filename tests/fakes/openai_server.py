"""A fake OpenAI-compatible server over a real socket: `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /tokenize`, `GET /health`, `GET /v1/models`, in one of two
flavours, each matching a real server's traits.

The "model" is a script of pieces, one piece a token. The tokenizer (`/tokenize`, usage's
`prompt_tokens`, the ids of a text prompt) counts words and punctuation marks, as `token_ids`
does, each as an id below TOKEN_BASE; the piece at script position i has id `TOKEN_BASE + i`.

**`flavour="vllm"`** (also what SGLang and Azure send, with the quirk flags):
- chat: a role chunk, content chunks (`words_per_chunk` pieces each), a chunk with the
  `finish_reason` (and vLLM's `stop_reason`, or SGLang's `matched_stop` via
  `stop_reason_field`), a `choices: []` chunk with `usage` when `stream_options.include_usage`
  asks for it (every other chunk then has `usage: null`), then `data: [DONE]`; with
  `stream: false`, one `chat.completion` object. The answer to a conversation is
  `scripts[last user message]` (or `script`). A request whose last message is an assistant
  message and that sets `continue_final_message: true` continues that message: the partial text
  must be a prefix of the scripted answer (else it is recorded in `resume_mismatches` and the
  answer starts over), so a migrated answer equals the uninterrupted one. A stop string is cut
  out of the text.
- completions: `stream: true` and `return_token_ids: true` answer events whose choice carries
  `text`, `token_ids`, `finish_reason`, `stop_reason`, and on the first event
  `prompt_token_ids`; a usage event; then `data: [DONE]`. A prompt given as token ids continues
  from the script position given by the ids >= TOKEN_BASE at its end, so a resumed request
  continues exactly.
- quirks a correct client must tolerate (flags): Azure's annotation chunks
  (`prompt_filter_results` with `choices: []`, and choices with `content_filter_results` and no
  `delta`), bare `choices: []` chunks, `delta.content: null`, keep-alive comments, the last
  piece in the finish chunk, no usage chunk (`send_usage=False`, older servers).

**`flavour="transformers"`**: as `transformers serve` (5.23) does, checked against the real
server (tests/test_clients_transformers_serve.py): fields outside OpenAI's schema (vLLM's
`return_token_ids`, `add_generation_prompt`, `continue_final_message`, `min_tokens`, `top_k`,
`repetition_penalty`) are `422 {"detail": "Unexpected fields in the request: {...}"}` (so a
partial assistant message is never continued), a token-id prompt is `400 {"detail": "prompt
must be a string."}`, `stream_options` is accepted and ignored, there is no `/tokenize` (404);
no event has `logprobs` or ids, nor a `finish_reason` key before the end; the chat role chunk is
`delta: {"role": "assistant"}`; a stop string is sent and ends the answer with `stop` (no
`stop_reason`); the final event (`delta: {}` / `text: ""`) has the finish reason and the usage,
and the body ends there without `[DONE]`; an in-band error is `{"error": "<message>"}` and ends
the body. A completions text prompt that ends with a prefix of the script continues the script
after it (a resume by text).

**Tool calls** (vllm flavour, chat): a request that offers `tools` and whose conversation ends
with a user message is answered with `tool_calls` (when set) as OpenAI streams them: the role
chunk (`content: null`), per call a chunk with its `index`, `id`, `type` and function `name`
(`arguments: ""`), then its arguments in fragments (`argument_splits[i]`: the cut offsets of call
i, else `fragment_chars` characters each), each `{"index", "function": {"arguments"}}` only (after
`tool_call_text`'s content chunks, when set: a model that says something first), then
the finish chunk (`delta: {}`, `finish_reason: "tool_calls"`), usage and `[DONE]`; unary, one
message with `content: null` and the calls. A conversation ending with a `tool` message gets the
text answer. A fault's `after` counts the fragment chunks.

Faults on cue (`OpenAIFault`): after N content chunks (chat) or tokens (completions), or right
after the chat finish chunk; modes as in FAULT_MODES (the transformers flavour serves close,
stall, error, eof and http; the others end its body like eof).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from .upstream import FakeUpstream, next_fault

TOKEN_BASE = 1000
DEFAULT_SCRIPT = ["The", " cat", " sat", " on", " the", " mat", "."]

FAULT_MODES = (
    "close",  # reset the connection
    "error",  # `{"error": {"message", "type", "param", "code"}}`, then [DONE]
    "object_error",  # vLLM's older `{"object": "error", "message", "type", ...}`, then [DONE]
    "string_error",  # `{"error": "<message>"}`, then [DONE]
    "done_early",  # [DONE] without a finish_reason
    "nested",  # an event nested 100,000 deep (past any parser's recursion limit)
    "eof",  # the end of the body without [DONE]
    "stall",  # stop sending, keep the connection open
    "stall_keepalive",  # stop sending events; a keep-alive comment now and at every `keepalive_tick`
    "abort",  # `finish_reason: "abort"`, then [DONE]
    "content_filter",  # `finish_reason: "content_filter"` (Azure), then usage and [DONE]
    "http",  # answer HTTP `status` with an OpenAI error body (`message`) instead of a stream
    "redirect",  # answer `302 Location: /health` instead of a stream
    "endless_line",  # `size` bytes of one `data:` line that never ends, then a stall
    "endless_event",  # `size` bytes of short `data:` lines with no blank line ending the event
    "empty_events",  # EMPTY_EVENTS events without a choice (`choices: []`), then a stall
)
EMPTY_EVENTS = 1000

# what transformers serve takes: OpenAI's request params + its own
TRANSFORMERS_CHAT_FIELDS = frozenset(
    {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
        "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
        "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
        "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
        "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options", "generation_config", "chat_template_kwargs",
    }
)  # fmt: skip
TRANSFORMERS_COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
        "suffix", "temperature", "top_p", "user", "generation_config",
    }
)  # fmt: skip

_WORDS = re.compile(r"\w+|[^\w\s]")


def token_ids(text: str) -> list[int]:
    """The fake tokenizer: one id below TOKEN_BASE per word or punctuation mark (so "The cat
    sat" is 3 tokens, like its script pieces)."""
    return [sum(map(ord, w)) % TOKEN_BASE for w in _WORDS.findall(text)]


def count_tokens(text: str) -> int:
    return len(token_ids(text))


def templated(messages: list[dict[str, Any]], generation_prompt: bool = True) -> str:
    """The fake chat template: what `/tokenize` with messages and a chat request's usage count
    (a partial assistant message that is continued included, as a real server counts it)."""
    text = "\n".join(f"<{m['role']}>{m['content']}" for m in messages)
    return text + "\n<assistant>" if generation_prompt else text


@dataclass
class OpenAIFault:
    mode: str
    after: int = 0  # content chunks (chat) or tokens (completions) sent before it
    after_finish: bool = False  # chat, instead: right after the finish chunk (before usage)
    times: int = 1  # requests it applies to; -1: all
    status: int = 503
    message: str = "injected"  # the message of an `http` fault's error body
    size: int = 4 << 20  # the bytes an `endless_line` or `endless_event` sends before it stalls

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {self.mode!r}")


Send = Callable[[dict[str, Any] | str], Awaitable[None]]


@dataclass(frozen=True)
class ScriptedToolCall:
    """A tool call the fake model makes."""

    id: str
    name: str
    arguments: str


@dataclass
class FakeOpenAI(FakeUpstream):
    script: list[str] = field(default_factory=lambda: list(DEFAULT_SCRIPT))
    scripts: dict[str, list[str]] = field(default_factory=dict)  # chat: by last user message
    flavour: Literal["vllm", "transformers"] = "vllm"
    fail: OpenAIFault | list[OpenAIFault] | None = None
    model: str = "fake-model"
    api_key: str | None = None  # when set, `Authorization: Bearer <key>` is required
    token_delay_s: float = 0.0
    words_per_chunk: int = 1  # chat
    stop_reason_field: str = "stop_reason"  # vLLM; SGLang says `matched_stop`
    # quirks (vllm flavour, chat)
    annotations: bool = False
    empty_choices: bool = False
    null_content: bool = False
    keepalive: bool = False
    finish_with_content: bool = False
    send_usage: bool = True  # False: ignore `stream_options.include_usage` (older servers)
    usage_override: dict[str, Any] = field(default_factory=dict)  # chat: merged into each usage
    # tool calls (vllm flavour, chat): see the module's docstring
    tool_calls: list[ScriptedToolCall] = field(default_factory=list)
    argument_splits: list[list[int]] | None = None
    fragment_chars: int = 5
    tool_call_text: list[str] = field(default_factory=list)  # content chunks before the calls
    calls_unoffered: bool = False  # answer with the calls even when the request offers no tools
    # chat (vllm flavour): `delta.reasoning_content` chunks before the answer (a reasoning
    # model under vLLM's reasoning parser)
    reasoning: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.faults: list[OpenAIFault] = (
            []
            if self.fail is None
            else [self.fail]
            if isinstance(self.fail, OpenAIFault)
            else self.fail
        )
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokenize_requests: list[dict[str, Any]] = []
        self.resume_mismatches: list[str] = []
        self.disconnects = 0
        # stall_keepalive: set by the test to have one more keep-alive sent (a gate, not a pace)
        self.keepalive_tick = asyncio.Event()
        self._init_upstream()

    @property
    def transformers(self) -> bool:
        return self.flavour == "transformers"

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        if not self.transformers:
            app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get(
            "/v1/models", lambda r: web.json_response({"data": [{"id": self.model}]})
        )
        await self._serve(app)
        return self.url

    def text(self, n: int | None = None) -> str:
        """The script's first `n` pieces (all of them by default)."""
        return "".join(self.script if n is None else self.script[:n])

    def answer(self, user: str = "") -> str:
        """The whole scripted chat answer to a conversation whose last user message is `user`."""
        return "".join(self.scripts.get(user, self.script))

    # -- what every endpoint shares -------------------------------------------------------------

    async def _admit(
        self, request: web.Request, allowed: frozenset[str]
    ) -> tuple[dict[str, Any], web.Response | None, OpenAIFault | None]:
        """Record the request; the refusal a real server would answer before streaming (no key,
        a field transformers serve does not take, an injected HTTP error), else the fault."""
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if not self._authorized(request):
            error = {"message": "unauthorized", "type": "auth", "param": None, "code": 401}
            return body, web.json_response({"error": error}, status=401), None
        if self.transformers:  # refused before anything else (no fault is used up)
            unexpected = set(body) - allowed
            if unexpected:
                detail = f"Unexpected fields in the request: {unexpected}"
                return body, web.json_response({"detail": detail}, status=422), None
        fault = next_fault(self.faults)
        if fault is not None and fault.mode == "redirect":
            raise web.HTTPFound("/health")
        if fault is not None and fault.mode == "http":
            error = {
                "message": fault.message,
                "type": "BadRequestError" if fault.status < 500 else "InternalError",
                "param": None,
                "code": fault.status,
            }
            return body, web.json_response({"error": error}, status=fault.status), None
        return body, None, fault

    def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == (
            f"Bearer {self.api_key}"
        )

    @contextlib.asynccontextmanager
    async def _sse(self, request: web.Request) -> AsyncIterator[tuple[web.StreamResponse, Send]]:
        """An open event stream and its `send` (a JSON object or a bare `data:` string); the
        transport is registered for `kill()`, and a client that goes away is counted."""
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)

        async def send(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())
            if self.keepalive:
                await resp.write(b": keep-alive\n\n")

        try:
            yield resp, send
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            if transport is not None:
                self._transports.discard(transport)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        body = await request.json()
        self.tokenize_requests.append(body)
        if "messages" in body:
            text = templated(body["messages"], body.get("add_generation_prompt", True))
        else:
            text = body["prompt"]
        ids = token_ids(text)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def _transformers_fault(
        self, request: web.Request, resp: web.StreamResponse, fault: OpenAIFault
    ) -> None:
        """A fault as transformers serve shows it: a reset, a stall, or the end of the body
        (after `{"error": ...}` for an error)."""
        if fault.mode == "close":
            assert request.transport is not None
            request.transport.abort()
            return
        if fault.mode == "stall":
            await asyncio.Event().wait()
        if fault.mode == "error":
            await resp.write(b'data: {"error": "injected error"}\n\n')
        await resp.write_eof()

    # -- chat -----------------------------------------------------------------------------------

    def _pieces(self, body: dict[str, Any]) -> list[str]:
        """The pieces still to generate for this chat request."""
        messages = body["messages"]
        partial = ""
        if body.get("continue_final_message") and messages[-1]["role"] == "assistant":
            partial = messages[-1]["content"]
            messages = messages[:-1]
        user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        script = self.scripts.get(user, self.script)
        if not "".join(script).startswith(partial):
            self.resume_mismatches.append(partial)
            return list(script)
        pieces: list[str] = []
        done = 0
        for piece in script:
            if done >= len(partial):
                pieces.append(piece)
            elif done + len(piece) > len(partial):
                pieces.append(piece[len(partial) - done :])  # the rest of a cut piece
            done += len(piece)
        return pieces

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, refused, fault = await self._admit(request, TRANSFORMERS_CHAT_FIELDS)
        if refused is not None:
            return refused
        offered = body.get("tools") or self.calls_unoffered
        if self.tool_calls and offered and body["messages"][-1]["role"] == "user":
            return await self._tool_call_reply(request, body, fault)
        pieces = self._pieces(body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        continued = bool(body.get("continue_final_message"))
        prompt_tokens = count_tokens(templated(body["messages"], not continued))
        # generate: pieces up to the budget, cut at a stop string (which is not sent)
        out: list[str] = []
        finish, stop_reason = "stop", None
        text = ""
        for piece in pieces:
            if len(out) >= limit:
                finish = "length"
                break
            hit = next((s for s in stops if s and s in text + piece), None)
            if hit is not None and self.transformers:
                out.append(piece)  # transformers serve sends the stop string, then stops
                break
            if hit is not None:
                cut = (text + piece).index(hit) - len(text)
                if cut > 0:
                    out.append(piece[:cut])
                finish, stop_reason = "stop", hit
                break
            out.append(piece)
            text += piece
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(out),
            "total_tokens": prompt_tokens + len(out),
            **self.usage_override,
        }
        rid = f"chatcmpl-{len(self.requests)}"
        if self.transformers and body.get("stream"):
            return await self._transformers_chat_stream(request, rid, out, finish, usage, fault)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(out)},
                            "finish_reason": finish,
                            self.stop_reason_field: stop_reason,
                        }
                    ],
                    "usage": usage,
                }
            )
        return await self._chat_stream(request, body, rid, out, finish, stop_reason, usage, fault)

    async def _chat_stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        rid: str,
        out: list[str],
        finish: str,
        stop_reason: str | None,
        usage: dict[str, int],
        fault: OpenAIFault | None,
    ) -> web.StreamResponse:
        options = body.get("stream_options") or {}
        include_usage = self.send_usage and bool(options.get("include_usage"))
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            obj: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
            if include_usage and "usage" not in obj:
                obj["usage"] = None  # as OpenAI: every other chunk has `usage: null`
            return obj

        def choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            c: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            if finish_reason is not None:
                c[self.stop_reason_field] = stop_reason
            return c

        async with self._sse(request) as (resp, send):

            async def inject(f: OpenAIFault) -> bool:
                """Serve the fault; True when the response is over."""
                if f.mode in ("abort", "content_filter"):
                    c = choice({}, f.mode)
                    c.pop(self.stop_reason_field, None)
                    if f.mode == "content_filter":
                        c["content_filter_results"] = {
                            "hate": {"filtered": True, "severity": "high"}
                        }
                    await send(chunk([c]))
                    if include_usage:
                        await send(chunk([], usage=usage))
                    await send("[DONE]")
                    await resp.write_eof()
                    return True
                return await self._vllm_fault(request, resp, send, f)

            if self.annotations:
                await send(
                    {
                        "id": "",
                        "object": "",
                        "created": 0,
                        "model": "",
                        "choices": [],
                        "prompt_filter_results": [
                            {"prompt_index": 0, "content_filter_results": {}}
                        ],
                    }
                )
            role: dict[str, Any] = {
                "role": "assistant",
                "content": None if self.null_content else "",
            }
            await send(chunk([choice(role)]))
            for thought in self.reasoning:
                await send(chunk([choice({"reasoning_content": thought})]))
            n = self.words_per_chunk
            groups = ["".join(out[i : i + n]) for i in range(0, len(out), n)]
            last = groups.pop() if self.finish_with_content and groups else ""
            for sent, text in enumerate(groups):
                if fault is not None and not fault.after_finish and fault.after == sent:
                    if await inject(fault):
                        return resp
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                await send(chunk([choice({"content": text})]))
                if self.annotations:
                    filtered = {"index": 0, "finish_reason": None, "content_filter_results": {}}
                    await send(chunk([filtered]))
                if self.empty_choices:
                    await send({"id": rid, "object": "chat.completion.chunk", "choices": []})
                if self.null_content:
                    await send(chunk([choice({"content": None})]))
            if (
                fault is not None
                and not fault.after_finish
                and fault.after >= len(groups)
                and await inject(fault)
            ):
                return resp
            await send(chunk([choice({"content": last} if last else {}, finish)]))
            if fault is not None and fault.after_finish and await inject(fault):
                return resp
            if include_usage:
                await send(chunk([], usage=usage))
            await send("[DONE]")
            await resp.write_eof()
            return resp

    def _fragments(self, i: int, arguments: str) -> list[str]:
        """Call i's arguments cut where `argument_splits` says, else every `fragment_chars`."""
        if self.argument_splits is not None:
            cuts = sorted({c for c in self.argument_splits[i] if 0 < c < len(arguments)})
        else:
            cuts = list(range(self.fragment_chars, len(arguments), self.fragment_chars))
        bounds = [0, *cuts, len(arguments)]
        return [arguments[a:b] for a, b in itertools.pairwise(bounds)]

    async def _tool_call_reply(
        self, request: web.Request, body: dict[str, Any], fault: OpenAIFault | None
    ) -> web.StreamResponse:
        rid = f"chatcmpl-{len(self.requests)}"
        created = int(time.time())
        prompt_tokens = count_tokens(templated(body["messages"]))
        fragments = [self._fragments(i, c.arguments) for i, c in enumerate(self.tool_calls)]
        completion = sum(len(f) + 1 for f in fragments) + len(self.tool_call_text)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        if not body.get("stream"):
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
            content = "".join(self.tool_call_text) or None
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": self.model,
                    "choices": [choice],
                    "usage": usage,
                }
            )

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }

        async with self._sse(request) as (resp, send):
            await send(chunk({"role": "assistant", "content": None}))
            for text in self.tool_call_text:
                await send(chunk({"content": text}))
            sent = 0
            for i, (call, parts) in enumerate(zip(self.tool_calls, fragments, strict=True)):
                head = {
                    "index": i,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
                await send(chunk({"tool_calls": [head]}))
                for part in parts:
                    if fault is not None and fault.after == sent:
                        if await self._vllm_fault(request, resp, send, fault):
                            return resp
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    fragment = {"index": i, "function": {"arguments": part}}
                    await send(chunk({"tool_calls": [fragment]}))
                    sent += 1
            await send(chunk({}, "tool_calls"))
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({**chunk({}), "choices": [], "usage": usage})
            await send("[DONE]")
            await resp.write_eof()
            return resp

    async def _vllm_fault(
        self, request: web.Request, resp: web.StreamResponse, send: Send, f: OpenAIFault
    ) -> bool:
        """The faults both vLLM-flavour streams serve alike; True when the response is over
        (False: a stall that ended, never in practice)."""
        m = f.mode
        if m == "close":
            assert request.transport is not None
            request.transport.abort()
            return True
        if m == "stall":
            await asyncio.Event().wait()
        if m == "empty_events":
            # a replica that looks alive and says nothing (bounded: the test's client shares
            # this event loop and reads them while the fake waits), then falls silent
            for _ in range(EMPTY_EVENTS):
                await send({"choices": []})
            await asyncio.Event().wait()
        if m in ("endless_line", "endless_event"):
            # a bounded size, then a stall: a client that buffers it all costs the test machine
            # `size` bytes, not all its memory
            line = b"data: x\n" * 8192 if m == "endless_event" else b"x" * (64 << 10)
            await resp.write(b'data: {"choices": [{"text": "' if m == "endless_line" else b"")
            for _ in range(f.size // len(line)):
                await resp.write(line)
            await asyncio.Event().wait()
        if m == "stall_keepalive":
            while True:
                await resp.write(b": keep-alive\n\n")
                await self.keepalive_tick.wait()
                self.keepalive_tick.clear()
        if m in ("error", "object_error", "string_error"):
            err: dict[str, Any] = {
                "error": {
                    "error": {
                        "message": "injected error",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
                "object_error": {
                    "object": "error",
                    "message": "injected object error",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                },
                "string_error": {"error": "injected string error"},
            }[m]
            await send(err)
            await send("[DONE]")
        elif m == "done_early":
            await send("[DONE]")
        elif m == "nested":
            await resp.write(b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n")
        await resp.write_eof()  # and eof
        return True

    async def _transformers_chat_stream(
        self,
        request: web.Request,
        rid: str,
        out: list[str],
        finish: str,
        usage: dict[str, int],
        fault: OpenAIFault | None,
    ) -> web.StreamResponse:
        """transformers serve's chat stream (module docstring)."""
        async with self._sse(request) as (resp, send):

            async def event(choice: dict[str, Any], **extra: Any) -> None:
                await send(
                    {
                        "id": rid,
                        "choices": [choice],
                        "created": int(time.time()),
                        "model": f"{self.model}@main",
                        "object": "chat.completion.chunk",
                        "system_fingerprint": "",
                        **extra,
                    }
                )

            await event({"delta": {"role": "assistant"}, "index": 0})
            for sent, piece in enumerate(out):
                if fault is not None and not fault.after_finish and fault.after == sent:
                    await self._transformers_fault(request, resp, fault)
                    return resp
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                await event({"delta": {"content": piece}, "index": 0})
            await event({"delta": {}, "index": 0, "finish_reason": finish}, usage=usage)
            await resp.write_eof()
            return resp

    # -- completions ----------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, refused, fault = await self._admit(request, TRANSFORMERS_COMPLETION_FIELDS)
        if refused is not None:
            return refused
        if self.transformers:
            if not isinstance(body.get("prompt", ""), str):
                return web.json_response({"detail": "prompt must be a string."}, status=400)
            return await self._transformers_completion_stream(request, body, fault)
        prompt = body["prompt"]
        p_ids = list(prompt) if isinstance(prompt, list) else token_ids(prompt)
        pos = 0
        while pos < len(p_ids) and p_ids[len(p_ids) - 1 - pos] >= TOKEN_BASE:
            pos += 1
        max_tokens = int(body.get("max_tokens", 16))
        stops = body.get("stop") or []
        rid = f"cmpl-{len(self.requests)}"

        async with self._sse(request) as (resp, send):

            async def event(choice: dict[str, Any] | None, **extra: Any) -> None:
                await send(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": self.model,
                        "choices": []
                        if choice is None
                        else [{"index": 0, "logprobs": None, **choice}],
                        **extra,
                    }
                )

            sent = 0
            generated = ""
            while True:
                if fault is not None and sent == fault.after:
                    if fault.mode == "abort":
                        abort = {"text": "", "token_ids": [], "finish_reason": "abort"}
                        await event({**abort, "stop_reason": None})
                        await send("[DONE]")
                        await resp.write_eof()
                        return resp
                    await self._vllm_fault(request, resp, send, fault)
                    return resp
                if pos >= len(self.script) or sent >= max_tokens:
                    break
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                tok = self.script[pos]
                generated += tok
                pos += 1
                sent += 1
                finish, stop_reason = None, None
                hit = next((s for s in stops if s and s in generated), None)
                if hit is not None:
                    finish, stop_reason = "stop", hit
                elif pos >= len(self.script):
                    finish = "stop"
                elif sent >= max_tokens:
                    finish = "length"
                choice = {
                    "text": tok,
                    "token_ids": [TOKEN_BASE + pos - 1],
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                }
                if sent == 1:
                    choice["prompt_token_ids"] = p_ids
                await event(choice)
                if finish is not None:
                    break
            await event(None, usage={"prompt_tokens": len(p_ids), "completion_tokens": sent})
            await send("[DONE]")
            await resp.write_eof()
            return resp

    async def _transformers_completion_stream(
        self, request: web.Request, body: dict[str, Any], fault: OpenAIFault | None
    ) -> web.StreamResponse:
        """transformers serve's completions stream (module docstring)."""
        prompt: str = body["prompt"]
        pos = max(
            (k for k in range(1, len(self.script) + 1) if prompt.endswith(self.text(k))),
            default=0,
        )
        max_tokens = int(body.get("max_tokens") or 1024)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        rid = f"{len(self.requests):08x}-0000-4000-8000-000000000000"

        async with self._sse(request) as (resp, send):

            async def event(text: str, **extra: Any) -> None:
                choice: dict[str, Any] = {"index": 0, "text": text}
                if "finish_reason" in extra:
                    choice = {"finish_reason": extra.pop("finish_reason"), **choice}
                await send(
                    {
                        "id": rid,
                        "choices": [choice],
                        "created": int(time.time()),
                        "model": f"{self.model}@main",
                        "object": "text_completion",
                        **extra,
                    }
                )

            sent = 0
            generated = ""
            finish = "stop"
            while pos < len(self.script):
                if fault is not None and sent == fault.after:
                    await self._transformers_fault(request, resp, fault)
                    return resp
                if sent >= max_tokens:
                    finish = "length"
                    break
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                tok = self.script[pos]
                pos += 1
                sent += 1
                generated += tok
                await event(tok)
                if any(stop and stop in generated for stop in stops):
                    break  # stopped after the token with the stop string, which was sent
                if sent >= max_tokens:
                    finish = "length"
                    break
            prompt_tokens = count_tokens(prompt)
            usage = {
                "completion_tokens": sent,
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + sent,
            }
            await event("", finish_reason=finish, usage=usage)
            await resp.write_eof()
            return resp


async def start_fakes(into: list[Any], n: int = 1, **options: Any) -> list[FakeOpenAI]:
    """Start `n` fakes with these options; each is also appended to `into` (the `servers`
    fixture closes them at the end of the test). The ones started."""
    out = []
    for _ in range(n):
        server = FakeOpenAI(**options)
        await server.start()
        into.append(server)
        out.append(server)
    return out
