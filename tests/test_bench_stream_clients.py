"""bench/stream_clients.py and bench/engine.py's HTTP level: a level's streams, spread over
several client processes started together, come back whole and in request order, against a real
engine subprocess (tiny-random, batch-invariant: a stream's tokens do not depend on what else runs
with it, so each read alone is the oracle)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from bench.engine import run_level
from bench.stream_clients import read_streams
from tests.engine_processes import EngineProcess, start_engine_subprocess
from tests.engine_support import BATCH_PROMPTS, generate

TOKENS = 5

#: bench/engine.py's level figures before the client processes; the JSON keeps every one
FIGURES = {
    "decoding",
    "concurrency",
    "tokens_total",
    "wall_s",
    "aggregate_tokens_per_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_max_s",
    "per_stream_tokens_per_s",
}


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    extra = ("--batch-invariant", "--threads", "1")
    with start_engine_subprocess("tiny-random", device="cpu", extra_args=extra) as process:
        yield process


def bodies(count: int) -> list[dict[str, Any]]:
    """Different prompts, seeded sampling with a seed each: every stream's tokens differ."""
    return [
        {
            "prompt": BATCH_PROMPTS[i],
            "max_new_tokens": TOKENS,
            "min_new_tokens": TOKENS,
            "decoding": {"method": "sampling", "seed": 100 + i, "temperature": 1.3},
        }
        for i in range(count)
    ]


async def alone(url: str, requests: list[dict[str, Any]]) -> list[list[int]]:
    """Each request's tokens read alone, one after another (tests/engine_support's reader)."""
    async with aiohttp.ClientSession() as session:
        return [(await generate(session, url, body)).token_ids for body in requests]


def test_streams_over_two_clients_are_each_requests_own_tokens_in_order(
    engine: EngineProcess,
) -> None:
    requests = bodies(5)
    oracle = asyncio.run(alone(engine.url, requests))
    assert len({tuple(ids) for ids in oracle}) > 1  # the order check below can fail
    read = read_streams(engine.url, [("/v1/generate", b) for b in requests], clients=2)
    assert read.clients == 2
    assert [s["token_ids"] for s in read.streams] == oracle
    for stream in read.streams:
        assert stream["tokens"] == TOKENS
        counts = [count for _, count in stream["arrivals"]]
        assert counts == sorted(counts) and counts[-1] == TOKENS
        times = [stream["sent"], *(at for at, _ in stream["arrivals"]), stream["end"]]
        assert times == sorted(times)  # one clock (CLOCK_MONOTONIC) for every client process
    assert read.cpu_s > 0 and read.cpu_share > 0


def test_a_stream_the_engine_refuses_fails_the_level(engine: EngineProcess) -> None:
    requests = [("/v1/generate", b) for b in bodies(2)]
    requests[1][1]["max_new_tokens"] = 0  # a 400: the client exits, the level raises
    with pytest.raises(RuntimeError, match="a stream client exited with 1"):
        read_streams(engine.url, requests, clients=2)


def test_the_engine_level_keeps_its_figures_and_adds_the_clients(engine: EngineProcess) -> None:
    r = asyncio.run(run_level(engine.url, 3, TOKENS, "greedy", clients=2))
    added = {"clients", "client_cpu_s", "client_cpu_share", "tokens_per_line"}
    assert set(r) == FIGURES | added | {"distinct_tokens_p50"}
    assert 1 <= r["tokens_per_line"] <= TOKENS and 1 <= r["distinct_tokens_p50"] <= TOKENS
    assert (r["decoding"], r["concurrency"], r["clients"]) == ("greedy", 3, 2)
    assert r["tokens_total"] == 3 * TOKENS
    assert r["wall_s"] > 0 and r["aggregate_tokens_per_s"] == r["tokens_total"] / r["wall_s"]
    assert 0 < r["ttft_p50_s"] <= r["ttft_max_s"] < r["wall_s"]
    assert r["client_cpu_share"] == r["client_cpu_s"] / (2 * r["wall_s"])
