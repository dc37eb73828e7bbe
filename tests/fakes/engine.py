"""A fake generation engine speaking the native protocol (DESIGN section 7) over a real socket.

Its "model" is a script: the token at position i is `script[i]` with id `1000 + i`, so any
replica running the same script continues a resumed stream exactly, like the real engine does
for greedy decoding. Faults are served on cue (a reset, a stall, an in-band error, a blank or
undecodable line, a missing `complete_final`, data after it, an HTTP error); every request body is
recorded, and so is every client that went away before its stream ended.

Ordering is set by gates, never by delays: with `hold_after=N` every fresh (not resumed) stream
stops after N tokens until the test sets `release`, e.g. once it has seen a frame reach the client
that must come before what the engine sends next. Run as a process, `--hold-after N` holds for
good (the replica is about to be killed).

    engine = FakeEngine(script=["Hello", ",", " world", "!"], fail=Fault("close", after_tokens=2))
    url = await engine.start()
    ...
    await engine.close()

Also runnable as a process (for the managed-engine supervisor tests):
`python tests/fakes/engine.py --port P [--script "a b c"] [--hold-after N] [--exit-after S]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

if not __package__:  # run as a script (`python tests/fakes/engine.py`) by the managed tests
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from servicekit.text_gate import TextGate
from tests.fakes.upstream import FakeUpstream, next_fault
from tests.wait_support import DEADLINE_S, until

TOKEN_BASE = 1000
DRAWN_SEED = 4242  # the seed the fake "draws" for a sampling request without one

FAULT_MODES = (
    "close",  # reset the connection after `after_tokens` tokens
    "eof",  # end the body cleanly after `after_tokens` tokens, without complete_final
    "stall",  # stop sending after `after_tokens` tokens, keep the connection open
    "error",  # an in-band error item (type `error_type`) after `after_tokens` tokens
    "blank",  # a blank line after `after_tokens` tokens
    "garbage",  # an undecodable line after `after_tokens` tokens
    "nested",  # a line nested 100,000 deep (past any parser's recursion limit)
    "no_data",  # an item with neither data nor error after `after_tokens` tokens
    "after_final",  # a normal stream, then a data item after complete_final
    "http",  # answer with HTTP `status` instead of a stream
    "hang",  # never answer (no headers)
    "redirect",  # answer `302 Location: location` instead of a stream
    "endless_line",  # after `after_tokens` tokens, `size` bytes of one item that never ends; stall
    "empty_items",  # after `after_tokens` tokens, EMPTY_ITEMS items with no token and no text,
    # then a stall
)
EMPTY_ITEMS = 1000


@dataclass
class Fault:
    mode: str
    after_tokens: int = 0
    times: int = 1  # how many requests it applies to; -1: all
    error_type: str = "generation_unavailable"
    status: int = 503
    message: str = "injected fault"
    location: str = "/health"  # where a `redirect` points
    size: int = 4 << 20  # the bytes an `endless_line` sends before it stalls

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {self.mode!r}")


@dataclass
class Recorded:
    body: dict[str, Any]
    headers: dict[str, str]
    tokens_sent: int = 0
    disconnected: bool = False  # the client went away before the stream ended
    completed: bool = False  # complete_final was written


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of a generate/tokenize body: `prompt`, or the last user message of
    `messages` (the fake has no chat template; scripts key on what the user said)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        users = [m.get("content", "") for m in messages if m.get("role") == "user"]
        return users[-1] if users else ""
    return body.get("prompt", "")


def prompt_ids(prompt: str) -> list[int]:
    """The fake tokenizer: one id below TOKEN_BASE per character."""
    return [min(ord(c), TOKEN_BASE - 1) for c in prompt]


@dataclass
class FakeEngine(FakeUpstream):
    script: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    fail: Fault | list[Fault] | None = None
    token_delay_s: float = 0.0
    finish_reason: str = "EOS_TOKEN"  # at the end of the script
    healthy: bool = True
    port: int = 0
    omit_finish_reason: bool = False  # a broken engine that never says why it stopped
    # Answer each prompt with its own script (e.g. echo it) instead of the fixed one.
    script_for: Callable[[str], list[str]] | None = None
    # Fresh streams wait after this many tokens until `release` is set; resumes never wait, so a
    # replica taking over a held stream finishes it.
    hold_after: int | None = None
    models_padding: int = 0  # characters of junk in `GET /v1/models` (a hostile replica's reply)

    def __post_init__(self) -> None:
        self.faults: list[Fault] = (
            [] if self.fail is None else [self.fail] if isinstance(self.fail, Fault) else self.fail
        )
        self.requests: list[Recorded] = []
        self.resume_mismatches: list[str] = []
        self._init_upstream()
        self.first_token = asyncio.Event()
        self.release = asyncio.Event()
        self.holding = 0  # streams waiting at `hold_after` now

    # -- control --------------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/generate", self._generate)
        app.router.add_post("/v1/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.port = await self._serve(app, self.port)
        return self.url

    def inject(self, fault: Fault) -> None:
        self.faults.append(fault)

    @property
    def disconnects(self) -> int:
        return sum(r.disconnected for r in self.requests)

    @property
    def active(self) -> int:
        return sum(not (r.completed or r.disconnected) for r in self.requests)

    def text(self, n: int | None = None) -> str:
        """The text of the first n script tokens (all by default)."""
        return "".join(self.script if n is None else self.script[:n])

    async def wait_requests(self, n: int, deadline_s: float = DEADLINE_S) -> None:
        await until(lambda: len(self.requests) >= n, deadline_s, f"{n} requests")

    async def wait_disconnects(self, n: int = 1, deadline_s: float = DEADLINE_S) -> None:
        await until(lambda: self.disconnects >= n, deadline_s, f"{n} disconnects")

    # -- handlers -------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"status": "unhealthy"}, status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        reply: dict[str, Any] = {"data": [{"id": "fake"}]}
        if self.models_padding:
            reply["padding"] = "x" * self.models_padding
        return web.json_response(reply)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = prompt_ids(prompt_text(body))
        return web.json_response({"token_ids": ids, "count": len(ids)})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "tools" in body or any(
            "tool_calls" in m or m.get("role") == "tool" for m in body.get("messages") or ()
        ):
            # as the real engine answers for a chat template without tool support (the fake
            # advertises nothing, so the orchestrator learns it here, before any byte)
            field = "tools" if "tools" in body else "messages"
            details = f"{field}: model fake's chat template has no tool support"
            return web.json_response(
                {"code": 422, "details": details, "type": "invalid_request"}, status=422
            )
        rec = Recorded(body=body, headers=dict(request.headers))
        self.requests.append(rec)
        fault = next_fault(self.faults)
        if fault is not None and fault.mode == "http":
            return web.json_response(
                {"code": fault.status, "type": fault.error_type, "message": fault.message},
                status=fault.status,
            )
        if fault is not None and fault.mode == "redirect":
            raise web.HTTPFound(fault.location)
        if fault is not None and fault.mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                rec.disconnected = True
                raise
        resp = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await resp.prepare(request)
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        try:
            await self._stream(request, resp, body, rec, fault)
        except (asyncio.CancelledError, ConnectionResetError):
            rec.disconnected = True
            raise
        finally:
            if transport is not None:
                self._transports.discard(transport)
        return resp

    async def _stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        body: dict[str, Any],
        rec: Recorded,
        fault: Fault | None,
    ) -> None:
        if "input_ids" in body:
            p_ids = list(body["input_ids"])
        else:
            p_ids = prompt_ids(prompt_text(body))
        resume = body.get("resume") or {}
        r_ids = list(resume.get("token_ids", []))
        r_text = resume.get("text", "")
        pos = len(r_ids)
        expected_ids = [TOKEN_BASE + i for i in range(pos)]
        if r_ids != expected_ids:
            self.resume_mismatches.append(f"resume ids {r_ids} != {expected_ids}")
        pending = ""  # resumed text not yet delivered
        script = self.script_for(prompt_text(body)) if self.script_for else self.script
        full = "".join(script[:pos])
        if full.startswith(r_text):
            pending = full[len(r_text) :]
        else:
            self.resume_mismatches.append(f"resume text {r_text!r} is not a prefix of {full!r}")
        max_new = int(body.get("max_new_tokens", 20))
        # stop sequences as the engine applies them (the stop sequence and what follows it are
        # never sent; a possible start of one is held until ruled out)
        gate = TextGate(body.get("stop_sequences") or [], already_delivered=len(r_text))
        gate.push(full)
        pending = gate.release() if full.startswith(r_text) else pending
        first = True

        async def send(obj: Any) -> None:
            await resp.write((json.dumps(obj) + "\n").encode())

        async def fault_now() -> bool:
            """Serve the fault due now; True when the stream must end here."""
            assert fault is not None
            if fault.mode == "close":
                assert request.transport is not None
                request.transport.abort()
                return True
            if fault.mode == "eof":
                await resp.write_eof()
                return True
            if fault.mode == "stall":
                await asyncio.Event().wait()
            if fault.mode == "error":
                await send(
                    {
                        "error": {"code": 503, "type": fault.error_type, "message": fault.message},
                        "complete_final": False,
                    }
                )
                await resp.write_eof()
                return True
            if fault.mode == "blank":
                await resp.write(b"\n")
            elif fault.mode == "garbage":
                await resp.write(b"{not json\n")
            elif fault.mode == "nested":
                await resp.write(b"[" * 100_000 + b"]" * 100_000 + b"\n")
            elif fault.mode == "no_data":
                await send({"complete_final": False})
            elif fault.mode == "empty_items":
                # a replica that looks alive and says nothing (bounded: the test's client
                # shares this event loop and reads them while the fake waits), then falls silent
                for _ in range(EMPTY_ITEMS):
                    await send({"data": {"token_ids": [], "text": ""}, "complete_final": False})
                await asyncio.Event().wait()
            elif fault.mode == "endless_line":
                # a bounded size, then a stall: a client that buffers it all costs the test
                # machine `size` bytes, not all its memory
                await resp.write(b'{"data": {"text": "')
                block = b"x" * (64 << 10)
                for _ in range(fault.size // len(block)):
                    await resp.write(block)
                await asyncio.Event().wait()
            return False

        sent = 0
        hold = self.hold_after if not r_ids else None
        while True:
            if hold is not None and sent == hold and not self.release.is_set():
                self.holding += 1
                try:
                    await self.release.wait()
                finally:
                    self.holding -= 1
            if (
                fault is not None
                and fault.mode not in ("after_final",)
                and sent == fault.after_tokens
            ):
                if await fault_now():
                    return
                fault = None
            if pos >= len(script) or pos >= max_new:
                break
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            tok = script[pos]
            pos += 1
            sent += 1
            finish = None
            gate.push(tok)
            if gate.stop_at is not None:
                finish = "STOP_SEQUENCE"
            elif pos >= len(script):
                finish = self.finish_reason
            elif pos >= max_new:
                finish = "MAX_TOKENS"
            if finish is not None:
                gate.finish()
            text = pending + gate.release()
            pending = ""
            if self.omit_finish_reason:
                finish = None
            data: dict[str, Any] = {
                "token_ids": [TOKEN_BASE + pos - 1],
                "text": text,
                "generated_token_count": pos,
                "input_token_count": len(p_ids),
                "finish_reason": finish,
            }
            if first:
                data["prompt_token_ids"] = p_ids
                decoding = body.get("decoding") or {}
                if decoding.get("method") == "sampling":
                    data["seed"] = decoding.get("seed", DRAWN_SEED)  # like the engine reports it
                first = False
            await send({"data": data, "complete_final": False})
            rec.tokens_sent = sent
            self.first_token.set()
            if finish is not None:
                break
            if pos >= max_new:
                break
        if fault is not None and fault.mode != "after_final" and sent == fault.after_tokens:
            if await fault_now():
                return
        await send({"complete_final": True})
        rec.completed = True
        if fault is not None and fault.mode == "after_final":
            await send({"data": {"token_ids": [], "text": "x"}, "complete_final": False})
        await resp.write_eof()


class GatedEngine(FakeEngine):
    """Holds every generate request until `gate` opens: streams stay open exactly as long as a
    test needs (all admitted streams running when a signal or an overload comes), however slow
    the machine, with no timing involved. `held`: generate requests that arrived."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gate = asyncio.Event()
        self.held = 0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.held += 1
        await self.gate.wait()
        return await super()._generate(request)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="fake native engine")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", default="Hello , world !")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument(
        "--hold-after", type=int, default=None, help="fresh streams go silent after N tokens"
    )
    parser.add_argument("--exit-after", type=float, default=0.0, help="exit with code 3 after S s")
    args = parser.parse_args()

    async def serve() -> None:
        engine = FakeEngine(
            script=[(" " if i else "") + w for i, w in enumerate(args.script.split())],
            token_delay_s=args.token_delay,
            port=args.port,
            hold_after=args.hold_after,
        )
        await engine.start()
        print(f"fake engine listening on {engine.url}", flush=True)
        if args.exit_after:
            await asyncio.sleep(args.exit_after)
            raise SystemExit(3)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
