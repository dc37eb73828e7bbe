"""The frames between a replica's API process and its engine core (generation/ipc.py): whatever
way the socket cuts the byte stream, the reader gets every message, whole and in order, each
read's complete frames in one batch; a corrupt length closes the connection; a job and the
worker's events cross whole."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import itertools
import socket
import termios
import threading
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


def _core(
    engine: Engine, sndbuf: int | None = None
) -> tuple[socket.socket, socket.socket, CoreSession]:
    """A core session over a real socketpair (its steps end a blocking `StepWriter`, as
    run_core builds it); the API process's end is returned, not yet read."""
    api_sock, core_sock = socket.socketpair()
    if sndbuf is not None:  # little kernel buffering: the backpressure shows early
        for sock in (api_sock, core_sock):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    loop = asyncio.get_running_loop()
    sessions: list[CoreSession] = []
    steps = ipc.StepWriter(core_sock, loop, lambda: sessions[0].on_lost())
    sessions.append(CoreSession(engine, loop, steps))
    return api_sock, core_sock, sessions[0]


def _queued(sock: socket.socket) -> int:
    """Bytes `sock` sent that its peer has not read (the kernel's count, for its buffer)."""
    return int.from_bytes(fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0\0\0\0"), "little")


def _blocked(steps: ipc.StepWriter, sock: socket.socket) -> bool:
    """A writer's send is blocked until its peer reads: it holds the lock in a send, and the
    kernel takes nothing more from `sock` (an AF_UNIX send waits while what the peer has not
    read, TIOCOUTQ, is at least SO_SNDBUF). Half the buffer is no proof: a worker seen with
    `sending` set may be past its kernel copy, only waiting for the GIL to return, with room
    left for the next frame (a loaded machine leaves it there long enough to see)."""
    return steps.sending and _queued(sock) >= sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)


