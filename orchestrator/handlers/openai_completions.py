"""POST /api/v2/text/completions-detection (issue 40): the OpenAI Completions request with
`detectors: {input, output}` over the guarded pipeline, the Chat Completions endpoint's twin.
The prompt is sent as it is (no chat template); input detectors judge it, the model's enforced
guardrails run, and the serving loop drives the completions writer or fold."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.openai_completions import CompletionRequest
from ..state import STATE
from ..streaming.completions_writer import CompletionChunkWriter, CompletionFold
from .body import read_model
from .prepare import Decoding, GenerationAsk, openai_ask, prepare
from .serving import serve, serve_unary


def completion_ask(request: web.Request, body: CompletionRequest) -> GenerationAsk:
    """The prompt as it is: no chat template."""
    return openai_ask(
        request,
        body,
        prompt=body.prompt,
        chat=False,
        inputs=body.prompt,
        input_chars=len(body.prompt),
        input_field="prompt",
        max_tokens=body.max_tokens,
        max_tokens_field="max_tokens",
        decoding=Decoding(
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_list()),
        ),
    )


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, CompletionRequest)
    run = partial(prepare, request.app[STATE], completion_ask(request, body))
    if not body.stream:
        return await serve_unary(request, run, CompletionFold(body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve(request, run, CompletionChunkWriter(body.model, include_usage=include_usage))
