"""A judge detector over any OpenAI-compatible server (`type: openai_judge`, DESIGN 6): a safety
model (Llama Guard, Granite Guardian, ShieldGemma, or any instruct model zero-shot) reads each
chunk through a prompt template and answers safe or unsafe.

It is a classifier (`judges_chunks`): each content gets one detection spanning it whole, whose
score in [0, 1] is the probability of the unsafe answer tokens over the safe and unsafe ones at
the answer's first token (`logprobs`, where the server returns them), else the answer text's
first word (unsafe -> 1.0, safe -> 0.0). On output it reads the conversation and the answer so
far (`JudgeContext`), so a chunk is judged in context, as Llama Guard's Agent turn expects.

Fail-closed (`on_error: block`, the default): a judge that answers an HTTP error, cannot be
reached, misses `timeout_s`, or answers something that is neither safe nor unsafe fails the call
like any detector (DetectorCallError): the text it did not judge never leaves (DESIGN 4.7).
With `on_error: annotate` the call is still counted as an error in the detector-call metrics,
and every content of the failed call gets an `unjudged` detection (detection_type
`judge_error`) that never blocks, redacts or refuses: the text flows with that warning.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from detectors.api import Detection

from ..config import DetectorConfig
from ..judge_templates import (
    LLAMA_GUARD_3_CATEGORIES,
    SHIPPED,
    JudgeContext,
    JudgePrompt,
    is_inline,
)
from .detector_timeout import detector_timeout
from .detectors import (
    DetectorCallError,
    RemoteDetectorClient,
)
from .peers import BodyTooLarge, log_error_body, read_bounded, read_error_body
from .reasons import connection_failure

log = logging.getLogger("guardstream.judges")

# the detection_type of a content an `on_error: annotate` judge could not judge
UNJUDGED_TYPE = "judge_error"
JUDGE_TYPE = "judge"
# answer tokens read: the verdict and Llama Guard's category line ("unsafe\nS1,S10,S14")
ANSWER_TOKENS = 24
# alternatives per answer position asked for (OpenAI's cap on chat `top_logprobs` is 20)
TOP_LOGPROBS = 5
# a judge's reply is one short completion: anything past this is not one
REPLY_BYTES = 1 << 20


class _Top(BaseModel):
    model_config = ConfigDict(extra="ignore")
    token: str
    logprob: float


class _ChatToken(BaseModel):
    model_config = ConfigDict(extra="ignore")
    token: str
    logprob: float
    top_logprobs: list[_Top] = []


class _ChatLogprobs(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: list[_ChatToken] | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str | None = None


class _ChatChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: _ChatMessage
    logprobs: _ChatLogprobs | None = None


class _CompletionLogprobs(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class _CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str
    logprobs: _CompletionLogprobs | None = None


class _ChatReply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    choices: list[_ChatChoice]


class _CompletionReply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    choices: list[_CompletionChoice]


# one answer position: (the token chosen, {alternative: logprob}) in the order generated
Position = tuple[str, dict[str, float]]


def _positions(choice: _ChatChoice | _CompletionChoice) -> list[Position]:
    """The answer's positions with their alternatives, from either API's logprobs shape."""
    if isinstance(choice, _ChatChoice):
        content = choice.logprobs.content if choice.logprobs is not None else None
        return [
            (t.token, {a.token: a.logprob for a in t.top_logprobs} or {t.token: t.logprob})
            for t in content or []
        ]
    lp = choice.logprobs
    if lp is None or not lp.tokens:
        return []
    tops = lp.top_logprobs or []
    out: list[Position] = []
    for i, token in enumerate(lp.tokens):
        top = tops[i] if i < len(tops) and tops[i] else {}
        chosen = lp.token_logprobs[i] if i < len(lp.token_logprobs) else None
        if not top and chosen is not None:
            top = {token: chosen}
        out.append((token, dict(top)))
    return out


def _norm(token: str) -> str:
    return token.strip().lower()


def score_from_logprobs(
    positions: list[Position], unsafe: frozenset[str], safe: frozenset[str]
) -> float | None:
    """P(unsafe) / (P(unsafe) + P(safe)) at the answer's first non-blank position (Llama Guard
    may open with blank lines), from that position's alternatives; None when none of them is an
    answer token, or when the token the judge chose there is none (the caller then reads the
    text). A server returns the top few alternatives only: when the judge answered something
    else ("I cannot help with that": a refusal, or a reply a judged text asked for), an answer
    word in its tail is no verdict, and a lone " safe" there would score 0.0 with the unsafe
    word just below the cut. A logprob that is not a finite number is garbage: ValueError."""
    for chosen, top in positions:
        if not chosen.strip():
            continue
        if _norm(chosen) not in unsafe and _norm(chosen) not in safe:
            return None
        p_unsafe = p_safe = 0.0
        for token, logprob in top.items():
            if not math.isfinite(logprob):
                raise ValueError(f"logprob {logprob} of token {token!r}")
            word = _norm(token)
            if word in unsafe:
                p_unsafe += math.exp(min(logprob, 0.0))
            elif word in safe:
                p_safe += math.exp(min(logprob, 0.0))
        if p_unsafe + p_safe == 0.0:
            return None
        return p_unsafe / (p_unsafe + p_safe)
    return None


def score_from_text(answer: str, unsafe: frozenset[str], safe: frozenset[str]) -> float | None:
    """1.0 when the answer's first word is an unsafe token, 0.0 for a safe one, None for
    anything else (garbage)."""
    words = answer.strip().split(None, 1)
    if not words:
        return None
    first = _norm(words[0].strip(".,:;!\"'"))
    if first in unsafe:
        return 1.0
    if first in safe:
        return 0.0
    return None


def category_codes(answer: str, known: Collection[str]) -> list[str]:
    """Llama Guard's second line, `S1,S10`, as codes: only those of `known` (the categories
    the judge was asked about; none when there is no second line). The line is the judge
    model's text, which read the text it judges: anything else there could quote what a
    blocking or redacting judge withholds (`Mix the bomb parts`), and a detection's name
    reaches the client (a refusal's detections, a `[{entity}]` replacement)."""
    lines = [line.strip() for line in answer.strip().splitlines()]
    if len(lines) < 2:
        return []
    return [code for c in lines[1].split(",") if (code := c.strip()) in known]


class JudgeDetectorClient(RemoteDetectorClient):
    """`type: openai_judge`: one completion per content, the contents of a call concurrently
    (a batching server such as vLLM batches them; its prefix cache makes the repeated
    conversation cheap), one shared pooled session for every judge."""

    health_path = "/v1/models"

    def _contents_path(self, config: DetectorConfig) -> str:
        return "/v1/chat/completions" if config.api == "chat" else "/v1/completions"

    def _set_up(self, config: DetectorConfig) -> None:
        assert config.model is not None and config.template is not None
        self._chat = config.api == "chat"
        shipped = None if is_inline(config.template) else SHIPPED[config.template]
        unsafe = config.unsafe_tokens or (shipped.unsafe_tokens if shipped else ())
        safe = config.safe_tokens or (shipped.safe_tokens if shipped else ())
        self._unsafe = frozenset(map(_norm, unsafe))
        self._safe = frozenset(map(_norm, safe))
        params = {
            k: v
            for k, v in config.params.items()
            if k not in ("threshold", "on_detection", "redact_with")
        }
        self._prompt = JudgePrompt(config.template, config.categories, params)
        self.on_error = config.on_error or "block"

    @property
    def judges_chunks(self) -> bool:
        return True

    @property
    def reads_context(self) -> bool:
        return True

    @property
    def caches_verdicts(self) -> bool:
        """Never: a judge judges in the conversation's context (its verdict depends on more
        than the content), and an `on_error: annotate` judge's failure is an `unjudged`
        reply that must not outlive the failure."""
        return False

    async def detect(
        self,
        contents: list[str],
        params: dict[str, Any],
        context: JudgeContext | None = None,
    ) -> list[list[Detection]]:
        """As any detector's (a failure is recorded as an `error` call); with `on_error:
        annotate` a failed call answers an `unjudged` detection per content instead of
        failing the request."""
        try:
            return await super().detect(contents, params, context)
        except DetectorCallError as exc:
            if self.on_error == "block" or exc.invalid_params:
                raise
            log.warning(
                "judge %s did not judge %d contents: %s",
                self.detector_id,
                len(contents),
                exc.message,
            )
            return [[_unjudged(content, exc.message)] for content in contents]

    async def _detect(self, contents: list[str], params: dict[str, Any]) -> list[list[Detection]]:
        return await self._detect_in_context(contents, params, None)

    async def _detect_in_context(
        self, contents: list[str], params: dict[str, Any], context: JudgeContext | None
    ) -> list[list[Detection]]:
        output = context is not None
        ctx = context or JudgeContext()
        prompts: list[str] = []
        prefix = ctx.prefix
        for content in contents:
            here = replace(ctx, prefix=prefix)  # (its judge-ready conversation kept)
            prompts.append(self._prompt.render(here, content, output=output))
            if output:
                prefix += content
        try:
            async with detector_timeout(self.config.timeout_s):
                async with asyncio.TaskGroup() as tg:
                    calls = [tg.create_task(self._judge_one(p)) for p in prompts]
        except* DetectorCallError as group:
            raise group.exceptions[0] from None
        except* TimeoutError:
            raise DetectorCallError(
                self.detector_id, f"timed out after {self.config.timeout_s:g} s"
            ) from None
        return [
            [self._detection(content, *call.result())]
            for content, call in zip(contents, calls, strict=True)
        ]

    def _detection(self, content: str, score: float, answer: str) -> Detection:
        names = self.config.categories or {}
        # the codes the prompt listed: the config's, else Llama Guard 3's (judge_templates)
        codes = category_codes(answer, names or LLAMA_GUARD_3_CATEGORIES) if score > 0 else []
        entity = ",".join(names.get(c, c) for c in codes) if codes and names else "unsafe"
        return Detection(
            start=0,
            end=len(content),
            text=content,
            detection=entity,
            detection_type=JUDGE_TYPE,
            score=score,
            metadata={"categories": codes} if codes else None,
        )

    async def _judge_one(self, prompt: str) -> tuple[float, str]:
        """(score, answer text) of one prompt; DetectorCallError for anything that is not a
        verdict."""
        body: dict[str, Any] = {
            "model": self.config.model,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "stream": False,
        }
        if self._chat:
            body |= {
                "messages": [{"role": "user", "content": prompt}],
                "logprobs": True,
                "top_logprobs": TOP_LOGPROBS,
            }
        else:
            body |= {"prompt": prompt, "logprobs": TOP_LOGPROBS}
        raw = await self._post(body)
        try:
            data = orjson.loads(raw)
            if self._chat:
                choice: _ChatChoice | _CompletionChoice = _ChatReply.model_validate(data).choices[0]
                answer = choice.message.content or ""  # type: ignore[union-attr]
            else:
                choice = _CompletionReply.model_validate(data).choices[0]
                answer = choice.text  # type: ignore[union-attr]
            score = score_from_logprobs(_positions(choice), self._unsafe, self._safe)
        except (orjson.JSONDecodeError, ValidationError, IndexError, ValueError) as exc:
            log.warning("judge %s: malformed reply: %s", self.detector_id, exc)
            raise DetectorCallError(self.detector_id, "malformed reply") from None
        if score is None:
            score = score_from_text(answer, self._unsafe, self._safe)
        if score is None:
            log.warning(
                "judge %s answered neither safe nor unsafe: %r", self.detector_id, answer[:200]
            )
            raise DetectorCallError(self.detector_id, "answered neither safe nor unsafe")
        return score, answer

    async def _post(self, body: dict[str, Any]) -> bytes:
        hdrs = {"content-type": "application/json", **self._auth}
        try:
            async with self._session.post(
                self._url,
                data=orjson.dumps(body),
                headers=hdrs,
                ssl=self._ssl,
                allow_redirects=False,  # a peer we do not trust (DESIGN 6): see peers.py
            ) as resp:
                if resp.status != 200:
                    log_error_body(
                        f"judge {self.detector_id}", resp.status, await read_error_body(resp)
                    )
                    hint = " (check the judge's api_key_env)" if resp.status in (401, 403) else ""
                    raise DetectorCallError(self.detector_id, f"HTTP {resp.status}{hint}")
                return await read_bounded(resp, REPLY_BYTES)
        except BodyTooLarge as exc:
            raise DetectorCallError(self.detector_id, f"reply {exc}") from None
        except aiohttp.ClientError as exc:
            log.warning("judge %s: call to %s failed: %s", self.detector_id, self._url, exc)
            reason = connection_failure(exc)
            raise DetectorCallError(self.detector_id, f"request failed: {reason}") from None

    async def health(self) -> bool:
        try:
            async with self._session.get(
                self._health_url,
                headers=self._auth,
                timeout=aiohttp.ClientTimeout(total=2),
                ssl=self._ssl,
                allow_redirects=False,
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def _unjudged(content: str, reason: str) -> Detection:
    return Detection(
        start=0,
        end=len(content),
        text=content,
        detection="unjudged",
        detection_type=UNJUDGED_TYPE,
        score=0.0,
        metadata={"reason": reason},
    )
