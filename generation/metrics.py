"""The engine's Prometheus series (`/metrics`), read from its counters at scrape time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .scheduler import Engine


class EngineCollector(Collector):
    """Reads the engine's counters at scrape time (no locking in the hot loop)."""

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self._engine = engine

    def collect(self) -> Any:
        engine = self._engine()
        stats = engine.stats
        yield CounterMetricFamily(
            "guardstream_engine_tokens_generated", "Tokens generated", value=stats.tokens_generated
        )
        yield CounterMetricFamily(
            "guardstream_engine_forward_passes", "Model forward passes", value=stats.forward_passes
        )
        yield CounterMetricFamily(
            "guardstream_engine_requests_started", "Requests admitted", value=stats.requests_started
        )
        yield CounterMetricFamily(
            "guardstream_engine_requests_cancelled",
            "Requests aborted because their client left",
            value=stats.requests_cancelled,
        )
        yield CounterMetricFamily(
            "guardstream_engine_prefill_chunks",
            "Forward passes over one chunk of a long context (chunked prefill)",
            value=stats.prefill_chunks,
        )
        yield GaugeMetricFamily(
            "guardstream_engine_prefilling_requests",
            "Requests whose long context is being prefilled chunk by chunk",
            value=engine.prefilling_requests,
        )
        yield GaugeMetricFamily(
            "guardstream_engine_active_requests",
            "Requests queued or running",
            value=engine.active_requests,
        )
        cache = engine.cache_info()
        for name, key, help_text in (
            ("kv_cache_rows", "rows", "Rows the KV cache holds (the largest decode batch)"),
            ("kv_cache_capacity_tokens", "capacity", "Tokens per row the KV cache holds"),
            ("kv_cache_rows_used", "rows_used", "Rows of the KV cache in use"),
            ("kv_cache_tokens_used", "tokens_used", "Tokens held by the running rows"),
            ("kv_cache_bytes", "bytes", "Bytes allocated by the KV cache"),
            ("decode_graphs", "graphs", "CUDA graphs captured for the decode step"),
        ):
            yield GaugeMetricFamily(f"guardstream_engine_{name}", help_text, value=cache[key])
        yield GaugeMetricFamily(
            "guardstream_engine_decode_compiled",
            "1 when the decode step's forward runs through torch.compile (--compile)",
            value=int(bool(cache["compiled"])),
        )
        yield GaugeMetricFamily(
            "guardstream_engine_decode_compile_failed",
            "1 when --compile was given up (compiling failed) and the step runs uncompiled",
            value=int(cache["compile_error"] is not None),
        )
        yield from _graph_passes("prefill", "prefill passes", engine.prefill_info())
        judge = engine.judges.info()
        yield GaugeMetricFamily(
            "guardstream_engine_judge_slots",
            "Judge sessions the static judge pass's pool holds (0: packed passes)",
            value=judge["slots"],
        )
        yield from _graph_passes("judge", "judge passes", judge)
        buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        sizes = dict(stats.batch_sizes)
        cumulative = [(str(b), sum(n for s, n in sizes.items() if s <= b)) for b in buckets]
        cumulative.append(("+Inf", sum(sizes.values())))
        yield HistogramMetricFamily(
            "guardstream_engine_decode_batch_size",
            "Rows per decode step",
            buckets=cumulative,
            sum_value=sum(s * n for s, n in sizes.items()),
        )


def _graph_passes(kind: str, what: str, info: dict[str, Any]) -> Any:
    """A static pass's graphs held, captures, replays and eager passes (prefill, judge): the
    `info` of model_runner.prefill_info / JudgeSessions.info."""
    yield GaugeMetricFamily(
        f"guardstream_engine_{kind}_graphs", f"CUDA graphs held for {what}", value=info["graphs"]
    )
    for name, key, help_text in (
        ("graph_captures", "captures", f"Keys of {what} captured into CUDA graphs"),
        ("graph_replays", "replays", f"{what.capitalize()} replayed from CUDA graphs"),
        ("eager_passes", "eager_passes", f"{what.capitalize()} run eagerly"),
    ):
        yield CounterMetricFamily(f"guardstream_engine_{kind}_{name}", help_text, value=info[key])
