"""Client of the native engine protocol (DESIGN section 7): `POST /v1/generate`, NDJSON back.

The end-of-stream contract is enforced here: only `{"complete_final": true}` followed by the end
of the response is a normal end. A missing marker, anything after it, a blank or undecodable
line, an item with neither `data` nor `error`, a reset or a stall is a migratable failure, so a
broken replica can never pass off a truncated stream as a finished one.

The transport (lines under the stall timeout, non-200 answers) is `line_transport.py`. An engine
started with `--api-keys-env` gets the key as a Bearer token; `advertised()` reads what the
engine accepts (`GET /v1/models`, see advertised_limits.py) so the orchestrator can reject a
request before dispatching it.
"""

from __future__ import annotations

import json
import ssl
from typing import Any

import aiohttp
import orjson

from .advertised_limits import EngineLimits
from .backend import (
    FINISH_REASONS,
    ChatMessage,
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
    HttpReplicaClient,
    int_list,
    parse_reply,
)
from .peers import log_inband_error

# `GET /v1/models` is a few hundred bytes: a reply past this is refused unread (it was read up
# to CALL_REPLY_BYTES and parsed on the event loop, a hostile replica's way to stall every client)
MODELS_REPLY_BYTES = 1 << 20


def native_body(
    request: GenerationRequest, continuation: Continuation | None, max_time: float
) -> dict[str, Any]:
    """The engine request. A resume sends the prompt as token ids plus what was delivered, and the
    ORIGINAL budget: the engine counts resumed tokens as already generated."""
    p = request.params
    decoding: dict[str, Any] = {
        "method": p.decoding_method.lower(),
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "repetition_penalty": p.repetition_penalty,
    }
    seed = p.seed if p.seed is not None else continuation.seed if continuation else None
    if seed is not None:
        decoding["seed"] = seed
    body: dict[str, Any] = {}
    if continuation is None:
        if request.messages is not None:
            body["messages"] = [m.wire() for m in request.messages]
        else:
            body["prompt"] = request.prompt
            body["chat"] = request.chat
    else:  # the prompt as the first replica tokenized it (template applied): same for messages
        body["input_ids"] = list(continuation.prompt_token_ids)
        body["resume"] = {"token_ids": list(continuation.token_ids), "text": continuation.text}
    tools = native_tools(request)
    if tools is not None:  # a resume too: the engine parses the resumed tokens' calls again
        body["tools"] = tools
    body["max_new_tokens"] = p.max_new_tokens
    body["min_new_tokens"] = p.min_new_tokens
    body["decoding"] = decoding
    body["stop_sequences"] = list(p.stop_sequences)
    if max_time > 0:
        body["max_time"] = max_time
    return body


def native_tools(request: GenerationRequest) -> list[Any] | None:
    """The tools the engine renders and parses calls for: the request's, unless `tool_choice`
    is `none` (the model is then told of no tool and its text is never parsed for calls)."""
    tools = request.extra.get("tools")
    if not tools or request.extra.get("tool_choice") == "none":
        return None
    return list(tools)


def parse_tool_calls(name: str, raw: Any) -> tuple[ToolCallDelta, ...]:
    """`data.tool_calls`: whole calls (`index`, `id`, `name`, `arguments`); a malformed one
    fails the replica, as any malformed item does."""
    if not isinstance(raw, list):
        raise unavailable(f"replica {name} sent a malformed tool_calls")
    calls = []
    for call in raw:
        if not isinstance(call, dict):
            raise unavailable(f"replica {name} sent a malformed tool_calls")
        index, cid, fname, args = (call.get(k) for k in ("index", "id", "name", "arguments"))
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or index < 0
            or not all(isinstance(v, str) for v in (cid, fname, args))
        ):
            raise unavailable(f"replica {name} sent a malformed tool_calls")
        calls.append(ToolCallDelta(index, cid, fname, args))
    return tuple(calls)


