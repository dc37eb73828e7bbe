"""Micro-batching: the MicroBatcher on a fake batch function (an idle model is called at once,
items queued while it is busy share the next pass, size cap, bounded queue, failure isolation,
cancellation, worker thread, fairness: a big request takes its share of each pass and a small one
behind it goes in the next), ordered with gates and never the clock; then on the real models:
32 concurrent requests reach the model in a few forward passes with results identical to
one-at-a-time calls, a request with bad params fails alone, and a full queue answers Overloaded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from detectors_support import ANCHORS, shared_anchor_classifier

import detectors
from detectors import DetectorError, InvalidParams, Overloaded
from detectors.batching import MicroBatcher


class Recorder:
    """A batch function that doubles numbers and records its batches and threads. It can hold
    every call at `gate` (cleared = busy model) and tells when a call has started (`entered`),
    so tests order events with gates, never with the clock."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.released: list[bool] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.entered.set()
        self.released.append(self.gate.wait(10))
        self.batches.append(list(items))
        self.threads.add(threading.current_thread().name)
        if -1 in items:
            raise RuntimeError("poisoned input")
        return [2 * i for i in items]

    async def wait_entered(self) -> None:
        """Until a call has started (a generous deadline, not a window)."""
        assert await asyncio.to_thread(self.entered.wait, 10), "the model was never called"
        self.entered.clear()


async def settle(condition: Callable[[], bool]) -> None:
    """Lets ready tasks run (no clock involved) until `condition` holds."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_submits_of_one_turn_become_one_call_in_a_worker_thread() -> None:
    fn = Recorder()
    batcher = MicroBatcher(fn)
    results = await asyncio.gather(*(batcher.submit([i]) for i in range(10)))
    assert results == [[2 * i] for i in range(10)]
    assert fn.batches == [list(range(10))]
    assert batcher.forward_passes == 1 and batcher.largest_batch == 10
    assert threading.main_thread().name not in fn.threads


async def test_an_idle_model_is_called_at_once_with_the_loop_clock_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the event loop's clock frozen, any wait on a timer (max_wait_ms) would never end:
    the lone request reaching the model proves no timer stands in its way."""
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "time", lambda: 0.0)
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn)
    task = asyncio.create_task(batcher.submit([1]))
    await fn.wait_entered()
    fn.gate.set()
    assert await task == [2]
    assert fn.batches == [[1]] and fn.released == [True]


async def test_items_queued_while_the_model_is_busy_share_the_next_pass() -> None:
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn)
    first = asyncio.create_task(batcher.submit([1]))
    await fn.wait_entered()  # dispatched alone, at once
    rest = [asyncio.create_task(batcher.submit([i])) for i in (2, 3, 4, 5)]
    await settle(lambda: batcher.outstanding == 5)
    fn.gate.set()
    assert await first == [2]
    assert [await t for t in rest] == [[4], [6], [8], [10]]
    assert fn.batches == [[1], [2, 3, 4, 5]]
    assert batcher.forward_passes == 2 and batcher.largest_batch == 4


async def test_batches_are_capped_at_max_batch_size() -> None:
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn, max_batch_size=32)
    busy = asyncio.create_task(batcher.submit([-2]))
    await fn.wait_entered()
    queued = [asyncio.create_task(batcher.submit([i])) for i in range(70)]
    await settle(lambda: batcher.outstanding == 71)
    fn.gate.set()
    assert await busy == [-4]
    assert [(await t)[0] for t in queued] == [2 * i for i in range(70)]
    assert [len(b) for b in fn.batches] == [1, 32, 32, 6]


async def test_a_big_request_is_split_and_reassembled_in_order() -> None:
    fn = Recorder()
    batcher = MicroBatcher(fn, max_batch_size=8)
    assert await batcher.submit(list(range(20))) == [2 * i for i in range(20)]
    assert [len(b) for b in fn.batches] == [8, 8, 4]


