"""POST /api/v2/text/detection/{chat,context,generated}: the FMS orchestrator's detection
endpoints on a conversation, a text with its context documents, and a prompt with its
generated text (issue 40). Each checks its body and its detectors' kinds before any detector
is called (404 / 422 in the FMS orchestrator's words), then judges once."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from ..api.errors import ApiError
from ..api.fms_detection import (
    ChatDetectionRequest,
    ContextDetectionRequest,
    DetectionResult,
    DetectionsResponse,
    GeneratedDetectionRequest,
)
from ..api.fms_requests import DetectorMap
from ..clients.registry import RequestedDetector
from ..errors import DETECTORS_TIMED_OUT
from ..state import STATE, AppState
from ..streaming.kind_judgement import judge_chat, judge_context, judge_generated
from ..streaming.text_judgement import off_loop
from ..tenants import CALLER
from .body import read_model
from .detection_chars import chat_chars, check_detection_chars, detection_char_limit
from .stream_slots import stream_slot

# the kinds each endpoint takes: its own, and (chat, generated) every text_contents detector,
# which judges each message or the generated text on its own
CHAT_KINDS = ("text_chat", "text_contents")
CONTEXT_KINDS = ("text_context_doc",)
GENERATED_KINDS = ("text_generation", "text_contents")


def resolve_kinds(
    state: AppState, detectors: DetectorMap, kinds: tuple[str, ...]
) -> list[RequestedDetector]:
    assert state.detectors is not None
    return state.detectors.resolve(detectors, "content", "detectors", kinds=kinds, fms_wording=True)


async def within_timeout(state: AppState, judging: Awaitable[list[DetectionResult]]) -> Any:
    """The detections, or 504 past request_timeout_s (as the content endpoint)."""
    try:
        async with asyncio.timeout(state.config.server.request_timeout_s):
            return await judging
    except TimeoutError:
        raise ApiError.of(DETECTORS_TIMED_OUT) from None


def reply(detections: list[DetectionResult]) -> web.Response:
    body = DetectionsResponse(detections=detections).model_dump(mode="json", exclude_none=True)
    return web.json_response(body)


async def chat(request: web.Request) -> web.Response:
    state = request.app[STATE]
    with stream_slot(state, request.get(CALLER)):  # taken first: a refusal costs nothing
        body = await read_model(request, ChatDetectionRequest)
        dets = resolve_kinds(state, body.detectors, CHAT_KINDS)
        # 20,000 one-part messages (1 MiB) took 75 ms to count: not on the loop
        count = functools.partial(chat_chars, body.messages, body.tools)
        sizes = await off_loop(count) if len(body.messages) > 1024 else count()
        check_detection_chars(sizes, detection_char_limit(state, request))
        # a conversation sent again: its earlier messages' verdicts are kept (verdict_cache.py)
        verdicts = state.input_verdicts(request.get(CALLER))
        judging = judge_chat(body.messages, body.tools, dets, state.chunkers, verdicts)
        return reply(await within_timeout(state, judging))


async def context(request: web.Request) -> web.Response:
    state = request.app[STATE]
    with stream_slot(state, request.get(CALLER)):
        body = await read_model(request, ContextDetectionRequest)
        dets = resolve_kinds(state, body.detectors, CONTEXT_KINDS)
        sizes = {"content": len(body.content), "context": sum(map(len, body.context))}
        check_detection_chars(sizes, detection_char_limit(state, request))
        judging = judge_context(body.content, body.context_type, body.context, dets)
        return reply(await within_timeout(state, judging))


async def generated(request: web.Request) -> web.Response:
    state = request.app[STATE]
    with stream_slot(state, request.get(CALLER)):
        body = await read_model(request, GeneratedDetectionRequest)
        dets = resolve_kinds(state, body.detectors, GENERATED_KINDS)
        sizes = {"prompt": len(body.prompt), "generated_text": len(body.generated_text)}
        check_detection_chars(sizes, detection_char_limit(state, request))
        judging = judge_generated(body.prompt, body.generated_text, dets, state.chunkers)
        return reply(await within_timeout(state, judging))
