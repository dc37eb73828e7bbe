"""A fake safety model behind an OpenAI-compatible server, over a real socket: `POST
/v1/completions` and `POST /v1/chat/completions` with `stream: false`, answering as vLLM does,
with `logprobs` in each API's own shape (completions: `tokens`, `token_logprobs`,
`top_logprobs` as `{token: logprob}` per position; chat: `logprobs.content[]` with `token`,
`logprob`, `bytes`, `top_logprobs[]`), and `GET /v1/models`.

The "model" answers `unsafe_answer` (Llama Guard's `unsafe\\nS1,S10`, or `Yes`) when the
rendered prompt holds one of `triggers`, else `safe_answer`; `logprobs` gives the alternatives
at the answer's first position by its first word (no entry, or `send_logprobs=False`: the reply
has `logprobs: null`, as servers that do not return them). `leading` opens every answer with
blank tokens (Llama Guard 3 may start with a newline). Faults (`fault`, on every request, or
only on prompts that hold `fault_on`): `http` (500 with an error body), `garbage` (an answer that
is neither safe nor unsafe), `malformed` (a 200 whose body is cut-off JSON), `hang` (no answer, ever: a judge past any timeout), `kill` (the
connection is reset mid-request, as when the server process dies). Every prompt is recorded in
`prompts`, and `arrived` is set when a request comes in.

The same model also speaks our engine's judge sessions (DESIGN 7; generation/judge_routes.py):
`POST /v1/judge/sessions`, `.../{id}/append`, `DELETE .../{id}`, `GET /health`. A session's
text is its head, chunks and tail; the score is `session_scores` (unsafe, safe) by the same
triggers, and `answer` (the verdict text above) is sent when the request asks for
`answer_tokens` and the score reaches `answer_min_score`, as the engine does. Session requests
are recorded in `session_requests`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from tests.fakes.upstream import FakeUpstream

FILLER_LOGPROB = -0.01


def answer_tokens(text: str) -> list[str]:
    """An answer as tokens: words and each newline apart (`unsafe\\nS1` -> unsafe, \\n, S1)."""
    return re.findall(r"\n|[^\s]+|[ \t]+", text)


@dataclass
class FakeJudge(FakeUpstream):
    triggers: tuple[str, ...] = ("bomb",)
    unsafe_answer: str = "unsafe\nS1,S9"
    safe_answer: str = "safe"
    logprobs: dict[str, dict[str, float]] = field(default_factory=dict)
    send_logprobs: bool = True
    leading: str = ""
    model: str = "guard-model"
    fault: Literal["http", "garbage", "malformed", "hang", "kill"] | None = None
    fault_on: str | None = None
    session_scores: tuple[float, float] = (0.96875, 0.03125)

    def __post_init__(self) -> None:
        self.sessions: dict[str, list[str]] = {}
        self.session_requests: list[dict[str, Any]] = []
        self.prompts: list[str] = []
        self.requests: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self.hanging = 0  # calls held by the `hang` fault now
        self._init_upstream()

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get(
            "/v1/models", lambda r: web.json_response({"data": [{"id": self.model}]})
        )
        app.router.add_post("/v1/judge/sessions", self._open_session)
        app.router.add_post("/v1/judge/sessions/{sid}/append", self._append)
        app.router.add_delete("/v1/judge/sessions/{sid}", self._close_session)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        await self._serve(app)
        return self.url

    def _judged(self, parts: list[str], body: dict[str, Any]) -> dict[str, Any]:
        text = "".join(parts)
        self.prompts.append(text)
        unsafe, safe = self.session_scores
        score = unsafe if any(t in text for t in self.triggers) else safe
        reply: dict[str, Any] = {"score": score, "p_unsafe": score, "p_safe": 1.0 - score}
        if body.get("answer_tokens", 0) and score >= body.get("answer_min_score", 0.5):
            reply["answer"] = self.verdict(text)
        return reply

    async def _open_session(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.session_requests.append(body)
        sid = f"js-{len(self.session_requests)}"
        self.sessions[sid] = [body["head"], *body.get("chunks", [])]
        reply = {"session_id": sid}
        if body.get("chunks"):
            reply |= self._judged([*self.sessions[sid], body.get("tail", "")], body)
        self.sessions[sid].append(body.get("tail", ""))  # the tail last, the chunks before it
        return web.json_response(reply)

    async def _append(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.session_requests.append(body)
        parts = self.sessions.get(request.match_info["sid"])
        if parts is None:
            return web.json_response({"code": 404, "details": "no session"}, status=404)
        parts.insert(len(parts) - 1, body["chunk"])
        return web.json_response(self._judged(parts, body))

    async def _close_session(self, request: web.Request) -> web.Response:
        self.sessions.pop(request.match_info["sid"], None)
        return web.Response(status=204)

    def verdict(self, prompt: str) -> str:
        flagged = any(t in prompt for t in self.triggers)
        return self.unsafe_answer if flagged else self.safe_answer

    async def _admit(self, request: web.Request, prompt_of: Any) -> tuple[str, web.Response | None]:
        body = await request.json()
        self.requests.append(body)
        prompt = prompt_of(body)
        self.prompts.append(prompt)
        self.arrived.set()
        fault = self.fault if self.fault_on is None or self.fault_on in prompt else None
        if fault == "hang":
            self.hanging += 1
            try:
                await asyncio.Event().wait()  # until the server closes or the client goes
            finally:
                self.hanging -= 1
        if fault == "kill":
            assert request.transport is not None
            request.transport.abort()  # the handler is cancelled with the connection
            await asyncio.Event().wait()
        if fault == "http":
            error = {"message": "judge down", "type": "InternalError", "code": 500}
            return "", web.json_response({"error": error}, status=500)
        if fault == "garbage":
            return "I cannot help with that.", None
        if fault == "malformed":
            body = b'{"id": "cmpl-judge", "choices": [{"index": 0, "text": "saf'
            return "", web.Response(body=body, content_type="application/json")
        return self.leading + self.verdict(prompt), None

    def _first(self, tokens: list[str]) -> tuple[int, dict[str, float]]:
        """The first non-blank answer position and its alternatives (empty: none sent)."""
        for i, token in enumerate(tokens):
            if token.strip():
                return i, dict(self.logprobs.get(token.strip(), {}))
        return -1, {}

    async def _completions(self, request: web.Request) -> web.Response:
        text, refused = await self._admit(request, lambda b: b["prompt"])
        if refused is not None:
            return refused
        tokens = answer_tokens(text)
        first, top = self._first(tokens)
        logprobs = None
        if self.send_logprobs and top:
            tops = [top if i == first else {t: FILLER_LOGPROB} for i, t in enumerate(tokens)]
            chosen = [
                top.get(t, FILLER_LOGPROB) if i == first else FILLER_LOGPROB
                for i, t in enumerate(tokens)
            ]
            logprobs = {
                "tokens": tokens,
                "token_logprobs": chosen,
                "top_logprobs": tops,
                "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))],
            }
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "stop"}
        return web.json_response(
            {
                "id": "cmpl-judge",
                "object": "text_completion",
                "model": self.model,
                "choices": [choice],
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        text, refused = await self._admit(request, lambda b: b["messages"][-1]["content"])
        if refused is not None:
            return refused
        tokens = answer_tokens(text)
        first, top = self._first(tokens)
        logprobs = None
        if self.send_logprobs and top:

            def entry(token: str, logprob: float) -> dict[str, Any]:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            content = []
            for i, token in enumerate(tokens):
                alternatives = top if i == first else {token: FILLER_LOGPROB}
                content.append(
                    {
                        **entry(token, alternatives.get(token, FILLER_LOGPROB)),
                        "top_logprobs": [entry(t, lp) for t, lp in alternatives.items()],
                    }
                )
            logprobs = {"content": content}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": "stop",
        }
        return web.json_response(
            {
                "id": "chatcmpl-judge",
                "object": "chat.completion",
                "model": self.model,
                "choices": [choice],
            }
        )