async def test_full_queue_is_overloaded_until_it_drains() -> None:
    fn = Recorder()
    fn.gate.clear()  # the model is busy
    batcher = MicroBatcher(fn, max_queue=4)
    busy = asyncio.create_task(batcher.submit([1, 2, 3]))
    await fn.wait_entered()
    waiting = asyncio.create_task(batcher.submit([4]))
    await settle(lambda: batcher.outstanding == 4)
    with pytest.raises(Overloaded, match="queue full"):
        await batcher.submit([5])
    assert batcher.outstanding == 4
    fn.gate.set()
    assert await busy == [2, 4, 6] and await waiting == [8]
    assert await batcher.submit([5]) == [10]
    assert batcher.outstanding == 0


async def test_a_request_larger_than_the_queue_runs_when_the_queue_is_empty() -> None:
    fn = Recorder()
    batcher = MicroBatcher(fn, max_queue=4, max_batch_size=4)
    assert await batcher.submit(list(range(6))) == [2 * i for i in range(6)]
    fn.gate.clear()
    busy = asyncio.create_task(batcher.submit([1]))
    await fn.wait_entered()
    with pytest.raises(Overloaded):
        await batcher.submit(list(range(6)))
    fn.gate.set()
    assert await busy == [2]


async def test_a_big_request_gets_its_share_and_a_small_one_is_in_the_next_pass() -> None:
    """The attack of issue 20: one caller with far more items than max_queue. Its backlog is its
    own: callers arriving behind it are admitted and served in the very next forward pass,
    round-robin with it, and every caller gets exactly its own results."""
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn, max_batch_size=8, max_queue=16)
    big = asyncio.create_task(batcher.submit(list(range(100, 2100))))  # 2000 items > max_queue
    await fn.wait_entered()  # its first pass (8 items) is in the model
    small = [asyncio.create_task(batcher.submit([i])) for i in (1, 2)]
    pair = asyncio.create_task(batcher.submit([3, 4]))
    await settle(lambda: batcher.outstanding == 2004)
    assert batcher.admitted == 8 + 1 + 1 + 2  # the big caller counts one pass, not 2000 items
    fn.gate.set()
    assert [await t for t in small] == [[2], [4]] and await pair == [6, 8]
    assert await big == [2 * i for i in range(100, 2100)]
    assert fn.batches[0] == list(range(100, 108))
    # the next pass: an equal share (8 // 4 callers = 2) each, and what the small ones cannot
    # use goes to the big one; each caller's slice stays contiguous, in ring order
    assert fn.batches[1] == [108, 109, 110, 111, 1, 2, 3, 4]
    assert fn.batches[2] == list(range(112, 120))
    assert [len(b) for b in fn.batches] == [8] * 250 + [4]  # every pass full
    assert batcher.outstanding == 0 and batcher.admitted == 0


async def test_round_robin_alternates_between_two_big_requests() -> None:
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn, max_batch_size=4)
    first = asyncio.create_task(batcher.submit(list(range(0, 12))))
    await fn.wait_entered()
    second = asyncio.create_task(batcher.submit(list(range(100, 112))))
    await settle(lambda: batcher.outstanding == 24)
    fn.gate.set()
    assert await first == [2 * i for i in range(12)]
    assert await second == [2 * i for i in range(100, 112)]
    assert fn.batches == [
        [0, 1, 2, 3],
        [4, 5, 100, 101],
        [6, 7, 102, 103],
        [8, 9, 104, 105],
        [10, 11, 106, 107],
        [108, 109, 110, 111],
    ]


async def test_only_the_caller_that_arrives_into_a_full_detector_is_refused() -> None:
    """max_queue counts each waiting caller's next pass: behind a 1000-item caller (8 slots),
    eight single-item callers fit in max_queue=16; the ninth is refused, the others finish."""
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn, max_batch_size=8, max_queue=16)
    big = asyncio.create_task(batcher.submit(list(range(1000))))
    await fn.wait_entered()
    singles = [asyncio.create_task(batcher.submit([i])) for i in range(8)]
    await settle(lambda: batcher.admitted == 16)
    with pytest.raises(Overloaded, match=r"queue full \(9 requests waiting, 16 of 16 queue slots"):
        await batcher.submit([99])
    fn.gate.set()
    assert [await t for t in singles] == [[2 * i] for i in range(8)]
    assert len(await big) == 1000


