"""Client of an OpenAI-compatible completions server (vLLM, a Dynamo frontend; DESIGN section 7).

`POST /v1/completions` with `stream: true` and vLLM's `return_token_ids: true`: every streamed
choice carries the delta's `token_ids` and the first one the `prompt_token_ids`, which is what a
resume needs. A resume sends `prompt` as token ids (prompt ids + delivered ids) and the remaining
budget. An in-band `{"error": ...}` event, `finish_reason: "abort"`, `[DONE]` without a finish
reason, or the end of the body without `[DONE]` is a migratable failure.

Resumes on such servers are seamless in text but, unlike the native engine, not guaranteed to be
token-identical to an uninterrupted run: the server reseeds sampling per request and checks stop
strings only in newly generated text.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from typing import Any

import aiohttp

from .generation import (
    Continuation,
    EngineItem,
    GenerationError,
    GenerationRequest,
    unavailable,
)
from .native import (
    FINAL_GRACE_S,
    HttpLineStream,
    HttpReplicaClient,
    _int_list,
    error_message,
)

log = logging.getLogger("guardstream.openai")
_DEADLINE = "\x00deadline"  # sentinel: max_time ran out while waiting


def map_finish(name: str, finish: str, stop_reason: Any) -> str:
    """vLLM's finish reasons in the native vocabulary; a failed request is migratable."""
    if finish == "stop":
        return "STOP_SEQUENCE" if isinstance(stop_reason, str) else "EOS_TOKEN"
    if finish == "length":
        return "MAX_TOKENS"
    if finish in ("abort", "error"):
        raise unavailable(f"replica {name}: the server ended the request ({finish})")
    log.warning("replica %s: unknown finish_reason %r, treated as EOS_TOKEN", name, finish)
    return "EOS_TOKEN"


def completions_body(
    model: str,
    request: GenerationRequest,
    prompt: str | list[int],
    delivered: int,
) -> dict[str, Any]:
    """The request; optional sampling knobs are sent only when set, for servers other than vLLM."""
    p = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "return_token_ids": True,
        "max_tokens": max(1, p.max_new_tokens - delivered),
        "temperature": p.temperature if p.decoding_method == "SAMPLING" else 0.0,
    }
    if p.decoding_method == "SAMPLING":
        if p.top_p != 1.0:
            body["top_p"] = p.top_p
        if p.top_k > 0:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
    if p.repetition_penalty != 1.0:
        body["repetition_penalty"] = p.repetition_penalty
    if p.stop_sequences:
        body["stop"] = list(p.stop_sequences)
    if p.min_new_tokens > delivered:
        body["min_tokens"] = p.min_new_tokens - delivered
    return body


