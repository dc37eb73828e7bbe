"""Reading a JSON body into a pydantic model, with the API's 4xx errors for every way it can be
wrong (DESIGN section 4: a client mistake is never a 5xx)."""

from __future__ import annotations

import asyncio
import difflib
import json
import math
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from ..api.errors import ApiError, ErrorType, invalid
from ..errors import BODY_TIMED_OUT
from ..state import STATE
from ..streaming.text_judgement import BULK_CHARS, off_loop
from ..tenants import confirm_caller

M = TypeVar("M", bound=BaseModel)

# How deep a request's JSON may nest. No request shape needs more than ~6 levels; detector
# params are free-form, so some room is left. Deeper bodies are refused before validation: a
# 1000-deep `[[[...]]]` (2 KB) made Python's parser raise RecursionError (a 500 with a
# traceback), and depth under that limit still reaches pydantic and the detectors' encoders.
MAX_JSON_DEPTH = 64
# What may stand for a surrogate in a UTF-8 body: a `\uD800`-`\uDFFF` escape, or the UTF-8 form
# of a surrogate, which Python's JSON decoder lets through (it decodes with "surrogatepass").
# (Two patterns, each with a literal prefix that the regex engine scans for quickly.)
_SURROGATE_HINTS = (re.compile(rb"\\u[dD][89a-fA-F]"), re.compile(rb"\xed[\xa0-\xbf]"))
_QUOTE, _BACKSLASH, _LIST, _LIST_END, _OBJECT, _OBJECT_END = (ord(c) for c in '"\\[]{}')


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    parts = []
    # (without urls, inputs and contexts: a body of many unknown keys is one error per key)
    for err in exc.errors(include_url=False, include_context=False, include_input=False)[:10]:
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(model, err["loc"])
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _did_you_mean(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    """A hint for a misspelt or guessed field (`parameters` -> `text_gen_parameters`), from the
    fields of the model the unknown key sits in."""
    fields = _fields_at(model, loc[:-1])
    if not fields or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], fields, n=1, cutoff=0.6)
    if not close:
        return f" (expected one of: {', '.join(sorted(fields))})"
    return f" (did you mean `{close[0]}`?)"


