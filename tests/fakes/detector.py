"""A remote detector speaking the detector API (DESIGN 6) over a real socket, for orchestrator
tests. It flags every occurrence of configured words, and can fail on cue: HTTP error, slow
reply, malformed reply, wrong reply count. It records every call and notices cancelled ones.
It can also be hostile (DESIGN 6, a peer we do not trust): an error body holding secrets, a
redirect, a reply of its choosing, or a reply that never ends."""

from __future__ import annotations

import asyncio
import json
import ssl
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .upstream import start_site


@dataclass
class DetectorBehaviour:
    words: dict[str, float] = field(default_factory=dict)  # word -> score
    detection: str = "flagged"
    detection_type: str = "test"
    fail_status: int | None = None  # answer every call with this HTTP status
    fail_on: str | None = None  # fail (fail_status or 500) only for contents containing this
    delay_s: float = 0.0
    malformed: bool = False
    drop_one: bool = False  # reply with one list fewer than contents
    gate: asyncio.Event | None = None  # hold every reply until the test sets it
    error_body: str | None = None  # the body of a failing reply (default: the API's error body)
    redirect_to: str | None = None  # answer every call with `302 Location: redirect_to`
    reply: Any = None  # a 200 reply of this JSON value (NaN/Infinity allowed) instead of detections
    endless: bool = False  # a 200 reply that never ends: 64 MiB of detections, then it stalls
    # a 200 reply in this Content-Encoding ("gzip", "deflate", "br") that inflates to 1 GiB of
    # spaces from 1 MiB on the wire (a decompression bomb)
    bomb: str | None = None
    huge_header: bool = False  # a 200 reply with a 1 MiB header (no client reads that)
    html: bool = False  # a 200 reply of an HTML page (a proxy's or a login page)
    # a 200 reply whose Content-Length promises the whole reply, cut after half of it (the
    # service died mid-write)
    cut_body: bool = False
    trickle: bool = False  # a 200 reply that sends a byte every 50 ms for ever
    # the unit its spans count in: code points (the detector API's), or the UTF-16 code units
    # (a JavaScript or Java service) or UTF-8 bytes (a Rust or Go one) some services count in
    units: str = "code_points"


