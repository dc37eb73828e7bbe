"""Overlapped decode steps (scheduler.py, model_runner.py): the static step N+1 is launched before
the host accepts step N's tokens; a row that finished at step N gets one extra token at N+1,
discarded. The streams must be exactly those of the synchronous engine: the same items (token
ids, text, counts, finish reasons) for every request, over random orders of joins, leaves
(cancels), stop sequences and finishes, greedy and seeded (tiny-random, float64, on a CPU, where
the step's "event" is complete when recorded: the same logic as on CUDA).

The worker's iterations are driven by hand (`Engine._iterate`, no thread), both engines from the
same script, so joins and cancels land at chosen iterations."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from generation.jobs import EngineDelta, Job, StreamError
from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import Engine

Event = EngineDelta | StreamError
ROWS = 3  # few slots: joiners wait for leavers and take their slots
CHUNK = 8  # prompts longer than this are prefilled a chunk per iteration
CAPACITY = 128
#: Strings tiny-random's streams contain often (so stop sequences do end streams; U+FFFD is
#: text too: the undecodable bytes a finished stream flushes).
STOPS = ["t", "a", "cat", " ❤️", "首都", "xt", " t", "\ufffd"]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    min_new_tokens: int
    stop: list[str]
    sampling: SamplingParams
    join: int  # the iteration it is queued at
    cancel: int | None  # the iteration its client leaves at (None: stays)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    length = draw(st.integers(1, 30))
    start = draw(st.integers(3, 600))
    max_new = draw(st.integers(1, 16))
    decoding = draw(st.sampled_from(["greedy", "seeded", "penalised"]))
    if decoding == "greedy":
        sampling = SamplingParams()
    else:
        sampling = SamplingParams(
            greedy=False,
            temperature=draw(st.sampled_from([0.7, 1.0, 1.3])),
            top_p=draw(st.sampled_from([1.0, 0.9])),
            seed=draw(st.integers(0, 2**31)),
            repetition_penalty=1.3 if decoding == "penalised" else 1.0,
        )
    join = draw(st.integers(0, 8))
    return Request(
        prompt=[(start + 37 * i) % 680 + 3 for i in range(length)],
        max_new_tokens=max_new,
        min_new_tokens=draw(st.sampled_from([0, 0, max_new])),
        stop=draw(st.lists(st.sampled_from(STOPS), max_size=2)),
        sampling=sampling,
        join=join,
        cancel=draw(st.integers(join, join + 12)) if draw(st.integers(0, 3)) == 0 else None,
    )


def new_engine(model: LoadedModel, overlap: bool, buckets: bool = True) -> Engine:
    """The static step on a CPU; `buckets`: rows and width padded as on CUDA (padding rows read
    stale slots), else exact."""
    engine = Engine(
        model,
        max_batch_size=ROWS,
        prefill_chunk_tokens=CHUNK,
        static_decode=True,
        static_buckets=buckets,
        static_capacity=CAPACITY,
        overlap=overlap,
    )
    with torch.inference_mode():
        engine._start_up()
    return engine


@pytest.fixture(scope="module", params=[True, False], ids=["buckets", "exact"])
def engines(
    tiny_model: LoadedModel, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine]]:
    """(synchronous, overlapped), reused across examples: each example leaves them empty."""
    buckets = request.param
    yield new_engine(tiny_model, False, buckets), new_engine(tiny_model, True, buckets)


async def drive(engine: Engine, script: list[Request]) -> list[list[Event]]:
    """Run the script's requests through the worker's iterations; each request's events."""
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[Event]] = [asyncio.Queue() for _ in script]
    jobs = [
        Job(
            prompt_ids=r.prompt,
            max_new_tokens=r.max_new_tokens,
            min_new_tokens=r.min_new_tokens,
            stop_sequences=r.stop,
            sampling=r.sampling,
            loop=loop,
            queue=queue,
        )
        for r, queue in zip(script, queues, strict=True)
    ]
    inbox: deque[Job] = deque()
    last = max(max(r.join, r.cancel or 0) for r in script)
    with torch.inference_mode():
        for iteration in range(500):
            for r, job in zip(script, jobs, strict=True):
                if r.join == iteration:
                    inbox.append(job)
                if r.cancel == iteration:
                    job.cancelled = True
            joiners = engine._sched.choose_joiners(inbox, engine._runner.batchable)
            engine._iterate(joiners)
            if iteration >= last and not inbox and not engine._sched.busy:
                engine._iterate([])  # the step in flight, if any, is accepted
                break
        else:
            raise AssertionError("the script did not finish in 500 iterations")
    assert engine._pending is None and not engine._sched.rows
    for _ in range(3):  # the mailboxes' deliveries (call_soon_threadsafe) run
        await asyncio.sleep(0)
    out: list[list[Event]] = []
    for queue in queues:
        events: list[Event] = []
        while not queue.empty():
            events.append(queue.get_nowait())
        out.append(events)
    return out


def assert_same_streams(
    script: list[Request], expected: list[list[Event]], got: list[list[Event]]
) -> None:
    """Two engines' runs of `script` (`drive`) streamed the same: every item the same for a
    client that stayed (and its stream finished, once, at its end); a client that left got a
    prefix of the same stream from each."""
    for r, want, have in zip(script, expected, got, strict=True):
        for events in (want, have):
            assert all(isinstance(e, EngineDelta) for e in events), events
            finishes = [i for i, e in enumerate(events) if e.finish_reason is not None]
            assert finishes in ([], [len(events) - 1])
        if r.cancel is None:
            assert have == want
            assert want and want[-1].finish_reason is not None
        else:  # a client that left: each engine delivered a prefix of the same stream
            shorter, longer = sorted((want, have), key=len)
            assert longer[: len(shorter)] == shorter


@settings(max_examples=25)
@given(script=st.lists(requests(), min_size=1, max_size=6))
def test_overlapped_steps_stream_exactly_what_synchronous_steps_do(
    engines: tuple[Engine, Engine], script: list[Request]
) -> None:
    sync, overlapped = engines
    assert_same_streams(
        script, asyncio.run(drive(sync, script)), asyncio.run(drive(overlapped, script))
    )


async def test_a_finished_row_gets_one_discarded_step_and_nothing_else(
    tiny_model: LoadedModel,
) -> None:
    """Overlap launches step N+1 before step N's tokens are accepted: a 5-token stream runs 4
    steps synchronously and 5 overlapped (the last one's token discarded), receives the same 5
    tokens, and while it runs, each iteration leaves one step in flight."""
    results = {}
    for overlap in (False, True):
        engine = new_engine(tiny_model, overlap)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        job = Job(
            prompt_ids=[5, 6, 7],
            max_new_tokens=5,
            min_new_tokens=5,
            sampling=SamplingParams(),
            loop=asyncio.get_running_loop(),
            queue=queue,
        )
        in_flight = []
        with torch.inference_mode():
            engine._iterate([job])
            while engine._sched.busy or engine._pending is not None:
                in_flight.append(engine._pending is not None)
                engine._iterate([])
        for _ in range(3):
            await asyncio.sleep(0)
        items = [queue.get_nowait() for _ in range(queue.qsize())]
        results[overlap] = items
        assert engine.stats.tokens_generated == 5
        if overlap:
            assert engine.stats.decode_steps == 5
            assert in_flight == [True] * 5  # the last: the discarded step
        else:
            assert engine.stats.decode_steps == 4
            assert in_flight == [False] * 3
    assert results[True] == results[False]
    assert [item.generated_token_count for item in results[True]] == [1, 2, 3, 4, 5]