async def test_a_failing_input_fails_only_its_own_request() -> None:
    fn = Recorder()
    batcher = MicroBatcher(fn)
    results = await asyncio.gather(
        batcher.submit([1]), batcher.submit([-1]), batcher.submit([3]), return_exceptions=True
    )
    assert results[0] == [2] and results[2] == [6]
    assert isinstance(results[1], DetectorError)
    assert str(results[1]) == "batcher: model call failed (RuntimeError)"
    assert isinstance(results[1].__cause__, RuntimeError)
    # one batch failed; each request then ran alone to find the culprit
    assert fn.batches == [[1, -1, 3], [1], [-1], [3]]
    assert await batcher.submit([4]) == [8]  # the batcher still works


async def test_a_cancelled_request_never_reaches_the_model() -> None:
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn)
    busy = asyncio.create_task(batcher.submit([0]))
    await fn.wait_entered()
    gone = asyncio.create_task(batcher.submit([7]))
    kept = asyncio.create_task(batcher.submit([8]))
    await settle(lambda: batcher.outstanding == 3)
    gone.cancel()
    fn.gate.set()
    assert await busy == [0] and await kept == [16]
    assert gone.cancelled()
    assert fn.batches == [[0], [8]]
    assert batcher.outstanding == 0


async def test_disabled_batching_runs_each_request_alone() -> None:
    fn = Recorder()
    batcher = MicroBatcher(fn, enabled=False, max_batch_size=4)
    results = await asyncio.gather(*(batcher.submit([i]) for i in range(5)))
    assert results == [[2 * i] for i in range(5)]
    assert sorted(map(tuple, fn.batches)) == [(i,) for i in range(5)]
    assert await batcher.submit(list(range(6))) == [2 * i for i in range(6)]
    assert batcher.forward_passes == 7


async def test_wrong_result_count_is_a_detector_error() -> None:
    batcher = MicroBatcher(lambda items: items[:-1])
    with pytest.raises(DetectorError, match="returned 1 results for 2 items"):
        await batcher.submit([1, 2])


async def test_close_fails_waiting_callers_and_later_submits() -> None:
    fn = Recorder()
    fn.gate.clear()
    batcher = MicroBatcher(fn)
    running = asyncio.create_task(batcher.submit([1]))
    await fn.wait_entered()
    waiting = asyncio.create_task(batcher.submit([2]))
    await settle(lambda: batcher.outstanding == 2)
    await batcher.close()
    for task in (running, waiting):
        with pytest.raises(DetectorError, match="closed"):
            await task
    with pytest.raises(DetectorError, match="closed"):
        await batcher.submit([1])
    fn.gate.set()  # the abandoned call in the worker thread ends
    assert fn.batches == [] or fn.batches == [[1]]


def test_a_batcher_moves_to_a_new_event_loop() -> None:
    fn = Recorder()
    batcher = MicroBatcher(fn)
    assert asyncio.run(batcher.submit([1])) == [2]
    assert asyncio.run(batcher.submit([2])) == [4]


# --- real models ------------------------------------------------------------------------------

SENTENCES = [
    ANCHORS["safe"],
    ANCHORS["sports"],
    ANCHORS["finance"],
    "The striker scored twice in the second half.",
    "Interest rates are expected to rise again next quarter, analysts said on Monday.",
    "Preheat the oven and bake the bread for forty minutes.",
    "ok",
    "A much longer sentence about nothing in particular that goes on for a while, with commas, "
    "clauses and more words than the others so that padding inside a batch really matters.",
]
TOPICS = {
    "sports": ["football match", "the team won the championship"],
    "finance": ["stock market", "interest rates"],
    "cooking": ["bake a cake", "recipe for bread"],
}


