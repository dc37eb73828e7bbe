"""bench/gpu/bars.py: issue 35's and 37's GPU bars read off check.sh summaries, exactly."""

from __future__ import annotations

from pathlib import Path

from bench.gpu.bars import read, verdicts

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "results"

SUMMARY = """\
=== gpu check 2026-11-28T06:06:50Z at f2f0c75, part all: e135 judge e135_compile
--- e135: rc=0, 192 s
ttft greedy 256 streams: p50 184 ms, mean 182 ms, max 214 ms (round 1); prefill cuda_graphs: 0
ttft sampling 256 streams: p50 201 ms, mean 173 ms, max 210 ms (round 1)
side by side, /root/m135r (aggregate tok/s; ratios engine/anchor):
  greedy   1 streams: engine    308.9 | generate     31.8 (9.73x) | serve     66.8 (4.63x) | step    3.2 ms vs graph replay   3.17 ms (1.0x)
  greedy  64 streams: engine  12505.4 | generate   2521.6 (4.96x) | serve   2439.4 (5.13x) | step    4.6 ms vs graph replay   3.76 ms (1.2x)
  greedy 256 streams: engine  31000.0 | generate   8067.0 (3.21x) | serve   2705.2 (3.90x) | step    5.7 ms vs graph replay   4.60 ms (1.2x)
sampling   1 streams: engine    306.5 | generate     23.8 (12.88x) | serve     68.7 (4.46x) | step    3.2 ms vs graph replay   3.17 ms (1.0x)
sampling  64 streams: engine  11999.0 | generate   1722.5 (7.35x) | serve   2344.0 (5.40x) | step    4.6 ms vs graph replay   3.76 ms (1.2x)
sampling 256 streams: engine  32000.0 | generate   9727.3 (2.99x) | serve   2833.9 (10.27x) | step    5.8 ms vs graph replay   4.60 ms (1.3x)
--- e1p7: rc=0, 250 s
side by side, /root/m1p7r (aggregate tok/s; ratios engine/anchor):
  greedy  64 streams: engine   9100.0 | generate   2000.0 (4.55x) | step    6.0 ms vs graph replay   5.00 ms (1.2x)
--- tests_test_engine_api: rc=0, 60 s
--- tests_test_engine_sampling: cut at 60 s, 232 s
--- tests_test_engine_api:
65 passed, 1 skipped in 60.17s (0:01:00)
--- tests_test_engine_sampling:
FAILED tests/test_engine_sampling.py::test_x - assert 1 == 2
judge_tokens_ratio=36.98 wall_ratio=5.20
16 streams: 3.90x the judged chunks/s of 1 stream, 3.90x its chunks per CPU-second
"""


def test_every_bar_is_met_short_or_unmeasured_as_the_figures_say() -> None:
    got = {name: (verdict, measured) for verdict, name, measured in verdicts(read([SUMMARY]))}
    assert got == {
        "135M 64 streams >= 12,000 tok/s": ("short", "greedy 12505.4, sampling 11999"),
        "135M 256 streams >= 30,000 tok/s": ("met", "greedy 31000, sampling 32000"),
        "135M 256 streams TTFT p50 <= 200 ms": ("short", "greedy 184, sampling 201"),
        "135M step / graph replay at 1 <= 1.1x": ("met", "greedy 1.01, sampling 1.01"),
        "135M step / graph replay at 64 <= 1.25x": ("met", "greedy 1.22, sampling 1.22"),
        "135M step / graph replay at 256 <= 1.25x": ("short", "greedy 1.24, sampling 1.26"),
        "greedy within 1.1x of sampling at 1": ("met", "sampling/greedy 0.992"),
        "greedy within 1.1x of sampling at 64": ("met", "sampling/greedy 0.96"),
        "greedy within 1.1x of sampling at 256": ("met", "sampling/greedy 1.032"),
        "135M >= 4x transformers serve at every level": (
            "short",
            "greedy 1 4.63, greedy 64 5.13, greedy 256 3.9, sampling 1 4.46, sampling 64 5.4, "
            "sampling 256 10.27",
        ),
        "--compile 1-row step <= 2 ms": ("unmeasured", "-"),
        "1.7B 64 streams >= 9,000 tok/s": ("met", "greedy 9100"),
        "CUDA engine and migration tests all pass": (
            "short",
            "files passed 1, of 2, failed tests 1",
        ),
        "judge: incremental >= 5x faster than re-judging": ("met", "wall_ratio 5.2"),
        "judge: >= 10x fewer judge tokens": ("met", "judge_tokens_ratio 36.98"),
        "judge: 16 streams >= 4x the chunks/s of 1": ("short", "16_over_1 3.9"),
    }


def test_nothing_measured_is_never_met() -> None:
    assert {verdict for verdict, _, _ in verdicts(read(["=== gpu check\n"]))} == {"unmeasured"}


def test_the_2026_11_28_h200_run_reads_as_its_note_says() -> None:
    """The results file of that run (both calls' summaries in one file)."""
    got = {
        name: verdict
        for verdict, name, _ in verdicts(read([(RESULTS / "2026-11-28-h200.md").read_text()]))
    }
    assert [name for name, v in got.items() if v == "met"] == [
        "135M 64 streams >= 12,000 tok/s",
        "135M 256 streams TTFT p50 <= 200 ms",
        "135M step / graph replay at 1 <= 1.1x",
        "135M step / graph replay at 64 <= 1.25x",
        "greedy within 1.1x of sampling at 1",
        "greedy within 1.1x of sampling at 64",
        "135M >= 4x transformers serve at every level",
    ]
    assert got["135M 256 streams >= 30,000 tok/s"] == "short"
    assert got["CUDA engine and migration tests all pass"] == "short"
    assert got["judge: incremental >= 5x faster than re-judging"] == "unmeasured"


def test_a_levels_ttft_over_rounds_is_the_median_of_its_rounds() -> None:
    """`--rounds 2` prints a `ttft` line per round; the bar reads their median (as the
    side-by-side throughput is), not whichever round came last."""
    summary = """\
--- e135: rc=0, 200 s
ttft greedy 256 streams: p50 240 ms, mean 230 ms, max 260 ms (round 1); prefill cuda_graphs: 0
ttft sampling 256 streams: p50 150 ms, mean 150 ms, max 170 ms (round 1)
ttft sampling 256 streams: p50 170 ms, mean 160 ms, max 190 ms (round 2)
ttft greedy 256 streams: p50 180 ms, mean 175 ms, max 200 ms (round 2)
"""
    figures = read([summary])
    assert figures.ttft_p50["e135"] == {("greedy", 256): 210.0, ("sampling", 256): 160.0}
    got = {name: (verdict, measured) for verdict, name, measured in verdicts(figures)}
    assert got["135M 256 streams TTFT p50 <= 200 ms"] == ("short", "greedy 210, sampling 160")
