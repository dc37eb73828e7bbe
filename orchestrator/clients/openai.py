"""Client of an OpenAI-compatible server (vLLM, SGLang, TGI, Ollama, `transformers serve`, a
Dynamo frontend, LiteLLM, OpenAI itself; DESIGN section 7). Two modes, the backend's `api`:

`completions`: `POST /v1/completions` with `stream: true` and vLLM's `return_token_ids: true`:
every streamed choice carries the delta's `token_ids` and the first one the `prompt_token_ids`,
which is what a token-exact resume needs: `prompt` as token ids (prompt ids + delivered ids) and
the remaining budget. A chat request (`messages`, or an FMS prompt with `chat`) is turned into
token ids by the server's `/tokenize`, which applies the chat template. A server without these
(`transformers serve`: no `return_token_ids`, no token-id prompts, no `/tokenize`) is served by
text: the prompt is text (templated with the backend's `tokenizer` folder), and a resume sends
the prompt text plus the delivered text (see `ServerTraits`).

`chat`: `POST /v1/chat/completions` with `stream: true` and `stream_options.include_usage`. There
are no token ids: a resume sends the conversation plus the delivered text as a final assistant
message with `continue_final_message: true, add_generation_prompt: false` (vLLM and SGLang honour
these). A server that refuses them cannot continue a partial answer: such a stream migrates only
before its first token. See ChatStream for what is counted how.

What a server can do is learnt, not assumed: a 400/422 that names a field guardstream sent
(`{"detail": "Unexpected fields in the request: {'return_token_ids'}"}` from transformers serve,
"Unrecognized request argument supplied: ..." from OpenAI) is remembered per replica; a protocol
field is then left out and the dispatch retried at once, a sampling field the client asked for
(`min_tokens`, `top_k`, `repetition_penalty`) makes the request a 422: never silently ignored.

In both modes an in-band error event (`{"error": ...}` or `{"object": "error", ...}`),
`finish_reason: "abort"`, `[DONE]` without a finish reason, or the end of the body before a
finish reason is a migratable failure; the end of the body right after the finish reason is a
normal end (transformers serve sends no `[DONE]`); events without choices or without a delta, and
SSE comments (keep-alives), are skipped. Keep-alives do not reset the stall timer: only events do.
Where guardstream reads text without token ids, it also enforces the stop sequences itself
(transformers serve stops after a stop string but sends it; OpenAI's contract is to leave it out).

Resumes on such servers are seamless in text but, unlike the native engine, not guaranteed to be
token-identical to an uninterrupted run: the server reseeds sampling per request and checks stop
strings only in newly generated text (a chat template may also retokenize the partial message);
a resume by text re-tokenizes prompt + delivered text, which equals the generated tokens only
where the tokenizer's canonical split of that text is the one the model produced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import aiohttp
import orjson

from generation.detokenizer import TextGate

from .backend import (
    ChatMessage,
    Continuation,
    EngineItem,
    GenerationError,
    GenerationRequest,
    unavailable,
)
from .chat_template import ChatTemplateError, LocalTokenizer
from .native import (
    FINAL_GRACE_S,
    HttpLineStream,
    HttpReplicaClient,
    LineReader,
    _int_list,
    error_message,
    http_error,
)

log = logging.getLogger("guardstream.openai")
_DEADLINE = b"\x00deadline"  # sentinel: max_time ran out while waiting
_DONE = b"[DONE]"
# fields of a chat request that only guardstream sets: `extra` never overrides them
_OWN_FIELDS = ("model", "messages", "stream")
# protocol fields only some servers take: left out (and the dispatch retried) once a server
# refuses them by name. The chat resume fields are not among them: without them a server would
# start a fresh answer, so refusing them makes the resume itself fail (ChatStream).
OPTIONAL_FIELDS = frozenset({"return_token_ids", "stream_options", "generation_config"})
# transformers serve samples only when the model's generation_config.json says `do_sample: true`
# (it sets do_sample only to false, for temperature 0): without this, `temperature` > 0 would be
# silently greedy there. vLLM ignores the field; a server that refuses it by name gets it no more.
SAMPLE = '{"do_sample": true}'
RESUME_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})
# sampling fields beyond OpenAI's, sent only when the client set them: a server that refuses one
# cannot honour the request, which is then the client's 422 (the name is the client's)
EXTENSION_FIELDS = {
    "min_tokens": "min_new_tokens",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
}


@dataclass
class ServerTraits:
    """What one replica's server was found to take, learnt from its answers (never assumed
    from its name): vLLM and SGLang keep every default; transformers serve ends with
    `token_ids`, `token_prompt` and `tokenize` false and the optional fields refused."""

    refused: set[str] = field(default_factory=set)  # fields the server named in a 400/422
    token_ids: bool = True  # completions events carry token ids
    token_prompt: bool = True  # `prompt` may be a list of token ids
    tokenize: bool = True  # `POST /tokenize` exists


def named_fields(message: str, fields: Any) -> set[str]:
    """The fields a server's error message names, as whole words (quoted or not)."""
    return {
        f for f in fields if re.search(rf"(?<![A-Za-z0-9_]){re.escape(f)}(?![A-Za-z0-9_])", message)
    }


