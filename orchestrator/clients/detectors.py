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
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from pydantic import TypeAdapter, ValidationError

import detectors
from detectors.api import ContentsRequest, Detection

from .. import tracing
from ..config import ConfigError, DetectorConfig
from .reasons import connection_failure

_REPLY = TypeAdapter(list[list[Detection]])
# bodies and replies past this many characters/bytes are encoded and parsed off the event loop
_LARGE_CHARS = 256 * 1024


log = logging.getLogger("guardstream.detectors")


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

    async def detect(self, contents: list[str], params: dict[str, Any]) -> list[list[Detection]]:
        """`params` are the request's detector_params (config params are merged under them).
        Every call, in-process or remote, is reported to `on_call` with its outcome and time."""
        started = time.perf_counter()
        outcome = "error"
        # the call's span, named by a remote call's traceparent (None: tracing is off)
        traced = tracing.start_detector_call(self.detector_id, contents)
        try:
            reply = await self._detect(contents, params)
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

    def open_tail(self, text: str, params: dict[str, Any]) -> Detection | None:
        """The tail of a text that ended early which could still grow into a match (DESIGN
        4.6a), as a detection; None for none. A remote detector has no such question in the
        detector API, so its verdict on what it was sent stands (what it cannot match whole,
        a cut text included, it judges as it is)."""
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

    async def _detect(self, contents: list[str], params: dict[str, Any]) -> list[list[Detection]]:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of a call that
        # finished just as the caller was cancelled, and so swallows the cancellation (a
        # synchronous regex detector made a cancelled DetectorQueue wait for ever; bpo-42130)
        try:
            async with asyncio.timeout(self.config.timeout_s):
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
        self._check_count(contents, reply)
        return reply

    def open_tail(self, text: str, params: dict[str, Any]) -> Detection | None:
        """The built-in's own answer (the regex detector's; None from classifiers). Synchronous:
        it looks at a bounded tail only."""
        try:
            return self._detector.open_tail(text, params or None)
        except detectors.InvalidParams as exc:  # (the queue's detect call already checked them)
            raise DetectorCallError(self.detector_id, str(exc), invalid_params=True) from None

    async def warm_up(self, text: str) -> None:
        """Loads the model and judges `text` once, in its worker threads (start-up only)."""
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


class HttpDetectorClient(DetectorClient):
    """A remote detector; one pooled session for all of them, a timeout per detector, and the
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
        self._url = config.url.rstrip("/") + "/api/v1/text/contents"
        self._health_url = config.url.rstrip("/") + "/health"
        self._session = session
        self._ssl = ssl_context
        key = detector_api_key(detector_id, config)
        self._auth: dict[str, str] = {"Authorization": f"Bearer {key}"} if key else {}

    async def _detect(self, contents: list[str], params: dict[str, Any]) -> list[list[Detection]]:
        merged = {**self.config.params, **(params or {})}
        for key in ("threshold", "on_detection"):
            merged.pop(key, None)
        request = ContentsRequest(contents=contents, detector_params=merged)
        # a large body is encoded, and a large reply parsed, in a thread: not on the event loop
        large = sum(map(len, contents)) > _LARGE_CHARS
        data = await asyncio.to_thread(_encode, request) if large else None
        # x-request-id and allowlisted client headers are added by the session's request hook
        hdrs = {"detector-id": self.detector_id, "content-type": "application/json", **self._auth}
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        body = None if large else request.model_dump(mode="json")
        try:
            async with self._session.post(
                self._url, json=body, data=data, headers=hdrs, timeout=timeout, ssl=self._ssl
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    # 422 is the detector rejecting the detector_params the client sent
                    hint = (
                        " (check the detector's api_key_env)" if resp.status in (401, 403) else ""
                    )
                    raise DetectorCallError(
                        self.detector_id,
                        f"HTTP {resp.status}: {_error_message(raw)}{hint}",
                        invalid_params=resp.status == 422,
                        # the detector service's queue-full answer is 503 with Retry-After
                        overloaded=resp.status == 429
                        or (resp.status == 503 and "Retry-After" in resp.headers),
                    )
        except TimeoutError:
            raise DetectorCallError(
                self.detector_id, f"timed out after {self.config.timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            # the address stays in the log: a client is told the kind of failure only
            log.warning("detector %s: call to %s failed: %s", self.detector_id, self._url, exc)
            reason = connection_failure(exc)
            raise DetectorCallError(self.detector_id, f"request failed: {reason}") from None
        try:
            if len(raw) > _LARGE_CHARS:
                reply = await asyncio.to_thread(_REPLY.validate_json, raw)
            else:
                reply = _REPLY.validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "reply"
            raise DetectorCallError(
                self.detector_id, f"malformed reply ({where}: {first['msg']})"
            ) from None
        self._check_count(contents, reply)
        return reply

    async def health(self) -> bool:
        try:
            async with self._session.get(
                self._health_url,
                headers=self._auth,
                timeout=aiohttp.ClientTimeout(total=2),
                ssl=self._ssl,
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def _encode(request: ContentsRequest) -> str:
    """What `json=` would send (json.dumps escapes what UTF-8 cannot carry)."""
    return json.dumps(request.model_dump(mode="json"))


def _error_message(raw: bytes) -> str:
    """The detector's `message` when it sent the API's error body, else a short raw excerpt."""
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            return data["message"][:500]
    except (ValueError, RecursionError):
        pass
    return raw[:200].decode("utf-8", "replace") or "(empty body)"