def _loads(raw: bytes) -> Any:
    """orjson (this runs once per streamed token), else json for what only json accepts (NaN,
    integers beyond 64 bits, lone surrogates): the same result and the same errors as json."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except RecursionError:  # nested past the interpreter's limit: undecodable, not a crash
        raise ValueError("nested too deeply") from None


def parse_data(name: str, data: Any) -> EngineDelta:
    """A `data` object of the native protocol; anything malformed fails the replica."""
    if not isinstance(data, dict):
        raise unavailable(f"replica {name} sent a malformed item: data is not an object")
    token_ids = int_list(data.get("token_ids", []))
    text = data.get("text", "")
    finish = data.get("finish_reason")
    prompt_ids = data.get("prompt_token_ids")
    input_count = data.get("input_token_count")
    if token_ids is None or not isinstance(text, str):
        raise unavailable(f"replica {name} sent a malformed item (token_ids/text)")
    if finish is not None and finish not in FINISH_REASONS:
        # its value is the replica's words: the log's, not the client's (DESIGN 6)
        log_inband_error(f"replica {name}", {"finish_reason": finish})
        raise unavailable(f"replica {name} sent an unknown finish_reason")
    parsed_prompt = None
    if prompt_ids is not None:
        parsed_prompt = int_list(prompt_ids)
        if parsed_prompt is None:
            raise unavailable(f"replica {name} sent malformed prompt_token_ids")
    if input_count is not None and (not isinstance(input_count, int) or input_count < 0):
        input_count = None
    seed = data.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = None
    raw_calls = data.get("tool_calls")
    return EngineDelta(
        tool_calls=() if raw_calls is None else parse_tool_calls(name, raw_calls),
        token_ids=token_ids,
        text=text,
        finish_reason=finish,
        prompt_token_ids=parsed_prompt,
        input_token_count=input_count,
        seed=seed,
    )


def inband_error(name: str, err: Any) -> GenerationError:
    """`{"error": {...}}`: `generation_unavailable` is the replica's trouble (migrate), `timeout`
    a 504, any other type a 502 about this request. What the engine said goes to the log: a
    client is told that the replica reported an error (DESIGN 6: a peer we do not trust)."""
    if not isinstance(err, dict):
        return unavailable(f"replica {name} sent a malformed error item")
    log_inband_error(f"replica {name}", err)
    etype = err.get("type")
    if etype == "generation_unavailable":
        return unavailable(f"replica {name} reported an error")
    if etype == "timeout":
        return GenerationError(f"replica {name} timed out", error_type="timeout", code=504)
    return GenerationError(
        f"replica {name} reported an error", error_type="generation_error", code=502
    )


class NativeStream(HttpLineStream):
    def __init__(self, client: NativeClient, body: dict[str, Any], stall_timeout_s: float) -> None:
        super().__init__(client, stall_timeout_s)
        self._body = body

    async def _request(self) -> tuple[str, dict[str, Any]]:
        return "/v1/generate", self._body

    async def _next_item(self) -> EngineDelta:
        assert self._reader is not None
        name = self._client.name
        grace = min(self._stall, FINAL_GRACE_S) if self._finished else self._stall
        line = await self._reader.readline(self._stall_wait(grace))
        if line is None:
            raise unavailable(f"replica {name}: stream ended without complete_final")
        item = self._parse(line)
        if item is None:  # complete_final: only the end of the body may follow
            await self._end_of_body()
        if self._finished:
            raise unavailable(f"replica {name}: data after the final item")
        if item.finish_reason is not None:
            self._finished = True
        return item

    def _parse(self, line: bytes) -> EngineDelta | None:
        """An item, or None for the end marker."""
        name = self._client.name
        if not line.strip():
            raise unavailable(f"replica {name} sent a blank line")
        try:
            obj = _loads(line)
        except ValueError:
            raise unavailable(f"replica {name} sent an undecodable line") from None
        if not isinstance(obj, dict):
            raise unavailable(f"replica {name} sent an item that is not an object")
        if "error" in obj:
            raise inband_error(name, obj["error"])
        if obj.get("complete_final") is True and "data" not in obj:
            return None
        if "data" not in obj:
            raise unavailable(f"replica {name} sent an item with neither data nor error")
        if obj.get("complete_final") is True:
            raise unavailable(f"replica {name} sent data in its complete_final item")
        return parse_data(name, obj["data"])


def tokenize_count(raw: bytes) -> int | None:
    """The count of a `/v1/tokenize` reply (`count`, else the length of `token_ids`); None for
    a malformed one."""
    try:
        data = json.loads(raw)
        count = data.get("count")
        if count is None:
            count = len(data["token_ids"])
        return int(count)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class NativeClient(HttpReplicaClient):
    """One engine replica speaking the native protocol; `api_key` (the engine's
    `--api-keys-env` key) goes along as a Bearer token on every call."""

    type = "native"

    def __init__(
        self,
        name: str,
        url: str,
        session: aiohttp.ClientSession,
        *,
        ssl_context: ssl.SSLContext | bool | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(name, url, session, ssl_context=ssl_context, api_key=api_key)

    def generate(
        self,
        request: GenerationRequest,
        continuation: Continuation | None,
        *,
        stall_timeout_s: float,
        max_time: float,
    ) -> NativeStream:
        return NativeStream(self, native_body(request, continuation, max_time), stall_timeout_s)

    async def tokenize(
        self,
        prompt: str,
        chat: bool,
        messages: tuple[ChatMessage, ...] | None = None,
        tools: list[Any] | None = None,
    ) -> int:
        body: dict[str, Any] = (
            {"messages": [m.wire() for m in messages]}
            if messages is not None
            else {"prompt": prompt, "chat": chat}
        )
        if tools is not None:
            body["tools"] = tools
        raw = await self.post_json("/v1/tokenize", body)
        count = await parse_reply(raw, tokenize_count)
        if count is None:
            raise unavailable(f"replica {self.name}: malformed tokenize reply")
        return count

    async def advertised(self, timeout_s: float) -> EngineLimits | None:
        """`GET /v1/models` parsed; None when the engine advertises no context. A transport
        failure or a non-200 reply is a GenerationError (as for any other call)."""
        raw = await self.call("GET", "/v1/models", None, timeout_s, MODELS_REPLY_BYTES)
        try:
            return EngineLimits.parse(json.loads(raw))
        except ValueError:
            raise unavailable(f"replica {self.name}: malformed /v1/models reply") from None
