"""A fake OpenAI-compatible chat server (`POST /v1/chat/completions`) over a real socket, speaking
the streaming protocol as vLLM and SGLang do: a role chunk, content chunks, a chunk with the
`finish_reason` (and vLLM's `stop_reason`), a `choices: []` chunk with `usage` when
`stream_options.include_usage` asks for it, then `data: [DONE]`. With `stream: false`, one
`chat.completion` object. Also `POST /tokenize` (messages or prompt), `GET /health`, `GET /v1/models`.

The "model" is a script: the answer to a conversation is `scripts[last user message]` (or
`script`), one piece a token, `words_per_chunk` pieces a chunk. A request whose last message is
an assistant message and that sets `continue_final_message: true` continues that message: the
partial text must be a prefix of the scripted answer (else it is recorded in `resume_mismatches`
and the answer starts over), so a migrated answer equals the uninterrupted one. Usage counts
pieces: `completion_tokens` = pieces sent, `prompt_tokens` = `count_tokens` over every message
(the partial assistant message included, as a real server counts it).

Quirks a correct client must tolerate (flags): Azure's annotation chunks (`prompt_filter_results`
with `choices: []`, and choices with `content_filter_results` and no `delta`), bare
`choices: []` chunks, `delta.content: null`, keep-alive comments, the last piece in the finish
chunk. Faults on cue (`ChatFault`), after N content chunks or after the finish chunk.

`transformers=True` speaks as `transformers serve` (5.23) does, checked against the real server
(tests/test_clients_transformers_serve.py): fields outside OpenAI's schema (`add_generation_prompt`,
`continue_final_message`, `min_tokens`, `top_k`, `repetition_penalty`) are `422 {"detail":
"Unexpected fields in the request: {...}"}` (so a partial assistant message is never continued),
`stream_options` is accepted and ignored; the role chunk is `delta: {"role": "assistant"}`, no
chunk has `logprobs` or a `finish_reason` key before the end, a stop string is sent and ends the
answer with `stop`, the finish chunk has `delta: {}`, the finish reason and the usage, and the
body ends there without `[DONE]`; an in-band error is `{"error": "<message>"}` and ends the body;
no `/tokenize`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .upstream import FakeUpstream, next_fault

CHAT_FAULTS = (
    "close",  # reset the connection
    "error",  # `{"error": {"message", "type", "param", "code"}}`, then [DONE]
    "object_error",  # vLLM's older `{"object": "error", "message", "type", ...}`, then [DONE]
    "string_error",  # `{"error": "<message>"}`, then [DONE]
    "done_early",  # [DONE] without a finish_reason
    "eof",  # the end of the body without [DONE]
    "stall",  # stop sending, keep the connection open
    "stall_keepalive",  # stop sending events, but send keep-alive comments forever
    "abort",  # `finish_reason: "abort"`, then [DONE]
    "content_filter",  # `finish_reason: "content_filter"` (Azure), then usage and [DONE]
    "http",  # answer HTTP `status` with an OpenAI error body instead of a stream
)

DEFAULT_SCRIPT = ["The", " cat", " sat", " on", " the", " mat", "."]
# what transformers serve takes on /v1/chat/completions: OpenAI's params + its own
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


def count_tokens(text: str) -> int:
    """The fake tokenizer: words and punctuation marks (so "The cat sat" is 3, like its pieces)."""
    return len(re.findall(r"\w+|[^\w\s]", text))


@dataclass
class ChatFault:
    mode: str
    after_chunks: int = 0  # content chunks sent before it
    after_finish: bool = False  # instead: right after the finish chunk (before usage)
    times: int = 1  # requests it applies to; -1: all
    status: int = 503

    def __post_init__(self) -> None:
        if self.mode not in CHAT_FAULTS:
            raise ValueError(f"unknown fault mode {self.mode!r}")


@dataclass
class FakeOpenAIChat(FakeUpstream):
    script: list[str] = field(default_factory=lambda: list(DEFAULT_SCRIPT))
    scripts: dict[str, list[str]] = field(default_factory=dict)  # by last user message
    words_per_chunk: int = 1
    fail: ChatFault | list[ChatFault] | None = None
    model: str = "fake-chat"
    api_key: str | None = None  # when set, `Authorization: Bearer <key>` is required
    token_delay_s: float = 0.0
    stop_reason_field: str = "stop_reason"  # vLLM; SGLang says `matched_stop`
    # quirks
    annotations: bool = False
    empty_choices: bool = False
    null_content: bool = False
    keepalive: bool = False
    finish_with_content: bool = False
    send_usage: bool = True  # False: ignore `stream_options.include_usage` (older servers)
    transformers: bool = False  # speak as transformers serve does (module docstring)

    def __post_init__(self) -> None:
        self.faults: list[ChatFault] = (
            []
            if self.fail is None
            else [self.fail]
            if isinstance(self.fail, ChatFault)
            else self.fail
        )
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokenize_requests: list[dict[str, Any]] = []
        self.resume_mismatches: list[str] = []
        self.disconnects = 0
        self._init_upstream()

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        if not self.transformers:
            app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get(
            "/v1/models", lambda r: web.json_response({"data": [{"id": self.model}]})
        )
        await self._serve(app)
        return self.url

    def answer(self, user: str = "") -> str:
        """The whole scripted answer to a conversation whose last user message is `user`."""
        return "".join(self.scripts.get(user, self.script))

    # -- the model ------------------------------------------------------------------------------

    def _pieces(self, body: dict[str, Any]) -> list[str]:
        """The pieces still to generate for this request."""
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

    def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == (
            f"Bearer {self.api_key}"
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_requests.append(body)
        if "messages" in body:
            n = sum(count_tokens(m["content"]) for m in body["messages"])
        else:
            n = count_tokens(body["prompt"])
        return web.json_response({"tokens": list(range(n)), "count": n, "max_model_len": 4096})

    # -- the endpoint ---------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if not self._authorized(request):
            return web.json_response(
                {"error": {"message": "unauthorized", "type": "auth", "param": None, "code": 401}},
                status=401,
            )
        if self.transformers:
            unexpected = set(body) - TRANSFORMERS_CHAT_FIELDS
            if unexpected:
                detail = f"Unexpected fields in the request: {unexpected}"
                return web.json_response({"detail": detail}, status=422)
        fault = next_fault(self.faults)
        if fault is not None and fault.mode == "http":
            return web.json_response(
                {
                    "error": {
                        "message": "injected",
                        "type": "BadRequestError" if fault.status < 500 else "InternalError",
                        "param": None,
                        "code": fault.status,
                    }
                },
                status=fault.status,
            )
        pieces = self._pieces(body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        prompt_tokens = sum(count_tokens(m["content"]) for m in body["messages"])
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
        }
        rid = f"chatcmpl-{len(self.requests)}"
        if self.transformers and body.get("stream"):
            return await self._transformers_stream(request, rid, out, finish, usage, fault)
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
        return await self._stream(request, body, rid, out, finish, stop_reason, usage, fault)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        rid: str,
        out: list[str],
        finish: str,
        stop_reason: str | None,
        usage: dict[str, int],
        fault: ChatFault | None,
    ) -> web.StreamResponse:
        options = body.get("stream_options") or {}
        include_usage = self.send_usage and bool(options.get("include_usage"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        created = int(time.time())

        async def send(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())
            if self.keepalive:
                await resp.write(b": keep-alive\n\n")

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

        async def inject(f: ChatFault) -> bool:
            """Serve the fault; True when the response is over."""
            m = f.mode
            if m == "close":
                assert request.transport is not None
                request.transport.abort()
                return True
            if m == "stall":
                await asyncio.Event().wait()
            if m == "stall_keepalive":
                while True:
                    await resp.write(b": keep-alive\n\n")
                    await asyncio.sleep(0.05)
            if m in ("error", "object_error", "string_error"):
                err: dict[str, Any] = {
                    "error": {
                        "message": "injected error",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
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
                if m == "error":
                    err = {"error": err}
                await send(err)
                await send("[DONE]")
            elif m == "done_early":
                await send("[DONE]")
            elif m in ("abort", "content_filter"):
                c = choice({}, m)
                c.pop(self.stop_reason_field, None)
                if m == "content_filter":
                    c["content_filter_results"] = {"hate": {"filtered": True, "severity": "high"}}
                await send(chunk([c]))
                if include_usage:
                    await send(chunk([], usage=usage))
                await send("[DONE]")
            await resp.write_eof()
            return True

        try:
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
            n = self.words_per_chunk
            groups = ["".join(out[i : i + n]) for i in range(0, len(out), n)]
            last = groups.pop() if self.finish_with_content and groups else ""
            for sent, text in enumerate(groups):
                if fault is not None and not fault.after_finish and fault.after_chunks == sent:
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
                and fault.after_chunks >= len(groups)
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
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            if transport is not None:
                self._transports.discard(transport)

    async def _transformers_stream(
        self,
        request: web.Request,
        rid: str,
        out: list[str],
        finish: str,
        usage: dict[str, int],
        fault: ChatFault | None,
    ) -> web.StreamResponse:
        """transformers serve's stream (module docstring)."""
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)

        async def send(choice: dict[str, Any], **extra: Any) -> None:
            obj = {
                "id": rid,
                "choices": [choice],
                "created": int(time.time()),
                "model": f"{self.model}@main",
                "object": "chat.completion.chunk",
                "system_fingerprint": "",
                **extra,
            }
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            await send({"delta": {"role": "assistant"}, "index": 0})
            for sent, piece in enumerate(out):
                if fault is not None and not fault.after_finish and fault.after_chunks == sent:
                    if fault.mode == "close":
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    if fault.mode == "stall":
                        await asyncio.Event().wait()
                    if fault.mode == "error":
                        await resp.write(b'data: {"error": "injected error"}\n\n')
                    await resp.write_eof()  # error, eof
                    return resp
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                await send({"delta": {"content": piece}, "index": 0})
            await send({"delta": {}, "index": 0, "finish_reason": finish}, usage=usage)
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            if transport is not None:
                self._transports.discard(transport)
