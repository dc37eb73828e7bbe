"""Client of the native engine protocol (DESIGN section 7): `POST /v1/generate`, NDJSON back.

The end-of-stream contract is enforced here: only `{"complete_final": true}` followed by the end
of the response is a normal end. A missing marker, anything after it, a blank or undecodable
line, an item with neither `data` nor `error`, a reset or a stall is a migratable failure, so a
broken replica can never pass off a truncated stream as a finished one.

An engine's 400/413/422 is about the request (another replica would say the same): it reaches
the client as `invalid_request` (422), is never migrated and never becomes a 502. An engine
started with `--api-keys-env` gets the key as a Bearer token; `advertised()` reads what the
engine accepts (`GET /v1/models`) so the orchestrator can reject a request before dispatching it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import aiohttp
import orjson

from .backend import (
    FINISH_REASONS,
    ChatMessage,
    Continuation,
    EngineItem,
    EngineStream,
    GenerationError,
    GenerationParams,
    GenerationRequest,
    ReplicaClient,
    unavailable,
)
from .reasons import connection_failure

log = logging.getLogger("guardstream.native")

# Once the model finished (or the end marker came) only the end of the response may follow;
# a replica that dawdles longer than this is treated as failed, so the client is not held up.
FINAL_GRACE_S = 2.0
# Statuses that say "this replica, now", not "this request": another replica may serve it.
RETRYABLE_STATUSES = frozenset({408, 425, 429})
# Statuses that say "this request is wrong": the client's mistake, reported as invalid_request.
# Other 4xx (401/403: our key; 404/405/415: our URL or our client) are a deployment problem.
INVALID_REQUEST_STATUSES = frozenset({400, 413, 422})


class StallClock:
    """The time and the timers of the stall timeout: the event loop's. A module attribute, so a
    test can put a manual clock in `stall_clock` and declare a silent replica stalled when it
    chooses instead of waiting for it (tests/fakes/clock.py); a reader keeps the one it started
    with."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


stall_clock = StallClock()


class WouldBlock(Exception):
    """A LineReader in no-wait mode had to wait for more bytes: what was buffered is used up."""


