"""The engine's judge-session routes (DESIGN 7, judge sessions; judge_sessions.py does the work).

- `POST /v1/judge/sessions` `{"head", "tail", "unsafe_tokens", "safe_tokens", "chunks"?}` opens a
  session: the template's head (tokenized with the model's special tokens) is its prefix, the
  tail closes every judgement; `chunks` (optional) are judged at once, as if appended one by one
  (the rebuild of a session whose replica died). 200 `{"session_id", "head_tokens",
  "tail_tokens", "unsafe_token_ids", "safe_token_ids"}` plus the verdict when `chunks` is given;
  429 `too_many_sessions` when the engine holds its maximum.
- `POST /v1/judge/sessions/{id}/append` `{"chunk"}`: the chunk joins the judged prefix;
  200 `{"score", "p_unsafe", "p_safe", "judged_tokens", "forward_tokens", "chunk_tokens"}`.
- `DELETE /v1/judge/sessions/{id}`: 204; its KV rows are freed. Unknown ids are 404.

Each chunk is tokenized alone (no special tokens), so a session's tokens are the head's, then
each chunk's, then the tail's: the same whether the chunks came one by one or at once.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, Field

from .jobs import EngineUnavailable
from .judge_sessions import JudgeSessionError, Verdict, answer_token_ids
from .models import LoadedModel
from .protocol import _STRICT, Utf8Str
from .server import STATE, ClientError, _read_model

SESSIONS_PATH = "/v1/judge/sessions"
MAX_ANSWER_WORDS = 16
AnswerWords = Annotated[
    list[Annotated[Utf8Str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_ANSWER_WORDS)
]


class OpenSession(BaseModel):
    model_config = _STRICT

    head: Utf8Str
    tail: Utf8Str = ""
    unsafe_tokens: AnswerWords
    safe_tokens: AnswerWords
    chunks: list[Utf8Str] = []


class AppendChunk(BaseModel):
    model_config = _STRICT

    chunk: Utf8Str


def add_routes(app: web.Application) -> None:
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
    tokenizer: Any = loaded.frontend_tokenizer
    return list(tokenizer(chunk, add_special_tokens=False)["input_ids"]) if chunk else []


def _client_error(exc: JudgeSessionError) -> ClientError:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return ClientError(exc.status, exc.message, exc.type, headers=headers)


def _verdict(v: Verdict) -> dict[str, Any]:
    return {
        "score": v.score,
        "p_unsafe": v.p_unsafe,
        "p_safe": v.p_safe,
        "judged_tokens": v.judged_tokens,
        "forward_tokens": v.forward_tokens,
    }


async def _judge(state: Any, session: Any, ids: list[int]) -> Verdict:
    try:
        if not state.engine.healthy:
            raise EngineUnavailable("the engine is not running")
        future = state.engine.judges.append(session, ids)
        return await asyncio.wrap_future(future)
    except JudgeSessionError as exc:
        raise _client_error(exc) from None
    except EngineUnavailable as exc:
        raise ClientError(503, str(exc), "generation_unavailable") from None


async def handle_open(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: OpenSession = await _read_model(request, OpenSession)
    parts = await state.run_tokenizer(_encode_open, state.loaded, req)
    if not parts["unsafe"] or not parts["safe"]:
        raise ClientError(422, "unsafe_tokens and safe_tokens need a first token of their own each")
    judges = state.engine.judges
    try:
        session = judges.open(parts["head"], parts["tail"], parts["unsafe"], parts["safe"])
    except JudgeSessionError as exc:
        raise _client_error(exc) from None
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
            body.update(_verdict(await _judge(state, session, ids)))
        except BaseException:
            judges.close(session.id)
            raise
    return web.json_response(body)


async def handle_append(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: AppendChunk = await _read_model(request, AppendChunk)
    try:
        session = state.engine.judges.get(request.match_info["session_id"])
    except JudgeSessionError as exc:
        raise _client_error(exc) from None
    ids = await state.run_tokenizer(_encode_chunk, state.loaded, req.chunk)
    verdict = await _judge(state, session, ids)
    return web.json_response({**_verdict(verdict), "chunk_tokens": len(ids)})


async def handle_close(request: web.Request) -> web.Response:
    state = request.app[STATE]
    session_id = request.match_info["session_id"]
    if not state.engine.judges.close(session_id):
        raise ClientError(404, f"no judge session {session_id!r}", "not_found")
    return web.Response(status=204)
