"""POST /v1/chat/completions (and its FMS alias /api/v2/chat/completions-detection): OpenAI Chat
Completions over the guarded pipeline (DESIGN 4.8). Every 4xx is raised before the first byte;
a generation that fails before anything was due to the client is a real HTTP error too."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ..api.errors import ApiError, invalid
from ..api.openai_chat import ChatCompletionRequest, check_extra_honoured
from ..config import OpenAIBackend
from ..state import STATE
from ..streaming.chat_writer import ChatChunkWriter, ChatCompletionFold
from ..streaming.events import Terminal
from ..streaming.guarded_generation import GuardedGeneration
from .admission import Conversation, find_model, prepare_conversation
from .body import read_model
from .fms_stream import SSE_HEADERS
from .stream_slots import stream_slot

CHAT_PATH = "/v1/chat/completions"
CHAT_DETECTION_PATH = "/api/v2/chat/completions-detection"


async def prepare_chat(request: web.Request, body: ChatCompletionRequest) -> GuardedGeneration:
    target = find_model(request.app[STATE], body.model)
    forwards = all(isinstance(b, OpenAIBackend) and b.api == "chat" for b in target.config.backends)
    if not forwards:
        try:
            check_extra_honoured(body.forwarded(), body.model)
        except ValueError as exc:
            raise invalid(str(exc)) from None
    detectors = body.detectors
    return await prepare_conversation(
        request,
        Conversation(
            model=body.model,
            messages=[(m.role, m.text()) for m in body.messages],
            pieces=body.input_pieces(),
            input_field="messages",
            max_tokens=body.max_completion_tokens or body.max_tokens,
            max_tokens_field="max_completion_tokens"
            if body.max_completion_tokens
            else "max_tokens",
            temperature=body.temperature,
            top_p=body.top_p,
            input_detectors=detectors.input if detectors else None,
            output_detectors=detectors.output if detectors else None,
            stream=body.stream,
            seed=body.seed,
            stop=tuple(body.stop_list()),
            extra=body.forwarded(),
        ),
    )


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, ChatCompletionRequest)
    pipeline = await prepare_chat(request, body)
    state = request.app[STATE]
    with stream_slot(state, pipeline):
        if not body.stream:
            fold = ChatCompletionFold(body.model)
            async with aclosing(pipeline.events()) as events:
                async for event in events:
                    fold.add(event)
            return web.json_response(fold.body())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = ChatChunkWriter(body.model, include_usage=include_usage)
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
