"""Prometheus metrics of the orchestrator, on a registry of its own per app (tests build many).

Everything `GET /metrics` serves lives on `OrchestratorMetrics.registry`: the request, stream,
frame, detection and terminal-event series defined here, the detector-call series recorded by
`record_detector_call` (the detector registry's `on_call`), and the migration counters
(`MigrationMetrics`), which `create_app` registers on the same registry through
`build_model_backends(registry=...)`.

Under `server.workers` > 1 every worker runs with PROMETHEUS_MULTIPROC_DIR set (before
prometheus_client is imported): each value lives in that directory, and the registry `/metrics`
serializes reads all of it, so every worker answers with the sum over all workers (counters and
histograms add up, `guardstream_active_streams` adds the live workers' streams), and
`guardstream_worker_requests` (only then) shows each live worker's requests by `pid`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from .streaming.events import Frame, Terminal
from .streaming.findings import Finding
from .streaming.guarded_generation import StreamObserver

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# a first frame: a token, a detector round trip, a migration; a stream: up to request_timeout_s
FIRST_FRAME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STREAM_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# stalls of the event loop: sub-millisecond when healthy, a GC pass or a CPU-bound burst above
STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


T = TypeVar("T")
_READER: ThreadPoolExecutor | None = None
_READER_LOCK = threading.Lock()


def _reader() -> ThreadPoolExecutor:
    """The one thread that reads the series for /metrics and /v1/usage: collecting the registry
    is CPU work (14 ms for /metrics with one process; 95 ms under `server.workers` 16, every
    worker's file read and merged), which on the event loop stalled every stream each call.
    One thread: a flood of reads queues here, not on the default executor (DNS lookups)."""
    global _READER
    with _READER_LOCK:
        if _READER is None:
            _READER = ThreadPoolExecutor(1, thread_name_prefix="guardstream-metrics")
        return _READER


async def off_loop(fn: Callable[[], T]) -> T:
    """`fn()` on the metrics reader thread."""
    return await asyncio.get_running_loop().run_in_executor(_reader(), fn)


class AllWorkersRegistry(CollectorRegistry):
    """A registry whose exposition is every worker's values (the multiprocess directory), not
    the collectors registered on it: those write their values into that directory. Registering
    still checks names, as in a plain registry."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._workers = MultiProcessCollector(None, path=path)

    def collect(self) -> Iterable[Metric]:
        return self._workers.collect()


def metrics_registry() -> CollectorRegistry:
    """The registry of one app: for all workers when PROMETHEUS_MULTIPROC_DIR is set."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return AllWorkersRegistry(path) if path else CollectorRegistry()


class OrchestratorMetrics:
    """The orchestrator's series. `observer()` feeds the streaming pipeline's hooks into them."""

    def __init__(self) -> None:
        self._gc_timer: GcPauseTimer | None = None  # gc_pause_timer's, flushed on the loop
        self.registry = metrics_registry()
        r = self.registry
        self.requests = Counter(
            "guardstream_requests",
            "HTTP requests by route and status (streams are counted when they end)",
            ["endpoint", "status"],
            registry=r,
        )
        self.active_streams = Gauge(
            "guardstream_active_streams",
            "Streams in progress (task endpoints and stream-content)",
            registry=r,
            multiprocess_mode="livesum",
        )
        # only under server.workers > 1: one series per live worker, by pid
        self.worker_requests: Gauge | None = None
        if isinstance(r, AllWorkersRegistry):
            self.worker_requests = Gauge(
                "guardstream_worker_requests",
                "HTTP requests each live worker served (by pid: how evenly the kernel spreads "
                "connections over the workers)",
                registry=r,
                multiprocess_mode="liveall",
            )
        self.rejected_streams = Counter(
            "guardstream_rejected_streams",
            "Requests turned away before they started: overloaded (server.max_concurrent_streams "
            "streams running: 429 with Retry-After) or draining (503 while shutting down)",
            ["reason"],
            registry=r,
        )
        for reason in ("overloaded", "draining"):  # at 0 from the start: rate() sees the first
            self.rejected_streams.labels(reason)
        # the kernel's count for the whole network namespace (a pod's own, in Kubernetes):
        # connections dropped because a listen queue was full; a client sees a timeout or reset
        self.listen_overflows = Gauge(
            "guardstream_tcp_listen_overflows",
            "Connections the kernel dropped since boot because a listen queue was full "
            "(/proc/net/netstat ListenOverflows, this network namespace; see "
            "server.listen_backlog)",
            registry=r,
            multiprocess_mode="max",
        )
        self.frames = Counter(
            "guardstream_frames",
            "Classified frames produced by the task pipeline (the unary endpoint folds them)",
            registry=r,
        )
        self.detections = Counter(
            "guardstream_detections",
            "Detections returned to clients, by detector",
            ["detector_id"],
            registry=r,
        )
        self.detector_latency = Histogram(
            "guardstream_detector_latency_seconds",
            "Duration of detector calls that returned or failed (cancelled calls excluded)",
            ["detector_id"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.detector_calls = Counter(
            "guardstream_detector_calls",
            "Detector calls by detector and outcome (ok | error | cancelled)",
            ["detector_id", "outcome"],
            registry=r,
        )
        self.cache_hits = Counter(
            "guardstream_detection_cache_hits",
            "Input contents answered from the detection cache (detection_cache), by detector",
            ["detector_id"],
            registry=r,
        )
        self.cache_misses = Counter(
            "guardstream_detection_cache_misses",
            "Input contents of a cached detector that were sent to it (no kept verdict)",
            ["detector_id"],
            registry=r,
        )
        self.cache_evictions = Counter(
            "guardstream_detection_cache_evictions",
            "Kept input verdicts pushed out by the detection cache's bounds, by detector",
            ["detector_id"],
            registry=r,
        )
        self.hold_back = Histogram(
            "guardstream_frame_hold_back_seconds",
            "Time from a frame's last character being generated to the frame being sent",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        # per model: model ids come from the config, so the label's values are bounded
        self.first_frame = Histogram(
            "guardstream_time_to_first_frame_seconds",
            "Time to first token as a client sees it: from the pipeline's start (the request "
            "validated and admitted) to the first frame with text, judged by every detector",
            ["model"],
            registry=r,
            buckets=FIRST_FRAME_BUCKETS,
        )
        self.stream_duration = Histogram(
            "guardstream_stream_duration_seconds",
            "Generation requests from the pipeline's start to their terminal event, by how they "
            "ended (completed | incomplete | failed | error)",
            ["model", "event"],
            registry=r,
            buckets=STREAM_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "guardstream_prompt_tokens",
            "Prompt tokens of generation requests (as the engine counted them)",
            ["model"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "guardstream_generated_tokens",
            "Tokens the model generated for clients (migrations do not count twice)",
            ["model"],
            registry=r,
        )
        self.terminal_events = Counter(
            "guardstream_terminal_events",
            "Terminal events by name (completed | incomplete | failed | error)",
            ["event"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "guardstream_event_loop_lag_seconds",
            "How late the event loop ran a probe due every 100 ms: what every stream's tokens "
            "and frames wait for at that moment",
            registry=r,
            buckets=STALL_BUCKETS,
        )
        # per tenant: label values only from the config's tenant ids (add_tenants)
        self.tenant_requests = Counter(
            "guardstream_tenant_requests",
            "HTTP requests by tenant (probes and scrapes of /health, /info, /metrics, /openapi.json not "
            "included)",
            ["tenant"],
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "guardstream_tenant_prompt_tokens",
            "Prompt tokens of a tenant's generation requests",
            ["tenant"],
            registry=r,
        )
        self.tenant_generated_tokens = Counter(
            "guardstream_tenant_generated_tokens",
            "Tokens generated for a tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_detections = Counter(
            "guardstream_tenant_detections",
            "Detections returned to a tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_refusals = Counter(
            "guardstream_tenant_refusals",
            "A tenant's requests a guardrail refused (a block or an input hit: content_filter)",
            ["tenant"],
            registry=r,
        )
        # what GET /v1/usage reports, by its name there
        self.tenant_series = {
            "requests": self.tenant_requests,
            "prompt_tokens": self.tenant_prompt_tokens,
            "generated_tokens": self.tenant_generated_tokens,
            "detections": self.tenant_detections,
            "refusals": self.tenant_refusals,
        }
        self.gc_pauses = Histogram(
            "guardstream_gc_pause_seconds",
            "Python's garbage collections by generation: each one stops the event loop, and so "
            "every stream, for its duration",
            ["generation"],
            registry=r,
            buckets=STALL_BUCKETS,
        )

    def add_tenants(self, tenant_ids: Iterable[str]) -> None:
        """The per-tenant series, at 0 from the start, for the config's tenant ids: the only
        label values they ever get (a key cannot name a tenant, so the set stays bounded)."""
        for tenant_id in tenant_ids:
            for series in self.tenant_series.values():
                series.labels(tenant_id)

    def count_request(self, endpoint: str, status: int, tenant: str | None = None) -> None:
        """One HTTP request ended (streams when they end)."""
        self.requests.labels(endpoint, str(status)).inc()
        if tenant is not None:
            self.tenant_requests.labels(tenant).inc()
        if self.worker_requests is not None:
            self.worker_requests.inc()

    def usage(self, tenant: str) -> dict[str, int]:
        """A tenant's counters, as /metrics says them (every worker's, under server.workers:
        the registry, which reads every worker's file; else the tenant series alone). CPU work:
        `read_usage` runs it off the loop."""
        names = {f"guardstream_tenant_{key}_total": key for key in self.tenant_series}
        out = dict.fromkeys(self.tenant_series, 0)
        sources: Iterable[Any] = (
            [self.registry]
            if isinstance(self.registry, AllWorkersRegistry)
            else self.tenant_series.values()
        )
        for source in sources:
            for metric in source.collect():
                for sample in metric.samples:
                    key = names.get(sample.name)
                    if key is not None and sample.labels.get("tenant") == tenant:
                        out[key] += int(sample.value)
        return out

    async def read_usage(self, tenant: str) -> dict[str, int]:
        """`usage`, off the event loop (GET /v1/usage)."""
        return await off_loop(lambda: self.usage(tenant))

    async def exposition(self) -> bytes:
        """The Prometheus text of every series (GET /metrics), serialized off the event loop;
        the collections timed since the last probe are observed first, on the loop."""
        self.flush_gc_pauses()
        return await off_loop(lambda: generate_latest(self.registry))

    def observer(
        self,
        model: str | None = None,
        tenant: str | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> StreamObserver:
        """Hooks for one request's pipeline (which itself knows nothing of prometheus); with a
        `model`, the generation series of that model, timed from now; with a `tenant`, its
        series too; `on_tokens` hears the prompt plus generated tokens when the stream ends (a
        tenant's token budget)."""
        started = time.monotonic()
        first_frame = None if model is None else self.first_frame.labels(model)

        def on_frame(frame: Frame, hold_s: float) -> None:
            nonlocal first_frame
            self.frames.inc()
            # every frame with text has been held back for some time, however short; frames
            # without text (an empty final frame) have nothing to hold
            if frame.text:
                self.hold_back.observe(max(hold_s, 0.0))
                if first_frame is not None:
                    first_frame.observe(time.monotonic() - started)
                    first_frame = None

        def on_findings(findings: list[Finding]) -> None:
            # one inc per detector, not per finding: a 1 MB request can bring 40,000
            for detector_id, n in Tally(f.detector_id for f in findings).items():
                self.detections.labels(detector_id).inc(n)
            if tenant is not None and findings:
                self.tenant_detections.labels(tenant).inc(len(findings))

        def on_terminal(terminal: Terminal) -> None:
            self.terminal_events.labels(terminal.kind).inc()
            tokens = (terminal.input_token_count or 0) + terminal.generated_token_count
            if tenant is not None:
                if terminal.reason == "content_filter":
                    self.tenant_refusals.labels(tenant).inc()
                if model is not None:
                    self.tenant_prompt_tokens.labels(tenant).inc(terminal.input_token_count or 0)
                    self.tenant_generated_tokens.labels(tenant).inc(terminal.generated_token_count)
            if on_tokens is not None:
                on_tokens(tokens)
            if model is None:
                return
            self.stream_duration.labels(model, terminal.kind).observe(time.monotonic() - started)
            self.prompt_tokens.labels(model).inc(terminal.input_token_count or 0)
            self.generated_tokens.labels(model).inc(terminal.generated_token_count)

        def on_abandoned(input_tokens: int, generated_tokens: int) -> None:
            # a stream its client left has no terminal event (nor a duration: it did not end on
            # its own), but its tokens were spent: counted and charged as any other's, or a
            # tenant that leaves before the end would never pay for what it read
            if tenant is not None and model is not None:
                self.tenant_prompt_tokens.labels(tenant).inc(input_tokens)
                self.tenant_generated_tokens.labels(tenant).inc(generated_tokens)
            if on_tokens is not None:
                on_tokens(input_tokens + generated_tokens)
            if model is not None:
                self.prompt_tokens.labels(model).inc(input_tokens)
                self.generated_tokens.labels(model).inc(generated_tokens)

        return StreamObserver(
            on_frame=on_frame,
            on_findings=on_findings,
            on_terminal=on_terminal,
            on_abandoned=on_abandoned,
        )

    def gc_pause_timer(self) -> GcPauseTimer:
        """A `gc.callbacks` entry that times each collection into `gc_pauses` (observed at the
        next loop-lag probe or scrape: `on_loop_probe`, `flush_gc_pauses`)."""
        self._gc_timer = GcPauseTimer(self.gc_pauses)
        return self._gc_timer

    def flush_gc_pauses(self) -> None:
        if self._gc_timer is not None:
            self._gc_timer.flush()

    def on_loop_probe(self, lag_s: float) -> None:
        """A loop-lag probe's measure; the collections timed since the last one are observed
        here too, on the loop, outside any collection."""
        self.loop_lag.observe(lag_s)
        self.flush_gc_pauses()

    def record_cache_lookup(self, detector_id: str, hits: int, misses: int) -> None:
        """One detector's lookups of one request in the detection cache."""
        if hits:
            self.cache_hits.labels(detector_id).inc(hits)
        if misses:
            self.cache_misses.labels(detector_id).inc(misses)

    def record_cache_eviction(self, detector_id: str) -> None:
        self.cache_evictions.labels(detector_id).inc()

    def record_detector_call(self, detector_id: str, outcome: str, seconds: float) -> None:
        """A detector call ended (`ok`, `error` or `cancelled`); a cancelled call's time says
        nothing about the detector, so only the finished ones enter the latency histogram."""
        self.detector_calls.labels(detector_id, outcome).inc()
        if outcome != "cancelled":
            self.detector_latency.labels(detector_id).observe(seconds)


class GcPauseTimer:
    """Times each of Python's garbage collections (a `gc.callbacks` entry): a full collection
    walks every live object with the loop stopped, which made the p99 latency at 256 streams
    before the start-up heap was frozen (see `server.freeze_startup_heap`)."""

    def __init__(self, histogram: Histogram) -> None:
        self._by_generation = {g: histogram.labels(str(g)) for g in range(3)}
        self._started = 0.0
        # timed here, observed in `flush`: a collection can start while a metric's lock is held
        # (prometheus_client's multiprocess values share one lock that cannot be taken twice),
        # and observing from the callback deadlocked a worker (py-spy: Histogram.labels ->
        # json.dumps -> gc -> this -> observe). Bounded: a flush comes with every loop probe.
        self._pending: deque[tuple[int, float]] = deque(maxlen=4096)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pending.append((info["generation"], time.perf_counter() - self._started))

    def flush(self) -> None:
        """Observes the collections timed since the last flush (not from a gc callback)."""
        pending = self._pending
        while pending:
            generation, seconds = pending.popleft()
            self._by_generation[generation].observe(seconds)
