"""`python -m orchestrator stream "prompt"`: a terminal client for the streaming endpoint.

Renders frames as they arrive, detected spans highlighted, then the terminal event. Exit status:
0 completed, 2 incomplete (cut short or refused), 1 failed/error or no terminal event.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any, TextIO

import aiohttp

STREAM_PATH = "/api/v1/task/server-streaming-classification-with-text-generation"

EXIT = {"completed": 0, "incomplete": 2, "failed": 1, "error": 1}


class Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def wrap(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def flagged(self, text: str) -> str:
        return self.wrap(text, "1;31;4") if self.color else f"[{text}]"

    def dim(self, text: str) -> str:
        return self.wrap(text, "2")


async def sse_events(
    response: aiohttp.ClientResponse,
) -> AsyncIterator[tuple[str | None, dict[str, Any]]]:
    """(event name or None for frames, data) for each SSE message."""
    name: str | None = None
    data: list[str] = []
    async for raw in response.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def render_frame(frame: dict[str, Any], style: Style) -> str:
    """The frame's text with every output detection inside it highlighted."""
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


def describe_detections(frame: dict[str, Any], kind: str) -> list[str]:
    found = (frame.get("token_classification_results") or {}).get(kind) or []
    return [
        f"{kind} detection: {d['detector_id']} {d['entity_group']}/{d['entity']} "
        f"[{d['start']}:{d['end']}] {d['word']!r} score={d['score']:.2f}"
        for d in found
    ]


async def run_terminal_client(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    style = Style(color=not args.no_color and out.isatty() and "NO_COLOR" not in os.environ)
    headers = {}
    key = args.api_key or os.environ.get("GUARDSTREAM_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = args.url.rstrip("/")
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
    ) as session:
        model = args.model
        if model is None:
            async with session.get(f"{url}/info") as resp:
                models = list((await resp.json()).get("models", {}))
            if not models:
                print("error: the server serves no model", file=sys.stderr)
                return 1
            model = models[0]
        body: dict[str, Any] = {"model_id": model, "inputs": args.prompt, "guardrail_config": {}}
        if args.input_detector:
            body["guardrail_config"]["input"] = {"models": {d: {} for d in args.input_detector}}
        if args.output_detector:
            body["guardrail_config"]["output"] = {"models": {d: {} for d in args.output_detector}}
        if args.max_new_tokens:
            body["text_gen_parameters"] = {"max_new_tokens": args.max_new_tokens}
        try:
            async with session.post(f"{url}{STREAM_PATH}", json=body, headers=headers) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    print(f"error: HTTP {resp.status}: {text}", file=sys.stderr)
                    return 1
                notes: list[str] = []
                async for name, data in sse_events(resp):
                    if name is None:
                        out.write(render_frame(data, style))
                        out.flush()
                        notes += describe_detections(data, "input") + describe_detections(
                            data, "output"
                        )
                        continue
                    if name == "refusal.delta":
                        continue
                    if name == "refusal.done":
                        out.write("\n" + style.flagged(data["refusal"]) + "\n")
                        continue
                    out.write("\n")
                    for note in notes:
                        out.write(style.dim(note) + "\n")
                    out.write(style.dim(f"[{name}] {json.dumps(data)}") + "\n")
                    return EXIT.get(name, 1)
        except aiohttp.ClientError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    print("\nerror: the stream ended without a terminal event", file=sys.stderr)
    return 1