class _PausedAfterCopy:
    """A socket whose `sendall` returns only once `resume` is set, after the kernel took the
    frame: a writer descheduled between its copy and the end of its send."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.copied = threading.Event()
        self.resume = threading.Event()
        self.resume.set()

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self.copied.set()
        self.resume.wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


async def test_a_writer_past_its_copy_with_room_left_is_not_blocked() -> None:
    """Repro of the blocked-send tests' flake under load: they took `sending` and half the
    socket buffer queued for a worker blocked in its send. A writer paused after its copy looks
    the same while the buffer still has room, and the loop's `stopping` frame then went out
    (`send_from_loop` True, where the test expected it to give up)."""
    api_sock, core_sock = socket.socketpair()
    core_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    paused = _PausedAfterCopy(core_sock)
    steps = ipc.StepWriter(paused, asyncio.get_running_loop(), lambda: None)  # type: ignore[arg-type]
    sndbuf = core_sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    frame = ["step", [[1, [{"token_ids": [5, 6], "text": "ab", "finish_reason": None}]]]]
    try:
        while _queued(core_sock) < sndbuf // 2:
            assert steps.send(frame)
        paused.resume.clear()
        paused.copied.clear()
        worker = asyncio.create_task(asyncio.to_thread(steps.send, frame))
        await until(paused.copied.is_set, what="the writer's copy")
        assert steps.sending and sndbuf // 2 <= _queued(core_sock) < sndbuf
        assert not _blocked(steps, core_sock)
        paused.resume.set()
        assert await worker
        assert await steps.send_from_loop(["stopping"], give_up=asyncio.Event().wait())
    finally:
        paused.resume.set()
        steps.close()
        api_sock.close()


async def test_a_core_whose_api_process_stops_reading_blocks_its_worker(
    tiny_model: LoadedModel,
) -> None:
    """The API process stalls (stops reading the steps socket) under 8 streams of 300 tokens:
    the worker, which writes each step's frame itself, blocks in its send once the socket's
    buffer is full, so the engine stops mid-stream instead of running ahead and buffering every
    token of every stream; once the API process reads again, every stream completes with
    exactly the tokens it gets alone."""
    engine = Engine(tiny_model)
    engine.start()
    api_sock, core_sock, session = _core(engine, sndbuf=4096)
    try:
        prompts = [[11 + i, 12, 13 + 2 * i] for i in range(8)]
        alone = [await run_alone(engine, make_job(p, 300, asyncio.Queue())) for p in prompts]
        generated = engine.stats.tokens_generated
        deliveries = engine.stats.worker.deliveries
        for rid, prompt in enumerate(prompts, start=1):  # the API process stalls: nobody reads
            session.submit(rid, job_spec(make_job(prompt, 300, asyncio.Queue())))
        await until(  # in a send, the socket's buffer full: blocked until a read
            lambda: _blocked(session.steps, core_sock), what="the worker blocked in its send"
        )
        assert engine.active_requests == 8  # stopped mid-stream, not run to the end
        assert engine.stats.tokens_generated - generated < 8 * 100  # what the socket holds
        received: list[Any] = []
        api = await ipc.connect(api_sock, received.extend, lambda: None)  # reads again
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
    assert [tokens[rid] for rid in range(1, 9)] == alone
    assert session.jobs == {} and session.rids == {}
    # the core's steps never went through its loop (no wake-up, no delivery there)
    assert engine.stats.worker.deliveries == deliveries
    assert api.transport is not None


async def test_a_core_whose_api_process_stops_reading_still_stops_and_its_loop_never_blocks(
    tiny_model: LoadedModel,
) -> None:
    """The API process alive but not reading (stopped, stuck) and the worker blocked in its
    send: the loop's own frames (`stopping`) go from a thread and give up after their patience
    while the loop runs on; closing the writer ends the worker's blocked send, so the engine
    stops; a submit refused after that answers from a thread, not from the loop."""
    engine = Engine(tiny_model)
    engine.start()
    api_sock, core_sock, session = _core(engine, sndbuf=4096)
    stopped = False
    try:
        for rid in range(1, 9):
            session.submit(rid, job_spec(make_job([11 + rid, 12], 300, asyncio.Queue())))
        await until(
            lambda: _blocked(session.steps, core_sock), what="the worker blocked in its send"
        )
        # the frame cannot go out (the worker holds the lock in its blocked send): it waits in
        # a thread while the loop runs on, and gives up when its patience ends (here a gate in
        # place of the clock); a send on the loop itself would never hand control back here
        patience_over = asyncio.Event()
        sent = asyncio.create_task(
            session.steps.send_from_loop(["stopping"], give_up=patience_over.wait())
        )
        for _ in range(5):
            await asyncio.sleep(0)
        assert not sent.done()
        patience_over.set()
        assert await sent is False
        session.steps.close()  # as run_core does when `stopping` could not go out
        async with asyncio.timeout(30):
            await asyncio.to_thread(engine.stop)  # the worker's send ended: it stops
        stopped = True
        assert session.steps.broken and not session.steps.sending
        session.submit(99, job_spec(make_job([5, 6], 3, asyncio.Queue())))  # refused
        await until(lambda: 99 not in session.jobs, what="the refusal, sent from a thread")
    finally:
        if not stopped:
            engine.stop()
        api_sock.close()


async def test_a_core_whose_api_process_dies_mid_stream_ends_and_its_worker_lives_on(
    tiny_model: LoadedModel,
) -> None:
    """The API process dies while its streams run: the worker's next send fails (EPIPE), which
    ends the session (`done`, as `on_lost`) instead of raising in the worker, which goes on
    serving (the core then stops its engine in order)."""
    engine = Engine(tiny_model)
    engine.start()
    api_sock, core_sock, session = _core(engine, sndbuf=4096)
    try:
        for rid in (1, 2):
            session.submit(rid, job_spec(make_job([11 + rid, 12], 400, asyncio.Queue())))
        await until(
            lambda: _blocked(session.steps, core_sock),
            what="the worker blocked in its send, mid-stream",
        )
        assert engine.active_requests == 2
        api_sock.close()  # the API process is gone
        await asyncio.wait_for(session.done.wait(), 30)
        assert session.steps.broken
        assert engine.healthy  # the worker did not die of it
        assert len(await run_alone(engine, make_job([5, 6, 7], 3, asyncio.Queue()))) == 3
    finally:
        engine.stop()
