"""The HTTP line transport both engine protocols stream over (native NDJSON, OpenAI SSE).

What they share: reading a streamed body line by line (or SSE event by event) under the stall
timeout, the request and its non-200 answers, transport failures as migratable errors, and the
rule that nothing but the end of the body may follow a stream's end marker. A protocol module
(`native.py`, `openai.py`) parses its own items on top of `HttpLineStream`.

An engine's 400/413/422 is about the request (another replica would say the same): it reaches
the client as `invalid_request` (422), is never migrated and never becomes a 502.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import aiohttp

from . import stall_timeout
from .backend import EngineDelta, EngineStream, GenerationError, ReplicaClient, unavailable
from .peers import BodyTooLarge, log_error_body, read_bounded, read_error_body
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
# the most a short call's reply (tokenize, models) may take: a tokenized prompt of the largest
# context any model has, with room to spare
CALL_REPLY_BYTES = 64 << 20
# a short call's reply up to this size is parsed on the event loop (a prompt of some thousand
# tokens); a larger one in a thread (a 1 MB prompt's tokenize reply, about 1.5 MB of token ids,
# is tens of milliseconds of json.loads)
LARGE_REPLY_BYTES = 64 << 10
# the longest line (an NDJSON item, an SSE line, an SSE event's data) a stream may send: a
# native stream's first item carries the prompt's token ids, as large as a short call's reply.
# Past it the replica failed (a line that never ends held the whole body in memory until the
# stall timeout: gigabytes from a fast peer)
MAX_LINE_BYTES = CALL_REPLY_BYTES


class LineTooLong(Exception):
    """A streamed line or SSE event passed `max_line_bytes` without ending."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{what} longer than {limit} bytes")


class WouldBlock(Exception):
    """A LineReader in no-wait mode had to wait for more bytes: what was buffered is used up."""


