"""Client of the native engine protocol (DESIGN section 7): `POST /v1/generate`, NDJSON back.

The end-of-stream contract is enforced here: only `{"complete_final": true}` followed by the end
of the response is a normal end. A missing marker, anything after it, a blank or undecodable
line, an item with neither `data` nor `error`, a reset or a stall is a migratable failure, so a
broken replica can never pass off a truncated stream as a finished one.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any, NoReturn

import aiohttp

from .generation import (
    FINISH_REASONS,
    Continuation,
    EngineItem,
    EngineStream,
    GenerationError,
    GenerationRequest,
    ReplicaClient,
    unavailable,
)

# Once the model finished (or the end marker came) only the end of the response may follow;
# a replica that dawdles longer than this is treated as failed, so the client is not held up.
FINAL_GRACE_S = 2.0
# Statuses that say "this replica, now", not "this request": another replica may serve it.
RETRYABLE_STATUSES = frozenset({408, 425, 429})


class LineReader:
    """Lines of a streamed HTTP body, with a deadline per line (the stall timeout).

    aiohttp's own readline() caps the line length; an engine's first item carries the prompt's
    token ids and may be long, so lines are assembled here without a cap.

    The deadline is enforced by one lazily re-armed timer per stream rather than an
    `asyncio.timeout` per line: with hundreds of streams at tens of tokens per second, creating
    and cancelling a timer for every token was a sizeable share of the event loop's time. The
    timer fires at most once per stall period; when the reader made progress meanwhile it is
    simply re-armed at the new deadline."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self._buf = bytearray()
        self._scanned = 0
        self._eof = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task[Any] | None = None
        self._expired = False

    async def readline(self, timeout_s: float) -> bytes | None:
        """The next line without its end of line; None at the end of the body. Raises
        TimeoutError when the line is not complete within `timeout_s`."""
        deadline: float | None = None
        while True:
            i = self._buf.find(b"\n", self._scanned)
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 1]
                self._scanned = 0
                return line[:-1] if line.endswith(b"\r") else line
            self._scanned = len(self._buf)
            if self._eof:
                if not self._buf:
                    return None
                line = bytes(self._buf)
                self._buf.clear()
                self._scanned = 0
                return line
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + timeout_s
            chunk = await self._read_chunk(deadline)
            if chunk:
                self._buf += chunk
            else:
                self._eof = True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _read_chunk(self, deadline: float) -> bytes:
        loop = asyncio.get_running_loop()
        self._deadline = deadline
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._on_timer)
        task = asyncio.current_task()
        self._waiting = task
        try:
            return await self._content.readany()
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                if task is not None and task.uncancel() == 0:
                    raise TimeoutError from None
            raise
        finally:
            self._waiting = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiting is None:
            return  # not waiting now: the next wait arms a new timer
        loop = asyncio.get_running_loop()
        if loop.time() >= self._deadline:
            self._expired = True
            self._waiting.cancel()
        else:
            self._timer = loop.call_at(self._deadline, self._on_timer)


def transport_error(name: str, exc: BaseException) -> GenerationError:
    """A connection-level failure: refused, reset, truncated body."""
    if isinstance(exc, aiohttp.ClientPayloadError):
        detail = "connection lost mid-stream"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        detail = f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    elif isinstance(exc, aiohttp.ServerDisconnectedError):
        detail = "server disconnected"
    else:
        detail = str(exc) or type(exc).__name__
    return unavailable(f"replica {name}: connection failed: {detail}")


def http_error(name: str, status: int, raw: bytes) -> GenerationError:
    """A non-200 reply. A 4xx is about the request (another replica would say the same), so it
    is not migrated; everything else is the replica's problem."""
    message = error_message(raw)
    if 400 <= status < 500 and status not in RETRYABLE_STATUSES:
        return GenerationError(
            f"replica {name} rejected the request (HTTP {status}): {message}",
            error_type="generation_error",
            code=502,
        )
    return unavailable(f"replica {name} answered HTTP {status}: {message}")


