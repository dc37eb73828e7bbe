"""A judge detector on our own engine (`type: engine_judge`, DESIGN 6): the safety model judges a
streamed answer incrementally through the engine's judge sessions (DESIGN 7).

One session per stream and direction. The detector API is stateless (each call brings its
contents and, on output, the conversation, the answer before them and the stream's token:
`JudgeContext`), so a stream's session is found by its stream and what it has judged: the
conversation and the answer so far. A call whose context names a judged text takes that session
(out of the table while it works, so two calls never append to one session), appends each
content (the engine prefills only its tokens and the template's tail) and puts it back under the
longer text. A miss (a new stream, or one whose session was evicted) opens a session prefilled
with the answer so far. Two streams never share a session, even with the same text: a hit on
another stream's (another tenant's) would tell, by its timing, what that stream was sent and
answered. When a stream ends, however it ends, its session is closed at once (`release`): the
engine's session slots are for streams being judged (held by ended ones, up to MAX_STREAMS of
them, they refused every new stream with 429, failed closed, until the engine's idle timeout).

Replicas. Each session lives on one engine replica. When the replica fails (cannot connect, a
5xx, the session unknown there: the engine restarted or expired it), the session is rebuilt on
another replica by prefilling its chunks, as kept here: the same tokens (each chunk is tokenized
alone, as appended), so the same scores, and the stream goes on. Only when every replica fails
does the call fail, and a failed call is fail-closed (`on_error: block`, JudgeDetectorClient).

Input (no context) and the content endpoints: each content is judged alone, in a session opened
with it and closed at once.

The score is the engine's (P(unsafe tokens) over P(unsafe + safe) at the answer position). With
`categories` configured (or the `llama_guard` template), the engine also generates the answer
after the verdict when the score reaches the detector's threshold (at most 0.5): Llama Guard's
second line, read by the same parser as `openai_judge`'s (`JudgeDetectorClient._detection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from detectors.api import Detection
from detectors.normalise import visible

from ..config import DetectorConfig
from ..judge_templates import SHIPPED, JudgeContext, JudgePrompt, is_inline
from .detector_timeout import detector_timeout
from .detectors import (
    CallRecorder,
    DetectorCallError,
    DetectorClient,
    _ignore_call,
    detector_api_key,
)
from .judges import ANSWER_TOKENS, JudgeDetectorClient
from .managed import EngineProcess, engine_command
from .peers import BodyTooLarge, log_error_body, read_bounded, read_error_body
from .reasons import connection_failure

log = logging.getLogger("guardstream.judges")

#: Streams whose sessions are kept between calls (least recently used closed beyond it): a
#: bound on top of `release`, which closes a stream's session when it ends.
MAX_STREAMS = 1024
REPLY_BYTES = 1 << 16
SESSIONS_PATH = "/v1/judge/sessions"


def _key(context: JudgeContext) -> tuple[Any, ...]:
    """Where a stream's session is kept: its stream (one stream's sessions are never another's,
    whatever the text) and what it has judged."""
    return (context.stream, context.messages, context.prefix)


class _ReplicaFailed(Exception):
    """This replica cannot serve the session: try another (the session is rebuilt there).
    `down`: the replica itself failed (not just the session, e.g. expired there)."""

    def __init__(self, reason: str, down: bool = True, full: bool = False) -> None:
        super().__init__(reason)
        self.down = down
        self.full = full  # it answered 429: every session (or its token budget) is in use


@dataclass(slots=True)
class Replica:
    url: str
    api_key: str | None = None
    process: EngineProcess | None = None

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"content-type": "application/json", **auth}


@dataclass(slots=True)
class _Stream:
    """A stream's judgement: its template parts and the chunks judged so far (what a rebuild
    prefills), and where its session is."""

    head: str
    tail: str
    chunks: list[str] = field(default_factory=list)
    replica: int | None = None
    session_id: str | None = None


class EngineJudgeClient(JudgeDetectorClient):
    """`type: engine_judge` (module docstring)."""

    def __init__(
        self,
        detector_id: str,
        config: DetectorConfig,
        session: aiohttp.ClientSession,
        *,
        ssl_context: Any = None,
        on_call: CallRecorder = _ignore_call,
        hidden_env: frozenset[str] = frozenset(),
    ) -> None:
        # JudgeDetectorClient's set-up is an OpenAI server's (one URL); only its verdict
        # handling is shared: the detector's own set-up, then this client's replicas
        DetectorClient.__init__(self, detector_id, config, on_call=on_call)
        assert config.template is not None
        self._session = session
        self._ssl = ssl_context
        shipped = None if is_inline(config.template) else SHIPPED[config.template]
        self._unsafe_words = list(
            config.unsafe_tokens or (shipped.unsafe_tokens if shipped else ())
        )
        self._safe_words = list(config.safe_tokens or (shipped.safe_tokens if shipped else ()))
        params = {
            k: v
            for k, v in config.params.items()
            if k not in ("threshold", "on_detection", "redact_with")
        }
        self._prompt = JudgePrompt(config.template, config.categories, params)
        self.on_error = config.on_error or "block"
        # the answer's category line is generated only when someone reads it
        wants_answer = bool(config.categories) or config.template == "llama_guard"
        self._answer = (
            {
                "answer_tokens": ANSWER_TOKENS,
                "answer_min_score": min(0.5, config.default_threshold),
            }
            if wants_answer
            else {}
        )
        self.replicas: list[Replica] = []
        if config.urls is not None:
            key = detector_api_key(detector_id, config)
            self.replicas = [Replica(u.rstrip("/"), key) for u in config.urls]
        else:
            assert config.model is not None
            command = engine_command(
                config.model, config.device or "auto", api_keys_env="GUARDSTREAM_ENGINE_API_KEYS"
            )
            for i in range(config.replicas or 1):
                process = EngineProcess(
                    f"judge-{detector_id}-{i}", command, session, hidden_env=hidden_env
                )
                self.replicas.append(Replica(process.url, process.api_key, process))
        self._streams: OrderedDict[tuple[Any, ...], _Stream] = OrderedDict()
        self._next = 0  # round robin over replicas for new sessions
        self._down: set[int] = set()  # replicas that failed since they last served
        self._closing: set[asyncio.Future[None]] = set()  # sessions being closed

    async def start(self) -> None:
        """Start the managed engines (none with `urls`)."""
        await asyncio.gather(*(r.process.start() for r in self.replicas if r.process is not None))

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), OrderedDict()
        for stream in streams:
            await self._close_session(stream)
        for replica in self.replicas:
            if replica.process is not None:
                await replica.process.stop()

    async def health(self) -> bool:
        for replica in self.replicas:
            try:
                async with self._session.get(
                    replica.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=2),
                    allow_redirects=False,
                ) as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                continue
        return False

    # ----- judging -----------------------------------------------------------------------------

    async def _detect_in_context(
        self, contents: list[str], params: dict[str, Any], context: JudgeContext | None
    ) -> list[list[Detection]]:
        try:
            async with detector_timeout(self.config.timeout_s):
                if context is None:
                    verdicts = [await self._judge_alone(content) for content in contents]
                else:
                    verdicts = await self._judge_stream(contents, context)
        except TimeoutError:
            raise DetectorCallError(
                self.detector_id, f"timed out after {self.config.timeout_s:g} s"
            ) from None
        return [
            [self._detection(content, score, answer)]
            for content, (score, answer) in zip(contents, verdicts, strict=True)
        ]

    async def _judge_alone(self, content: str) -> tuple[float, str]:
        head, tail = self._prompt.split(JudgeContext(), output=False)
        stream = _Stream(head, tail)
        try:
            return await self._append(stream, content)
        finally:
            await self._close_session(stream)

    async def _judge_stream(
        self, contents: list[str], context: JudgeContext
    ) -> list[tuple[float, str]]:
        stream = self._streams.pop(_key(context), None)
        if stream is None:  # a new stream (or an evicted one): its answer so far is one chunk
            head, tail = self._prompt.split(replace(context, prefix=""), output=True)
            stream = _Stream(head, tail, [visible(context.prefix)] if context.prefix else [])
        verdicts: list[tuple[float, str]] = []
        try:
            for content in contents:
                verdicts.append(await self._append(stream, content))
        except BaseException:
            # the session's state is unknown (an append may have run): it is not reused
            self._close_later(stream)
            raise
        judged = context.prefix + "".join(contents)
        self._keep(_key(replace(context, prefix=judged)), stream)
        return verdicts

    def release(self, context: JudgeContext) -> None:
        """The stream judged up to `context` ended: its session is closed now."""
        stream = self._streams.pop(_key(context), None)
        if stream is not None:
            self._close_later(stream)

    def _keep(self, key: tuple[Any, ...], stream: _Stream) -> None:
        old = self._streams.pop(key, None)
        if old is not None:  # two identical streams: one session is enough
            self._close_later(old)
        self._streams[key] = stream
        while len(self._streams) > MAX_STREAMS:
            _key, evicted = self._streams.popitem(last=False)
            self._close_later(evicted)

    async def _append(self, stream: _Stream, chunk: str) -> tuple[float, str]:
        """The score after `chunk` joins the stream's judged text, and the judge's answer when
        one was generated ("" otherwise); the session is (re)built on another replica when its
        own fails. The judge reads what a reader sees of the chunk (`visible`), as every judge
        does (judge_templates.judged); the engine tokenizes it as text."""
        chunk = visible(chunk)
        failures: list[str] = []
        full = True  # every replica that was asked answered 429 (at capacity, not broken)
        attempts = len(self.replicas)
        forgotten = False  # a live replica forgot the session once: rebuilt, there too
        while attempts > 0:
            attempts -= 1
            index = self._pick(stream)
            replica = self.replicas[index]
            try:
                if stream.session_id is None:
                    body = {
                        "head": stream.head,
                        "tail": stream.tail,
                        "unsafe_tokens": self._unsafe_words,
                        "safe_tokens": self._safe_words,
                        "chunks": [*stream.chunks, chunk],
                        **self._answer,
                    }
                    reply = await self._post(replica, SESSIONS_PATH, body)
                    stream.session_id, stream.replica = reply["session_id"], index
                else:
                    path = f"{SESSIONS_PATH}/{stream.session_id}/append"
                    reply = await self._post(replica, path, {"chunk": chunk, **self._answer})
            except _ReplicaFailed as exc:
                failures.append(f"{replica.url}: {exc}")
                full = full and exc.full
                if exc.down:
                    self._down.add(index)
                elif not forgotten:  # (expired or restarted there; a lone replica included)
                    forgotten, attempts = True, attempts + 1
                stream.session_id = stream.replica = None  # rebuilt from its chunks elsewhere
                continue
            self._down.discard(index)
            stream.chunks.append(chunk)
            score = reply.get("score")
            answer = reply.get("answer", "")
            if (
                not isinstance(score, float)
                or not 0.0 <= score <= 1.0
                or not isinstance(answer, str)
            ):
                raise DetectorCallError(self.detector_id, "malformed reply")
            return score, answer
        log.warning("judge %s: every replica failed: %s", self.detector_id, "; ".join(failures))
        if full:  # at capacity, as a remote detector's 429: the client may retry (overloaded)
            raise DetectorCallError(
                self.detector_id, "every judge engine is at capacity", overloaded=True
            )
        raise DetectorCallError(self.detector_id, "no judge engine could judge the text")

    def _pick(self, stream: _Stream) -> int:
        """The stream's own replica, else the next one in turn that has not failed lately."""
        if stream.replica is not None and stream.session_id is not None:
            return stream.replica
        n = len(self.replicas)
        for step in range(n):
            index = (self._next + step) % n
            if index not in self._down:
                self._next = index + 1
                return index
        index = self._next % n  # all failed lately: try them in turn anyway
        self._next = index + 1
        return index

    async def _post(self, replica: Replica, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._session.post(
                replica.url + path,
                data=orjson.dumps(body),
                headers=replica.headers(),
                allow_redirects=False,
            ) as resp:
                if resp.status != 200:
                    log_error_body(
                        f"judge {self.detector_id}", resp.status, await read_error_body(resp)
                    )
                    if resp.status in (404, 429) or resp.status >= 500:
                        raise _ReplicaFailed(
                            f"HTTP {resp.status}",
                            down=resp.status != 404,
                            full=resp.status == 429,
                        )
                    raise DetectorCallError(self.detector_id, f"HTTP {resp.status}")
                reply = orjson.loads(await read_bounded(resp, REPLY_BYTES))
        except aiohttp.ClientError as exc:
            raise _ReplicaFailed(connection_failure(exc)) from None
        except BodyTooLarge as exc:
            raise DetectorCallError(self.detector_id, f"reply {exc}") from None
        except (orjson.JSONDecodeError, ValueError):
            raise DetectorCallError(self.detector_id, "malformed reply") from None
        if not isinstance(reply, dict):
            raise DetectorCallError(self.detector_id, "malformed reply")
        return reply

    def _close_later(self, stream: _Stream) -> None:
        task = asyncio.ensure_future(self._close_session(stream))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_session(self, stream: _Stream) -> None:
        """Free the session's KV rows (best effort: an engine also closes idle sessions)."""
        session_id, index = stream.session_id, stream.replica
        stream.session_id = stream.replica = None
        if session_id is None or index is None:
            return
        replica = self.replicas[index]
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._session.delete(
                f"{replica.url}{SESSIONS_PATH}/{session_id}",
                headers=replica.headers(),
                timeout=aiohttp.ClientTimeout(total=5),
                allow_redirects=False,
            ):
                pass
