"""JSON bytes for the wire: orjson, else json's `\\u` escapes. A client's text can carry a lone
surrogate (JSON allows `"\\ud800"`), a detection or refusal quotes it back, and orjson refuses
such strings; falling back keeps a started stream from breaking with a 500."""

from __future__ import annotations

import json
from typing import Any

import orjson

# The SSE comment every streaming surface sends after sse_keepalive_s of silence (DESIGN 4.3)
KEEPALIVE_COMMENT = b": keep-alive\n\n"


def dumps(data: Any) -> bytes:
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data, separators=(",", ":")).encode()
