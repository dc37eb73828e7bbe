"""The frames between a replica's API process and its engine core (generation/ipc.py): whatever
way the socket cuts the byte stream, the reader gets every message, whole and in order, each
read's complete frames in one batch; a corrupt length closes the connection; a job and the
worker's events cross whole."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from generation import ipc
from generation.core_client import job_spec
from generation.engine_core import CoreSession, job_from_spec
from generation.jobs import EngineDelta, FinishReason, Job, StreamError
from generation.models import LoadedModel
from generation.sampling import SamplingParams
from generation.scheduler import Engine
from tests.engine_support import make_job, run_alone
from tests.wait_support import until

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _reader() -> tuple[ipc.FrameProtocol, list[list[Any]], _Transport]:
    batches: list[list[Any]] = []
    protocol = ipc.FrameProtocol(batches.append, lambda: None)
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, batches, transport


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    messages=st.lists(st.lists(json_values, min_size=1, max_size=4), max_size=8),
    cuts=st.lists(st.integers(0, 10_000), max_size=10),
)
def test_frames_survive_any_cut_of_the_byte_stream(
    messages: list[list[Any]], cuts: list[int]
) -> None:
    data = b"".join(ipc.encode(m) for m in messages)
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    protocol, batches, transport = _reader()
    for start, end in itertools.pairwise(bounds):
        protocol.data_received(data[start:end])
    assert [m for batch in batches for m in batch] == messages
    assert all(batches)  # a read that completes no frame hands on nothing
    assert not transport.closed


def test_one_read_of_several_frames_is_one_batch() -> None:
    """A reader behind the writer takes every step waiting in the socket at once."""
    protocol, batches, _ = _reader()
    protocol.data_received(ipc.encode(["step", 1]) + ipc.encode(["step", 2]) + b"\x00")
    protocol.data_received(b"\x00\x00\x02[]")
    assert batches == [[["step", 1], ["step", 2]], [[]]]


def test_events_go_as_orjson_encodes_their_dataclasses() -> None:
    """The core encodes the worker's events as they are (no per-row conversion); the API
    process reads back exactly their fields."""
    protocol, batches, _ = _reader()
    delta = EngineDelta([5, 6], "hé", 2, FinishReason.STOP_SEQUENCE)
    error = StreamError(503, "generation_unavailable", "gone")
    protocol.data_received(ipc.encode(["step", [[7, (delta, error)]]]))
    assert batches == [
        [
            [
                "step",
                [
                    [
                        7,
                        [
                            {
                                "token_ids": [5, 6],
                                "text": "hé",
                                "generated_token_count": 2,
                                "finish_reason": "STOP_SEQUENCE",
                            },
                            {"code": 503, "type": "generation_unavailable", "message": "gone"},
                        ],
                    ]
                ],
            ]
        ]
    ]


def test_a_corrupt_length_closes_the_connection() -> None:
    protocol, batches, transport = _reader()
    protocol.data_received(b"\xff\xff\xff\xff{}")
    assert transport.closed and batches == []


def test_integers_past_64_bits_still_encode() -> None:
    protocol, batches, _ = _reader()
    protocol.data_received(ipc.encode(["x", 2**70]))
    assert batches == [[["x", 2**70]]]


async def test_a_job_crosses_to_the_core_whole() -> None:
    """Every field of a `Job` but its loop, its sink and `cancelled` reaches the core as sent
    (through the frame's encoding): a field added to `Job` later cannot be dropped silently."""
    loop = asyncio.get_running_loop()
    job = Job(
        prompt_ids=[1, 2, 3],
        max_new_tokens=17,
        sampling=SamplingParams(
            greedy=False, temperature=0.7, top_k=5, top_p=0.9, seed=2**40, repetition_penalty=1.3
        ),
        loop=loop,
        queue=asyncio.Queue(),
        resume_ids=[4, 5],
        resume_text_len=3,
        min_new_tokens=2,
        stop_sequences=["\n\n", "é"],
        deadline=12345.5,
    )
    protocol, batches, _ = _reader()
    protocol.data_received(ipc.encode(["submit", 1, job_spec(job)]))
    [[[_, _, spec]]] = batches
    sink = object()
    rebuilt = job_from_spec(spec, loop, sink)  # type: ignore[arg-type]
    assert rebuilt.loop is loop and rebuilt.queue is sink and not rebuilt.cancelled
    for field in dataclasses.fields(Job):
        if field.name not in ("loop", "queue"):
            assert getattr(rebuilt, field.name) == getattr(job, field.name), field.name


async def test_a_core_whose_api_process_stops_reading_holds_its_engine(
    tiny_model: LoadedModel,
) -> None:
    """The API process stalls (stops reading the socketpair) under 8 streams of 300 tokens: the
    core's unsent frames stop at the high-water mark, because its engine holds between steps
    instead of running ahead and buffering every token of every stream; once the API process
    reads again, every stream completes with exactly the tokens it gets alone."""
    engine = Engine(tiny_model)
    engine.start()
    api_sock, core_sock = socket.socketpair()
    for sock in (api_sock, core_sock):  # little kernel buffering: the transport's shows
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    high = 16 * 1024
    try:
        prompts = [[11 + i, 12, 13 + 2 * i] for i in range(8)]
        alone = [await run_alone(engine, make_job(p, 300, asyncio.Queue())) for p in prompts]
        received: list[Any] = []
        api = await ipc.connect(api_sock, received.extend, lambda: None)
        session = CoreSession(engine, asyncio.get_running_loop())
        core = await ipc.connect(
            core_sock,
            session.on_messages,
            session.on_lost,
            on_pause=session.pause,
            on_resume=session.resume,
            high_water=high,
        )
        session.channel = core
        assert api.transport is not None and core.transport is not None
        api.transport.pause_reading()  # the API process stalls
        for rid, prompt in enumerate(prompts, start=1):
            api.send(["submit", rid, job_spec(make_job(prompt, 300, asyncio.Queue()))])
        await until(lambda: engine.active_requests == 8, what="the 8 requests in the core")
        # the hold itself (Engine._idle is also true for an instant while the worker hands
        # joiners from its inbox to the scheduler: waiting on it let this run on too early)
        await until(lambda: core.paused and engine._held > 0, what="the engine held")
        assert core.transport.get_write_buffer_size() <= high + 8 * 1024
        assert engine.active_requests == 8  # held mid-stream, not run to the end
        api.transport.resume_reading()
        tokens: dict[int, list[int]] = {rid: [] for rid in range(1, 9)}
        finished: set[int] = set()

        def complete() -> bool:
            while received:
                kind, *rest = received.pop(0)
                assert kind == "step"
                for rid, events in rest[0]:
                    for event in events:
                        tokens[rid].extend(event["token_ids"])
                        if event["finish_reason"] is not None:
                            finished.add(rid)
            return len(finished) == 8

        await until(complete, what="every stream's last token")
    finally:
        engine.stop()
        api_sock.close()
        core_sock.close()
    assert [tokens[rid] for rid in range(1, 9)] == alone
    assert not core.paused and engine._held == 0