def _fields_at(model: type[BaseModel] | None, path: tuple[Any, ...]) -> list[str]:
    """Field names of the (nested) model at `path`; [] when the path leaves pydantic models."""
    current: Any = model
    for part in path:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = _model_in(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [name for name, f in current.model_fields.items() if not f.exclude]
    return []


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside `X | None` (the only wrapping request models use for submodels)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def require_json_content_type(request: web.Request) -> None:
    ctype = request.content_type
    if ctype not in ("application/json", "") and not ctype.endswith("+json"):
        raise ApiError(
            415, ErrorType.INVALID_REQUEST, f"expected content-type application/json, got {ctype}"
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def too_deep() -> ApiError:
    return ApiError(
        400,
        ErrorType.INVALID_REQUEST,
        f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels",
    )


def json_depth(text: bytes) -> int:
    """How deep the UTF-8 JSON `text` nests (exact for valid JSON; for invalid JSON, at least as
    deep as a parser gets before the first error), at C speed (numpy) rather than in a Python
    loop over up to `max_request_bytes` characters."""
    if text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper: the common case costs two scans
    # imported here: the orchestrator's workers import no numpy at rest (tests/test_orchestrator_capacity.py)
    import numpy as np

    chars = np.frombuffer(text, dtype=np.uint8)
    # only brackets, quotes and backslashes matter: the rest of the work is on their positions
    marks = (chars == _QUOTE) | (chars == _LIST) | (chars == _LIST_END)
    marks |= (chars == _OBJECT) | (chars == _OBJECT_END)
    escapes = b'\\"' in text  # no backslash right before a quote: no quote is escaped
    if escapes:
        marks |= chars == _BACKSLASH
    where = np.flatnonzero(marks)
    kind = chars[where]
    quotes = kind == _QUOTE
    if escapes:
        # a quote after an odd run of backslashes (adjacent in the text) is escaped: it is
        # part of a string, not its end
        index = np.arange(len(where))
        joins_next = np.zeros(len(where), dtype=bool)  # a backslash right before the next mark
        joins_next[:-1] = (kind[:-1] == _BACKSLASH) & (where[1:] - where[:-1] == 1)
        last_break = np.maximum.accumulate(np.where(joins_next, -1, index))
        run_before = np.zeros(len(where), dtype=np.int64)
        run_before[1:] = index[:-1] - last_break[:-1]
        quotes &= (run_before & 1) == 0
    in_string = (np.cumsum(quotes, dtype=np.int32) & 1).astype(bool)
    step = (kind == _LIST).astype(np.int32) + (kind == _OBJECT)
    step -= (kind == _LIST_END).astype(np.int32) + (kind == _OBJECT_END)
    step[in_string] = 0
    return int(np.cumsum(step).max(initial=0))


def _walk(data: Any) -> Iterator[tuple[str, Any]]:
    """Every leaf and key of `data` with its path (`messages.0.content`; "" for the top level;
    a key has its object's path, "(key)" at the top level), in document order. Iterative: the
    body's depth is the parser's to bound, not the stack's."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                stack.append((f"{path}.{key}" if path else str(key), item))
                stack.append((path or "(key)", _Key(key)))
        elif isinstance(value, list):
            stack.extend(
                (f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(value)))
            )
        else:
            yield path, value.key if isinstance(value, _Key) else value


class _Key:
    """A key on `_walk`'s stack (yielded as the string it is)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _lone_surrogate_at(data: Any) -> str | None:
    """The path (`messages.0.content`) of the first string or key holding a lone surrogate,
    "" for the top level, None when there is none."""
    for path, value in _walk(data):
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
    return None


def _non_finite_at(data: Any) -> str | None:
    """The path of the first number that is not finite, None when there is none."""
    for path, value in _walk(data):
        if isinstance(value, float) and not math.isfinite(value):
            return path
    return None


class _Overflow(Exception):
    """A number literal beyond a float's range (`_finite_float`)."""


def _finite_float(literal: str) -> float:
    """A JSON number as Python's parser reads it, but never infinity: `1e999` is valid JSON
    that it reads as `inf`, and a field forwarded untouched (an upstream's `frequency_penalty`,
    a tool's JSON schema) then went out as `Infinity`, which is not JSON. (A hook per float
    literal: a body of text costs nothing, 1 MiB of floats ~30 ms; a regex scan for long
    exponents cost ~50 ms on every MiB, and quadratic time on runs of digits.)"""
    value = float(literal)
    if math.isinf(value):
        raise _Overflow
    return value


def not_finite(raw: bytes) -> ApiError:
    """422 naming the first number of `raw` beyond a float's range (a typed field would say
    the same); 400 where the JSON breaks after it (the first parse stopped at the number)."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:
        return ApiError(400, ErrorType.INVALID_REQUEST, f"invalid JSON body: {exc}")
    path = _non_finite_at(data)
    return invalid(f"{path}: must be a finite number" if path else "must be a finite number")


def check_unicode(raw: bytes, data: Any, encoding: str) -> None:
    """Text must be Unicode: JSON lets `"\\ud800"` through, and a lone surrogate then broke
    things after the reply started (an engine's 422 as an in-stream `event: error`). Refused
    here, for every endpoint, before the first byte. Only bodies that may hold one are walked."""
    if encoding == "utf-8" and not any(hint.search(raw) for hint in _SURROGATE_HINTS):
        return
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # C speed; the walk only on failure
    except UnicodeEncodeError:
        path = _lone_surrogate_at(data)
        prefix = f"{path}: " if path else ""
        raise invalid(
            f"{prefix}text must be valid Unicode (it contains a lone surrogate)"
        ) from None


def parse_json(raw: bytes) -> Any:
    """A JSON value, nested at most MAX_JSON_DEPTH deep, whose strings are valid Unicode and
    whose numbers are finite.

    Depth is measured on the bytes BEFORE parsing: Python's parser recurses once per level, and
    near the recursion limit whatever runs meanwhile (a finalizer the garbage collector calls
    from there) fails too. Up to the first syntax error the scan and the parser agree on what
    is a string, so a body the scan passes never takes the parser deeper than the bound."""
    try:
        encoding = json.detect_encoding(raw)
        # the scan reads UTF-8: another encoding (JSON allows UTF-16/32) is converted first
        text = raw if encoding == "utf-8" else raw.decode(encoding).encode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ApiError(400, ErrorType.INVALID_REQUEST, f"invalid JSON body: {exc}") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise too_deep()
    try:
        # NaN and Infinity are not JSON; Python's parser accepts them unless told not to
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except _Overflow:
        raise not_finite(raw) from None
    except RecursionError:  # not reachable past the scan; kept so it can never be a 500
        raise too_deep() from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, ErrorType.INVALID_REQUEST, f"invalid JSON body: {exc}") from None
    check_unicode(raw, data, encoding)
    return data


def validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(describe_validation_error(exc, model)) from None


# The Content-Encodings a body may come in: those aiohttp's parser decodes as it reads (bounded
# by max_request_bytes after decoding). br and zstd need libraries this service does not install:
# the parser refuses them before a route is known (http_protocol answers 415).
ACCEPTED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})
UNSUPPORTED_ENCODING = (
    "unsupported Content-Encoding (this server accepts gzip, deflate or identity)"
)


class UnreadBody(ApiError):
    """A refusal that leaves the rest of the body unread: the connection is closed right after
    the answer (the error middleware sees this type), not kept while aiohttp reads and throws
    away whatever the client still sends (its lingering read lasts up to 10 s)."""


def too_large(limit: int) -> UnreadBody:
    """413 naming the limit, so a client knows how far to cut its request."""
    return UnreadBody(
        413, ErrorType.INVALID_REQUEST, f"request body too large (limit {limit} bytes)"
    )


def check_content_encoding(request: web.BaseRequest) -> None:
    """415 for a Content-Encoding the parser does not decode: aiohttp passes any other value
    through, and the body would be read as if it were plain (a list such as `gzip, identity`
    included). The client's value is not repeated."""
    encoding = ",".join(request.headers.getall("Content-Encoding", ())).strip().lower()
    if encoding not in ACCEPTED_ENCODINGS:
        raise UnreadBody(415, ErrorType.INVALID_REQUEST, UNSUPPORTED_ENCODING)


def not_encoded() -> UnreadBody:
    """400: the body is not in the Content-Encoding it names (plain text sent as gzip)."""
    return UnreadBody(
        400,
        ErrorType.INVALID_REQUEST,
        "the request body is not encoded as its Content-Encoding says",
    )


class BodyTimeout(UnreadBody):
    """408: the body stalled or came too slowly. The connection is closed after the reply
    (the error middleware sees this type), so a stalled client holds nothing afterwards."""

    def __init__(self, details: str) -> None:
        super().__init__(408, ErrorType.TIMEOUT, details)


def body_stalled() -> BodyTimeout:
    return BodyTimeout("the request body stalled for longer than body_idle_timeout_s")


def body_too_slow() -> BodyTimeout:
    return BodyTimeout(BODY_TIMED_OUT.message)


def malformed_body() -> UnreadBody:
    """A body the HTTP parser refused (a bad chunk size, a short Content-Length body): the
    parser's own message may quote the input, so it is not repeated."""
    return UnreadBody(400, ErrorType.INVALID_REQUEST, "malformed request body")


async def read_chunk(content: Any, timeout_s: float, *, idle: bool) -> bytes:
    """One `readany()` of the body within `timeout_s`; BodyTimeout (`idle`: the idle bound
    expired, else the request's) or a 400 for a body the HTTP parser refused."""
    try:
        async with asyncio.timeout(max(timeout_s, 0)):
            return await content.readany()
    except TimeoutError:
        raise (body_stalled() if idle else body_too_slow()) from None
    except ContentEncodingError:
        raise not_encoded() from None
    except RequestPayloadError as exc:
        # aiohttp wraps what its decoder raised (zlib's error as a ContentEncodingError)
        raise (
            not_encoded() if isinstance(exc.__cause__, ContentEncodingError) else malformed_body()
        ) from None
    except HttpProcessingError:
        raise malformed_body() from None


async def read_body(request: web.Request) -> bytes:
    """The whole body, bounded in size (413: by Content-Length before a byte is read, so an
    `Expect: 100-continue` client never sends it), in idle time (`body_idle_timeout_s`: a
    client that stops sending) and in total (`request_timeout_s`)."""
    server = request.app[STATE].config.server
    limit = request.client_max_size
    check_content_encoding(request)
    if (request.content_length or 0) > limit:
        raise too_large(limit)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + server.request_timeout_s
    parts: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - loop.time()
        idle = server.body_idle_timeout_s < remaining
        chunk = await read_chunk(
            request.content, min(server.body_idle_timeout_s, remaining), idle=idle
        )
        if not chunk:
            confirm_caller(request)  # a reload while it came may have taken its key away
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)


async def read_model(request: web.Request, model: type[M]) -> M:
    require_json_content_type(request)
    return await decode_body(await read_body(request), model)


async def decode_body(raw: bytes, model: type[M], check: Callable[[Any], None] | None = None) -> M:
    """`raw` parsed (`parse_json`), `check`ed and validated as `model`: past BULK_CHARS bytes in
    the bulk executor, not on the event loop. The request models' validators are Python work
    per item (a misspelt-field hint per unknown key held the loop 0.9 s for 1 MiB of them);
    a small body stays inline (a thread hop costs more than the work)."""

    def decode() -> M:
        data = parse_json(raw)
        if check is not None:
            check(data)
        return validate(model, data)

    if len(raw) > BULK_CHARS:
        return await off_loop(decode)
    return decode()
