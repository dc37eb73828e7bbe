"""A fake OpenAI-compatible completions server speaking vLLM's streaming protocol over a real
socket: `POST /v1/completions` with `stream: true` and `return_token_ids: true` answers SSE
events whose choice carries `text`, `token_ids`, `finish_reason`, `stop_reason`, and on the first
event `prompt_token_ids`; then `data: [DONE]`. Also `POST /tokenize` and `GET /health`.

The "model" is a script, as in tests/fakes/engine.py: the token at position i is `script[i]`
with id `1000 + i`. A prompt given as token ids continues from the script position given by the
ids >= 1000 at its end, so a resumed request continues exactly. Faults on cue: an in-band error
event then `[DONE]`, `finish_reason: "abort"`, the end of the body without `[DONE]`, `[DONE]`
without a finish reason, a reset, a stall, an HTTP error.

`transformers=True` speaks `/v1/completions` as `transformers serve` (5.23) does, checked against
the real server (tests/test_clients_transformers_serve.py): fields outside OpenAI's schema (vLLM's
`return_token_ids`, `min_tokens`, `top_k`, `repetition_penalty`) are `422 {"detail":
"Unexpected fields in the request: {...}"}`, a token-id prompt is `400 {"detail": "prompt must
be a string."}`, there is no `/tokenize` (404); events carry only `text` (no ids, no `logprobs`,
no `finish_reason` key until the end), a stop string is sent and ends the text with `stop` and
no `stop_reason`, the final event has `text: ""`, the finish reason and the usage, and the body
ends there without `[DONE]`; an in-band error is `{"error": "<message>"}` and ends the body. A
text prompt that ends with a prefix of the script continues the script after it (a resume by
text).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .engine import TOKEN_BASE, prompt_ids
from .upstream import FakeUpstream, next_fault

VLLM_FAULTS = ("error", "abort", "eof", "done_early", "close", "stall", "http")
# what transformers serve takes on /v1/completions: OpenAI's CompletionCreateParams + its own
TRANSFORMERS_COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
        "suffix", "temperature", "top_p", "user", "generation_config",
    }
)  # fmt: skip


@dataclass
class VllmFault:
    mode: str
    after_tokens: int = 0
    times: int = 1
    status: int = 503

    def __post_init__(self) -> None:
        if self.mode not in VLLM_FAULTS:
            raise ValueError(f"unknown fault mode {self.mode!r}")


@dataclass
class FakeVllm(FakeUpstream):
    script: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    fail: VllmFault | list[VllmFault] | None = None
    token_delay_s: float = 0.0
    model: str = "fake-model"
    api_key: str | None = None  # when set, `Authorization: Bearer <key>` is required
    transformers: bool = False  # speak as transformers serve does (module docstring)

    def __post_init__(self) -> None:
        self.faults: list[VllmFault] = (
            []
            if self.fail is None
            else [self.fail]
            if isinstance(self.fail, VllmFault)
            else self.fail
        )
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokenize_requests: list[dict[str, Any]] = []
        self.disconnects = 0
        self._init_upstream()

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        if not self.transformers:
            app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        await self._serve(app)
        return self.url

    def text(self, n: int | None = None) -> str:
        return "".join(self.script if n is None else self.script[:n])

    def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == (
            f"Bearer {self.api_key}"
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        body = await request.json()
        self.tokenize_requests.append(body)
        if "messages" in body:
            text = "<user>" + "".join(m["content"] for m in body["messages"]) + "<assistant>"
        else:
            text = body["prompt"]
        ids = prompt_ids(text)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if not self._authorized(request):
            return web.json_response(
                {"error": {"message": "unauthorized", "type": "auth", "code": 401}}, status=401
            )
        if self.transformers:  # refused before anything else (no fault is used up)
            unexpected = set(body) - TRANSFORMERS_COMPLETION_FIELDS
            if unexpected:
                detail = f"Unexpected fields in the request: {unexpected}"
                return web.json_response({"detail": detail}, status=422)
            if not isinstance(body.get("prompt", ""), str):
                return web.json_response({"detail": "prompt must be a string."}, status=400)
        fault = next_fault(self.faults)
        if fault is not None and fault.mode == "http":
            return web.json_response(
                {"error": {"message": "injected", "type": "x", "code": fault.status}},
                status=fault.status,
            )
        if self.transformers:
            return await self._transformers_stream(request, body, fault)
        prompt = body["prompt"]
        p_ids = list(prompt) if isinstance(prompt, list) else prompt_ids(prompt)
        pos = 0
        while pos < len(p_ids) and p_ids[len(p_ids) - 1 - pos] >= TOKEN_BASE:
            pos += 1
        max_tokens = int(body.get("max_tokens", 16))
        stops = body.get("stop") or []
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        rid = f"cmpl-{len(self.requests)}"

        async def event(choice: dict[str, Any] | None, **extra: Any) -> None:
            obj: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [] if choice is None else [{"index": 0, "logprobs": None, **choice}],
                **extra,
            }
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            sent = 0
            generated = ""
            while True:
                if fault is not None and sent == fault.after_tokens:
                    m = fault.mode
                    if m == "error":
                        err = {
                            "error": {"message": "injected error", "type": "Internal", "code": 500}
                        }
                        await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                        await resp.write(b"data: [DONE]\n\n")
                        await resp.write_eof()
                        return resp
                    if m == "abort":
                        await event(
                            {
                                "text": "",
                                "token_ids": [],
                                "finish_reason": "abort",
                                "stop_reason": None,
                            }
                        )
                        await resp.write(b"data: [DONE]\n\n")
                        await resp.write_eof()
                        return resp
                    if m == "eof":
                        await resp.write_eof()
                        return resp
                    if m == "done_early":
                        await resp.write(b"data: [DONE]\n\n")
                        await resp.write_eof()
                        return resp
                    if m == "close":
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    if m == "stall":
                        await asyncio.Event().wait()
                    fault = None
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
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            if transport is not None:
                self._transports.discard(transport)

    async def _transformers_stream(
        self, request: web.Request, body: dict[str, Any], fault: VllmFault | None
    ) -> web.StreamResponse:
        """transformers serve's stream (module docstring)."""
        prompt: str = body["prompt"]
        pos = max(
            (k for k in range(1, len(self.script) + 1) if prompt.endswith(self.text(k))),
            default=0,
        )
        max_tokens = int(body.get("max_tokens") or 1024)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        rid = f"{len(self.requests):08x}-0000-4000-8000-000000000000"

        async def event(text: str, **extra: Any) -> None:
            choice: dict[str, Any] = {"index": 0, "text": text}
            if "finish_reason" in extra:
                choice = {"finish_reason": extra.pop("finish_reason"), **choice}
            obj = {
                "id": rid,
                "choices": [choice],
                "created": int(time.time()),
                "model": f"{self.model}@main",
                "object": "text_completion",
                **extra,
            }
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            sent = 0
            generated = ""
            finish = "stop"
            while pos < len(self.script):
                if fault is not None and sent == fault.after_tokens:
                    if fault.mode == "error":
                        await resp.write(b'data: {"error": "injected error"}\n\n')
                        await resp.write_eof()
                        return resp
                    if fault.mode == "close":
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    if fault.mode == "stall":
                        await asyncio.Event().wait()
                    if fault.mode == "eof":
                        await resp.write_eof()
                        return resp
                    fault = None
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
            usage = {
                "completion_tokens": sent,
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + sent,
            }
            await event("", finish_reason=finish, usage=usage)
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            if transport is not None:
                self._transports.discard(transport)
