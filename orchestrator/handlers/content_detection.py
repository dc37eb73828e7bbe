"""POST /api/v2/text/detection/content: detectors on a given text, spans relative to all of it."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..api.errors import ApiError, ErrorType
from ..api.requests import ContentDetectionRequest
from ..api.responses import ContentDetectionResponse
from ..state import STATE
from ..streaming.redaction import redact_text
from ..streaming.text_judgement import judge_text
from .body import read_model


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_model(request, ContentDetectionRequest)
    assert state.detectors is not None
    dets = state.detectors.resolve(body.detectors, "content", "detectors")
    try:
        async with asyncio.timeout(state.config.server.request_timeout_s):
            findings = await judge_text(body.content, dets, state.chunkers, whole=body.redact)
    except TimeoutError:
        raise ApiError(
            504, ErrorType.TIMEOUT, "the detectors did not answer within request_timeout_s"
        ) from None
    state.metrics.observer().on_findings(findings)
    if not body.redact:
        response = ContentDetectionResponse(detections=[f.to_content() for f in findings])
        return web.json_response(response.dump())
    # DESIGN 4.6a: every detection replaced by its detector's `redact_with`; spans relative to
    # the redacted text the reply carries
    redacted, mapped = redact_text(body.content, findings, {d.detector_id: d for d in dets})
    response = ContentDetectionResponse(
        detections=[f.to_content() for f in mapped], redacted_content=redacted
    )
    return web.json_response(response.dump())
