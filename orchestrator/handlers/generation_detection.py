"""POST /api/v2/text/generation-detection (issue 40): generate, then judge the prompt and the
generated text with `text_generation` (and `text_contents`) detectors, as the FMS orchestrator
does. The detectors' kinds are checked before the model is called; the generation is the FMS
task pipeline's (the model's limits and its enforced input and output guardrails apply: a
refused prompt never reaches the model, flagged output never leaves), folded as the unary task
endpoint folds it; its warnings say when a guardrail acted."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.fms_detection import GenerationDetectionRequest, GenerationDetectionResponse
from ..api.fms_requests import GuardrailsHttpRequest, TextGenParameters
from ..state import STATE
from ..streaming.fms_writer import UnaryFold
from ..streaming.kind_judgement import judge_generated
from ..tenants import CALLER
from .body import read_model
from .fms_detection import GENERATED_KINDS, resolve_kinds, within_timeout
from .fms_task import task_ask
from .prepare import prepare
from .serving import fold_unary
from .stream_slots import stream_slot


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    # one slot across the generation and the judging after it, taken first: a refusal costs
    # nothing (handlers/stream_slots.py)
    with stream_slot(state, request.get(CALLER)) as slot:
        body = await read_model(request, GenerationDetectionRequest)
        dets = resolve_kinds(state, body.detectors, GENERATED_KINDS)
        task = GuardrailsHttpRequest(
            model_id=body.model_id,
            inputs=body.prompt,
            text_gen_parameters=body.text_gen_parameters or TextGenParameters(),
        )
        ask = task_ask(request, task, streaming=False)
        folded = await fold_unary(partial(prepare, state, ask), UnaryFold(), slot)
        generated_text = folded.get("generated_text") or ""
        detections = []
        if generated_text:  # a refused prompt: nothing was generated, nothing to judge
            judging = judge_generated(body.prompt, generated_text, dets, state.chunkers)
            detections = await within_timeout(state, judging)
    warnings = [{"id": w["id"], "message": w["message"]} for w in folded.get("warnings") or []]
    result = GenerationDetectionResponse(
        generated_text=generated_text,
        detections=detections,
        input_token_count=folded.get("input_token_count") or 0,
        warnings=warnings or None,
    )
    return web.json_response(result.model_dump(mode="json", exclude_none=True))
