"""Structured logs: one JSON object per line, each carrying the id of the request it belongs to.

The request-id middleware sets `REQUEST_ID` for the whole handling of a request; asyncio copies
context variables into every task a handler creates (the stream pipeline, detector calls, engine
calls), so any log line written on a request's behalf carries its id without passing it around.
Log collectors (Loki, Elastic, Cloud Logging) parse one JSON object per line without a schema.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["json", "text"]

REQUEST_ID: ContextVar[str | None] = ContextVar("guardstream_request_id", default=None)
# Set by orchestrator.tracing while tracing is on: the current (trace_id, span_id) in hex, or
# None outside a span; stamped on each record next to its request id (None: tracing is off).
TRACE_IDS: Callable[[], tuple[str, str] | None] | None = None

# Attributes every LogRecord has; anything else on a record came from `extra=` and is emitted.
_RECORD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "request_id", "taskName"}
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s%(trace)s] %(message)s"
# Characters that end a line for some reader of a log (a terminal, Python's str.splitlines, a
# log shipper) or drive a terminal: C0 controls but tab, DEL, C1 controls, the Unicode line and
# paragraph separators. A message can quote a client (the access line's URL-decoded path:
# `/a%0A<forged line>`), so a text line shows them escaped, and a JSON line escapes the ones
# JSON leaves raw (U+0085, U+2028, U+2029), so one record stays one line for every reader.
_LINE_BREAKERS = [*range(0x00, 0x09), *range(0x0A, 0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]
_TEXT_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _LINE_BREAKERS}
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in (0x85, 0x2028, 0x2029)}


class RequestIdFilter(logging.Filter):
    """Stamps `record.request_id` when the record is made, in the context that made it (a
    handler on another thread, such as a QueueListener, would no longer see the context)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        if TRACE_IDS is not None and getattr(record, "trace_id", None) is None:
            ids = TRACE_IDS()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message", "request_id"?, "exc"?, ...extra}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = record.stack_info
        # default=str: an `extra` value that is not JSON must not lose the whole line
        return json.dumps(entry, ensure_ascii=False, default=str).translate(_JSON_ESCAPES)


class _TextFormatter(logging.Formatter):
    """`... [request-id trace=<trace id>] message`: the trace id (with tracing on, inside a span)
    finds the line's trace in the tracing backend, as the JSON lines' `trace_id` does."""

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get() or "-"
        trace_id = getattr(record, "trace_id", None)
        record.trace = f" trace={trace_id}" if trace_id else ""
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:
        # the message escaped (a traceback, appended after it, keeps its own lines)
        escaped = record.message.translate(_TEXT_ESCAPES)
        return TEXT_FORMAT % {**record.__dict__, "message": escaped}


def make_handler(fmt: LogFormat = "json", stream: TextIO | None = None) -> logging.Handler:
    """A stream handler with the request-id filter and the chosen formatter."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TextFormatter(TEXT_FORMAT))
    return handler


def configure_logging(
    fmt: LogFormat = "json", level: int | str = logging.INFO, stream: TextIO | None = None
) -> None:
    """Replaces the root logger's handlers with one writing `fmt` lines to `stream` (stderr)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(level)
    # aiohttp's access log is off (the orchestrator writes its own access line with the id)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