@pytest.fixture(scope="session")
def anchor_dir() -> Path:
    return shared_anchor_classifier()


def flat(result: list[list[detectors.Detection]]) -> list[tuple]:
    return [(d.start, d.end, d.detection, d.score) for per in result for d in per]


def assert_same(batched: list, alone: list) -> None:
    assert len(batched) == len(alone)
    for got, want in zip(batched, alone, strict=True):
        assert [g[:3] for g in flat(got)] == [w[:3] for w in flat(want)]
        np.testing.assert_allclose(
            [g[3] for g in flat(got)], [w[3] for w in flat(want)], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("builtin", ["hf_classifier", "topic", "prompt_injection", "profanity"])
async def test_32_concurrent_requests_take_a_few_forward_passes_with_identical_results(
    builtin: str, anchor_dir: Path
) -> None:
    params: dict = {"min_score": 0.0}
    if builtin == "hf_classifier":
        params["model_path"] = str(anchor_dir)
    elif builtin == "topic":
        params["topics"] = TOPICS
    det = detectors.build(builtin, params)
    texts = [SENTENCES[i % len(SENTENCES)] + f" #{i}" * (i % 3) for i in range(32)]
    alone = [await det.detect([t]) for t in texts]  # also warms the model and the topic cache
    before = det.forward_passes
    assert before >= 32
    batched = await asyncio.gather(*(det.detect([t]) for t in texts))
    passes = det.forward_passes - before
    assert 1 <= passes <= 3, passes
    assert det.batcher.largest_batch >= 16
    assert_same(batched, alone)


async def test_nanoguard_batches_too() -> None:
    det = detectors.build("prompt_injection", {"model": "nanoguard", "min_score": 0.0})
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(8)]
    alone = [await det.detect([t]) for t in texts]
    before = det.forward_passes
    batched = await asyncio.gather(*(det.detect([t]) for t in texts))
    assert det.forward_passes - before <= 2
    assert_same(batched, alone)


async def test_bad_params_in_the_middle_fail_alone(anchor_dir: Path) -> None:
    det = detectors.build("hf_classifier", {"model_path": str(anchor_dir), "min_score": 0.0})
    await det.warmup()
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(32)]
    params = [None] * 32
    params[16] = {"min_score": 7}
    params[20] = {"safe_labels": ["nonsense"]}
    before = det.forward_passes
    results = await asyncio.gather(
        *(det.detect([t], p) for t, p in zip(texts, params, strict=True)), return_exceptions=True
    )
    assert isinstance(results[16], InvalidParams) and "min_score" in str(results[16])
    assert isinstance(results[20], InvalidParams) and "nonsense" in str(results[20])
    good = [r for i, r in enumerate(results) if i not in (16, 20)]
    assert all(isinstance(r, list) and len(r) == 1 and r[0] for r in good)
    assert det.forward_passes - before <= 3


async def test_real_detector_overloads_when_its_queue_is_full(anchor_dir: Path) -> None:
    det = detectors.build("hf_classifier", {"model_path": str(anchor_dir), "max_queue": 8})
    await det.warmup()
    first = asyncio.create_task(det.detect([ANCHORS["sports"]] * 8))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await det.detect([ANCHORS["finance"]])
    assert len(await first) == 8
    assert len(await det.detect([ANCHORS["finance"]])) == 1


async def test_batching_off_gives_the_same_results_one_pass_per_request(anchor_dir: Path) -> None:
    on = detectors.build("hf_classifier", {"model_path": str(anchor_dir), "min_score": 0.0})
    off = detectors.build(
        "hf_classifier", {"model_path": str(anchor_dir), "min_score": 0.0, "batching": False}
    )
    texts = SENTENCES * 2
    a = await asyncio.gather(*(on.detect([t]) for t in texts))
    before = off.forward_passes
    b = await asyncio.gather(*(off.detect([t]) for t in texts))
    assert off.forward_passes - before == len(texts)
    assert_same(a, b)
