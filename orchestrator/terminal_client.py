"""`python -m orchestrator stream "prompt"`: a terminal client for the streaming endpoint.

Frames are written as they arrive, with detected spans highlighted: ANSI colour when stdout is a
terminal (unless `--no-color` or `NO_COLOR`), `[[...]]` markers otherwise, so piped output still
shows what was flagged. After the stream, every detection is listed, then the terminal event as
one line `[<event>] <json data>`. Errors and their details also go to stderr.

`--api-key` (or the environment variable GUARDSTREAM_API_KEY) is sent as `Authorization: Bearer`.
`--api chat` talks to the OpenAI Chat Completions surface (`/v1/chat/completions`) instead of the
FMS streaming endpoint; the output and exit status are the same.

Exit status, so scripts can tell outcomes apart without parsing the output:

    0  completed     the model finished and every frame was delivered
    1  failed/error  the stream broke (a `failed` or `error` terminal event)
    2  incomplete    cut short: token or time budget, or a guardrail (refusal included)
    3  rejected      the server answered with an HTTP error (bad request, unknown model, 401, ...)
    4  unreachable   cannot connect, or the connection ended without a terminal event
    130 interrupted  Ctrl-C
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any, TextIO

import aiohttp

STREAM_PATH = "/api/v1/task/server-streaming-classification-with-text-generation"
CHAT_PATH = "/v1/chat/completions"
API_KEY_ENV = "GUARDSTREAM_API_KEY"

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_INCOMPLETE = 2
EXIT_REJECTED = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130
EXIT = {
    "completed": EXIT_COMPLETED,
    "incomplete": EXIT_INCOMPLETE,
    "failed": EXIT_FAILED,
    "error": EXIT_FAILED,
}
TERMINAL_EVENTS = frozenset(EXIT)


class Style:
    """ANSI styling, or plain-text markers when colour is off (pipes, files, NO_COLOR)."""

    def __init__(self, color: bool) -> None:
        self.color = color

    def wrap(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def flagged(self, text: str) -> str:
        if not text:
            return text
        return self.wrap(text, "1;31;4") if self.color else f"[[{text}]]"

    def dim(self, text: str) -> str:
        return self.wrap(text, "2")

    def bold(self, text: str) -> str:
        return self.wrap(text, "1")


async def sse_events(
    response: aiohttp.ClientResponse, *, done_marker: bool = False
) -> AsyncIterator[tuple[str | None, dict[str, Any]]]:
    """(event name, or None for a frame; data) for each SSE message. Lines are split here
    rather than with `readline`, which rejects lines over 128 KiB (a long final frame).
    With `done_marker`, `data: [DONE]` (OpenAI's end of stream) ends the iteration."""
    name: str | None = None
    data: list[str] = []
    buf = b""

    def lines(chunk: bytes) -> list[bytes]:
        nonlocal buf
        buf += chunk
        *complete, buf = buf.split(b"\n")
        return complete

    async for chunk in response.content.iter_any():
        for raw in lines(chunk):
            line = raw.decode("utf-8").rstrip("\r")
            if not line:
                if data:
                    if done_marker and data == ["[DONE]"]:
                        return
                    yield name, json.loads("\n".join(data))
                name, data = None, []
            elif line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
    if data:  # a last message without its blank line
        yield name, json.loads("\n".join(data))


def render_frame(frame: dict[str, Any], style: Style) -> str:
    """The frame's text with every output detection inside it highlighted. Spans are
    stream-relative; a whole-document detection on text already printed is only listed."""
    text: str = frame.get("generated_text") or ""
    base = frame.get("start_index") or 0
    spans = sorted(
        (max(d["start"] - base, 0), min(d["end"] - base, len(text)))
        for d in (frame.get("token_classification_results") or {}).get("output") or []
    )
    out, pos = [], 0
    for start, end in spans:
        if end <= pos:
            continue
        start = max(start, pos)
        out.append(text[pos:start])
        out.append(style.flagged(text[start:end]))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def describe(detection: dict[str, Any], kind: str) -> str:
    return (
        f"{kind} detection: {detection['detector_id']} "
        f"{detection['entity_group']}/{detection['entity']} "
        f"[{detection['start']}:{detection['end']}] {detection['word']!r} "
        f"score={detection['score']:.2f}"
    )


def describe_frame(frame: dict[str, Any]) -> list[str]:
    results = frame.get("token_classification_results") or {}
    return [describe(d, kind) for kind in ("input", "output") for d in results.get(kind) or []]


def request_body(args: argparse.Namespace, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model_id": model, "inputs": args.prompt}
    guardrails: dict[str, Any] = {}
    if args.input_detector:
        guardrails["input"] = {"models": {d: {} for d in args.input_detector}}
    if args.output_detector:
        guardrails["output"] = {"models": {d: {} for d in args.output_detector}}
    if guardrails:
        body["guardrail_config"] = guardrails
    if getattr(args, "max_new_tokens", None):
        body["text_gen_parameters"] = {"max_new_tokens": args.max_new_tokens}
    return body


def chat_request_body(args: argparse.Namespace, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": args.prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    detectors: dict[str, Any] = {}
    if args.input_detector:
        detectors["input"] = {d: {} for d in args.input_detector}
    if args.output_detector:
        detectors["output"] = {d: {} for d in args.output_detector}
    if detectors:
        body["detectors"] = detectors
    if getattr(args, "max_new_tokens", None):
        body["max_tokens"] = args.max_new_tokens
    return body


async def chat_events(
    response: aiohttp.ClientResponse,
) -> AsyncIterator[tuple[str | None, dict[str, Any]]]:
    """Chat-completion chunks as the FMS events the renderer knows: content chunks as frames,
    a refusal as refusal.delta/done, the finish reason (or an error object) as the terminal."""
    at = 0
    finish: str | None = None
    usage: dict[str, Any] = {}
    migrations = 0  # guardstream's extension on the finish chunk
    async for _, chunk in sse_events(response, done_marker=True):
        if "error" in chunk:
            e = chunk["error"]
            name = "failed" if at else "error"
            error = {"code": e.get("code"), "type": e.get("type"), "message": e.get("message")}
            if name == "failed":
                yield name, {"processed_index": at, "error": error}
            else:
                yield name, {"code": e.get("code"), "type": e.get("type"), "details": e["message"]}
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        migrations = chunk.get("migrations") or migrations
        detections = chunk.get("detections") or {}
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            outputs = [d for o in detections.get("output") or [] for d in o["results"]]
            inputs = [d for i in detections.get("input") or [] for d in i["results"]]
            if delta.get("refusal"):
                yield "refusal.delta", {"delta": delta["refusal"]}
                yield "refusal.done", {"refusal": delta["refusal"], "detections": inputs + outputs}
            elif text or outputs:
                frame = {
                    "generated_text": text,
                    "start_index": at,
                    "token_classification_results": {"output": outputs},
                }
                at += len(text)
                yield None, frame
            finish = choice.get("finish_reason") or finish
    counts = {
        "finish_reason": finish,
        "generated_token_count": usage.get("completion_tokens", 0),
        "input_token_count": usage.get("prompt_tokens"),
        "processed_index": at,
        "migrations": migrations,
    }
    if finish == "stop":
        yield "completed", counts
    elif finish in ("length", "content_filter"):
        reason = "max_output_tokens" if finish == "length" else "content_filter"
        yield "incomplete", {**counts, "incomplete_details": {"reason": reason}}


async def _default_model(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> str | None:
    """The server's first model, from GET /v1/models (with the key: /info shows no ids to a
    caller without one)."""
    async with session.get(f"{url}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise Rejected(resp.status, (await resp.text()).strip() or "(empty body)")
        try:
            listing = await resp.json(content_type=None)
        except ValueError:
            return None
    data = listing.get("data") if isinstance(listing, dict) else None
    ids = [m.get("id") for m in data or [] if isinstance(m, dict)]
    return ids[0] if ids and isinstance(ids[0], str) else None


class Rejected(Exception):
    """The server answered with an HTTP error before any stream started."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")


def server_url(given: str) -> str:
    """`localhost:8033` (no scheme) means http: aiohttp would otherwise fail on
    `localhost:8033/info` with a message that does not say what is wrong."""
    url = given.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


async def run_terminal_client(
    args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Streams one generation to `out`; returns the exit status (module docstring)."""
    out = out or sys.stdout
    err = err or sys.stderr
    color = not getattr(args, "no_color", False) and out.isatty() and "NO_COLOR" not in os.environ
    style = Style(color)
    url = server_url(args.url)
    if not url.startswith(("http://", "https://")):
        print(f"error: --url {args.url}: only http:// and https:// are supported", file=err)
        return EXIT_REJECTED
    headers: dict[str, str] = {}
    key = args.api_key or os.environ.get(API_KEY_ENV)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        ) as session:
            model = args.model or await _default_model(session, url, headers)
            if model is None:
                print(f"error: {url} serves no model (pass --model)", file=err)
                return EXIT_REJECTED
            chat = getattr(args, "api", "fms") == "chat"
            path, body = (
                (CHAT_PATH, chat_request_body(args, model))
                if chat
                else (STREAM_PATH, request_body(args, model))
            )
            async with session.post(f"{url}{path}", json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise Rejected(resp.status, (await resp.text()).strip() or "(empty body)")
                events = chat_events(resp) if chat else sse_events(resp)
                return await _render(events, out, err, style)
    except Rejected as exc:
        print(f"error: {exc}", file=err)
        return EXIT_REJECTED
    except aiohttp.ClientConnectorError as exc:
        print(f"error: cannot connect to {url}: {exc.os_error or exc}", file=err)
        return EXIT_UNREACHABLE
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"\nerror: the connection to {url} failed: {exc or type(exc).__name__}", file=err)
        return EXIT_UNREACHABLE
    except asyncio.CancelledError:  # Ctrl-C under asyncio.run: end quietly
        print("\ninterrupted", file=err)
        return EXIT_INTERRUPTED


async def _render(
    events: AsyncIterator[tuple[str | None, dict[str, Any]]],
    out: TextIO,
    err: TextIO,
    style: Style,
) -> int:
    notes: list[str] = []
    at_line_start = True

    def write(text: str) -> None:
        nonlocal at_line_start
        if text:
            out.write(text)
            out.flush()
            at_line_start = text.endswith("\n")

    def newline() -> None:
        if not at_line_start:
            write("\n")

    async for name, data in events:
        if name is None:
            write(render_frame(data, style))
            notes += describe_frame(data)
        elif name == "refusal.delta":
            newline()
            write(style.flagged(data.get("delta", "")))
        elif name == "refusal.done":
            notes += [describe(d, "blocking") for d in data.get("detections") or []]
        elif name in TERMINAL_EVENTS:
            newline()
            for note in notes:
                write(style.dim(note) + "\n")
            write(style.bold(f"[{name}]") + " " + json.dumps(data, ensure_ascii=False) + "\n")
            if name == "failed":
                e = data.get("error") or {}
                print(f"error: {e.get('type')} ({e.get('code')}): {e.get('message')}", file=err)
            elif name == "error":
                print(
                    f"error: {data.get('type')} ({data.get('code')}): {data.get('details')}",
                    file=err,
                )
            return EXIT[name]
    newline()
    print("error: the stream ended without a terminal event (connection cut)", file=err)
    return EXIT_UNREACHABLE
