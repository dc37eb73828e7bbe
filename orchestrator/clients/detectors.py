"""Detector clients: in-process built-ins and remote services speaking the detector API (DESIGN 6).

Both answer `detect(contents, params) -> list[list[Detection]]` and fail with DetectorCallError,
which names the detector, for every way a detector can let a request down: HTTP error, timeout,
malformed reply, or a reply whose count differs from the contents sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

import detectors
from detectors.api import ContentsRequest, Detection

from .. import tracing
from ..config import ConfigError, DetectorConfig
from ..judge_templates import JudgeContext
from .detector_timeout import detector_timeout
from .peers import BodyTooLarge, log_error_body, read_bounded, read_error_body
from .reasons import connection_failure

_REPLY = TypeAdapter(list[list[Detection]])
_NO_AIOHTTP_TIMEOUT = aiohttp.ClientTimeout()  # detector_timeout bounds a call instead
# bodies and replies past this many characters/bytes are encoded and parsed off the event loop
_LARGE_CHARS = 256 * 1024
# A remote detector's reply is bounded (DESIGN 6): more detections than this for one content is
# a detector_error, and a reply is read up to reply_limit(contents) bytes before it is parsed
MAX_DETECTIONS_PER_CONTENT = 10_000
REPLY_BASE_BYTES = 1 << 20
# room for MAX_DETECTIONS_PER_CONTENT detections of ~200 bytes each
REPLY_BYTES_PER_CONTENT = 2 << 20


log = logging.getLogger("guardstream.detectors")
T = TypeVar("T")


class DetectorCallError(Exception):
    """A detector call failed; `message` is safe to show to the client. `overloaded`: the
    detector refused this call because it is full (its micro-batch queue, or a remote service's
    429/503); the client is told `overloaded` with Retry-After, not that the detector failed."""

    def __init__(
        self,
        detector_id: str,
        message: str,
        *,
        invalid_params: bool = False,
        overloaded: bool = False,
    ) -> None:
        super().__init__(f"detector `{detector_id}`: {message}")
        self.detector_id = detector_id
        self.message = message
        self.invalid_params = invalid_params
        self.overloaded = overloaded


# (detector_id, outcome "ok" | "error" | "cancelled", seconds): how metrics learn of each call
CallRecorder = Callable[[str, str, float], None]


def _ignore_call(detector_id: str, outcome: str, seconds: float) -> None:
    return None


class DetectorClient(ABC):
    def __init__(
        self, detector_id: str, config: DetectorConfig, *, on_call: CallRecorder = _ignore_call
    ) -> None:
        self.detector_id = detector_id
        self.config = config
        self.on_call = on_call

    @property
    def judges_chunks(self) -> bool:
        """A classifier (its verdict is on the chunk it was given), not a span detector."""
        return self.config.judges == "chunks"

    @property
    def reads_context(self) -> bool:
        """A judge (clients/judges.py): on output it reads the conversation and the answer so
        far beside each chunk (`detect`'s `context`), so its chunks are consecutive text."""
        return False

    def crosses_natural_cuts(self, params: dict[str, Any]) -> bool:
        """Whether a span this detector finds may cross a natural cut (`chunkers.natural_cut`):
        a remote detector's spans are unknown, so yes (seam windows at every boundary)."""
        return True

    @property
    def caches_verdicts(self) -> bool:
        """Whether its input verdicts may be kept (`detection_cache`): only where its reply is
        a function of the text and the params alone. A remote service may change under us, so
        only when its config says `cache: true`."""
        return self.config.cache is True

    async def detect(
        self,
        contents: list[str],
        params: dict[str, Any],
        context: JudgeContext | None = None,
    ) -> list[list[Detection]]:
        """`params` are the request's detector_params (config params are merged under them).
        `context`: output judging's conversation and answer so far, for a detector that
        `reads_context` (the others judge the text alone). Every call, in-process or remote,
        is reported to `on_call` with its outcome and time."""
        # the call's span, named by a remote call's traceparent (None: tracing is off)
        traced = tracing.start_detector_call(self.detector_id, contents)
        return await self._recorded(self._detect_in_context(contents, params, context), traced)

    async def _detect_in_context(
        self, contents: list[str], params: dict[str, Any], context: JudgeContext | None
    ) -> list[list[Detection]]:
        return await self._detect(contents, params)

    def release(self, context: JudgeContext) -> None:
        """The stream that judged up to `context` has ended (finished, failed or its client
        left): what this client keeps for it can go. Synchronous, so a cancelled stream's
        `finally` can call it. Nothing is kept by default."""
        return None

    async def _recorded(self, call: Awaitable[T], traced: Any = None) -> T:
        """`call`'s result, its outcome and time reported to `on_call` (and its span ended)."""
        started = time.perf_counter()
        outcome = "error"
        reply: T | None = None
        try:
            reply = await call
            outcome = "ok"
            return reply
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            seconds = time.perf_counter() - started
            self.on_call(self.detector_id, outcome, seconds)
            if traced is not None:
                traced.end(outcome, reply if outcome == "ok" else None, seconds)

    @abstractmethod
    async def _detect(
        self, contents: list[str], params: dict[str, Any]
    ) -> list[list[Detection]]: ...

    async def judge(
        self, path: str, body: dict[str, Any], params: dict[str, Any]
    ) -> list[KindDetection]:
        """One call of an FMS detection kind (`path`: /api/v1/text/chat, /context/doc,
        /generation) with `body` and the merged `detector_params`; reported like `detect`."""
        return await self._recorded(self._judge(path, body, params))

    async def _judge(
        self, path: str, body: dict[str, Any], params: dict[str, Any]
    ) -> list[KindDetection]:
        raise DetectorCallError(self.detector_id, "speaks only the text_contents detector API")

    def _merged(self, params: dict[str, Any] | None) -> dict[str, Any]:
        """The detector_params sent: config params under the request's, minus the
        orchestrator's own keys."""
        merged = {**self.config.params, **(params or {})}
        for key in ("threshold", "on_detection", "redact_with"):
            merged.pop(key, None)
        return merged

    def open_tail(
        self, text: str, params: dict[str, Any], *, cut: bool = False
    ) -> Detection | None:
        """The tail of a text that ended early which could still grow into a match (DESIGN
        4.6a), as a detection; None for none (`cut`: see `Detector.open_tail`). A remote
        detector has no such question in the detector API, so its verdict on what it was sent
        stands (what it cannot match whole, a cut text included, it judges as it is)."""
        return None

    def held_from(self, text: str, at: int, params: dict[str, Any]) -> int | None:
        """Where an entity that goes on across a window's cut at `at` starts (a spelt number's
        head: `Detector.held_from`); a remote detector is not asked: None."""
        return None

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def _check_count(self, contents: list[str], reply: list[list[Detection]]) -> None:
        if len(reply) != len(contents):
            raise DetectorCallError(
                self.detector_id,
                f"returned {len(reply)} results for {len(contents)} contents",
            )


class InProcessDetectorClient(DetectorClient):
    """A built-in detector running inside the orchestrator (its models in worker threads)."""

    def __init__(
        self,
        detector_id: str,
        config: DetectorConfig,
        detector: detectors.Detector,
        *,
        on_call: CallRecorder = _ignore_call,
    ) -> None:
        super().__init__(detector_id, config, on_call=on_call)
        self._detector = detector

    @property
    def judges_chunks(self) -> bool:
        if self.config.judges is not None:
            return self.config.judges == "chunks"
        return not type(self._detector).finds_spans

    def crosses_natural_cuts(self, params: dict[str, Any]) -> bool:
        return self._detector.crosses_natural_cuts(params)

    @property
    def caches_verdicts(self) -> bool:
        """A built-in's reply is a function of the text and the params (its model is fixed
        while this client lives): kept unless its config says `cache: false`."""
        return self.config.cache is not False

    async def _detect(self, contents: list[str], params: dict[str, Any]) -> list[list[Detection]]:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of a call that
        # finished just as the caller was cancelled, and so swallows the cancellation (a
        # synchronous regex detector made a cancelled DetectorQueue wait for ever; bpo-42130)
        try:
            async with detector_timeout(self.config.timeout_s):
                reply = await self._detector.detect(contents, params or None)
        except TimeoutError:
            raise DetectorCallError(
                self.detector_id, f"timed out after {self.config.timeout_s:g} s"
            ) from None
        except detectors.InvalidParams as exc:
            raise DetectorCallError(self.detector_id, str(exc), invalid_params=True) from None
        except detectors.Overloaded as exc:
            raise DetectorCallError(self.detector_id, str(exc), overloaded=True) from None
        except detectors.DetectorError as exc:
            raise DetectorCallError(self.detector_id, str(exc) or type(exc).__name__) from None
        except Exception as exc:
            # a bug in the built-in: still this detector failing (DESIGN 4.7), named as such;
            # what it raised may quote the text it judged, so it goes to the log only
            log.exception("detector %s raised", self.detector_id)
            raise DetectorCallError(self.detector_id, f"failed ({type(exc).__name__})") from None
        self._check_count(contents, reply)
        return reply

    def open_tail(
        self, text: str, params: dict[str, Any], *, cut: bool = False
    ) -> Detection | None:
        """The built-in's own answer (the regex detector's; None from classifiers). Synchronous:
        it looks at a bounded tail only."""
        try:
            return self._detector.open_tail(text, params or None, cut=cut)
        except detectors.InvalidParams as exc:  # (the queue's detect call already checked them)
            raise DetectorCallError(self.detector_id, str(exc), invalid_params=True) from None

    def held_from(self, text: str, at: int, params: dict[str, Any]) -> int | None:
        """The built-in's own answer (`Detector.held_from`). Synchronous: a bounded stretch."""
        try:
            return self._detector.held_from(text, at, params or None)
        except detectors.InvalidParams as exc:
            raise DetectorCallError(self.detector_id, str(exc), invalid_params=True) from None

    async def warm_up(self, text: str) -> None:
        """Loads the model and judges `text` once, in its worker threads (at start-up, and
        before a reload swaps a new detector in)."""
        await self._detector.warmup()
        await self._detector.detect([text], None)

    async def close(self) -> None:
        await self._detector.close()


def detector_api_key(
    detector_id: str, config: DetectorConfig, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The key of a remote detector service (`api_key_env`), or None when it names none. A
    named variable that is unset or empty is a ConfigError at start-up: calling a keyed
    service without its key would fail every request with 401."""
    name = config.api_key_env
    if not name:
        return None
    key = environ.get(name, "").strip()
    if not key:
        state = "is not set" if name not in environ else "holds no key"
        raise ConfigError(
            [f"detectors.{detector_id}.api_key_env: environment variable {name} {state}"]
        )
    return key


class RemoteDetectorClient(DetectorClient):
    """A detector behind a URL: one pooled session for all of them, the config's TLS, and the
    service's Bearer key (from the environment variable `api_key_env` names) on every call."""

    def __init__(
        self,
        detector_id: str,
        config: DetectorConfig,
        session: aiohttp.ClientSession,
        *,
        ssl_context: ssl.SSLContext | bool | None = None,
        on_call: CallRecorder = _ignore_call,
    ) -> None:
        super().__init__(detector_id, config, on_call=on_call)
        assert config.url is not None
        self._base = config.url.rstrip("/")
        self._url = self._base + self._contents_path(config)
        self._health_url = self._base + self.health_path
        self._session = session
        self._ssl = ssl_context
        key = detector_api_key(detector_id, config)
        self._auth: dict[str, str] = {"Authorization": f"Bearer {key}"} if key else {}
        self._set_up(config)

    health_path = "/health"

    def _contents_path(self, config: DetectorConfig) -> str:
        """Where a call goes (the detector API's contents endpoint)."""
        return "/api/v1/text/contents"

    def _set_up(self, config: DetectorConfig) -> None:
        """What a kind of remote detector sets up beside the shared part (nothing here)."""


class HttpDetectorClient(RemoteDetectorClient):
    """A detector service speaking the detector API (DESIGN 6), with a timeout per detector."""

    async def _detect(self, contents: list[str], params: dict[str, Any]) -> list[list[Detection]]:
        request = ContentsRequest(contents=contents, detector_params=self._merged(params))
        # a large body is encoded, and a large reply parsed, in a thread: not on the event loop
        large = sum(map(len, contents)) > _LARGE_CHARS
        data = await asyncio.to_thread(_encode, request) if large else None
        body = None if large else request.model_dump(mode="json")
        raw = await self._post(self._url, body, data, reply_limit(contents))
        if len(raw) > _LARGE_CHARS:
            reply = await asyncio.to_thread(_parse_reply, raw, contents)
        else:
            reply = _parse_reply(raw, contents)
        if isinstance(reply, str):
            raise DetectorCallError(self.detector_id, reply)
        return reply

    async def _judge(
        self, path: str, body: dict[str, Any], params: dict[str, Any]
    ) -> list[KindDetection]:
        sent = {**body, "detector_params": self._merged(params)}
        url = self._base + path
        raw = await self._post(url, sent, None, REPLY_BASE_BYTES + REPLY_BYTES_PER_CONTENT)
        reply = _parse_kind_reply(raw)
        if isinstance(reply, str):
            raise DetectorCallError(self.detector_id, reply)
        return reply

    async def _post(self, url: str, body: Any, data: str | None, limit: int) -> bytes:
        """The reply body of one POST (JSON `body`, or `data` already encoded), read up to
        `limit` bytes; any failure is a DetectorCallError naming this detector."""
        # x-request-id and allowlisted client headers are added by the session's request hook
        hdrs = {
            "detector-id": self.detector_id,
            "x-model-name": self.detector_id,  # as the FMS orchestrator sends it
            "content-type": "application/json",
            **self._auth,
        }
        try:
            # the detector's timeout bounds the whole call (connection, reply, its last byte);
            # aiohttp's own timeouts are off, so only timeout_s ends it
            async with (
                detector_timeout(self.config.timeout_s),
                self._session.post(
                    url,
                    json=body,
                    data=data,
                    headers=hdrs,
                    timeout=_NO_AIOHTTP_TIMEOUT,
                    ssl=self._ssl,
                    allow_redirects=False,  # a peer we do not trust (DESIGN 6): see peers.py
                ) as resp,
            ):
                if resp.status != 200:
                    raise self._http_error(resp, await read_error_body(resp))
                return await read_bounded(resp, limit)
        except BodyTooLarge as exc:
            raise DetectorCallError(self.detector_id, f"reply {exc}") from None
        except TimeoutError:
            raise DetectorCallError(
                self.detector_id, f"timed out after {self.config.timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            # the address stays in the log: a client is told the kind of failure only
            log.warning("detector %s: call to %s failed: %s", self.detector_id, url, exc)
            reason = connection_failure(exc)
            raise DetectorCallError(self.detector_id, f"request failed: {reason}") from None

    def _http_error(self, resp: aiohttp.ClientResponse, raw: bytes) -> DetectorCallError:
        """A non-200 answer: its body goes to the log, the client is told the status only."""
        log_error_body(f"detector {self.detector_id}", resp.status, raw)
        # 422 is the detector rejecting the detector_params the client sent
        hint = " (check the detector's api_key_env)" if resp.status in (401, 403) else ""
        return DetectorCallError(
            self.detector_id,
            f"HTTP {resp.status}{hint}",
            invalid_params=resp.status == 422,
            # the detector service's queue-full answer is 503 with Retry-After
            overloaded=resp.status == 429 or (resp.status == 503 and "Retry-After" in resp.headers),
        )

    async def health(self) -> bool:
        try:
            async with self._session.get(
                self._health_url,
                headers=self._auth,
                timeout=aiohttp.ClientTimeout(total=2),
                ssl=self._ssl,
                allow_redirects=False,  # a peer we do not trust (DESIGN 6)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def _encode(request: ContentsRequest) -> str:
    """What `json=` would send (json.dumps escapes what UTF-8 cannot carry)."""
    return json.dumps(request.model_dump(mode="json"))


def reply_limit(contents: list[str]) -> int:
    """The most bytes a sane reply to `contents` takes: a base, REPLY_BYTES_PER_CONTENT per
    content (room for MAX_DETECTIONS_PER_CONTENT short detections) and the contents' own size
    several times over (detections quote the text they found, JSON-escaped)."""
    chars = sum(map(len, contents))
    return REPLY_BASE_BYTES + REPLY_BYTES_PER_CONTENT * len(contents) + 8 * chars


class KindDetection(BaseModel):
    """One detection in a reply of the FMS detection kinds (chat, context/doc, generation):
    no span; the detector's own `detector_id`, if any, is replaced by the configured one."""

    model_config = ConfigDict(extra="ignore")

    detection_type: str
    detection: str
    score: float
    detector_id: str | None = None
    evidence: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


_KIND_REPLY = TypeAdapter(list[KindDetection])


def _parse_kind_reply(raw: bytes) -> list[KindDetection] | str:
    """A kind's reply checked like a contents reply (DESIGN 6): bounded, scores in [0, 1]."""
    try:
        reply = _KIND_REPLY.validate_json(raw, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "reply"
        return f"malformed reply ({where}: {first['msg']})"
    if len(reply) > MAX_DETECTIONS_PER_CONTENT:
        return f"{len(reply)} detections (at most {MAX_DETECTIONS_PER_CONTENT})"
    for j, d in enumerate(reply):
        if not 0.0 <= d.score <= 1.0:  # also true of NaN
            return f"detection {j}: score {d.score} is not in [0, 1]"
    return reply


def _parse_reply(raw: bytes, contents: list[str]) -> list[list[Detection]] | str:
    """The reply, checked against what was sent (DESIGN 6: a peer we do not trust); a string
    saying what is wrong with it when it is not a sane reply. Parsing and checking a large
    reply runs in a thread: this is the whole of that work."""
    try:
        # strict: JSON's own types, as the FMS orchestrator's serde reads them (a number in a
        # string, or true for 1, is a malformed reply, not a value to guess at)
        reply = _REPLY.validate_json(raw, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "reply"
        return f"malformed reply ({where}: {first['msg']})"
    if len(reply) != len(contents):
        return f"returned {len(reply)} results for {len(contents)} contents"
    for i, (found, content) in enumerate(zip(reply, contents, strict=True)):
        if len(found) > MAX_DETECTIONS_PER_CONTENT:
            return f"content {i} has {len(found)} detections (at most {MAX_DETECTIONS_PER_CONTENT})"
        size = len(content)
        found = reply[i] = _code_point_spans(found, content)
        for j, d in enumerate(found):
            # `not 0 <= score <= 1` is also true of NaN
            if not 0.0 <= d.score <= 1.0:
                return f"detection {j} of content {i}: score {d.score} is not in [0, 1]"
            if not 0 <= d.start <= d.end <= size:
                return (
                    f"detection {j} of content {i}: span [{d.start}, {d.end}) lies outside "
                    f"its content of {size} characters"
                )
    return reply


# the units some services count spans in instead of code points (DESIGN 6): UTF-16 code units
# (JavaScript, Java, .NET) and UTF-8 bytes (Rust, Go); (codec, numpy dtype of a unit, the mask
# and value of a unit that continues a character rather than starting one). numpy is imported
# only when a span needs it: the orchestrator's workers load no numpy at rest
# (tests/test_orchestrator_capacity.py)
_OTHER_UNITS = (
    ("utf-16-le", "<u2", 0xFC00, 0xDC00),
    ("utf-8", "u1", 0xC0, 0x80),
)


def _code_point_spans(found: list[Detection], content: str) -> list[Detection]:
    """`found` with each span in code points. A span whose text is not the detection's `text`,
    but is when its offsets count UTF-16 code units or UTF-8 bytes, counts those: it is read
    in them (in any text with astral or non-ASCII characters before an entity, such a
    service's span lies past the entity in code points, and redacting it released the
    entity's head). A span that holds its text, or that no other unit explains (a detector
    that reports normalised text), stands as it is. Each unit's reading of the content is
    made once, in C, and only when some span needs it."""
    starts: dict[str, Any] = {}  # codec -> numpy array of character starts
    out: list[Detection] = []
    for d in found:
        span = None
        if d.text and 0 <= d.start <= d.end and content[d.start : d.end] != d.text:
            span = _read_in_other_units(d, content, starts)
        out.append(d if span is None else d.model_copy(update={"start": span[0], "end": span[1]}))
    return out


def _read_in_other_units(
    d: Detection, content: str, starts: dict[str, Any]
) -> tuple[int, int] | None:
    """The code-point span of `d` read in the first other unit whose reading holds `d.text`;
    None when none does."""
    import numpy as np

    for codec, dtype, mask, continuation in _OTHER_UNITS:
        if codec not in starts:
            units = np.frombuffer(content.encode(codec, "surrogatepass"), dtype=np.dtype(dtype))
            # the unit offset where each character starts, and the end
            first = np.flatnonzero((units & mask) != continuation)
            starts[codec] = np.append(first, len(units))
        at = starts[codec]
        a, b = np.searchsorted(at, [d.start, d.end])
        if b >= len(at) or at[a] != d.start or at[b] != d.end:
            continue  # not character boundaries in this unit
        if content[a:b] == d.text:
            return int(a), int(b)
    return None
