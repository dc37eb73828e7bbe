"""POST /v1/responses: the OpenAI Responses API over the guarded pipeline, with the
OpenResponses streaming events (DESIGN 4.9). Stateless: the whole conversation comes in
`input`. Parse, prepare, then the serving loop (handlers/serving.py) with the Responses writer
or fold. Every 4xx is raised before the first byte; after that, the stream itself says how it
ended (`response.completed`, `response.incomplete`, `response.failed`, or `error` when no
response object was created yet)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from aiohttp import web

from ..api.input_pieces import input_chars
from ..api.openai_responses import ResponsesRequest, check_stateless
from ..state import STATE, AppState
from ..streaming.guarded_generation import GuardedGeneration
from ..streaming.responses_writer import ResponsesFold, ResponsesWriter
from .body import decode_body, read_body, require_json_content_type
from .prepare import Decoding, GenerationAsk, conversation, openai_ask, prepare
from .serving import bulk_ask, serve, serve_unary

RESPONSES_PATH = "/v1/responses"


async def read_request(request: web.Request) -> ResponsesRequest:
    """The body, with stored-state and tool requests refused (400) before schema errors (422)."""
    require_json_content_type(request)
    return await decode_body(await read_body(request), ResponsesRequest, check_stateless)


def responses_ask(request: web.Request, body: ResponsesRequest) -> GenerationAsk:
    """`instructions` and every input item are judged, each on its own (DESIGN 4.9)."""
    turns = body.chat()
    pieces = body.input_pieces()
    messages = [(role, text) for role, text, _ in turns]
    prompt, chat = conversation(messages)
    chat = tuple(
        replace(
            m,
            tool_call_id=tools.get("tool_call_id"),
            tool_calls=tuple(tools["tool_calls"]) if "tool_calls" in tools else None,
        )
        for m, (_, _, tools) in zip(chat, turns, strict=True)
    )
    return openai_ask(
        request,
        body,
        prompt=prompt,
        messages=chat,
        inputs=pieces,
        input_chars=input_chars(pieces),
        input_field="input",
        max_tokens=body.max_output_tokens,
        max_tokens_field="max_output_tokens",
        decoding=Decoding(temperature=body.temperature, top_p=body.top_p),
        extra=body.chat_tools(),
    )


async def prepare_response(
    state: AppState, ask: GenerationAsk, writer: ResponsesWriter
) -> GuardedGeneration:
    """The pipeline; `writer` learns whether it redacts input (then the labels, `metadata`,
    `user` and `safety_identifier`, which no guardrail judges, are not echoed)."""
    pipeline = await prepare(state, ask)
    writer.withhold_labels = pipeline.redacts_input
    return pipeline


async def handle(request: web.Request) -> web.StreamResponse:
    body = await read_request(request)
    state, ask = request.app[STATE], await bulk_ask(request, responses_ask, body)
    if not body.stream:
        fold = ResponsesFold(body)
        return await serve_unary(request, partial(prepare_response, state, ask, fold.writer), fold)
    writer = ResponsesWriter(body)
    return await serve(request, partial(prepare_response, state, ask, writer), writer)
