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
        prefill = engine.prefill_info()
        yield GaugeMetricFamily(
            "guardstream_engine_prefill_graphs",
            "CUDA graphs held for prefill passes (the static prefill)",
            value=prefill["graphs"],
        )
        for name, key, help_text in (
            ("prefill_graph_captures", "captures", "Prefill pass keys captured into CUDA graphs"),
            ("prefill_graph_replays", "replays", "Prefill passes replayed from CUDA graphs"),
            ("prefill_eager_passes", "eager_passes", "Whole prefill passes run eagerly"),
        ):
            yield CounterMetricFamily(f"guardstream_engine_{name}", help_text, value=prefill[key])
        judge = engine.judges.info()
        yield GaugeMetricFamily(
            "guardstream_engine_judge_slots",
            "Judge sessions the static judge pass's pool holds (0: packed passes)",
            value=judge["slots"],
        )
        yield GaugeMetricFamily(
            "guardstream_engine_judge_graphs",
            "CUDA graphs held for judge passes",
            value=judge["graphs"],
        )
        for name, key, help_text in (
            ("judge_graph_captures", "captures", "Judge pass keys captured into CUDA graphs"),
            ("judge_graph_replays", "replays", "Judge passes replayed from CUDA graphs"),
            ("judge_eager_passes", "eager_passes", "Judge passes run eagerly"),
        ):
            yield CounterMetricFamily(f"guardstream_engine_{name}", help_text, value=judge[key])
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
