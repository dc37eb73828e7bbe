"""POST /api/v1/task/classification-with-text-generation: the same pipeline as the streaming
endpoint, folded into one JSON object. Failures become real HTTP errors (nothing was sent)."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..api.errors import ApiError, ErrorBody, ErrorType
from ..api.responses import (
    ClassifiedFrame,
    ClassifiedGeneratedTextResult,
    FrameWarning,
    RefusalDone,
    TerminalSummary,
    TokenClassificationResult,
    TokenClassificationResults,
)
from ..state import STATE
from .stream_slots import stream_slot
from .task_request import prepare_generation


async def handle(request: web.Request) -> web.Response:
    pipeline = await prepare_generation(request)
    state = request.app[STATE]
    texts: list[str] = []
    inputs: list[TokenClassificationResult] = []
    outputs: list[TokenClassificationResult] = []
    warnings: dict[str, FrameWarning] = {}
    result = ClassifiedGeneratedTextResult()
    with stream_slot(state, pipeline):
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                payload = event.payload
                if isinstance(payload, ClassifiedFrame):
                    if payload.generated_text:
                        texts.append(payload.generated_text)
                    tcr = payload.token_classification_results
                    inputs.extend(tcr.input or [])
                    outputs.extend(tcr.output or [])
                    for w in payload.warnings or []:
                        warnings.setdefault(w.id, w)
                    result.input_token_count = payload.input_token_count
                    result.seed = payload.seed
                elif isinstance(payload, RefusalDone):
                    result.refusal = payload
                elif isinstance(payload, ErrorBody):
                    raise ApiError(payload.code, payload.type, payload.details)
                elif isinstance(payload, TerminalSummary):
                    if payload.error is not None:
                        err = payload.error
                        raise ApiError(err.code, ErrorType(err.type), err.message)
                    result.finish_reason = payload.finish_reason
                    result.generated_token_count = payload.generated_token_count
                    result.input_token_count = payload.input_token_count
                    result.migrations = payload.migrations
                    result.incomplete_details = payload.incomplete_details
                    result.status = "incomplete" if event.name == "incomplete" else "completed"
    result.generated_text = "".join(texts) if texts or not inputs else None
    result.token_classification_results = TokenClassificationResults(
        input=inputs or None, output=outputs if outputs or texts else None
    )
    result.warnings = list(warnings.values()) or None
    return web.json_response(result.dump())
