"""What every handler needs, built once per app at start-up."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .clients.backend import ModelBackend
from .clients.registry import ChunkerRegistry, DetectorRegistry, EnforcedGuardrails
from .config import Config
from .metrics import OrchestratorMetrics
from .streaming.loop_lag import LoopLag


@dataclass
class AppState:
    config: Config
    metrics: OrchestratorMetrics
    chunkers: ChunkerRegistry
    session: aiohttp.ClientSession | None = None
    detectors: DetectorRegistry | None = None
    backends: dict[str, ModelBackend] = field(default_factory=dict)
    enforced: dict[str, EnforcedGuardrails] = field(default_factory=dict)  # by model id
    active_streams: int = 0
    # the taken stream slots (handlers/stream_slots.py), so a drain can end each pipeline with a
    # terminal event
    streams: set[Any] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no stream runs
    draining: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    loop_lag: LoopLag = field(default_factory=LoopLag)  # read pacing applies while it is busy


STATE = web.AppKey("state", AppState)
