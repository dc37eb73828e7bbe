"""The figures of bench/engine_host.py (issue 35): the share of the host's step hidden by
overlapped steps comes from its step and device-clock accounting, checked here on hand-built
arrivals and a hand-driven clock (the bench itself needs minutes and a quiet machine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench import engine_host
from bench.engine_host import (
    ClockEvent,
    Level,
    NullModel,
    TtftLevel,
    hidden_shares,
    median_step,
    step_time,
    ttft_line,
)


def streams(rows: int, tokens: int, step: float) -> list[list[tuple[float, int]]]:
    """Every stream's (arrival, tokens so far), one token per `step` seconds."""
    return [[(k * step + i * 1e-5, k) for k in range(1, tokens + 1)] for i in range(rows)]


def test_median_step_ignores_a_stall_and_a_straggler_that_the_mean_counts() -> None:
    arrivals = streams(8, 64, 0.004)
    for stream in arrivals:  # every stream stalls 50 ms after its 30th token (another tenant)
        stream[30:] = [(at + 0.05, k) for at, k in stream[30:]]
    arrivals[0][-1] = (arrivals[0][-1][0] + 0.2, 64)  # one client read its last token late
    mean, steps = step_time(arrivals)
    assert steps == 63
    assert mean == pytest.approx((63 * 0.004 + 0.25) / 63)  # stream 0: first and last
    assert median_step(arrivals) == pytest.approx(0.004)


def test_median_step_over_a_client_reading_several_tokens_at_once() -> None:
    # a client behind takes 4 tokens per read: their arrivals coincide, the rate does not change
    arrivals = [[(0.016 * ((k - 1) // 4 + 1), k) for k in range(1, 65)] for _ in range(4)]
    assert median_step(arrivals) == pytest.approx(0.004)


def level(overlap: bool, median_step_ms: float, idle_ms: list[float], repeat: int) -> Level:
    return Level(
        "http-api",
        "greedy",
        256,
        4.0,
        median_step_ms,
        64,
        overlap,
        median_step_ms=median_step_ms,
        idle_ms=idle_ms,
        repeat=repeat,
    )


def test_hidden_shares_pair_each_repeats_overlapped_and_synchronous_runs() -> None:
    levels = [  # each run's first step (after prefill and joins) is left out
        level(True, 4.1, [9.0, 0.0, 0.0, 0.6], 0),
        level(False, 5.0, [9.0, 1.0, 1.0, 1.0], 0),
        level(True, 4.0, [0.0, 0.0, 0.0, 0.0], 1),
        level(False, 4.5, [0.0, 0.4, 0.5, 0.6], 1),
        level(True, 4.2, [], 2),  # repeat 2's synchronous run is missing: no share
    ]
    shares = hidden_shares(levels, "http-api", "greedy", 256, 4.0)
    assert shares["steps"] == pytest.approx([0.9, 1.0])  # (off - on) / (off - 4 ms)
    assert shares["device"] == pytest.approx([1.0, 1.0])  # median idle: 0 of 1.0, 0 of 0.5
    assert shares["device_mean"] == pytest.approx([0.8, 1.0])  # mean idle: 0.2 of 1.0, 0 of 0.5


def test_the_simulated_device_queues_static_steps_and_counts_its_idle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = SimpleNamespace(now=100.0, slept=[])

    def sleep(seconds: float) -> None:
        clock.slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(
        engine_host, "time", SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep)
    )
    model = NullModel(torch.zeros(8), torch.device("cpu"), torch.float32, 4.0)
    model._device_pass(queued=False)  # prefill: the host waits for it (sleeping, GIL released)
    assert clock.slept == [pytest.approx(0.004)] and clock.now == pytest.approx(100.004)
    clock.now += 0.001  # the host's work: the device sits idle
    model._device_pass(queued=True)  # step N: queued, the host goes on
    first = ClockEvent(model.busy_until)
    clock.now += 0.0005
    model._device_pass(queued=True)  # step N+1, queued behind N while N runs: no idle
    assert clock.slept == [pytest.approx(0.004)]
    first.synchronize()  # step N's tokens: ready when the clock has run it
    assert clock.now == pytest.approx(100.009)
    assert model.take_idle() == pytest.approx([0.001, 0.0])
    assert model.take_idle() == []


def test_ttft_line_reports_the_burst_with_the_lowest_median() -> None:
    def burst(ttfts: list[float], repeat: int, device_ms: float = 4.0) -> TtftLevel:
        return TtftLevel("http-api", "greedy", 4, device_ms, True, sorted(ttfts), repeat)

    bursts = [
        burst([30.0, 10.0, 20.0, 1050.0], 0),  # a dropped SYN's 1 s retry
        burst([12.0, 14.0, 16.0, 18.0], 1),
        burst([5.0, 5.0, 5.0, 5.0], 0, device_ms=0.0),  # another setting
    ]
    assert bursts[0].quantile(0.5) == 30.0 and bursts[0].quantile(0.9) == 1050.0
    assert ttft_line(bursts, "http-api", 4, 4.0) == "ttft_ms_4 p50=16 p90=18 max=18"
    assert ttft_line(bursts, "http", 4, 4.0) is None


def test_an_engine_starts_on_the_null_model() -> None:
    """The engine takes what it needs of a model from its `LoadedModel` (the null model says no
    dtype of its own): an engine on it starts and stops. On 9302280 the judge sessions' memory
    budget read `model.dtype` and the CPU rehearsal of `engine_host` failed at the engine's
    construction."""
    loaded = engine_host.load_null("cpu", 0.0)
    engine = engine_host.make_engine(loaded, 2, eager=False, overlap=True)
    engine.start()
    try:
        assert engine.healthy and engine.judges.max_tokens is not None
    finally:
        engine.stop()
