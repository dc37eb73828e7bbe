"""POST /api/v2/text/detection/content: detectors on a given text, spans relative to all of it."""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web

from ..api.errors import ApiError
from ..api.fms_requests import ContentDetectionRequest
from ..errors import DETECTORS_TIMED_OUT
from ..state import STATE
from ..streaming import wire_json
from ..streaming.finding_wire import content
from ..streaming.redaction import redact_text
from ..streaming.text_judgement import judge_text, off_loop
from ..tenants import CALLER
from .body import read_model
from .detection_chars import check_detection_chars, detection_char_limit
from .stream_slots import stream_slot


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    with stream_slot(state, request.get(CALLER)):  # taken first: a refusal costs nothing
        return await _detect(request)


async def _detect(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_model(request, ContentDetectionRequest)
    assert state.detectors is not None
    dets = state.detectors.resolve(body.detectors, "content", "detectors")
    check_detection_chars({"content": len(body.content)}, detection_char_limit(state, request))
    try:
        async with asyncio.timeout(state.config.server.request_timeout_s):
            findings = await judge_text(
                body.content,
                dets,
                state.chunkers,
                whole=body.redact,
                annotating=True,
                verdicts=state.input_verdicts(request.get(CALLER)),
            )
    except TimeoutError:
        raise ApiError.of(DETECTORS_TIMED_OUT) from None
    state.metrics.observer().on_findings(findings)
    redacted: str | None = None
    if body.redact:
        # DESIGN 4.6a: every detection replaced by its detector's `redact_with`; spans relative
        # to the redacted text the reply carries
        # (off the loop with many findings, like the reply: 80,000 phones in 1 MiB took 0.5 s)
        redactors = {d.detector_id: d for d in dets}
        redact = functools.partial(redact_text, body.content, findings, redactors)
        redacted, findings = await off_loop(redact) if len(findings) > 256 else redact()

    def reply() -> bytes:
        # encoded a slice at a time: 40,000 dicts alive at once were as many objects for the
        # garbage collector to walk (with the loop stopped) before the first was freed
        parts = (
            wire_json.dumps([content(f) for f in findings[i : i + 512]])[1:-1]
            for i in range(0, len(findings), 512)
        )
        out = b'{"detections":[' + b",".join(parts) + b"]"
        if redacted is not None:
            out += b',"redacted_content":' + wire_json.dumps(redacted)
        return out + b"}"

    # tens of thousands of detections take a second to build and encode: not on the loop
    data = await off_loop(reply) if len(findings) > 256 else reply()
    return web.Response(body=data, content_type="application/json", charset="utf-8")
