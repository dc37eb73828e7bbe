"""Detectors on a conversation, on a text against its context documents, and on a prompt with
its generated text: the FMS detection endpoints beyond `content` (issue 40).

A detector of the endpoint's own kind (`text_chat`, `text_context_doc`, `text_generation`) is
a remote service judging the whole thing in one call (the FMS detector API's paths and bodies).
A `text_contents` detector (every built-in) serves chat and generated detection too: it judges
each message (chat) or the generated text on its own, as the input and output guardrails do,
and its spans go into the detection's `metadata`. Detections are kept at `score >= threshold`
and listed detector by detector (sorted by id), each detector's in its own order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..api.fms_detection import ChatMessage, DetectionResult
from ..api.input_pieces import InputPiece
from ..clients.registry import ChunkerRegistry, RequestedDetector
from .finding_wire import detection_result
from .text_judgement import judge_pieces, judge_text
from .verdict_cache import TenantVerdicts

# the FMS detector API's path for each kind
KIND_PATHS = {
    "text_chat": "/api/v1/text/chat",
    "text_context_doc": "/api/v1/text/context/doc",
    "text_generation": "/api/v1/text/generation",
}


async def judge_chat(
    messages: list[ChatMessage],
    tools: list[dict[str, Any]],
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    verdicts: TenantVerdicts | None = None,
) -> list[DetectionResult]:
    """`verdicts`: the tenant's kept verdicts for the text_contents detectors' messages."""

    async def one(d: RequestedDetector) -> list[DetectionResult]:
        if d.kind == "text_chat":
            body = {"messages": [m.wire() for m in messages], "tools": tools}
            return await _remote(d, body)
        pieces = [InputPiece(m.text(), message_index=i) for i, m in enumerate(messages)]
        found = await judge_pieces(pieces, [d], chunkers, verdicts)
        return [detection_result(f) for f in found]

    return await _each(detectors, one)


async def judge_context(
    content: str, context_type: str, context: list[str], detectors: list[RequestedDetector]
) -> list[DetectionResult]:
    body = {"content": content, "context_type": context_type, "context": context}

    async def one(d: RequestedDetector) -> list[DetectionResult]:
        return await _remote(d, body)

    return await _each(detectors, one)


async def judge_generated(
    prompt: str,
    generated_text: str,
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
) -> list[DetectionResult]:
    async def one(d: RequestedDetector) -> list[DetectionResult]:
        if d.kind == "text_generation":
            return await _remote(d, {"prompt": prompt, "generated_text": generated_text})
        return [detection_result(f) for f in await judge_text(generated_text, [d], chunkers)]

    return await _each(detectors, one)


async def _each(
    detectors: list[RequestedDetector],
    one: Callable[[RequestedDetector], Awaitable[list[DetectionResult]]],
) -> list[DetectionResult]:
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(d)) for d in detectors]
    return [r for t in tasks for r in t.result()]


async def _remote(d: RequestedDetector, body: dict[str, Any]) -> list[DetectionResult]:
    """One call of the detector's kind; its detections at or above the threshold, each with
    the configured id (whatever the reply said)."""
    replies = await d.client.judge(KIND_PATHS[d.kind], body, d.params)
    return [
        DetectionResult(
            detection_type=r.detection_type,
            detection=r.detection,
            detector_id=d.detector_id,
            score=r.score,
            evidence=r.evidence or None,
            metadata=r.metadata or None,
        )
        for r in replies
        if r.score >= d.threshold
    ]
