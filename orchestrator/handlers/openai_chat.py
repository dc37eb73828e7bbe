"""POST /v1/chat/completions (and its FMS alias /api/v2/chat/completions-detection): OpenAI Chat
Completions over the guarded pipeline (DESIGN 4.8). Parse, prepare, then the serving loop
(handlers/serving.py) with the chat writer or fold. Every 4xx is raised before the first byte;
a generation that fails before anything was due to the client is a real HTTP error too."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from ..api.errors import invalid
from ..api.openai_chat import ChatCompletionRequest, check_extra_honoured
from ..config import OpenAIBackend
from ..state import STATE
from ..streaming.chat_writer import ChatChunkWriter, ChatCompletionFold
from ..streaming.guarded_generation import GuardedGeneration
from .admission import Conversation, find_model, prepare_conversation
from .body import read_model
from .serving import serve, serve_unary

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
    prepare = partial(prepare_chat, request, body)
    if not body.stream:
        return await serve_unary(request, prepare, ChatCompletionFold(body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve(request, prepare, ChatChunkWriter(body.model, include_usage=include_usage))