class OpenAIStream(HttpLineStream):
    unit = "event"
    end_marker = "[DONE]"

    def __init__(
        self,
        client: OpenAIClient,
        request: GenerationRequest,
        continuation: Continuation | None,
        stall_timeout_s: float,
        max_time: float,
    ) -> None:
        super().__init__(client, stall_timeout_s)
        self._request_ = request
        self._continuation = continuation
        self._deadline = time.monotonic() + max_time if max_time > 0 else None
        self._data: list[str] = []  # data lines of the SSE event being read

    async def _next_item(self) -> EngineItem:
        name = self._client.name
        while True:
            if self._deadline_passed():
                # the server has no time budget of its own: max_time is enforced here
                self.close()
                return EngineItem(token_ids=(), text="", finish_reason="TIME_LIMIT")
            payload = await self._next_event()
            if payload is _DEADLINE:
                continue
            if payload is None:
                raise unavailable(f"replica {name}: stream ended without [DONE]")
            if payload == "[DONE]":
                if not self._finished:
                    raise unavailable(f"replica {name}: [DONE] without a finish_reason")
                await self._end_of_body(blank_ok=True)
            item = self._parse(payload)
            if item is not None:
                return item

    async def _request(self) -> tuple[str, dict[str, Any]]:
        c = self._client
        cont = self._continuation
        request = self._request_
        if cont is not None:
            prompt: str | list[int] = [*cont.prompt_token_ids, *cont.token_ids]
            delivered = len(cont.token_ids)
        elif request.chat:
            # completions take no messages: the server's chat template is applied by /tokenize
            prompt = await c.tokenize_ids(request.prompt, True)
            delivered = 0
        else:
            prompt, delivered = request.prompt, 0
        return "/v1/completions", completions_body(c.model, request, prompt, delivered)

    def _deadline_passed(self) -> bool:
        return (
            not self._finished and self._deadline is not None and time.monotonic() >= self._deadline
        )

    async def _next_event(self) -> str | None:
        """The data of the next SSE event; None at the end of the body."""
        assert self._reader is not None
        while True:
            timeout = min(self._stall, FINAL_GRACE_S) if self._finished else self._stall
            if self._deadline is not None and not self._finished:
                timeout = max(0.0, min(timeout, self._deadline - time.monotonic()))
            try:
                line = await self._reader.readline(timeout)
            except TimeoutError:
                if self._deadline_passed():
                    return _DEADLINE
                raise
            if line is None:
                return None
            if line == b"":
                if self._data:
                    data = "\n".join(self._data)
                    self._data = []
                    return data
                continue
            text = line.decode("utf-8", "replace")
            if text.startswith(":"):
                continue  # comment / keep-alive
            field, _, value = text.partition(":")
            if field == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)

    def _parse(self, payload: str) -> EngineItem | None:
        name = self._client.name
        try:
            obj = json.loads(payload)
        except ValueError:
            raise unavailable(f"replica {name} sent an undecodable event") from None
        if not isinstance(obj, dict):
            raise unavailable(f"replica {name} sent an event that is not an object")
        if "error" in obj or obj.get("object") == "error":
            message = error_message(payload.encode())
            raise unavailable(f"replica {name}: {message}")
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise unavailable(f"replica {name} sent an event without choices")
        if not choices:
            return None  # a usage-only event
        choice = choices[0]
        if not isinstance(choice, dict):
            raise unavailable(f"replica {name} sent a malformed choice")
        if self._finished:
            raise unavailable(f"replica {name}: data after the final event")
        text = choice.get("text") or ""
        token_ids = _int_list(choice.get("token_ids"))
        if token_ids is None:
            if choice.get("token_ids") is None:
                raise GenerationError(
                    f"replica {name} does not return token ids (`return_token_ids` needs "
                    "vLLM >= 0.10.2 or a compatible server)",
                    error_type="generation_error",
                    code=502,
                )
            raise unavailable(f"replica {name} sent malformed token_ids")
        prompt_ids = None
        if choice.get("prompt_token_ids") is not None:
            prompt_ids = _int_list(choice["prompt_token_ids"])
            if prompt_ids is None:
                raise unavailable(f"replica {name} sent malformed prompt_token_ids")
        finish = None
        if choice.get("finish_reason") is not None:
            finish = map_finish(name, str(choice["finish_reason"]), choice.get("stop_reason"))
            self._finished = True
        if not isinstance(text, str):
            raise unavailable(f"replica {name} sent a malformed text")
        return EngineItem(
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            prompt_token_ids=prompt_ids,
            input_token_count=len(prompt_ids) if prompt_ids is not None else None,
        )


class OpenAIClient(HttpReplicaClient):
    """One OpenAI-compatible server."""

    type = "openai"

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        session: aiohttp.ClientSession,
        *,
        api_key: str | None = None,
        ssl_context: ssl.SSLContext | bool | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(name, url, session, ssl_context=ssl_context, headers=headers)
        self.model = model

    def generate(
        self,
        request: GenerationRequest,
        continuation: Continuation | None,
        *,
        stall_timeout_s: float,
        max_time: float,
    ) -> OpenAIStream:
        return OpenAIStream(self, request, continuation, stall_timeout_s, max_time)

    async def tokenize_ids(self, prompt: str, chat: bool) -> list[int]:
        """vLLM's `/tokenize`; with `chat`, the prompt as one user message under the template."""
        body: dict[str, Any] = {"model": self.model}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = prompt
        raw = await self.post_json("/tokenize", body)
        try:
            tokens = _int_list(json.loads(raw)["tokens"])
        except (ValueError, KeyError, TypeError):
            tokens = None
        if tokens is None:
            raise unavailable(f"replica {self.name}: malformed tokenize reply")
        return list(tokens)

    async def tokenize(self, prompt: str, chat: bool) -> int:
        return len(await self.tokenize_ids(prompt, chat))
