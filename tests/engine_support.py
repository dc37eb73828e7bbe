"""Helpers for the engine tests: read an NDJSON generate stream and check its framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

FINISH_REASONS = {"EOS_TOKEN", "STOP_SEQUENCE", "MAX_TOKENS", "TIME_LIMIT"}


@dataclass
class Stream:
    """A parsed generate response; `check_framing` enforces DESIGN section 7."""

    status: int
    lines: list[dict[str, Any]] = field(default_factory=list)
    raw: bytes = b""

    @property
    def items(self) -> list[dict[str, Any]]:
        return [line["data"] for line in self.lines if "data" in line]

    @property
    def token_ids(self) -> list[int]:
        return [t for item in self.items for t in item["token_ids"]]

    @property
    def texts(self) -> list[str]:
        return [item["text"] for item in self.items]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def finish_reason(self) -> str | None:
        return self.items[-1]["finish_reason"] if self.items else None

    @property
    def error(self) -> dict[str, Any] | None:
        return self.lines[-1].get("error") if self.lines else None

    @property
    def completed(self) -> bool:
        return bool(self.lines) and self.lines[-1] == {"complete_final": True}

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.items[0]["prompt_token_ids"]

    def delivered_text(self, tokens: int) -> str:
        """The text a client had received once it had received `tokens` token ids."""
        out, seen = [], 0
        for item in self.items:
            if seen + len(item["token_ids"]) > tokens:
                break
            seen += len(item["token_ids"])
            out.append(item["text"])
        return "".join(out)

    def check_framing(self) -> None:
        assert self.raw.endswith(b"\n"), "every line ends with a newline"
        finals = [i for i, line in enumerate(self.lines) if line.get("complete_final") is True]
        errors = [i for i, line in enumerate(self.lines) if "error" in line]
        if errors:
            assert errors == [len(self.lines) - 1], "an error ends the stream"
            assert not finals, "an error stream has no complete_final"
            assert self.lines[-1]["complete_final"] is False
            assert set(self.lines[-1]["error"]) == {"code", "type", "message"}
        else:
            assert finals == [len(self.lines) - 1], "complete_final exactly once, last"
            assert self.lines[-1] == {"complete_final": True}
        items = self.items
        for i, item in enumerate(items):
            expected = {
                "token_ids",
                "text",
                "generated_token_count",
                "input_token_count",
                "finish_reason",
            }
            if i == 0:
                assert "prompt_token_ids" in item
                assert item["input_token_count"] == len(item["prompt_token_ids"])
                expected = expected | {"prompt_token_ids"} | ({"seed"} & set(item))
            assert set(item) == expected, item
        for line in self.lines:
            if "data" in line:
                assert line["complete_final"] is False
        if items:
            for item in items[:-1]:
                assert item["finish_reason"] is None
            if not errors:
                assert items[-1]["finish_reason"] in FINISH_REASONS
            counts = [item["generated_token_count"] for item in items]
            assert counts == sorted(counts)
            assert len({item["input_token_count"] for item in items}) == 1


def parse(status: int, raw: bytes) -> Stream:
    stream = Stream(status=status, raw=raw)
    for line in raw.decode("utf-8").splitlines():
        stream.lines.append(json.loads(line))
    return stream


async def generate(
    session: aiohttp.ClientSession | Any, url: str, body: dict[str, Any], check: bool = True
) -> Stream:
    """POST /v1/generate and read the whole stream (`session` may be a pytest-aiohttp client)."""
    async with session.post(url + "/v1/generate", json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return Stream(status=resp.status, lines=[json.loads(raw)], raw=raw)
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        stream = parse(resp.status, raw)
    if check:
        stream.check_framing()
    return stream


def run(coro: Awaitable[Any]) -> Any:
    """Run a coroutine from a synchronous (hypothesis) test."""
    return asyncio.run(coro)  # type: ignore[arg-type]
