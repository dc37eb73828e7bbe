"""Prometheus metrics of the orchestrator, on a registry of its own per app (tests build many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .api.responses import ClassifiedFrame
from .streaming.findings import Finding
from .streaming.guarded_generation import StreamObserver


class OrchestratorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "guardstream_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.active_streams = Gauge("guardstream_active_streams", "Streams in progress", registry=r)
        self.frames = Counter("guardstream_frames", "Classified frames sent", registry=r)
        self.detections = Counter(
            "guardstream_detections",
            "Detections sent to clients by detector",
            ["detector_id"],
            registry=r,
        )
        self.detector_latency = Histogram(
            "guardstream_detector_latency_seconds",
            "Detector call latency",
            ["detector_id"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.hold_back = Histogram(
            "guardstream_frame_hold_back_seconds",
            "Time from a frame's text being generated to the frame being sent",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.terminal_events = Counter(
            "guardstream_terminal_events", "Terminal events by name", ["event"], registry=r
        )

    def observer(self) -> StreamObserver:
        def on_frame(frame: ClassifiedFrame, hold_s: float) -> None:
            self.frames.inc()
            if hold_s > 0:
                self.hold_back.observe(hold_s)

        def on_findings(findings: list[Finding]) -> None:
            for f in findings:
                self.detections.labels(f.detector_id).inc()

        def on_terminal(name: str) -> None:
            self.terminal_events.labels(name).inc()

        return StreamObserver(on_frame=on_frame, on_findings=on_findings, on_terminal=on_terminal)