class LineReader:
    """Lines of a streamed HTTP body, with a deadline per line (the stall timeout).

    aiohttp's own readline() caps the line length; an engine's first item carries the prompt's
    token ids and may be long, so lines are assembled here without a cap.

    The deadline is enforced by one lazily re-armed timer per stream rather than an
    `asyncio.timeout` per line: with hundreds of streams at tens of tokens per second, creating
    and cancelling a timer for every token was a sizeable share of the event loop's time. The
    timer fires at most once per stall period; when the reader made progress meanwhile it is
    simply re-armed at the new deadline.

    With `nowait` set, a read that would have to wait raises WouldBlock instead (nothing is
    consumed): a stream parses every item already buffered in one go (`next_batch`)."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self._clock = stall_clock
        self._buf = bytearray()
        self._scanned = 0
        self._eof = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task[Any] | None = None
        self._expired = False
        self.nowait = False

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
                deadline = self._clock.time() + timeout_s
            chunk = await self._read_chunk(deadline)
            if chunk:
                self._buf += chunk
            else:
                self._eof = True

    async def fill(self, timeout_s: float) -> bool:
        """Waits for more bytes and buffers them; False at the end of the body. Raises
        TimeoutError when none come within `timeout_s`."""
        if self._eof:
            return False
        chunk = await self._read_chunk(self._clock.time() + timeout_s)
        if chunk:
            self._buf += chunk
            return True
        self._eof = True
        return False

    def awaits_sse_data(self) -> bool:
        """The buffer is empty or holds only the start of a `data: <payload>\n\n` event: more
        bytes may complete the common shape, so the reader waits for them (`fill`) instead of
        splitting the event into lines."""
        if self._eof:
            return False
        buf = self._buf
        head = min(len(buf), 6)
        return buf[:head] == b"data: "[:head] and buf.find(b"\n") in (-1, len(buf) - 1)

    def take_sse_data(self) -> bytes | None:
        """The payload of a `data: <payload>\n\n` event at the head of the buffer, consumed: the
        shape nearly every event of an OpenAI stream has, taken without splitting it into lines.
        None (nothing consumed) for any other head, or one not complete yet."""
        peeked = self.peek_sse_data()
        if peeked is None:
            return None
        self.consume(peeked[1])
        return peeked[0]

    @property
    def buffered(self) -> bool:
        """Bytes are waiting here (what the body delivered is moved here whole by each read)."""
        return bool(self._buf) or self._eof

    def peek_sse_data(self) -> tuple[bytes, int] | None:
        """`take_sse_data` without consuming: the payload and the bytes its event takes."""
        buf = self._buf
        if not buf.startswith(b"data: "):
            return None
        i = buf.find(b"\n", 6)
        if i < 0 or buf[i + 1 : i + 2] != b"\n" or buf[i - 1] == 13:  # 13: a CRLF line
            return None
        return bytes(buf[6:i]), i + 2

    def consume(self, n: int) -> None:
        """Drops the first `n` buffered bytes (an event `peek_sse_data` returned)."""
        del self._buf[:n]
        self._scanned = 0

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _read_chunk(self, deadline: float) -> bytes:
        if self.nowait:
            raise WouldBlock
        self._deadline = deadline
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._clock.call_at(deadline, self._on_timer)
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
        if self._clock.time() >= self._deadline:
            self._expired = True
            self._waiting.cancel()
        else:
            self._timer = self._clock.call_at(self._deadline, self._on_timer)


def transport_error(name: str, exc: BaseException) -> GenerationError:
    """A connection-level failure: refused, reset, truncated body."""
    # the address stays in the log: a client is told the kind of failure only
    log.warning("replica %s: connection failed: %r", name, exc)
    return unavailable(f"replica {name}: connection failed: {connection_failure(exc)}")


def http_error(name: str, status: int, raw: bytes) -> GenerationError:
    """A non-200 reply. A 4xx is about the request (another replica would say the same), so it
    is not migrated: 400/413/422 reach the client as its own mistake (invalid_request, 422);
    other 4xx are the deployment's (a wrong key or URL: generation_error, 502). 408/425/429 and
    5xx are the replica's problem (migratable)."""
    message = error_message(raw)
    if status in INVALID_REQUEST_STATUSES:
        return GenerationError(
            f"replica {name} rejected the request (HTTP {status}): {message}",
            error_type="invalid_request",
            code=422,
        )
    if 400 <= status < 500 and status not in RETRYABLE_STATUSES:
        hint = " (check the backend's api_key_env)" if status in (401, 403) else ""
        return GenerationError(
            f"replica {name} rejected the request (HTTP {status}): {message}{hint}",
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
        if request.messages is not None:
            body["messages"] = [m.wire() for m in request.messages]
        else:
            body["prompt"] = request.prompt
            body["chat"] = request.chat
    else:  # the prompt as the first replica tokenized it (template applied): same for messages
        body["input_ids"] = list(continuation.prompt_token_ids)
        body["resume"] = {"token_ids": list(continuation.token_ids), "text": continuation.text}
    body["max_new_tokens"] = p.max_new_tokens
    body["min_new_tokens"] = p.min_new_tokens
    body["decoding"] = decoding
    body["stop_sequences"] = list(p.stop_sequences)
    if max_time > 0:
        body["max_time"] = max_time
    return body


def _loads(raw: bytes) -> Any:
    """orjson (this runs once per streamed token), else json for what only json accepts (NaN,
    integers beyond 64 bits, lone surrogates): the same result and the same errors as json."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


_INTS_ONLY = frozenset({int})


def _int_list(value: Any) -> tuple[int, ...] | None:
    """A JSON list of integers (not booleans) as a tuple, else None. The type check runs in C
    (`map(type, ...)` into a set): a first item carries the whole prompt's ids, and a generator
    over them was a visible share of the orchestrator's time at 256 streams."""
    if type(value) is not list or not _INTS_ONLY.issuperset(map(type, value)):
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
        self._pending_error: Exception | None = None  # met by next_batch after some items

    async def _request(self) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of the request."""
        raise NotImplementedError

    async def _next_item(self) -> EngineItem:
        """The next item; raises StopAsyncIteration after the end marker."""
        raise NotImplementedError

    async def __anext__(self) -> EngineItem:
        if self._pending_error is not None:
            exc, self._pending_error = self._pending_error, None
            raise exc
        if self._done:
            raise StopAsyncIteration
        name = self._client.name
        try:
            if self._reader is None:
                await self._connect()
            return await self._next_item()
        except (StopAsyncIteration, WouldBlock):
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

    async def next_batch(self, limit: int) -> list[EngineItem]:
        """The next item (waiting for it as `__anext__` does), then every further item whose
        bytes are already buffered, up to `limit`: one wake-up of the reader takes what a burst
        delivered. Stops after the item that finishes the model, so the wait for the end marker
        is never spent holding items back. StopAsyncIteration at the end."""
        items = [await self.__anext__()]
        reader = self._reader
        if reader is None:
            return items
        reader.nowait = True
        try:
            while len(items) < limit and not self._finished and not self._done:
                if not reader.buffered:
                    break  # the usual end of a batch, without raising WouldBlock through it
                if self._take_buffered(items, limit):
                    continue
                items.append(await self.__anext__())
        except (WouldBlock, StopAsyncIteration):
            pass
        except Exception as exc:  # the items before it still count (migration resumes after
            self._pending_error = exc  # them): it is raised by the next call
        finally:
            reader.nowait = False
        return items

    def _take_buffered(self, items: list[EngineItem], limit: int) -> int:
        """A protocol's fast path for `next_batch`: appends the items of buffered events of its
        most common shape, parsed in one loop; how many. The general path reads the rest."""
        return 0

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


Number = int | float


def _number(value: Any) -> Number | None:
    """A finite JSON number, kept as it came (an int bound like 2**63-1 stays exact)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _tighter(a: Number | None, b: Number | None, pick: Any) -> Number | None:
    return b if a is None else a if b is None else pick(a, b)


@dataclass(frozen=True)
class ParamRange:
    """One advertised numeric range (JSON-Schema keywords of `GET /v1/models`)."""

    minimum: Number | None = None
    exclusive_minimum: Number | None = None
    maximum: Number | None = None
    exclusive_maximum: Number | None = None

    @classmethod
    def parse(cls, raw: Any) -> ParamRange:
        raw = raw if isinstance(raw, dict) else {}
        return cls(
            minimum=_number(raw.get("minimum")),
            exclusive_minimum=_number(raw.get("exclusiveMinimum")),
            maximum=_number(raw.get("maximum")),
            exclusive_maximum=_number(raw.get("exclusiveMaximum")),
        )

    def contains(self, value: Number) -> bool:
        return not (
            (self.minimum is not None and value < self.minimum)
            or (self.exclusive_minimum is not None and value <= self.exclusive_minimum)
            or (self.maximum is not None and value > self.maximum)
            or (self.exclusive_maximum is not None and value >= self.exclusive_maximum)
        )

    def intersect(self, other: ParamRange) -> ParamRange:
        """What both accept (a request may migrate to any replica)."""
        return ParamRange(
            minimum=_tighter(self.minimum, other.minimum, max),
            exclusive_minimum=_tighter(self.exclusive_minimum, other.exclusive_minimum, max),
            maximum=_tighter(self.maximum, other.maximum, min),
            exclusive_maximum=_tighter(self.exclusive_maximum, other.exclusive_maximum, min),
        )

    def describe(self) -> str:
        """`between 0 and 100`, `greater than 0 and at most 1`, `at least 0`."""
        low = high = None
        if self.exclusive_minimum is not None:
            low = f"greater than {_fmt(self.exclusive_minimum)}"
        if self.minimum is not None and (
            self.exclusive_minimum is None or self.minimum > self.exclusive_minimum
        ):
            low = f"at least {_fmt(self.minimum)}"
        if self.exclusive_maximum is not None:
            high = f"less than {_fmt(self.exclusive_maximum)}"
        if self.maximum is not None and (
            self.exclusive_maximum is None or self.maximum < self.exclusive_maximum
        ):
            high = f"at most {_fmt(self.maximum)}"
        if low and high and low.startswith("at least") and high.startswith("at most"):
            return f"between {_fmt(self.minimum)} and {_fmt(self.maximum)}"
        return " and ".join(p for p in (low, high) if p) or "any value"


def _fmt(value: Number | None) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _count(raw: Any, key: str) -> int | None:
    value = raw.get(key) if isinstance(raw, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class EngineLimits:
    """What a native engine advertises in `GET /v1/models`: its context and the accepted range
    of each numeric parameter (by the engine's field name), stop sequences and messages."""

    model: str
    max_model_len: int
    ranges: dict[str, ParamRange] = field(default_factory=dict)
    max_stop_sequences: int | None = None
    min_stop_length: int | None = None
    max_stop_length: int | None = None
    max_messages: int | None = None
    roles: frozenset[str] | None = None
    decoding_methods: frozenset[str] | None = None
    chat_template: bool | None = None

    NUMERIC = (
        "max_new_tokens",
        "min_new_tokens",
        "max_time",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "repetition_penalty",
    )

    @classmethod
    def parse(cls, body: Any) -> EngineLimits | None:
        """The first model of a `/v1/models` reply; None when it advertises no context (an
        engine of an older protocol, a fake): then nothing is checked against it."""
        data = body.get("data") if isinstance(body, dict) else None
        entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        length = entry.get("max_model_len", entry.get("max_context"))
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            return None
        params = entry.get("parameters")
        params = params if isinstance(params, dict) else {}
        stops = params.get("stop_sequences")
        stop_items = stops.get("items") if isinstance(stops, dict) else None
        messages = params.get("messages")
        roles = messages.get("roles") if isinstance(messages, dict) else None
        methods = params.get("decoding_method")
        methods = methods.get("enum") if isinstance(methods, dict) else None
        template = entry.get("chat_template")
        return cls(
            model=str(entry.get("id", "")),
            max_model_len=length,
            ranges={k: ParamRange.parse(params[k]) for k in cls.NUMERIC if k in params},
            max_stop_sequences=_count(stops, "maxItems"),
            min_stop_length=_count(stop_items, "minLength"),
            max_stop_length=_count(stop_items, "maxLength"),
            max_messages=_count(messages, "maxItems"),
            roles=frozenset(r for r in roles if isinstance(r, str))
            if isinstance(roles, list)
            else None,
            decoding_methods=frozenset(m.lower() for m in methods if isinstance(m, str))
            if isinstance(methods, list)
            else None,
            chat_template=template if isinstance(template, bool) else None,
        )


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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(name, url, session, ssl_context=ssl_context, headers=headers)

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
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int:
        body: dict[str, Any] = (
            {"messages": [m.wire() for m in messages]}
            if messages is not None
            else {"prompt": prompt, "chat": chat}
        )
        raw = await self.post_json("/v1/tokenize", body)
        try:
            data = json.loads(raw)
            count = data.get("count")
            if count is None:
                count = len(data["token_ids"])
            return int(count)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise unavailable(f"replica {self.name}: malformed tokenize reply") from None

    async def advertised(self, timeout_s: float) -> EngineLimits | None:
        """`GET /v1/models` parsed; None when the engine advertises no context. A transport
        failure or a non-200 reply is a GenerationError (as for any other call)."""
        try:
            async with self.session.get(
                self.url + "/v1/models",
                ssl=self.ssl,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise http_error(self.name, resp.status, raw)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise transport_error(self.name, exc) from None
        try:
            return EngineLimits.parse(json.loads(raw))
        except ValueError:
            raise unavailable(f"replica {self.name}: malformed /v1/models reply") from None


# ----- checking a request against what the replicas advertise ------------------------------------

# Token count of a text, bounded from above without a tokenizer: byte-level BPE (GPT-2, Llama 3,
# Qwen, SmolLM) and SentencePiece with byte fallback (Llama 2, Mistral) never produce more tokens
# than the text has UTF-8 bytes (each token stands for at least one byte; an unknown character
# becomes at most its bytes), and a special token typed as text is one token for many bytes. What
# bytes do not bound is what the tokenizer and the chat template add: BOS/EOS, a dummy-prefix
# space, role headers, a default system prompt. These allowances cover the usual templates
# generously; a template that adds more only means the engine's own check rejects the request
# at dispatch (422 as well, never a 5xx: see http_error), a little later.
FIXED_SLACK_TOKENS = 256
MESSAGE_SLACK_TOKENS = 16


def token_upper_bound(request: GenerationRequest) -> int:
    """More tokens than the request's prompt can have (see FIXED_SLACK_TOKENS)."""
    if request.messages is not None:
        texts = [t for m in request.messages for t in (m.role, m.content)]
        slack = FIXED_SLACK_TOKENS + MESSAGE_SLACK_TOKENS * len(request.messages)
    else:
        texts = [request.prompt]
        slack = FIXED_SLACK_TOKENS + (MESSAGE_SLACK_TOKENS if request.chat else 0)
    return slack + sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _common(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return b if a is None else a if b is None else a & b


def merge_limits(limits: list[EngineLimits]) -> EngineLimits:
    """What every replica accepts: a request may migrate to any of them."""
    merged = limits[0]
    for other in limits[1:]:
        ranges = dict(merged.ranges)
        for name, r in other.ranges.items():
            ranges[name] = ranges[name].intersect(r) if name in ranges else r
        templates = (merged.chat_template, other.chat_template)
        merged = replace(
            merged,
            max_model_len=min(merged.max_model_len, other.max_model_len),
            ranges=ranges,
            max_stop_sequences=_least(merged.max_stop_sequences, other.max_stop_sequences),
            min_stop_length=_tighter(merged.min_stop_length, other.min_stop_length, max),
            max_stop_length=_least(merged.max_stop_length, other.max_stop_length),
            max_messages=_least(merged.max_messages, other.max_messages),
            roles=_common(merged.roles, other.roles),
            decoding_methods=_common(merged.decoding_methods, other.decoding_methods),
            chat_template=None if None in templates else all(templates),
        )
    return merged


def _param_values(params: GenerationParams) -> dict[str, Number]:
    """The request's numeric parameters by the engine's field names (as native_body sends them)."""
    values: dict[str, Number] = {
        "max_new_tokens": params.max_new_tokens,
        "min_new_tokens": params.min_new_tokens,
        "max_time": params.max_time,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.seed is not None:
        values["seed"] = params.seed
    return values


def request_problem(limits: EngineLimits, request: GenerationRequest) -> str | None:
    """Why the engines would reject this request's parameters, or None. Named by the engine's
    parameter names (`max_new_tokens`, `temperature`, `stop_sequences[1]`, ...)."""
    p = request.params
    for name, value in _param_values(p).items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} is {value}; it must be a finite number"
        allowed = limits.ranges.get(name)
        if allowed is not None and not allowed.contains(value):
            return f"{name} is {_fmt(value)}; it must be {allowed.describe()}"
    method = p.decoding_method.lower()
    if limits.decoding_methods is not None and method not in limits.decoding_methods:
        known = ", ".join(sorted(limits.decoding_methods))
        return f"decoding method {p.decoding_method} is not supported (supported: {known})"
    stops = p.stop_sequences
    if limits.max_stop_sequences is not None and len(stops) > limits.max_stop_sequences:
        return (
            f"stop_sequences has {len(stops)} entries; at most {limits.max_stop_sequences} "
            "are accepted"
        )
    for i, stop in enumerate(stops):
        if limits.max_stop_length is not None and len(stop) > limits.max_stop_length:
            return (
                f"stop_sequences[{i}] is {len(stop)} characters long; at most "
                f"{limits.max_stop_length} are accepted"
            )
        if limits.min_stop_length is not None and len(stop) < limits.min_stop_length:
            n = limits.min_stop_length
            return f"stop_sequences[{i}] must be at least {n} character{'s' * (n != 1)} long"
    if request.messages is not None:
        if limits.chat_template is False:
            return "messages: the model has no chat template"
        if limits.max_messages is not None and len(request.messages) > limits.max_messages:
            return (
                f"messages has {len(request.messages)} entries; at most {limits.max_messages} "
                "are accepted"
            )
        if limits.roles is not None:
            for i, message in enumerate(request.messages):
                if message.role not in limits.roles:
                    roles = ", ".join(sorted(limits.roles))
                    return f"messages[{i}].role `{message.role}` is not accepted (use {roles})"
    elif request.chat and limits.chat_template is False:
        return "chat: the model has no chat template"
    return None


def context_problem(limits: EngineLimits, prompt_tokens: int, max_new_tokens: int) -> str | None:
    """Why a prompt of `prompt_tokens` and this budget do not fit the context, or None."""
    context = limits.max_model_len
    if prompt_tokens >= context:
        return (
            f"the prompt has {prompt_tokens} tokens: it must be shorter than the model's "
            f"context of {context} tokens"
        )
    if prompt_tokens + max_new_tokens > context:
        return (
            f"the prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
            f"{prompt_tokens + max_new_tokens} tokens exceed the model's context of {context} "
            f"tokens (at most {context - prompt_tokens} new tokens fit)"
        )
    return None


class AdvertisedLimits:
    """Each native replica's `GET /v1/models`, fetched lazily the first time a request needs it
    and cached by URL (a restarted managed engine on a new port is asked again). Concurrent
    requests share one fetch; a request waits at most `timeout_s` for it (a dead replica costs
    one bounded wait, then is not asked again for `retry_s`)."""

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._known: dict[str, EngineLimits | None] = {}
        self._retry_at: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Task[EngineLimits | None]] = {}

    def cached(self, client: NativeClient) -> EngineLimits | None:
        return self._known.get(client.url)

    async def gather(self, clients: list[NativeClient]) -> list[tuple[NativeClient, EngineLimits]]:
        """The replicas that advertise limits, with them; fetches what is not known yet."""
        now = self._clock()
        waiting: list[asyncio.Task[EngineLimits | None]] = []
        for client in clients:
            url = client.url
            if url in self._known or now < self._retry_at.get(url, -math.inf):
                continue
            task = self._inflight.get(url)
            if task is None:
                task = asyncio.ensure_future(self._fetch(client))
                self._inflight[url] = task
            waiting.append(task)
        if waiting:
            await asyncio.wait(waiting, timeout=self.timeout_s)
        out = []
        for client in clients:
            limits = self._known.get(client.url)
            if limits is not None:
                out.append((client, limits))
        return out

    async def _fetch(self, client: NativeClient) -> EngineLimits | None:
        url = client.url
        try:
            limits = await client.advertised(self.timeout_s)
        except Exception as exc:  # any failure: not known yet, ask again after retry_s
            self._retry_at[url] = self._clock() + self.retry_s
            detail = exc.message if isinstance(exc, GenerationError) else repr(exc)
            log.info("replica %s: no /v1/models yet (%s)", client.name, detail)
            return None
        else:
            self._known[url] = limits
            self._retry_at.pop(url, None)
            return limits
        finally:
            self._inflight.pop(url, None)

    async def close(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