def loads(payload: bytes) -> Any:
    """orjson (several times faster than json: this runs once per streamed token), else json for
    what orjson refuses and json accepts (NaN, lone surrogates; undecodable bytes replaced, as a
    text decode would)."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return json.loads(payload.decode("utf-8", "replace"))


def map_finish(name: str, finish: str, stop_reason: Any) -> str:
    """OpenAI finish reasons in the native vocabulary. A stop string matched when the server
    names it (vLLM's `stop_reason`, SGLang's `matched_stop` is a string). A failed request is
    migratable; an upstream content filter is not (see ChatStream)."""
    if finish == "stop":
        return "STOP_SEQUENCE" if isinstance(stop_reason, str) else "EOS_TOKEN"
    if finish == "length":
        return "MAX_TOKENS"
    if finish in ("abort", "error"):
        raise unavailable(f"replica {name}: the server ended the request ({finish})")
    if finish == "content_filter":
        raise GenerationError(
            f"replica {name}: the upstream's content filter stopped the generation",
            error_type="generation_error",
            code=502,
        )
    if finish in ("tool_calls", "function_call"):
        return "EOS_TOKEN"  # the model ended its turn (with a call guardstream passes over)
    log.warning("replica %s: unknown finish_reason %r, treated as EOS_TOKEN", name, finish)
    return "EOS_TOKEN"


def completions_body(
    model: str,
    request: GenerationRequest,
    prompt: str | list[int],
    delivered: int,
    refused: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The request; optional sampling knobs are sent only when set, for servers other than vLLM,
    and `return_token_ids` only to a server that did not refuse it."""
    p = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "return_token_ids": True,
        "max_tokens": max(1, p.max_new_tokens - delivered),
        "temperature": p.temperature if p.decoding_method == "SAMPLING" else 0.0,
    }
    _sampling(body, request, delivered)
    for name in refused & (OPTIONAL_FIELDS | p.defaulted):
        body.pop(name, None)
    return body


def _sampling(body: dict[str, Any], request: GenerationRequest, delivered: int) -> None:
    """The knobs beyond the OpenAI basics, sent only when set (vLLM and SGLang take them)."""
    p = request.params
    if p.decoding_method == "SAMPLING":
        body["generation_config"] = SAMPLE
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


def chat_messages(request: GenerationRequest) -> list[dict[str, str]]:
    """The conversation: the request's messages, or its prompt as one user message. An FMS prompt
    goes as a user message even when `chat` is false: a chat endpoint has no raw-prompt mode."""
    if request.messages is not None:
        return [m.wire() for m in request.messages]
    return [{"role": "user", "content": request.prompt}]


