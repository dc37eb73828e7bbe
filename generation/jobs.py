"""What goes into the engine and what comes out of it: a `Job` per request, the `EngineDelta`s
and `StreamError`s its queue receives, the finish reasons, and the counters the server reports.
The worker loop (scheduler.py) and the HTTP server (server.py) both speak these; neither owns
them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # not at run time: the API process imports this before torch (sampling.py)
    from .sampling import SamplingParams


class FinishReason(StrEnum):
    EOS_TOKEN = "EOS_TOKEN"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    MAX_TOKENS = "MAX_TOKENS"
    TIME_LIMIT = "TIME_LIMIT"


@dataclass(slots=True)
class EngineDelta:
    """One NDJSON data item: the token generated in one step and the text released by it (the
    orchestrator parses it into its own `EngineDelta`, the same word from here to the pipeline).

    Token ids are reported as soon as they are generated; text may lag behind them: an incomplete
    UTF-8 character, or text that may be the start of a stop sequence, is held back until
    resolved. So at any point the delivered text is a prefix of decode(delivered token ids), and a
    client resuming elsewhere sends both (`resume.token_ids`, `resume.text`); the new replica
    replays the tokens through the same detokenizer and stop-sequence state and releases the
    text of resumed tokens that `resume.text` lacks first. When a stop sequence ends the stream,
    the final item carries the token that completed it, while the text stops before the stop
    sequence (it and anything after it are never emitted).
    """

    token_ids: list[int]
    text: str
    generated_token_count: int
    finish_reason: FinishReason | None = None


@dataclass
class StreamError:
    """An in-band error; `type` is `generation_unavailable` when another replica could succeed."""

    code: int
    type: str
    message: str


class StreamSink(Protocol):
    """A job's receiver on its event loop, in place of an `asyncio.Queue`: the worker's
    delivery (output_processor.py, one hand-off per step) calls `put_many` on the loop with each
    job's new events, in order: once per delivery (once per event of a job that had two in
    one step). The engine server's stream is one: it writes them to its socket right there, in
    one write (issue 35), instead of a queue put, a task wake-up and a write per token. Never
    raises: a sink that fails ends its own stream."""

    def put_many(self, events: list[EngineDelta | StreamError]) -> None: ...


class StepSink(Protocol):
    """One receiver for many jobs (the engine core's, engine_core.py): the delivery hands it all
    of a step's events at once, `(job, event)` in order, in one call, instead of a call per job:
    it forwards them to another process in one message, so the worker's process does no
    per-stream work. Used when every job of a delivery has this same sink. Never raises.

    One with `direct = True` is called on the worker thread itself, from its `flush` (so it
    must be thread-safe); otherwise on the jobs' loop, through its mailbox."""

    def put_step(self, events: list[tuple[Job, EngineDelta | StreamError]]) -> None: ...


class EngineUnavailable(RuntimeError):
    """The engine is shutting down (or its worker died) and takes no new requests."""


@dataclass(eq=False)
class Job:
    """A generation request as the worker sees it. Created on the event loop, then owned by the
    worker except for `cancelled`, which the loop may set at any time."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    # the server's: a StreamSink; the engine core's: a StepSink
    queue: asyncio.Queue[EngineDelta | StreamError] | StreamSink | StepSink
    resume_ids: list[int] = field(default_factory=list)
    resume_text_len: int = 0  # characters of the resumed tokens' text the client already has
    min_new_tokens: int = 0
    stop_sequences: list[str] = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() value; None = no time limit
    cancelled: bool = False


#: The parts `WorkerTimes` splits the worker thread's time into.
WORKER_PARTS = ("admit", "launch", "device_wait", "accept", "deliver", "judge", "idle")


@dataclass
class WorkerTimes:
    """Where the worker thread's time goes (/health `worker`), cumulative nanoseconds per part:
    `admit` (cancels, joins and their prefills, a long prompt's chunk), `launch` (a decode step
    queued: a graph replay's launch, or the whole eager step), `device_wait` (blocked on a
    step's tokens: the device still running it), `accept` (tokens into rows: stops,
    detokenization, events), `deliver` (the events posted to their loops), `judge` (judge
    passes), `idle` (no work). On a GPU a step whose `device_wait` is near zero is host-bound:
    the rest is what the host adds. The loop side (`deliveries`, `delivered_posts`,
    `delivery_ns`) is the events' fan-out on the event loop, which shares the GIL with the
    worker: `delivered_posts` above `deliveries` means the loop fell behind the steps. Why: on an
    H200 at 256 rows a client saw 8.2 ms per token against a 4.6 ms graph replay, and nothing
    said whether the worker, the loop, the API process or the client held the rest."""

    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORKER_PARTS, 0))
    decode_steps: int = 0
    rows_stepped: int = 0  # rows summed over decode steps
    deliveries: int = 0
    delivered_posts: int = 0
    delivery_ns: int = 0

    def info(self) -> dict[str, object]:
        """/health's `worker`: seconds per part, and the loop's deliveries."""
        return {
            "decode_steps": self.decode_steps,
            "rows_stepped": self.rows_stepped,
            "seconds": {part: ns / 1e9 for part, ns in self.ns.items()},
            "deliveries": self.deliveries,
            "delivered_posts": self.delivered_posts,
            "delivery_seconds": self.delivery_ns / 1e9,
        }


@dataclass
class EngineStats:
    """Counters the server exposes in /health and /metrics."""

    forward_passes: int = 0
    prefill_passes: int = 0
    prefill_chunks: int = 0  # passes over part of a long prompt (the last one counts as a prefill)
    decode_steps: int = 0
    tokens_generated: int = 0
    requests_started: int = 0
    requests_cancelled: int = 0  # dropped because their client left (or a fault cut them)
    max_batch_size_seen: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    worker: WorkerTimes = field(default_factory=WorkerTimes)
