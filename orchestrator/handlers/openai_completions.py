"""POST /api/v2/text/completions-detection (issue 40): the OpenAI Completions request with
`detectors: {input, output}` over the guarded pipeline, the Chat Completions endpoint's twin.
The prompt is sent as it is (no chat template); input detectors judge it, the model's enforced
guardrails run, and the serving loop drives the completions writer or fold."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.openai_completions import CompletionRequest
from ..clients.backend import GenerationRequest
from ..state import STATE
from ..streaming.completions_writer import CompletionChunkWriter, CompletionFold
from ..streaming.guarded_generation import GuardedGeneration
from .admission import (
    budget,
    build_pipeline,
    check_input_size,
    find_model,
    openai_params,
    resolve_detectors,
)
from .body import read_model
from .serving import serve, serve_unary


async def prepare_completion(request: web.Request, body: CompletionRequest) -> GuardedGeneration:
    state = request.app[STATE]
    target = find_model(state, body.model)
    check_input_size(target, len(body.prompt), "prompt")
    max_new = budget(target, body.max_tokens, "max_tokens")
    detectors = body.detectors
    input_dets = resolve_detectors(
        state, target, "input", detectors.input if detectors else None, "detectors.input"
    )
    output_dets = resolve_detectors(
        state, target, "output", detectors.output if detectors else None, "detectors.output"
    )
    gen_request = GenerationRequest(
        prompt=body.prompt,
        params=openai_params(
            target,
            max_new,
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_list()),
        ),
        chat=False,
        request_id=request.get("request_id", ""),
    )
    return await build_pipeline(
        request,
        target,
        gen_request,
        inputs=body.prompt,
        masks=None,
        input_detectors=input_dets,
        output_detectors=output_dets,
        keepalive=body.stream,
    )


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, CompletionRequest)
    prepare = partial(prepare_completion, request, body)
    if not body.stream:
        return await serve_unary(request, prepare, CompletionFold(body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve(
        request, prepare, CompletionChunkWriter(body.model, include_usage=include_usage)
    )
