"""JSON bytes for the wire: orjson, else json's `\\u` escapes. A client's text can carry a lone
surrogate (JSON allows `"\\ud800"`), a detection or refusal quotes it back, and orjson refuses
such strings; falling back keeps a started stream from breaking with a 500."""

from __future__ import annotations

import json
from typing import Any

import orjson

# The SSE comment every streaming surface sends after sse_keepalive_s of silence (DESIGN 4.3)
KEEPALIVE_COMMENT = b": keep-alive\n\n"
# The headers of every SSE reply (the FMS task stream, Chat Completions, Responses)
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


def dumps(data: Any) -> bytes:
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data, separators=(",", ":")).encode()