class LineReader:
    """Lines of a streamed HTTP body, with a deadline per line (the stall timeout).

    aiohttp's own readline() caps the line length at its read buffer's size; an engine's first
    item carries the prompt's token ids and may be far longer, so lines are assembled here, up
    to `max_line_bytes` (LineTooLong past it).

    The deadline is enforced by one lazily re-armed timer per stream rather than an
    `asyncio.timeout` per line: with hundreds of streams at tens of tokens per second, creating
    and cancelling a timer for every token was a sizeable share of the event loop's time. The
    timer fires at most once per stall period; when the reader made progress meanwhile it is
    simply re-armed at the new deadline.

    With `nowait` set, a read that would have to wait raises WouldBlock instead (nothing is
    consumed): a stream parses every item already buffered in one go (`next_batch`)."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self._clock = stall_timeout.stall_clock
        self._buf = bytearray()
        self._scanned = 0
        self._eof = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task[Any] | None = None
        self._expired = False
        self.nowait = False
        self.max_line_bytes = MAX_LINE_BYTES

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
            if self._scanned > self.max_line_bytes:
                raise LineTooLong("a line", self.max_line_bytes)
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
            # (called only while the buffer holds one unfinished event: see awaits_sse_data)
            if len(self._buf) > self.max_line_bytes:
                raise LineTooLong("a line", self.max_line_bytes)
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
    def clock(self) -> stall_timeout.StallClock:
        """The stall clock this reader times its reads on."""
        return self._clock

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


T = TypeVar("T")


async def parse_reply(raw: bytes, parse: Callable[[bytes], T]) -> T:
    """`parse(raw)`, in a thread past LARGE_REPLY_BYTES: nothing CPU-heavy on the event loop."""
    if len(raw) > LARGE_REPLY_BYTES:
        return await asyncio.to_thread(parse, raw)
    return parse(raw)


def transport_error(name: str, exc: BaseException) -> GenerationError:
    """A connection-level failure: refused, reset, truncated body."""
    # the address stays in the log: a client is told the kind of failure only
    log.warning("replica %s: connection failed: %r", name, exc)
    return unavailable(f"replica {name}: connection failed: {connection_failure(exc)}")


def http_error(name: str, status: int, raw: bytes) -> GenerationError:
    """A non-200 reply. A 4xx is about the request (another replica would say the same), so it
    is not migrated: 400/413/422 reach the client as its own mistake (invalid_request, 422);
    other 4xx and every 3xx (redirects are never followed) are the deployment's (a wrong key or
    URL: generation_error, 502). 408/425/429 and 5xx are the replica's problem (migratable); a
    plain 500 (the replica alive, its handler failing on this request) is tried elsewhere without
    quarantining the replica (`replica_fault`: one crafted request once quarantined every
    replica of a model in turn); a 429 (an engine at its bound on waiting work) is a busy
    replica (`busy`): tried elsewhere, never quarantined. The body goes to the log; a client is
    told the status only (DESIGN 6)."""
    log_error_body(f"replica {name}", status, raw)
    if status in INVALID_REQUEST_STATUSES:
        return GenerationError(
            f"replica {name} rejected the request (HTTP {status})",
            error_type="invalid_request",
            code=422,
        )
    if 300 <= status < 500 and status not in RETRYABLE_STATUSES:
        hint = " (check the backend's api_key_env)" if status in (401, 403) else ""
        return GenerationError(
            f"replica {name} rejected the request (HTTP {status}){hint}",
            error_type="generation_error",
            code=502,
        )
    return unavailable(
        f"replica {name} answered HTTP {status}", replica_fault=status != 500, busy=status == 429
    )


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


INTS_ONLY = frozenset({int})


def int_list(value: Any) -> tuple[int, ...] | None:
    """A JSON list of integers (not booleans) as a tuple, else None. The type check runs in C
    (`map(type, ...)` into a set): a first item carries the whole prompt's ids, and a generator
    over them was a visible share of the orchestrator's time at 256 streams."""
    if type(value) is not list or not INTS_ONLY.issuperset(map(type, value)):
        return None
    return tuple(value)


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
        # (stall clock) when the stall timeout runs out: re-armed by every item that says
        # something, not by every line (see `_stall_wait`)
        self._stall_at: float | None = None
        # (stall clock) when an item that said nothing was handed out: the time until the next
        # read is the consumer's, not the replica's, and moves `_stall_at` on
        self._handed_at: float | None = None

    async def _request(self) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of the request."""
        raise NotImplementedError

    async def _next_item(self) -> EngineDelta:
        """The next item; raises StopAsyncIteration after the end marker."""
        raise NotImplementedError

    def _stall_wait(self, wait: float) -> float:
        """How long the next read may wait: `wait`, and never past the stall timeout counted
        from the last item that said something (a token, text, a tool call, a finish). Lines
        and events that say nothing (an empty item, `choices: []`, a keep-alive) do not keep a
        replica alive: one sending only those held a request until request_timeout_s. Raises
        TimeoutError once that time is up, even with such lines still buffered."""
        assert self._reader is not None
        now = self._reader.clock.time()
        if self._stall_at is None:
            self._stall_at = now + self._stall
        elif self._handed_at is not None:  # the consumer's time since, not the replica's
            self._stall_at += now - self._handed_at
        self._handed_at = None
        left = self._stall_at - now
        if left <= 0:
            raise TimeoutError
        return min(wait, left)

    def _progressed(self, item: EngineDelta) -> EngineDelta:
        """`item`, after re-arming the stall timeout if it says something."""
        if item.text or item.token_ids or item.tool_calls or item.finish_reason or item.token_count:
            self._stall_at = None
        elif self._reader is not None:
            self._handed_at = self._reader.clock.time()
        return item

    async def __anext__(self) -> EngineDelta:
        if self._pending_error is not None:
            exc, self._pending_error = self._pending_error, None
            raise exc
        if self._done:
            raise StopAsyncIteration
        name = self._client.name
        try:
            if self._reader is None:
                await self._connect()
            return self._progressed(await self._next_item())
        except (StopAsyncIteration, WouldBlock):
            raise
        except GenerationError:
            self.close()
            raise
        except LineTooLong as exc:
            self.close()
            raise unavailable(f"replica {name} sent {exc}") from None
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

    async def next_batch(self, limit: int) -> list[EngineDelta]:
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
                    self._stall_at = None  # (it takes only items with text or a call)
                    continue
                items.append(await self.__anext__())
        except (WouldBlock, StopAsyncIteration):
            pass
        except Exception as exc:  # the items before it still count (migration resumes after
            self._pending_error = exc  # them): it is raised by the next call
        finally:
            reader.nowait = False
        return items

    def _take_buffered(self, items: list[EngineDelta], limit: int) -> int:
        """A protocol's fast path for `next_batch`: appends the items of buffered events of its
        most common shape, parsed in one loop; how many. The general path reads the rest."""
        return 0

    # sends of one dispatch at most: the first, and again without what the server refused
    MAX_SENDS = 4

    async def _connect(self) -> None:
        """The one connect path of every protocol: the request, and a non-200 answer as the
        replica's error (http_error), unless the protocol can send it again without what the
        server refused by name (`_resend_without`)."""
        c = self._client
        for _ in range(self.MAX_SENDS):
            path, body = await self._request()
            self._check_body(body)
            async with asyncio.timeout(self._stall):
                resp = await c.session.post(
                    c.url + path, json=body, ssl=c.ssl, headers=c.headers, allow_redirects=False
                )
            self._resp = resp
            if resp.status == 200:
                self._reader = LineReader(resp.content)
                return
            async with asyncio.timeout(FINAL_GRACE_S):
                raw = await read_error_body(resp)
            if not self._resend_without(resp.status, body, raw):
                break
            resp.release()
        raise http_error(c.name, resp.status, raw)

    def _check_body(self, body: dict[str, Any]) -> None:
        """A protocol's last look at a request before it is sent (raise to refuse it)."""

    def _resend_without(self, status: int, body: dict[str, Any], raw: bytes) -> bool:
        """A non-200 answer to `body`: True when the protocol learnt what the server refused and
        `_request()` now builds a request without it. The native protocol never resends."""
        return False

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


class HttpReplicaClient(ReplicaClient):
    """What a replica reached over HTTP needs whatever its protocol: the pooled session, TLS,
    its API key (a Bearer token on every call), short JSON calls and `GET /health`."""

    def __init__(
        self,
        name: str,
        url: str,
        session: aiohttp.ClientSession,
        *,
        ssl_context: ssl.SSLContext | bool | None = None,
        api_key: str | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.session = session
        self.ssl = ssl_context
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def post_json(self, path: str, body: dict[str, Any], timeout_s: float = 10) -> bytes:
        """The raw reply of a short JSON call; an HTTP or transport failure is a
        GenerationError like any other failure of the replica."""
        return await self.call("POST", path, body, timeout_s)

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout_s: float,
        limit: int = CALL_REPLY_BYTES,
    ) -> bytes:
        """The raw 200 reply of a short call (`body` as JSON, if any), up to `limit` bytes; a
        non-200 reply, a longer one or a transport failure is a GenerationError like any other
        failure of the replica."""
        try:
            async with self.session.request(
                method,
                self.url + path,
                json=body,
                ssl=self.ssl,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,  # a peer we do not trust (DESIGN 6)
            ) as resp:
                if resp.status != 200:
                    raise http_error(self.name, resp.status, await read_error_body(resp))
                return await read_bounded(resp, limit)
        except BodyTooLarge as exc:
            raise unavailable(f"replica {self.name}: reply {exc}") from None
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
                allow_redirects=False,
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
