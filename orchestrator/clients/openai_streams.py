"""The streams of an OpenAI-compatible server (clients/openai.py): server-sent events read over
the line transport, as EngineDeltas; `OpenAIStream` for `api: completions`, `ChatStream` for
`api: chat`. What they need of their client is `OpenAIServer` (the client implements it).
"""

from __future__ import annotations

import time
from typing import Any, NoReturn, Protocol

import aiohttp
import orjson

from servicekit.text_gate import TextGate

from .backend import (
    CannotContinue,
    Continuation,
    EngineDelta,
    GenerationError,
    GenerationRequest,
    ToolCallDelta,
    unavailable,
)
from .line_transport import (
    FINAL_GRACE_S,
    HttpLineStream,
    LineTooLong,
    error_message,
    int_list,
)
from .openai_protocol import (
    RESUME_FIELDS,
    NoTokenize,
    ServerTraits,
    chat_body,
    completions_body,
    loads,
    map_finish,
)
from .peers import log_inband_error

_DEADLINE = b"\x00deadline"  # sentinel: max_time ran out while waiting
_DONE = b"[DONE]"


class OpenAIServer(Protocol):
    """What a stream asks of its client (OpenAIClient), beyond the transport's session."""

    name: str
    model: str
    traits: ServerTraits

    def check_honoured(self, body: dict[str, Any], soft: frozenset[str] = ...) -> None: ...
    def learn(self, body: dict[str, Any], raw: bytes, soft: frozenset[str] = ...) -> bool: ...
    def cannot_continue(self) -> CannotContinue: ...
    async def prompt_text(self, request: GenerationRequest) -> str: ...
    async def tokenize_ids(
        self,
        prompt: str,
        chat: bool,
        messages: Any = None,
        *,
        add_special_tokens: bool | None = None,
    ) -> list[int]: ...


