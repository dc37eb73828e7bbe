"""bench/judge.py's own parts (issue 37): the pass profile a GPU run prints for its summary
(checked on a CPU with tiny-random: it must not fail without CUDA), the FLOPs it sets against
the hardware, and the short answer that fits a small model's context."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from bench.judge import Flops, Judge, answer_chunks, profile_pass
from generation.models import LoadedModel
from generation.scheduler import Engine


@pytest.fixture(scope="module")
def judge(tiny_model: LoadedModel) -> Iterator[Judge]:
    # no `threads`: Engine.start sets torch's thread count process-wide, and this test
    # shares its process with others (a float32 tolerance elsewhere failed at 1 thread)
    engine = Engine(tiny_model)
    engine.start()
    try:
        yield Judge(engine, tiny_model)
    finally:
        engine.stop()


def test_the_answer_stops_within_the_room_the_context_leaves(judge: Judge) -> None:
    tokenizer = judge.engine.judges.loaded.tokenizer
    chunks = answer_chunks(tokenizer, 2000, limit=300)
    counts = [len(judge.encode(c)) for c in chunks]
    assert sum(counts) <= 300
    following = answer_chunks(tokenizer, 2000, limit=10_000)[len(chunks)]
    assert sum(counts) + len(judge.encode(following)) > 300
    assert answer_chunks(tokenizer, 50) == answer_chunks(tokenizer, 50, limit=10_000)


def test_flops_are_the_models_multiply_adds(tiny_model: LoadedModel) -> None:
    """tiny-random is a GPT-2 of width 64, 2 layers, 2 heads: 12 * 64^2 weights per layer in
    its linear layers, attention over 64 channels per layer, a tied output layer."""
    flops = Flops(tiny_model)
    vocab = tiny_model.model.get_output_embeddings().weight.shape[0]
    assert flops.body == 2 * 12 * 64 * 64
    assert flops.output == vocab * 64
    # 3 tokens after a prefix of 10: they attend to 11, 12 and 13 keys
    expected = 2 * flops.body * 3 + 4 * (2 * 64) * (11 + 12 + 13) + 2 * vocab * 64
    assert flops.append(10, 3) == expected
    # a stream: the head rides with the first chunk; each append runs its chunk and the tail
    chunks = [[1, 2], [3]]
    assert flops.incremental(5, 4, chunks) == flops.append(0, 11) + flops.append(7, 5)
    assert flops.rejudging(5, 4, chunks) == flops.append(0, 11) + flops.append(0, 12)


def test_a_pass_profile_on_a_cpu(judge: Judge) -> None:
    """The profile lines of a 3-stream pass on a CPU: the pass's figures, the profiler's counts
    (no kernels, no device syncs on a CPU) and the top ops, every line tagged for the summary."""
    tokenizer = judge.engine.judges.loaded.tokenizer
    chunk_ids = [judge.encode(c) for c in answer_chunks(tokenizer, 120)]
    lines = profile_pass(judge, chunk_ids, 3, top=5)
    assert all(line.startswith("prof  3 streams: ") for line in lines)
    assert re.search(r"a pass of 3 appends, \d+ tokens after ~\d+-token prefixes", lines[0])
    assert "ms profiled" in lines[0] and "GFLOP/s" in lines[0]
    counts = re.search(
        r"(\d+) aten ops, (\d+) kernel launches \((\d+) kernels\), (\d+) host", lines[1]
    )
    assert counts is not None and int(counts[1]) > 0
    assert (counts[2], counts[3], counts[4]) == ("0", "0", "0")
    assert re.search(r"host in ops [0-9.]+ ms of [0-9.]+ ", lines[1])
    assert lines[1].endswith("device busy - (cpu)")
    rows = [line.removeprefix("prof  3 streams: ").split() for line in lines[3:]]
    assert len(rows) == 5 and all(row[0].startswith("aten::") for row in rows)
    assert judge.judges.sessions == {}  # its sessions are closed
