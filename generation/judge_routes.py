"""The engine's judge-session routes (DESIGN 7, judge sessions; judge_sessions.py does the work).

- `POST /v1/judge/sessions` `{"head", "tail", "unsafe_tokens", "safe_tokens", "chunks"?}` opens a
  session: the template's head (tokenized with the model's special tokens) is its prefix, the
  tail closes every judgement; `chunks` (optional) are judged at once, as if appended one by one
  (the rebuild of a session whose replica died). 200 `{"session_id", "head_tokens",
  "tail_tokens", "unsafe_token_ids", "safe_token_ids"}` plus the verdict when `chunks` is given;
  429 `too_many_sessions` when the engine holds its maximum.
- `POST /v1/judge/sessions/{id}/append` `{"chunk"}`: the chunk joins the judged prefix;
  200 `{"score", "p_unsafe", "p_safe", "judged_tokens", "forward_tokens", "chunk_tokens"}`.
- Both take `answer_tokens` (0-64, default 0) and `answer_min_score` (default 0.5): when the
  score reaches it, the judge's answer is generated after the tail (the verdict, its most
  probable unsafe token, then greedy tokens to an end of sequence or `answer_tokens`) and
  returned as `answer` (Llama Guard's "unsafe\nS1,S10": the orchestrator reads its categories).
- `DELETE /v1/judge/sessions/{id}`: 204; its KV rows are freed. Unknown ids are 404.

Each chunk is tokenized alone (no special tokens), so a session's tokens are the head's, then
each chunk's, then the tail's: the same whether the chunks came one by one or at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, Field

from .control_tokens import encode_text
from .jobs import EngineUnavailable
from .judge_sessions import JudgeSession, JudgeSessionError, Verdict, answer_token_ids
from .models import LoadedModel
from .protocol import _STRICT, Utf8Str

SESSIONS_PATH = "/v1/judge/sessions"
MAX_ANSWER_WORDS = 16
MAX_ANSWER_TOKENS = 64
AnswerWords = Annotated[
    list[Annotated[Utf8Str, Field(min_length=1)]],
    Field(min_length=1, max_length=MAX_ANSWER_WORDS),
]


class AnswerRequest(BaseModel):
    """Ask for the judge's answer text after the verdict (Llama Guard's category line): up to
    `answer_tokens` generated tokens when the score reaches `answer_min_score`."""

    model_config = _STRICT

    answer_tokens: int = Field(0, ge=0, le=MAX_ANSWER_TOKENS)
    answer_min_score: float = Field(0.5, ge=0.0, le=1.0)


class OpenSession(AnswerRequest):
    head: Utf8Str
    tail: Utf8Str = ""
    unsafe_tokens: AnswerWords
    safe_tokens: AnswerWords
    chunks: list[Utf8Str] = []


class AppendChunk(AnswerRequest):
    chunk: Utf8Str


@dataclass(frozen=True, slots=True)
class Server:
    """What the routes use of server.py, passed in (server.py imports this module): its state
    key, its 4xx exception `client_error(status, details, type, headers=)`, body reader and
    the size a request's text counts toward the tokenizer's queue (`text_size`)."""

    state: web.AppKey[Any]
    client_error: Callable[..., Exception]
    read_model: Callable[[web.Request, type[BaseModel]], Awaitable[Any]]
    text_size: Callable[[web.Request], int]


SERVER = web.AppKey("guardstream_judge_routes", Server)


def add_routes(app: web.Application, server: Server) -> None:
    app[SERVER] = server
    app.router.add_post(SESSIONS_PATH, handle_open)
    app.router.add_post(SESSIONS_PATH + "/{session_id}/append", handle_append)
    app.router.add_delete(SESSIONS_PATH + "/{session_id}", handle_close)


def _encode_open(loaded: LoadedModel, req: OpenSession) -> dict[str, Any]:
    """Token ids of the session's parts (tokenizer thread)."""
    tokenizer: Any = loaded.frontend_tokenizer
    unsafe = answer_token_ids(tokenizer, req.unsafe_tokens)
    safe = answer_token_ids(tokenizer, req.safe_tokens)
    shared = set(unsafe) & set(safe)  # a token of both answers tells neither apart
    return {
        "head": list(tokenizer(req.head, add_special_tokens=True)["input_ids"]),
        "tail": list(tokenizer(req.tail, add_special_tokens=False)["input_ids"]),
        "unsafe": [t for t in unsafe if t not in shared],
        "safe": [t for t in safe if t not in shared],
        "chunks": [_encode_chunk(loaded, c) for c in req.chunks],
    }


