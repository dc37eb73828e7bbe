"""POST /v1/chat/completions (and its FMS alias /api/v2/chat/completions-detection): OpenAI Chat
Completions over the guarded pipeline (DESIGN 4.8). Every 4xx is raised before the first byte;
a generation that fails before anything was due to the client is a real HTTP error too."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..api.errors import ApiError
from ..api.openai_chat import ChatCompletionRequest
from ..clients.generation import ChatMessage, GenerationParams, GenerationRequest
from ..state import STATE
from ..streaming.chat_writer import ChatChunkWriter, ChatCompletionFold
from ..streaming.events import Terminal
from ..streaming.guarded_generation import GuardedGeneration
from .body import read_model
from .generation_request import (
    budget,
    build_pipeline,
    check_input_size,
    find_model,
    resolve_detectors,
)
from .stream_slots import stream_slot
from .streaming_generation import SSE_HEADERS

CHAT_PATH = "/v1/chat/completions"
CHAT_DETECTION_PATH = "/api/v2/chat/completions-detection"


def last_user_message(body: ChatCompletionRequest) -> int:
    """Input detectors judge the last user message (spans relative to it)."""
    return max(i for i, m in enumerate(body.messages) if m.role == "user")


async def prepare_chat(
    request: web.Request, body: ChatCompletionRequest
) -> tuple[GuardedGeneration, int]:
    state = request.app[STATE]
    target = find_model(state, body.model)
    texts = [m.text() for m in body.messages]
    check_input_size(target, sum(len(t) for t in texts), "messages")
    requested = body.max_completion_tokens or body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_new = budget(target, requested, field)
    index = last_user_message(body)
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
        prompt=texts[index],
        params=GenerationParams(
            max_new_tokens=max_new,
            decoding_method="GREEDY" if temperature == 0 else "SAMPLING",
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop_sequences=tuple(body.stop_list()),
        ),
        chat=True,
        request_id=request.get("request_id", ""),
        messages=tuple(
            # chat templates know system, user and assistant; `developer` is OpenAI's newer
            # name for the system role
            ChatMessage("system" if m.role == "developer" else m.role, t)
            for m, t in zip(body.messages, texts, strict=True)
        ),
        extra=body.forwarded(),
    )
    pipeline = await build_pipeline(
        request,
        target,
        gen_request,
        inputs=texts[index],
        masks=None,
        input_detectors=input_dets,
        output_detectors=output_dets,
        keepalive=body.stream,
    )
    return pipeline, index


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, ChatCompletionRequest)
    pipeline, index = await prepare_chat(request, body)
    state = request.app[STATE]
    with stream_slot(state, pipeline):
        if not body.stream:
            fold = ChatCompletionFold(body.model, input_message_index=index)
            async with aclosing(pipeline.events()) as events:
                async for event in events:
                    fold.add(event)
            return web.json_response(fold.body())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = ChatChunkWriter(body.model, include_usage=include_usage, input_message_index=index)
        response: web.StreamResponse | None = None
        async with aclosing(pipeline.events()) as events:
            async for event in events:
                if response is None:
                    if isinstance(event, Terminal) and event.error is not None:
                        # nothing was sent: the client gets a real HTTP error
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
