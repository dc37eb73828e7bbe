"""POST /v1/chat/completions (and its FMS alias /api/v2/chat/completions-detection): OpenAI Chat
Completions over the guarded pipeline (DESIGN 4.8). Parse, say what it asks for, then the
serving loop (handlers/serving.py) with the chat writer or fold. Every 4xx is raised before the
first byte; a generation that fails before anything was due to the client is a real HTTP error
too."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from aiohttp import web

from ..api.input_pieces import input_chars
from ..api.openai_chat import ChatCompletionRequest
from ..state import STATE
from ..streaming.chat_writer import ChatChunkWriter, ChatCompletionFold
from .body import read_model
from .prepare import Decoding, GenerationAsk, conversation, openai_ask, prepare
from .serving import bulk_ask, serve, serve_unary

CHAT_PATH = "/v1/chat/completions"
CHAT_DETECTION_PATH = "/api/v2/chat/completions-detection"


def chat_ask(request: web.Request, body: ChatCompletionRequest) -> GenerationAsk:
    """Input detectors judge every piece of the conversation, each on its own (DESIGN 4.8)."""
    messages = [(m.role, m.text()) for m in body.messages]
    pieces = body.input_pieces()
    prompt, chat = conversation(messages)
    chat = tuple(
        replace(c, name=m.name, tool_call_id=m.tool_call_id, tool_calls=m.wire_tool_calls())
        for c, m in zip(chat, body.messages, strict=True)
    )
    return openai_ask(
        request,
        body,
        prompt=prompt,
        messages=chat,
        inputs=pieces,
        input_chars=input_chars(pieces),
        input_field="messages",
        max_tokens=body.max_completion_tokens or body.max_tokens,
        max_tokens_field="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        decoding=Decoding(
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_list()),
        ),
        extra=body.forwarded(),
    )


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_model(request, ChatCompletionRequest)
    run = partial(prepare, request.app[STATE], await bulk_ask(request, chat_ask, body))
    if not body.stream:
        return await serve_unary(request, run, ChatCompletionFold(body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve(request, run, ChatChunkWriter(body.model, include_usage=include_usage))