def _encode_chunk(loaded: LoadedModel, chunk: str) -> list[int]:
    # the judged text is a client's or the model's: its special tokens' text is text, or a
    # chunk could close the judge's turn and write the verdict itself (control_tokens.py)
    return encode_text(loaded.frontend_tokenizer, chunk)


def _client_error(server: Server, exc: JudgeSessionError) -> Exception:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return server.client_error(exc.status, exc.message, exc.type, headers=headers)


async def _verdict(state: Any, v: Verdict) -> dict[str, Any]:
    body: dict[str, Any] = {
        "score": v.score,
        "p_unsafe": v.p_unsafe,
        "p_safe": v.p_safe,
        "judged_tokens": v.judged_tokens,
        "forward_tokens": v.forward_tokens,
    }
    if v.answer_ids is not None:
        body["answer"] = await state.run_tokenizer(_decode, state.loaded, v.answer_ids)
    return body


def _decode(loaded: LoadedModel, ids: list[int]) -> str:
    tokenizer: Any = loaded.frontend_tokenizer
    return str(tokenizer.decode(ids, skip_special_tokens=True))


async def _judge(
    server: Server, state: Any, session: JudgeSession, ids: list[int], answer: AnswerRequest
) -> Verdict:
    try:
        if not state.engine.healthy:
            raise EngineUnavailable("the engine is not running")
        future = state.engine.judges.append(
            session, ids, answer.answer_tokens, answer.answer_min_score
        )
        return await asyncio.wrap_future(future)
    except JudgeSessionError as exc:
        raise _client_error(server, exc) from None
    except EngineUnavailable as exc:
        raise server.client_error(503, str(exc), "generation_unavailable") from None


async def handle_open(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    state = request.app[server.state]
    req: OpenSession = await server.read_model(request, OpenSession)
    parts = await state.run_tokenizer(
        _encode_open, state.loaded, req, chars=server.text_size(request)
    )
    if not parts["unsafe"] or not parts["safe"]:
        raise server.client_error(
            422, "unsafe_tokens and safe_tokens need a first token of their own each"
        )
    judges = state.engine.judges
    pending = judges.ready()  # the static judge pool, built by the worker at the first open
    if pending is not None:
        await asyncio.wrap_future(pending)
    try:
        session = judges.open(parts["head"], parts["tail"], parts["unsafe"], parts["safe"])
    except JudgeSessionError as exc:
        raise _client_error(server, exc) from None
    body: dict[str, Any] = {
        "session_id": session.id,
        "head_tokens": len(parts["head"]),
        "tail_tokens": len(parts["tail"]),
        "unsafe_token_ids": parts["unsafe"],
        "safe_token_ids": parts["safe"],
    }
    if req.chunks:
        ids = [t for chunk in parts["chunks"] for t in chunk]
        try:
            body.update(await _verdict(state, await _judge(server, state, session, ids, req)))
        except BaseException:
            judges.close(session.id)
            raise
    return web.json_response(body)


async def handle_append(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    state = request.app[server.state]
    req: AppendChunk = await server.read_model(request, AppendChunk)
    try:
        session = state.engine.judges.get(request.match_info["session_id"])
    except JudgeSessionError as exc:
        raise _client_error(server, exc) from None
    ids = await state.run_tokenizer(
        _encode_chunk, state.loaded, req.chunk, chars=server.text_size(request)
    )
    verdict = await _judge(server, state, session, ids, req)
    return web.json_response({**await _verdict(state, verdict), "chunk_tokens": len(ids)})


async def handle_close(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    state = request.app[server.state]
    session_id = request.match_info["session_id"]
    if not state.engine.judges.close(session_id):
        raise server.client_error(404, f"no judge session {session_id!r}", "not_found")
    return web.Response(status=204)