def error_message(raw: bytes) -> str:
    """The message of an error body in any of the usual shapes, else a short raw excerpt."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "details", "detail"):
                if isinstance(err.get(key), str):
                    return err[key][:500]
        if isinstance(err, str):
            return err[:500]
    return json.dumps(data)[:200]


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
        body["prompt"] = request.prompt
        body["chat"] = request.chat
    else:
        body["input_ids"] = list(continuation.prompt_token_ids)
        body["resume"] = {"token_ids": list(continuation.token_ids), "text": continuation.text}
    body["max_new_tokens"] = p.max_new_tokens
    body["min_new_tokens"] = p.min_new_tokens
    body["decoding"] = decoding
    body["stop_sequences"] = list(p.stop_sequences)
    if max_time > 0:
        body["max_time"] = max_time
    return body


def _int_list(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return None
    return tuple(value)


def parse_data(name: str, data: Any) -> EngineItem:
    """A `data` object of the native protocol; anything malformed fails the replica."""
    if not isinstance(data, dict):
        raise unavailable(f"replica {name} sent a malformed item: data is not an object")
    token_ids = _int_list(data.get("token_ids", []))
    text = data.get("text", "")
    finish = data.get("finish_reason")
    prompt_ids = data.get("prompt_token_ids")
    input_count = data.get("input_token_count")
    if token_ids is None or not isinstance(text, str):
        raise unavailable(f"replica {name} sent a malformed item (token_ids/text)")
    if finish is not None and finish not in FINISH_REASONS:
        raise unavailable(f"replica {name} sent an unknown finish_reason {finish!r}")
    parsed_prompt = None
    if prompt_ids is not None:
        parsed_prompt = _int_list(prompt_ids)
        if parsed_prompt is None:
            raise unavailable(f"replica {name} sent malformed prompt_token_ids")
    if input_count is not None and (not isinstance(input_count, int) or input_count < 0):
        input_count = None
    seed = data.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = None
    return EngineItem(
        token_ids=token_ids,
        text=text,
        finish_reason=finish,
        prompt_token_ids=parsed_prompt,
        input_token_count=input_count,
        seed=seed,
    )


def inband_error(name: str, err: Any) -> GenerationError:
    """`{"error": {...}}`: `generation_unavailable` is the replica's trouble (migrate); any other
    type is about this request and reaches the client as the engine stated it."""
    if not isinstance(err, dict):
        return unavailable(f"replica {name} sent a malformed error item")
    etype = err.get("type")
    message = err.get("message")
    message = message if isinstance(message, str) and message else "engine error"
    if etype == "generation_unavailable":
        return unavailable(f"replica {name}: {message}")
    if etype == "timeout":
        return GenerationError(f"replica {name}: {message}", error_type="timeout", code=504)
    return GenerationError(f"replica {name}: {message}", error_type="generation_error", code=502)


class HttpLineStream(EngineStream):
    """What both streaming HTTP protocols (native NDJSON, OpenAI SSE) share: the request, the
    stall timeout, transport failures as migratable errors, and the rule that nothing but the
    end of the body may follow the end marker. Subclasses parse their own items."""

    unit = "item"  # what the protocol calls one streamed message, for error messages
    end_marker = "complete_final"

    def __init__(self, client: ReplicaClient, stall_timeout_s: float) -> None:
        self._client: Any = client
        self._stall = stall_timeout_s
        self._resp: aiohttp.ClientResponse | None = None
        self._reader: LineReader | None = None
        self._finished = False  # a finish_reason was seen
        self._done = False

    async def _request(self) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of the request."""
        raise NotImplementedError

    async def _next_item(self) -> EngineItem:
        """The next item; raises StopAsyncIteration after the end marker."""
        raise NotImplementedError

    async def __anext__(self) -> EngineItem:
        if self._done:
            raise StopAsyncIteration
        name = self._client.name
        try:
            if self._reader is None:
                await self._connect()
            return await self._next_item()
        except StopAsyncIteration:
            raise
        except GenerationError:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise unavailable(
                f"replica {name}: no {self.unit} for {self._stall:g} s (stalled)"
                if not self._finished
                else f"replica {name}: no {self.end_marker} after the final {self.unit}"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            self.close()
            raise transport_error(name, exc) from None
        except BaseException:
            self.close()
            raise

    async def _connect(self) -> None:
        c = self._client
        path, body = await self._request()
        async with asyncio.timeout(self._stall):
            resp = await c.session.post(c.url + path, json=body, ssl=c.ssl, headers=c.headers)
        self._resp = resp
        if resp.status != 200:
            async with asyncio.timeout(FINAL_GRACE_S):
                raw = await resp.content.read(4096)
            raise http_error(c.name, resp.status, raw)
        self._reader = LineReader(resp.content)

    async def _end_of_body(self, *, blank_ok: bool = False) -> NoReturn:
        """After the end marker: the body must end (a blank line allowed where the framing
        uses them); then the stream is done."""
        assert self._reader is not None and self._resp is not None
        rest = await self._reader.readline(min(self._stall, FINAL_GRACE_S))
        if rest is not None and not (blank_ok and rest == b""):
            raise unavailable(f"replica {self._client.name}: data after {self.end_marker}")
        self._done = True
        self._resp.release()
        self._reader.close()
        raise StopAsyncIteration

    def close(self) -> None:
        self._done = True
        if self._reader is not None:
            self._reader.close()
        if self._resp is not None and not self._resp.closed:
            self._resp.close()


class NativeStream(HttpLineStream):
    def __init__(self, client: NativeClient, body: dict[str, Any], stall_timeout_s: float) -> None:
        super().__init__(client, stall_timeout_s)
        self._body = body

    async def _request(self) -> tuple[str, dict[str, Any]]:
        return "/v1/generate", self._body

    async def _next_item(self) -> EngineItem:
        assert self._reader is not None
        name = self._client.name
        grace = min(self._stall, FINAL_GRACE_S) if self._finished else self._stall
        line = await self._reader.readline(grace)
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

    def _parse(self, line: bytes) -> EngineItem | None:
        """An item, or None for the end marker."""
        name = self._client.name
        if not line.strip():
            raise unavailable(f"replica {name} sent a blank line")
        try:
            obj = json.loads(line)
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


class HttpReplicaClient(ReplicaClient):
    """What a replica reached over HTTP needs whatever its protocol: the pooled session, TLS,
    headers, short JSON calls and `GET /health`."""

    def __init__(
        self,
        name: str,
        url: str,
        session: aiohttp.ClientSession,
        *,
        ssl_context: ssl.SSLContext | bool | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.session = session
        self.ssl = ssl_context
        self.headers = headers or {}

    async def post_json(self, path: str, body: dict[str, Any], timeout_s: float = 10) -> bytes:
        """The raw reply of a short JSON call; an HTTP or transport failure is a
        GenerationError like any other failure of the replica."""
        try:
            async with self.session.post(
                self.url + path,
                json=body,
                ssl=self.ssl,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise http_error(self.name, resp.status, raw)
                return raw
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise transport_error(self.name, exc) from None

    async def health(self, timeout_s: float) -> bool:
        """`GET /health` answers 200: what both the native engine and vLLM serve."""
        try:
            async with self.session.get(
                self.url + "/health",
                ssl=self.ssl,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False


class NativeClient(HttpReplicaClient):
    """One engine replica speaking the native protocol."""

    type = "native"

    def generate(
        self,
        request: GenerationRequest,
        continuation: Continuation | None,
        *,
        stall_timeout_s: float,
        max_time: float,
    ) -> NativeStream:
        return NativeStream(self, native_body(request, continuation, max_time), stall_timeout_s)

    async def tokenize(self, prompt: str, chat: bool) -> int:
        raw = await self.post_json("/v1/tokenize", {"prompt": prompt, "chat": chat})
        try:
            data = json.loads(raw)
            count = data.get("count")
            if count is None:
                count = len(data["token_ids"])
            return int(count)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise unavailable(f"replica {self.name}: malformed tokenize reply") from None