class SseStream(HttpLineStream):
    """Server-sent events of an OpenAI stream, with the max_time budget enforced here (these
    servers have none of their own)."""

    unit = "event"
    end_marker = "[DONE]"

    def __init__(
        self,
        client: OpenAIServer,
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
        self._data_bytes = 0  # their length, bounded like one line (LineReader.max_line_bytes)
        self._gate: TextGate | None = None  # stop sequences enforced here (text-only streams)

    def _check_body(self, body: dict[str, Any]) -> None:
        self._client.check_honoured(body)

    def _resend_without(self, status: int, body: dict[str, Any], raw: bytes) -> bool:
        """Sent again at once without what the server refused by name (a protocol field, a
        token-id prompt); a refused sampling field is the client's 422 (`learn` raises)."""
        soft = self._request_.params.defaulted
        return status in (400, 422) and self._client.learn(body, raw, soft)

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
        """The data of the next SSE event; None at the end of the body. The stall timer runs
        from the last item that said something (`_stall_wait`): comment lines (keep-alives)
        and events without a choice do not reset it."""
        reader = self._reader
        assert reader is not None
        wait = self._stall_wait(min(self._stall, FINAL_GRACE_S) if self._finished else self._stall)
        if not self._data:  # the usual `data: {...}\n\n`, without splitting it into lines
            payload = reader.take_sse_data()
            if payload is not None:
                return payload
        clock = reader.clock
        stall_at = clock.time() + wait
        while True:
            timeout = stall_at - clock.time()
            if self._deadline is not None and not self._finished:
                timeout = min(timeout, self._deadline - time.monotonic())
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
                    self._data_bytes = 0
                    return data
                continue
            if line.startswith(b":"):
                continue  # comment / keep-alive
            field, _, value = line.partition(b":")
            if field == b"data":
                self._data.append(value[1:] if value.startswith(b" ") else value)
                self._data_bytes += len(line) + 1  # as received
                if self._data_bytes > reader.max_line_bytes:  # data lines that never end an event
                    raise LineTooLong("an event", reader.max_line_bytes)

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
            # what it said goes to the log, not to a client (DESIGN 6)
            log_inband_error(f"replica {name}", error_message(payload))
            raise unavailable(f"replica {name} reported an error")
        return obj

    def _time_limit(self) -> EngineDelta:
        self.close()
        return EngineDelta(token_ids=(), text="", finish_reason="TIME_LIMIT", token_count=0)


class OpenAIStream(SseStream):
    """`api: completions`. With token ids (vLLM) items carry them; without (transformers serve)
    each text event counts one token, the final item is corrected to the server's
    `usage.completion_tokens` where the event carries it, and stop sequences are enforced here."""

    # per-stream state (immutable defaults: the first assignment makes them the instance's;
    # SseStream.__init__ is the one constructor of both modes)
    _with_ids: bool | None = None  # whether this stream's events carry token ids
    _counted = 0  # tokens the items of a stream without ids stood for so far

    async def _next_item(self) -> EngineDelta:
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
        c: OpenAIServer = self._client
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
            except NoTokenize:
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

    def _parse(self, payload: bytes) -> EngineDelta | None:
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
        token_ids = int_list(raw_ids)
        if token_ids is None:
            raise unavailable(f"replica {name} sent malformed token_ids")
        prompt_ids = None
        if choice.get("prompt_token_ids") is not None:
            prompt_ids = int_list(choice["prompt_token_ids"])
            if prompt_ids is None:
                raise unavailable(f"replica {name} sent malformed prompt_token_ids")
        return EngineDelta(
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            prompt_token_ids=prompt_ids,
            input_token_count=len(prompt_ids) if prompt_ids is not None else None,
        )

    def _text_item(self, text: str, finish: str | None, usage: Any) -> EngineDelta | None:
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
        return EngineDelta(
            token_ids=(),
            text=out,
            finish_reason=finish,
            input_token_count=input_count,
            token_count=count,
        )


class ChatStream(SseStream):
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

    # per-stream state, as in OpenAIStream
    _counted = 0  # tokens this dispatch's items stood for so far
    _prompt_tokens: int | None = None
    _completion_tokens: int | None = None
    # (released text, finish, whether the event had text, its tool-call fragments) of the
    # final event
    _held: tuple[str, str, bool, tuple[ToolCallDelta, ...]] | None = None
    _failure: BaseException | None = None  # raised after the held item went out
    _after_done = False

    async def _request(self) -> tuple[str, dict[str, Any]]:
        c: OpenAIServer = self._client
        if self._continuation is not None and c.traits.refused & RESUME_FIELDS:
            raise c.cannot_continue()
        self._start_gate()
        body = chat_body(c.model, self._request_, self._continuation, c.traits.refused)
        return "/v1/chat/completions", body

    async def _next_item(self) -> EngineDelta:
        if self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc
        if self._after_done:
            await self._end_of_sse()
        try:
            return await self._read()
        except (GenerationError, LineTooLong, TimeoutError, aiohttp.ClientError, OSError) as exc:
            if self._held is None:
                raise
            self._failure = exc
            return self._release()

    async def _read(self) -> EngineDelta:
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
            text, finish, stop_reason, calls = self._choice(obj)
            if not (text or calls or finish) and _reasons(obj):
                self._stall_at = None  # the model is thinking: generating, not stalled
            if self._finished:
                if text or calls:
                    raise unavailable(f"replica {name}: data after the final event")
                if has_usage and self._held is not None:
                    return self._release()
                continue
            if finish is not None:
                out, stopped = self._gated(text, True)
                mapped = "STOP_SEQUENCE" if stopped else map_finish(name, finish, stop_reason)
                self._held = (out, mapped, bool(text or calls), calls)
                self._finished = True
                continue
            if calls:  # a tool call's fragment (with any text beside it): about a token
                out, _ = self._gated(text, False)
                return self._item(out, None, 1, calls)
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

    def _choice(
        self, obj: dict[str, Any]
    ) -> tuple[str, str | None, Any, tuple[ToolCallDelta, ...]]:
        """Text, finish reason, stop reason and tool-call fragments of the event's first choice;
        an event with no choices or without a delta (usage, Azure's filter annotations) has
        none of them."""
        name = self._client.name
        choices = obj.get("choices")
        if choices is None or choices == []:
            return "", None, None, ()
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
        calls = tool_call_deltas(name, delta.get("tool_calls")) if isinstance(delta, dict) else ()
        finish = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        if stop_reason is None:
            stop_reason = choice.get("matched_stop")  # SGLang
        return text, None if finish is None else str(finish), stop_reason, calls

    def _release(self) -> EngineDelta:
        """The held final item, with the server's counts where it sent them."""
        assert self._held is not None
        text, finish, had_text, calls = self._held
        self._held = None
        own = 1 if had_text else 0
        if self._completion_tokens is not None:
            own = max(own, self._completion_tokens - self._counted)
        return self._item(text, finish, own, calls)

    def _take_buffered(self, items: list[EngineDelta], limit: int) -> int:
        """Buffered events that are plain content deltas (one choice, `delta.content` text, no
        finish reason, no usage, no error), or plain argument fragments of a tool call (a
        delta with only `tool_calls: [{"index", "function": {"arguments"}}]`: a call streams
        as many of them as a text streams content deltas), become items here; anything else
        stops the loop unconsumed, for `_read`."""
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
            calls = delta.get("tool_calls")
            fragment = None
            if calls is not None:
                fragment = _plain_fragment(calls, delta)
                if fragment is None:
                    break
            elif type(text) is not str or delta.get("refusal") is not None:
                break
            if obj.get("object") == "error":
                break
            reader.consume(peeked[1])
            if fragment is not None:
                items.append(EngineDelta((), "", None, None, input_count, None, 1, 0, fragment))
            elif text:  # an EngineDelta per token: built positionally (half the time of keywords)
                items.append(EngineDelta((), text, None, None, input_count, None, 1))
            else:
                continue
            self._counted += 1
            taken += 1
        return taken

    def _item(
        self,
        text: str,
        finish: str | None,
        count: int,
        calls: tuple[ToolCallDelta, ...] = (),
    ) -> EngineDelta:
        self._counted += count
        return EngineDelta(
            token_ids=(),
            text=text,
            finish_reason=finish,
            input_token_count=self._input_count(),
            token_count=count,
            tool_calls=calls,
        )

    def _input_count(self) -> int | None:
        """The prompt's tokens as the usage reports them, less the resumed ones (which the
        continuation put in the prompt); None until the usage came."""
        if self._prompt_tokens is None:
            return None
        cont = self._continuation
        taken = cont.generated_token_count if cont is not None else 0
        return max(0, self._prompt_tokens - taken)


# where servers put a reasoning model's thinking (vLLM: `reasoning_content`, newer `reasoning`)
REASONING_FIELDS = ("reasoning_content", "reasoning")


def _reasons(obj: dict[str, Any]) -> bool:
    """The event's first choice carries reasoning text: never passed on, but the replica is
    generating (its stall timer restarts, as for text)."""
    choices = obj.get("choices")
    delta = choices[0].get("delta") if choices else None
    return isinstance(delta, dict) and any(
        isinstance(delta.get(f), str) and delta[f] for f in REASONING_FIELDS
    )


def _plain_fragment(calls: Any, delta: dict[str, Any]) -> tuple[ToolCallDelta] | None:
    """The fragment of a delta that holds only `[{"index": i, "function": {"arguments": s}}]`
    (no content, id or name); None for anything else (`tool_call_deltas` reads it)."""
    if type(calls) is not list or len(calls) != 1 or len(delta) != 1:
        return None
    call = calls[0]
    if type(call) is not dict or len(call) != 2:
        return None
    index, function = call.get("index"), call.get("function")
    if type(index) is not int or index < 0 or type(function) is not dict or len(function) != 1:
        return None
    arguments = function.get("arguments")
    if type(arguments) is not str:
        return None
    return (ToolCallDelta(index, None, None, arguments),)


def tool_call_deltas(name: str, raw: Any) -> tuple[ToolCallDelta, ...]:
    """`delta.tool_calls` as ToolCallDeltas; a malformed one fails the replica (as a malformed
    `delta.content` does). `index` defaults to the fragment's position (a server that leaves
    it out sends one call per event)."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list):
        raise unavailable(f"replica {name} sent a malformed delta.tool_calls")
    out = []
    for position, call in enumerate(raw):
        if not isinstance(call, dict):
            raise unavailable(f"replica {name} sent a malformed delta.tool_calls")
        index = call.get("index", position)
        function = call.get("function") or {}
        call_id = call.get("id")
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or index < 0
            or not isinstance(function, dict)
            or not (call_id is None or isinstance(call_id, str))
        ):
            raise unavailable(f"replica {name} sent a malformed delta.tool_calls")
        fname, arguments = function.get("name"), function.get("arguments")
        if not (fname is None or isinstance(fname, str)) or not (
            arguments is None or isinstance(arguments, str)
        ):
            raise unavailable(f"replica {name} sent a malformed delta.tool_calls")
        out.append(ToolCallDelta(index, call_id or None, fname or None, arguments or ""))
    return tuple(out)