def chat_body(
    model: str,
    request: GenerationRequest,
    continuation: Continuation | None,
    refused: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The chat request. `request.extra` goes first, untouched, so that everything guardstream
    sets wins (and `model`, `messages`, `stream` are always its own); `stream_options` is merged
    so that usage is always asked for. A resume appends the delivered text as the final assistant
    message (or extends the client's own prefill) and asks the server to continue it."""
    p = request.params
    body: dict[str, Any] = {k: v for k, v in request.extra.items() if k not in _OWN_FIELDS}
    messages = chat_messages(request)
    delivered = 0
    if continuation is not None:
        delivered = continuation.generated_token_count or len(continuation.token_ids)
        prefill = request.extra.get("continue_final_message") is True
        if prefill and messages and messages[-1]["role"] == "assistant":
            last = messages[-1]
            messages[-1] = {**last, "content": last["content"] + continuation.text}
        else:
            messages.append({"role": "assistant", "content": continuation.text})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    options = body.get("stream_options")
    body.update(
        model=model,
        messages=messages,
        stream=True,
        stream_options={**(options if isinstance(options, dict) else {}), "include_usage": True},
        max_tokens=max(1, p.max_new_tokens - delivered),
        temperature=p.temperature if p.decoding_method == "SAMPLING" else 0.0,
    )
    _sampling(body, request, delivered)
    for name in refused & (OPTIONAL_FIELDS | p.defaulted):
        body.pop(name, None)
    return body


class _SseStream(HttpLineStream):
    """Server-sent events of an OpenAI stream, with the max_time budget enforced here (these
    servers have none of their own)."""

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
        self._data: list[bytes] = []  # data lines of the SSE event being read
        self._gate: TextGate | None = None  # stop sequences enforced here (text-only streams)

    async def _connect(self) -> None:
        """The request, again at once without what the server refused by name (a protocol field,
        a token-id prompt); a refused sampling field is the client's 422. Other non-200s are
        errors as for every replica (http_error)."""
        c: OpenAIClient = self._client
        for _ in range(4):
            path, body = await self._request()
            c.check_honoured(body)
            async with asyncio.timeout(self._stall):
                resp = await c.session.post(c.url + path, json=body, ssl=c.ssl, headers=c.headers)
            self._resp = resp
            if resp.status == 200:
                self._reader = LineReader(resp.content)
                return
            async with asyncio.timeout(FINAL_GRACE_S):
                raw = await resp.content.read(4096)
            resp.release()
            soft = self._request_.params.defaulted
            if not (resp.status in (400, 422) and c.learn(body, raw, soft)):
                raise http_error(c.name, resp.status, raw)
        raise http_error(c.name, resp.status, raw)

    def _start_gate(self) -> None:
        """Enforce the request's stop sequences on the text read here (a server that sends no
        token ids may send the stop string, as transformers serve does; where one stops and
        leaves it out, as vLLM does, the gate only holds a possible prefix back an event)."""
        stops = self._request_.params.stop_sequences
        if stops:
            done = self._continuation.text if self._continuation is not None else ""
            self._gate = TextGate(stops, already_delivered=len(done))
            self._gate.push(done)
            self._gate.release()

    def _gated(self, text: str, final: bool) -> tuple[str, bool]:
        """The text that may leave now, and whether a stop sequence ended the text."""
        gate = self._gate
        if gate is None:
            return text, False
        gate.push(text)
        if final:
            gate.finish()
        return gate.release(), gate.stop_at is not None

    def _body_ended(self) -> None:
        """The body ended right after the final event, without `[DONE]` (transformers serve):
        a normal end."""
        self._done = True
        if self._resp is not None:
            self._resp.release()
        if self._reader is not None:
            self._reader.close()

    def _deadline_passed(self) -> bool:
        return (
            not self._finished and self._deadline is not None and time.monotonic() >= self._deadline
        )

    async def _next_event(self) -> bytes | None:
        """The data of the next SSE event; None at the end of the body. The stall timer runs per
        event: comment lines (keep-alives) do not reset it."""
        reader = self._reader
        assert reader is not None
        if not self._data:  # the usual `data: {...}\n\n`, without splitting it into lines
            payload = reader.take_sse_data()
            if payload is not None:
                return payload
        wait = min(self._stall, FINAL_GRACE_S) if self._finished else self._stall
        stall_at = time.monotonic() + wait
        while True:
            now = time.monotonic()
            timeout = stall_at - now
            if self._deadline is not None and not self._finished:
                timeout = min(timeout, self._deadline - now)
            try:
                if not self._data and reader.awaits_sse_data():
                    # the next event is still on its way: wait for it whole, then take it
                    # without splitting it into lines (one wake-up per token on a paced stream)
                    if await reader.fill(max(0.0, timeout)):
                        payload = reader.take_sse_data()
                        if payload is not None:
                            return payload
                    continue
                line = await reader.readline(max(0.0, timeout))
            except TimeoutError:
                if self._deadline_passed():
                    return _DEADLINE
                raise
            if line is None:
                return None
            if line == b"":
                if self._data:
                    data = b"\n".join(self._data)
                    self._data = []
                    return data
                continue
            if line.startswith(b":"):
                continue  # comment / keep-alive
            field, _, value = line.partition(b":")
            if field == b"data":
                self._data.append(value[1:] if value.startswith(b" ") else value)

    async def _end_of_sse(self) -> NoReturn:
        """After [DONE]: the body must end; blank lines and comments (a keep-alive that raced
        the end) may come first."""
        assert self._reader is not None and self._resp is not None
        stall_at = time.monotonic() + min(self._stall, FINAL_GRACE_S)
        while True:
            line = await self._reader.readline(max(0.0, stall_at - time.monotonic()))
            if line is None:
                break
            if line and not line.startswith(b":"):
                raise unavailable(f"replica {self._client.name}: data after [DONE]")
        self._done = True
        self._resp.release()
        self._reader.close()
        raise StopAsyncIteration

    def _decode(self, payload: bytes) -> dict[str, Any]:
        """The event's object; an in-band error in any of its shapes fails the replica."""
        name = self._client.name
        try:
            obj = loads(payload)
        except ValueError:
            raise unavailable(f"replica {name} sent an undecodable event") from None
        if not isinstance(obj, dict):
            raise unavailable(f"replica {name} sent an event that is not an object")
        if "error" in obj or obj.get("object") == "error":
            message = error_message(payload)
            raise unavailable(f"replica {name}: {message}")
        return obj

    def _time_limit(self) -> EngineItem:
        self.close()
        return EngineItem(token_ids=(), text="", finish_reason="TIME_LIMIT", token_count=0)


class OpenAIStream(_SseStream):
    """`api: completions`. With token ids (vLLM) items carry them; without (transformers serve)
    each text event counts one token, the final item is corrected to the server's
    `usage.completion_tokens` where the event carries it, and stop sequences are enforced here."""

    def __init__(
        self,
        client: OpenAIClient,
        request: GenerationRequest,
        continuation: Continuation | None,
        stall_timeout_s: float,
        max_time: float,
    ) -> None:
        super().__init__(client, request, continuation, stall_timeout_s, max_time)
        self._with_ids: bool | None = None  # whether this stream's events carry token ids
        self._counted = 0  # tokens the items of a stream without ids stood for so far

    async def _next_item(self) -> EngineItem:
        name = self._client.name
        while True:
            if self._deadline_passed():
                return self._time_limit()
            payload = await self._next_event()
            if payload is _DEADLINE:
                continue
            if payload is None:
                if self._finished:
                    self._body_ended()
                    raise StopAsyncIteration
                raise unavailable(f"replica {name}: stream ended without [DONE]")
            if payload == _DONE or payload.strip() == _DONE:
                if not self._finished:
                    raise unavailable(f"replica {name}: [DONE] without a finish_reason")
                await self._end_of_sse()
            item = self._parse(payload)
            if item is not None:
                return item

    async def _request(self) -> tuple[str, dict[str, Any]]:
        c: OpenAIClient = self._client
        cont = self._continuation
        request = self._request_
        traits = c.traits
        chat = request.chat or request.messages is not None
        prompt: str | list[int] | None = None
        delivered = 0
        if cont is not None and cont.prompt_token_ids and traits.token_prompt:
            prompt = [*cont.prompt_token_ids, *cont.token_ids]
            delivered = len(cont.token_ids)
        elif traits.token_prompt and traits.tokenize and (cont is not None or chat):
            # the prompt as the server tokenizes it (its chat template), then the delivered
            # text's own tokens (a continuation that began on an `api: chat` replica)
            try:
                prompt = await c.tokenize_ids(request.prompt, chat, request.messages)
                if cont is not None:
                    prompt += await c.tokenize_ids(cont.text, False, add_special_tokens=False)
                    delivered = cont.generated_token_count
            except _NoTokenize:
                prompt = None
        if prompt is None:  # by text: the prompt (templated here) and what was delivered
            prompt = await c.prompt_text(request) if chat else request.prompt
            if cont is not None:
                prompt += cont.text
                delivered = cont.generated_token_count or len(cont.token_ids)
        if isinstance(prompt, str):
            self._start_gate()
        return "/v1/completions", completions_body(
            c.model, request, prompt, delivered, traits.refused
        )

    def _parse(self, payload: bytes) -> EngineItem | None:
        name = self._client.name
        obj = self._decode(payload)
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
        if not isinstance(text, str):
            raise unavailable(f"replica {name} sent a malformed text")
        raw_ids = choice.get("token_ids")
        if self._with_ids is None:
            self._with_ids = raw_ids is not None
            if not self._with_ids:
                self._client.traits.token_ids = False
        elif self._with_ids != (raw_ids is not None):
            raise unavailable(f"replica {name} sent token_ids on some events only")
        finish = None
        if choice.get("finish_reason") is not None:
            finish = map_finish(name, str(choice["finish_reason"]), choice.get("stop_reason"))
            self._finished = True
        if not self._with_ids:
            return self._text_item(text, finish, obj.get("usage"))
        token_ids = _int_list(raw_ids)
        if token_ids is None:
            raise unavailable(f"replica {name} sent malformed token_ids")
        prompt_ids = None
        if choice.get("prompt_token_ids") is not None:
            prompt_ids = _int_list(choice["prompt_token_ids"])
            if prompt_ids is None:
                raise unavailable(f"replica {name} sent malformed prompt_token_ids")
        return EngineItem(
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            prompt_token_ids=prompt_ids,
            input_token_count=len(prompt_ids) if prompt_ids is not None else None,
        )

    def _text_item(self, text: str, finish: str | None, usage: Any) -> EngineItem | None:
        """An event of a stream without token ids: one token per text event; the final one takes
        the server's count where its event has the usage (transformers serve puts it there)."""
        out, stopped = self._gated(text, finish is not None)
        count = 1 if text else 0
        input_count = None
        if isinstance(usage, dict):
            done = usage.get("completion_tokens")
            if finish is not None and isinstance(done, int) and not isinstance(done, bool):
                count = max(count, done - self._counted)
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int) and not isinstance(prompt, bool):
                cont = self._continuation
                taken = cont.generated_token_count if cont is not None else 0
                input_count = max(0, prompt - taken)
        if stopped and finish is None:
            # the stop sequence is in the text: the answer ends here, whatever the server
            # goes on with (its generation stops when the connection is dropped)
            finish = "STOP_SEQUENCE"
            self._finished = True
            self.close()
        elif stopped:
            finish = "STOP_SEQUENCE"
        if not out and not count and finish is None:
            return None
        self._counted += count
        return EngineItem(
            token_ids=(),
            text=out,
            finish_reason=finish,
            input_token_count=input_count,
            token_count=count,
        )


class ChatStream(_SseStream):
    """`api: chat`. Items carry text and no token ids; what they count:

    - `token_count` is 1 per content event (servers stream about one token an event) unless the
      event carries `usage` (vLLM's `continuous_usage_stats`), whose `completion_tokens` then
      counts exactly; the final item is corrected to the server's `usage.completion_tokens`, so a
      stream that is not migrated ends with the server's exact count.
    - `input_token_count` is `usage.prompt_tokens`; on a resume that includes the partial
      assistant message, so the delivered token count is taken off it (an approximation).

    The event with the finish reason is held until the usage event (or `[DONE]`) so that the
    final item carries those counts; a failure after it still delivers it first, and the failure
    after (MigratingStream then completes without re-dispatch).

    `finish_reason: "content_filter"` (an upstream such as Azure refused to go on) is a
    GenerationError that is not migratable: another replica of the same upstream would refuse too,
    and ending with EOS_TOKEN would pass off a cut answer as a finished one. `delta.refusal` text
    (OpenAI's refusal channel) is delivered like content: it is what the model said."""

    def __init__(
        self,
        client: OpenAIClient,
        request: GenerationRequest,
        continuation: Continuation | None,
        stall_timeout_s: float,
        max_time: float,
    ) -> None:
        super().__init__(client, request, continuation, stall_timeout_s, max_time)
        self._counted = 0  # tokens this dispatch's items stood for so far
        self._prompt_tokens: int | None = None
        self._completion_tokens: int | None = None
        # (released text, finish, whether the event had text) of the final event
        self._held: tuple[str, str, bool] | None = None
        self._failure: BaseException | None = None  # raised after the held item went out
        self._after_done = False

    async def _request(self) -> tuple[str, dict[str, Any]]:
        c: OpenAIClient = self._client
        if self._continuation is not None and c.traits.refused & RESUME_FIELDS:
            raise c.cannot_continue()
        self._start_gate()
        body = chat_body(c.model, self._request_, self._continuation, c.traits.refused)
        return "/v1/chat/completions", body

    async def _next_item(self) -> EngineItem:
        if self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc
        if self._after_done:
            await self._end_of_sse()
        try:
            return await self._read()
        except (GenerationError, TimeoutError, aiohttp.ClientError, OSError) as exc:
            if self._held is None:
                raise
            self._failure = exc
            return self._release()

    async def _read(self) -> EngineItem:
        name = self._client.name
        while True:
            if self._deadline_passed():
                return self._time_limit()
            payload = await self._next_event()
            if payload is _DEADLINE:
                continue
            if payload is None:
                if not self._finished:
                    raise unavailable(f"replica {name}: stream ended without [DONE]")
                self._body_ended()  # after the final event, without [DONE]: a normal end
                if self._held is not None:
                    return self._release()
                raise StopAsyncIteration
            if payload == _DONE or payload.strip() == _DONE:
                if not self._finished:
                    raise unavailable(f"replica {name}: [DONE] without a finish_reason")
                if self._held is not None:
                    self._after_done = True
                    return self._release()
                await self._end_of_sse()
            obj = self._decode(payload)
            has_usage = self._usage(obj.get("usage"))
            text, finish, stop_reason = self._choice(obj)
            if self._finished:
                if text:
                    raise unavailable(f"replica {name}: data after the final event")
                if has_usage and self._held is not None:
                    return self._release()
                continue
            if finish is not None:
                out, stopped = self._gated(text, True)
                mapped = "STOP_SEQUENCE" if stopped else map_finish(name, finish, stop_reason)
                self._held = (out, mapped, bool(text))
                self._finished = True
                continue
            if text:
                n = 1
                if has_usage and self._completion_tokens is not None:
                    n = max(0, self._completion_tokens - self._counted)
                out, stopped = self._gated(text, False)
                if stopped:  # the stop sequence is in the text: the answer ends here
                    self._finished = True
                    self.close()
                    return self._item(out, "STOP_SEQUENCE", n)
                return self._item(out, None, n)

    def _usage(self, usage: Any) -> bool:
        """Remember an event's usage; whether it had one."""
        if not isinstance(usage, dict):
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
            self._prompt_tokens = prompt
        if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
            return False
        self._completion_tokens = completion
        return True

    def _choice(self, obj: dict[str, Any]) -> tuple[str, str | None, Any]:
        """Text, finish reason and stop reason of the event's first choice; an event with no
        choices or without a delta (usage, Azure's filter annotations) has none of them."""
        name = self._client.name
        choices = obj.get("choices")
        if choices is None or choices == []:
            return "", None, None
        if not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise unavailable(f"replica {name} sent malformed choices")
        choice = choices[0]
        delta = choice.get("delta")
        text = ""
        if isinstance(delta, dict):
            for key in ("content", "refusal"):
                part = delta.get(key)
                if part is None:
                    continue
                if not isinstance(part, str):
                    raise unavailable(f"replica {name} sent a malformed delta.{key}")
                text += part
        elif delta is not None:
            raise unavailable(f"replica {name} sent a malformed delta")
        finish = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        if stop_reason is None:
            stop_reason = choice.get("matched_stop")  # SGLang
        return text, None if finish is None else str(finish), stop_reason

    def _release(self) -> EngineItem:
        """The held final item, with the server's counts where it sent them."""
        assert self._held is not None
        text, finish, had_text = self._held
        self._held = None
        own = 1 if had_text else 0
        if self._completion_tokens is not None:
            own = max(own, self._completion_tokens - self._counted)
        return self._item(text, finish, own)

    def _take_buffered(self, items: list[EngineItem], limit: int) -> int:
        """Buffered events that are plain content deltas (one choice, `delta.content` text, no
        finish reason, no usage, no error) become items here; anything else stops the loop
        unconsumed, for `_read`."""
        reader = self._reader
        assert reader is not None
        if self._gate is not None:
            return 0  # stop sequences are looked for in `_read`
        taken = 0
        input_count = self._input_count()  # one value for every item this loop takes
        while len(items) < limit and (self._deadline is None or not self._deadline_passed()):
            peeked = reader.peek_sse_data()
            if peeked is None:
                break
            try:
                obj = orjson.loads(peeked[0])
            except orjson.JSONDecodeError:
                break
            if type(obj) is not dict or "error" in obj or obj.get("usage") is not None:
                break
            choices = obj.get("choices")
            if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
                break
            choice = choices[0]
            delta = choice.get("delta")
            if choice.get("finish_reason") is not None or type(delta) is not dict:
                break
            text = delta.get("content")
            if type(text) is not str or delta.get("refusal") is not None:
                break
            if obj.get("object") == "error":
                break
            reader.consume(peeked[1])
            if text:  # an EngineItem per token: built positionally (half the time of keywords)
                items.append(EngineItem((), text, None, None, input_count, None, 1))
                self._counted += 1
                taken += 1
        return taken

    def _item(self, text: str, finish: str | None, count: int) -> EngineItem:
        self._counted += count
        return EngineItem(
            token_ids=(),
            text=text,
            finish_reason=finish,
            input_token_count=self._input_count(),
            token_count=count,
        )

    def _input_count(self) -> int | None:
        """The prompt's tokens as the usage reports them, less the resumed ones (which the
        continuation put in the prompt); None until the usage came."""
        if self._prompt_tokens is None:
            return None
        cont = self._continuation
        taken = cont.generated_token_count if cont is not None else 0
        return max(0, self._prompt_tokens - taken)


class _NoTokenize(GenerationError):
    """The server has no `/tokenize` (HTTP 404)."""


class OpenAIClient(HttpReplicaClient):
    """One OpenAI-compatible server, with what it was found to take (`traits`)."""

    type = "openai"

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        session: aiohttp.ClientSession,
        *,
        api: Literal["completions", "chat"] = "completions",
        api_key: str | None = None,
        ssl_context: ssl.SSLContext | bool | None = None,
        tokenizer: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(name, url, session, ssl_context=ssl_context, headers=headers)
        self.model = model
        self.api = api
        self.traits = ServerTraits()
        self.local = LocalTokenizer(tokenizer) if tokenizer else None

    def generate(
        self,
        request: GenerationRequest,
        continuation: Continuation | None,
        *,
        stall_timeout_s: float,
        max_time: float,
    ) -> _SseStream:
        cls = ChatStream if self.api == "chat" else OpenAIStream
        return cls(self, request, continuation, stall_timeout_s, max_time)

    def learn(self, body: dict[str, Any], raw: bytes, soft: frozenset[str] = frozenset()) -> bool:
        """A 400/422 answer to `body`: remember what it refused; True when the request can be
        sent again without it. Raises when the refusal makes the request impossible here.
        `soft`: fields the operator's defaults set (dropped, never the client's 422)."""
        message = error_message(raw)
        named = named_fields(message, body.keys())
        traits = self.traits
        dropped = named & soft
        if dropped:
            traits.refused |= dropped
            named -= dropped
            log.warning(
                "replica %s: the server refuses %s (a model default); sending without",
                self.name,
                sorted(dropped),
            )
            if not named:
                return True
        if named & RESUME_FIELDS:
            traits.refused |= named & RESUME_FIELDS
            log.warning("replica %s: the server refuses %s", self.name, sorted(named))
            raise self.cannot_continue()
        extension = named & EXTENSION_FIELDS.keys()
        if extension:
            traits.refused |= extension
            self.check_honoured(body, soft)
        optional = named & OPTIONAL_FIELDS - traits.refused
        if optional:
            traits.refused |= optional
            if "return_token_ids" in optional:
                traits.token_ids = False
            log.warning(
                "replica %s: the server refuses %s; sending without", self.name, sorted(optional)
            )
            return True
        if isinstance(body.get("prompt"), list) and traits.token_prompt and "prompt" in named:
            traits.token_prompt = False  # transformers serve: "prompt must be a string."
            log.warning(
                "replica %s: the server takes no token-id prompts; resumes by text", self.name
            )
            return True
        return False

    def check_honoured(self, body: dict[str, Any], soft: frozenset[str] = frozenset()) -> None:
        """422 for a sampling field this server refused before: it would be ignored or refused."""
        refused = sorted(self.traits.refused & EXTENSION_FIELDS.keys() & body.keys() - soft)
        if refused:
            names = ", ".join(f"`{EXTENSION_FIELDS[f]}`" for f in refused)
            raise GenerationError(
                f"replica {self.name} cannot honour {names} (its server refuses "
                f"{', '.join(f'`{f}`' for f in refused)}); leave it unset for this model",
                error_type="invalid_request",
                code=422,
            )

    def unhonoured(self, request: GenerationRequest) -> list[str]:
        """The request's sampling fields (the client's names) this server was found to refuse:
        the backend's validate makes them a 422 before the response starts."""
        body: dict[str, Any] = {}
        _sampling(body, request, 0)
        refused = self.traits.refused & body.keys() - request.params.defaulted
        return [EXTENSION_FIELDS[f] for f in sorted(refused & EXTENSION_FIELDS.keys())]

    def cannot_continue(self) -> GenerationError:
        """A resume on a chat server that cannot continue a partial assistant message: a fresh
        answer would repeat or contradict what the client has, so the stream ends here."""
        return GenerationError(
            f"replica {self.name} cannot continue a partial answer (its server refuses "
            "`continue_final_message`): the stream could not be resumed",
            error_type="generation_unavailable",
            code=503,
        )

    async def prompt_text(self, request: GenerationRequest) -> str:
        """A chat request's prompt as text, templated with the backend's `tokenizer` folder (a
        server without `/tokenize` cannot do it for us on the completions endpoint)."""
        if self.local is None:
            raise GenerationError(
                f"replica {self.name} cannot apply the chat template (its server has no "
                "/tokenize and the backend names no `tokenizer` folder; set one, or use "
                "`api: chat`)",
                error_type="generation_error",
                code=502,
            )
        try:
            return await self.local.render(chat_messages(request))
        except ChatTemplateError as exc:
            raise GenerationError(
                f"model {self.model}: {exc}", error_type="invalid_request", code=422
            ) from None

    async def tokenize_ids(
        self,
        prompt: str,
        chat: bool,
        messages: tuple[ChatMessage, ...] | None = None,
        *,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """vLLM's (and SGLang's) `/tokenize`: `messages`, or with `chat` the prompt as one user
        message, under the chat template with the generation prompt; else the raw prompt.
        _NoTokenize when the server has none (remembered)."""
        if not self.traits.tokenize:
            raise _NoTokenize(f"replica {self.name} has no /tokenize")
        body: dict[str, Any] = {"model": self.model}
        if messages is not None or chat:
            wire = [m.wire() for m in messages] if messages is not None else None
            body["messages"] = wire or [{"role": "user", "content": prompt}]
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = prompt
            if add_special_tokens is not None:
                body["add_special_tokens"] = add_special_tokens
        try:
            raw = await self.post_json("/tokenize", body)
        except GenerationError as exc:
            if "(HTTP 404)" not in exc.message:
                raise
            self.traits.tokenize = False
            raise _NoTokenize(f"replica {self.name} has no /tokenize") from None
        try:
            tokens = _int_list(json.loads(raw)["tokens"])
        except (ValueError, KeyError, TypeError):
            tokens = None
        if tokens is None:
            raise unavailable(f"replica {self.name}: malformed tokenize reply")
        return list(tokens)

    async def tokenize(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int:
        """`api: chat` counts an FMS prompt as the one user message it sends (chat or not). A
        server without `/tokenize` is counted with the backend's `tokenizer` folder."""
        chat = chat or self.api == "chat" or messages is not None
        if self.traits.tokenize:
            try:
                return len(await self.tokenize_ids(prompt, chat, messages))
            except _NoTokenize:
                if self.local is None:
                    raise
        if self.local is None:
            raise _NoTokenize(f"replica {self.name} has no /tokenize")
        wire = (
            [m.wire() for m in messages]
            if messages is not None
            else [{"role": "user", "content": prompt}]
        )
        try:
            text = await self.local.render(wire) if chat else prompt
            return await self.local.count(text)
        except ChatTemplateError as exc:
            raise GenerationError(
                f"model {self.model}: {exc}", error_type="invalid_request", code=422
            ) from None