class FakeDetectorServer:
    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context  # HTTPS when set
        self.detectors: dict[str, DetectorBehaviour] = {}
        self.calls: list[tuple[str, list[str], dict[str, Any]]] = []
        # calls of the FMS detection kinds: (path, headers, body), as received
        self.kind_calls: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.cancelled = 0
        self.in_flight = 0
        self.trickling = 0  # trickling replies under way (their first byte sent)
        self.health_redirect: str | None = None  # `GET /health` answers 302 to this
        self._runner: web.AppRunner | None = None
        self.url = ""

    def add(self, detector_id: str, behaviour: DetectorBehaviour) -> None:
        self.detectors[detector_id] = behaviour

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/api/v1/text/contents", self._contents)
        for path in ("/api/v1/text/chat", "/api/v1/text/context/doc", "/api/v1/text/generation"):
            app.router.add_post(path, self._kind)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        self.url = await start_site(self._runner, ssl_context=self.ssl_context)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_redirect is not None:
            raise web.HTTPFound(self.health_redirect)
        return web.json_response({"status": "ok"})

    async def _contents(self, request: web.Request) -> web.Response:
        detector_id = request.headers.get("detector-id", "")
        behaviour = self.detectors.get(detector_id)
        if behaviour is None:
            return web.json_response(
                {"code": 404, "message": f"no detector {detector_id}"}, status=404
            )
        body = await request.json()
        contents: list[str] = body["contents"]
        self.calls.append((detector_id, contents, body.get("detector_params", {})))
        self.in_flight += 1
        try:
            if behaviour.delay_s:
                await asyncio.sleep(behaviour.delay_s)
            if behaviour.gate is not None:
                await behaviour.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        failing = behaviour.fail_status is not None and (
            behaviour.fail_on is None or any(behaviour.fail_on in c for c in contents)
        )
        if behaviour.redirect_to is not None:
            raise web.HTTPFound(behaviour.redirect_to)
        if failing and behaviour.error_body is not None:
            return web.Response(text=behaviour.error_body, status=behaviour.fail_status or 500)
        if failing:
            return web.json_response(
                {"code": behaviour.fail_status, "message": "detector exploded"},
                status=behaviour.fail_status or 500,
            )
        if behaviour.malformed:
            return web.Response(text='[{"start": "zero"}]', content_type="application/json")
        if behaviour.reply is not None:
            return web.Response(text=json.dumps(behaviour.reply), content_type="application/json")
        if behaviour.endless:
            return await self._endless(request)
        if behaviour.html:
            return web.Response(text="<html><body>Sign in</body></html>", content_type="text/html")
        if behaviour.cut_body:
            return await self._cut(request, [self._detect(behaviour, c) for c in contents])
        if behaviour.trickle:
            return await self._trickle(request)
        if behaviour.huge_header:
            return web.json_response([[] for _ in contents], headers={"x-padding": "a" * (1 << 20)})
        if behaviour.bomb is not None:
            return await self._bomb(request, behaviour.bomb)
        reply = [_in_units(self._detect(behaviour, c), c, behaviour.units) for c in contents]
        if behaviour.drop_one:
            reply = reply[:-1]
        return web.Response(text=json.dumps(reply), content_type="application/json")

    async def _kind(self, request: web.Request) -> web.Response:
        """The FMS detection kinds (chat, context/doc, generation): one reply for the whole
        body, a detection per configured word found anywhere in its text (score: the word's),
        or the behaviour's `reply`; failures as for contents."""
        detector_id = request.headers.get("detector-id", "")
        behaviour = self.detectors.get(detector_id)
        if behaviour is None:
            return web.json_response(
                {"code": 404, "message": f"no detector {detector_id}"}, status=404
            )
        body = await request.json()
        self.kind_calls.append((request.path, dict(request.headers), body))
        if behaviour.fail_status is not None:
            return web.json_response(
                {"code": behaviour.fail_status, "message": "detector exploded"},
                status=behaviour.fail_status,
            )
        if behaviour.reply is not None:
            return web.Response(text=json.dumps(behaviour.reply), content_type="application/json")
        text = json.dumps({k: v for k, v in body.items() if k != "detector_params"})
        return web.json_response(
            [
                {
                    "detection_type": behaviour.detection_type,
                    "detection": behaviour.detection,
                    "detector_id": "as-the-detector-calls-itself",
                    "score": score,
                }
                for word, score in behaviour.words.items()
                if word in text
            ]
        )

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        """`[[`, 64 MiB of detections, then nothing while the connection stays open: the client
        must stop reading, not this (64 MiB, not for ever: a client that reads it all costs the
        test machine that much memory, not all of it)."""
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(b"[[")
        item = json.dumps(
            {"start": 0, "end": 1, "text": "x", "detection": "d", "detection_type": "t", "score": 1}
        )
        block = ((item + ",") * 1000).encode()
        try:
            for _ in range((64 << 20) // len(block)):
                await resp.write(block)
            await asyncio.Event().wait()
        except (ConnectionError, asyncio.CancelledError):
            self.cancelled += 1
            raise

    async def _cut(self, request: web.Request, reply: Any) -> web.StreamResponse:
        """`reply`'s headers and first half, then the connection closed."""
        body = json.dumps(reply).encode()
        resp = web.StreamResponse(
            headers={"content-type": "application/json", "content-length": str(len(body))}
        )
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        assert request.transport is not None
        request.transport.close()
        return resp

    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        """`[` and then a space every 50 ms, until the client goes away."""
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(b"[")
        self.trickling += 1
        try:
            while True:
                await asyncio.sleep(0.05)
                await resp.write(b" ")
        except (ConnectionError, asyncio.CancelledError):
            self.cancelled += 1
            raise
        finally:
            self.trickling -= 1

    async def _bomb(self, request: web.Request, encoding: str) -> web.StreamResponse:
        """A body of `encoding` that inflates to 1 GiB: 1024 copies of one compressed MiB of
        spaces (after a full flush a compressor starts afresh, so the copies chain into one
        valid stream), written whole. `br` is sent as gzip bytes: a client without brotli must
        refuse it as it would any br."""
        wbits = {"gzip": 31, "deflate": 15, "br": 31}[encoding]
        compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
        block = b" " * (1 << 20)
        first = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
        again = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
        resp = web.StreamResponse(
            headers={"content-type": "application/json", "content-encoding": encoding}
        )
        await resp.prepare(request)
        try:
            await resp.write(first + again * 1023)
            await asyncio.Event().wait()
        except (ConnectionError, asyncio.CancelledError):
            self.cancelled += 1
            raise
        return resp

    @staticmethod
    def _detect(behaviour: DetectorBehaviour, content: str) -> list[dict[str, Any]]:
        found = []
        for word, score in behaviour.words.items():
            start = content.find(word)
            while start != -1:
                found.append(
                    {
                        "start": start,
                        "end": start + len(word),
                        "text": word,
                        "detection": behaviour.detection,
                        "detection_type": behaviour.detection_type,
                        "score": score,
                    }
                )
                start = content.find(word, start + 1)
        return sorted(found, key=lambda d: d["start"])


def _in_units(found: list[dict[str, Any]], content: str, units: str) -> list[dict[str, Any]]:
    """`found`'s code-point spans counted in `units` instead ("utf-16", "utf-8")."""
    if units == "code_points":
        return found
    codec = {"utf-16": "utf-16-le", "utf-8": "utf-8"}[units]
    width = 2 if units == "utf-16" else 1

    def at(i: int) -> int:
        return len(content[:i].encode(codec)) // width

    return [{**d, "start": at(d["start"]), "end": at(d["end"])} for d in found]
