"""POST /v1/responses: the OpenAI Responses API over the guarded pipeline, with the
OpenResponses streaming events (DESIGN 4.9). Stateless: the whole conversation comes in
`input`. Every 4xx is raised before the first byte; after that, the stream itself says how it
ended (`response.completed`, `response.incomplete`, `response.failed`, or `error` when no
response object was created yet)."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..api.errors import ApiError
from ..api.openai_responses import ResponsesRequest, check_stateless
from ..clients.generation import ChatMessage, GenerationParams, GenerationRequest
from ..state import STATE
from ..streaming.events import Terminal
from ..streaming.guarded_generation import GuardedGeneration
from ..streaming.responses_writer import ResponsesFold, ResponsesWriter
from .body import parse_json, require_json_content_type, too_large, validate
from .generation_request import (
    budget,
    build_pipeline,
    check_input_size,
    find_model,
    resolve_detectors,
)
from .stream_slots import stream_slot
from .streaming_generation import SSE_HEADERS

RESPONSES_PATH = "/v1/responses"


async def read_request(request: web.Request) -> ResponsesRequest:
    """The body, with stored-state and tool requests refused (400) before schema errors (422)."""
    require_json_content_type(request)
    try:
        raw = await request.read()  # bounded by the app's client_max_size
    except web.HTTPRequestEntityTooLarge:
        raise too_large(request.client_max_size) from None
    data = parse_json(raw)
    check_stateless(data)
    return validate(ResponsesRequest, data)


async def prepare_response(request: web.Request, body: ResponsesRequest) -> GuardedGeneration:
    state = request.app[STATE]
    target = find_model(state, body.model)
    conversation = body.conversation_messages()
    check_input_size(target, sum(len(text) for _, text in conversation), "input")
    max_new = budget(target, body.max_output_tokens, "max_output_tokens")
    # input detectors judge the last user message (spans relative to it)
    last_user = max(i for i, (role, _) in enumerate(conversation) if role == "user")
    inputs = conversation[last_user][1]
    detectors = body.detectors
    input_dets = resolve_detectors(
        state, target, "input", detectors.input if detectors else None, "detectors.input"
    )
    output_dets = resolve_detectors(
        state, target, "output", detectors.output if detectors else None, "detectors.output"
    )
    # OpenAI's default temperature is 1 (sampling); 0 asks for greedy decoding
    temperature = 1.0 if body.temperature is None else body.temperature
    gen_request = GenerationRequest(
        prompt=inputs,
        params=GenerationParams(
            max_new_tokens=max_new,
            decoding_method="GREEDY" if temperature == 0 else "SAMPLING",
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if body.top_p is None else body.top_p,
        ),
        chat=True,
        request_id=request.get("request_id", ""),
        # chat templates know system, user and assistant; `developer` is OpenAI's newer name
        # for the system role
        messages=tuple(
            ChatMessage("system" if role == "developer" else role, text)
            for role, text in conversation
        ),
    )
    return await build_pipeline(
        request,
        target,
        gen_request,
        inputs=inputs,
        masks=None,
        input_detectors=input_dets,
        output_detectors=output_dets,
        keepalive=body.stream,
    )


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_request(request)
    pipeline = await prepare_response(request, body)
    state = request.app[STATE]
    with stream_slot(state, pipeline):
        if not body.stream:
            fold = ResponsesFold(body)
            async with aclosing(pipeline.events()) as events:
                async for event in events:
                    fold.add(event)
            return web.json_response(fold.body())
        writer = ResponsesWriter(body)
        response: web.StreamResponse | None = None
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                if response is None:
                    if isinstance(event, Terminal) and event.error and event.error.code < 500:
                        # the client's own mistake, found before any byte: a real HTTP error
                        e = event.error
                        raise ApiError(e.code, e.type, e.message)
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                data = writer.render(event)
                if data:
                    await response.write(data)
        assert response is not None
        await response.write_eof()
        return response
