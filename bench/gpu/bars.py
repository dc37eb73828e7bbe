"""Issue 35's and 37's GPU bars, read off bench/gpu/check.sh summaries: met, short or unmeasured.

    python bench/gpu/bars.py SUMMARY [SUMMARY ...]      # e.g. both calls' summary.txt

A lent session has minutes, and its summary is ~150 lines of figures: this says at once which
bar each figure meets. Every bar is the issues' own wording (the numbers below); a bar no summary
has a figure for is `unmeasured`, never met. Several summaries (a session's two calls) are read
as one: a step's figures come from the summary that ran it. A figure is taken from the lines the
summary keeps (`side by side`, `ttft`, the test files' results, `judge_tokens_ratio`), the step a
line belongs to from the `--- STEP: rc=...` line before it. With several rounds (`--rounds 2`),
a level's TTFT p50 is the median of its rounds' p50s, as the side-by-side throughput is the
median of its rounds. Exit status 0 whatever the verdicts:
this reads, it does not gate.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: (streams, aggregate tok/s) the 135M shape must reach, each decoding.
AGGREGATE_135M = {64: 12_000.0, 256: 30_000.0}
TTFT_P50_MS_256 = 200.0
#: The engine's step / the graph-replayed StaticCache step, at most, per streams.
STEP_RATIO = {1: 1.1, 64: 1.25, 256: 1.25}
GREEDY_OVER_SAMPLING = 1.1  # sampling's aggregate / greedy's, at most
COMPILED_STEP_MS_1 = 2.0
AGGREGATE_1P7B_64 = 9_000.0
OVER_SERVE = 4.0  # the engine / `transformers serve`, at least
JUDGE_WALL_RATIO = 5.0
JUDGE_TOKENS_RATIO = 10.0
JUDGE_16_OVER_1 = 4.0

_SIDE = re.compile(
    r"^\s*(greedy|sampling)\s+(\d+) streams: engine\s+([\d.]+)\s*\|(.*?)step\s+([\d.]+) ms vs "
    r"graph replay\s+([\d.]+) ms"
)
_SERVE = re.compile(r"serve\s+([\d.]+) \(([\d.]+)x\)")
_TTFT = re.compile(r"^ttft (greedy|sampling) (\d+) streams: p50 (\d+) ms")
_STEP_HEADER = re.compile(r"^--- (\S+?):? (rc=(-?\d+)|cut at|skipped)")
_TEST_RESULT = re.compile(r"^(FAILED|ERROR) (tests/\S+)")


@dataclass
class Level:
    aggregate: float
    step_ms: float
    replay_ms: float
    serve_ratio: float | None


@dataclass
class Figures:
    """What the summaries measured, by step: `levels[step][(decoding, streams)]`."""

    levels: dict[str, dict[tuple[str, int], Level]] = field(default_factory=dict)
    ttft_p50: dict[str, dict[tuple[str, int], float]] = field(default_factory=dict)
    ttft_rounds: dict[str, dict[tuple[str, int], list[float]]] = field(default_factory=dict)
    test_files: dict[str, str] = field(default_factory=dict)  # file step -> "rc=0", "cut", ...
    failed_tests: list[str] = field(default_factory=list)
    judge: dict[str, float] = field(default_factory=dict)


def read(texts: list[str]) -> Figures:
    figures = Figures()
    for text in texts:
        step = ""
        for line in text.splitlines():
            header = _STEP_HEADER.match(line)
            if header:
                step = header.group(1)
                if step.startswith("tests_"):
                    outcome = header.group(2)
                    figures.test_files[step] = "rc=0" if outcome == "rc=0" else outcome
                continue
            side = _SIDE.match(line)
            if side:
                serve = _SERVE.search(side.group(4))
                figures.levels.setdefault(step, {})[(side.group(1), int(side.group(2)))] = Level(
                    float(side.group(3)),
                    float(side.group(5)),
                    float(side.group(6)),
                    float(serve.group(2)) if serve else None,
                )
                continue
            ttft = _TTFT.match(line)
            if ttft:
                key = (ttft.group(1), int(ttft.group(2)))
                got = figures.ttft_rounds.setdefault(step, {}).setdefault(key, [])
                got.append(float(ttft.group(3)))
                figures.ttft_p50.setdefault(step, {})[key] = statistics.median(got)
                continue
            failed = _TEST_RESULT.match(line)
            if failed:
                figures.failed_tests.append(failed.group(2))
                continue
            for key, value in re.findall(r"(judge_tokens_ratio|wall_ratio)=([\d.]+)", line):
                figures.judge[key] = float(value)
            sixteen = re.match(r"^16 streams: ([\d.]+)x the judged chunks/s of 1 stream", line)
            if sixteen:
                figures.judge["16_over_1"] = float(sixteen.group(1))
    return figures


def verdicts(figures: Figures) -> list[tuple[str, str, str]]:
    """(verdict, bar, what was measured) per bar: verdict `met`, `short` or `unmeasured`."""
    out: list[tuple[str, str, str]] = []

    def bar(name: str, values: list[tuple[str, float]], ok: bool | None) -> None:
        measured = ", ".join(f"{label} {value:g}" for label, value in values) or "-"
        out.append(("unmeasured" if ok is None else "met" if ok else "short", name, measured))

    e135 = figures.levels.get("e135", {})
    for streams, goal in AGGREGATE_135M.items():
        got = [
            (d, e135[(d, streams)].aggregate)
            for d in ("greedy", "sampling")
            if (d, streams) in e135
        ]
        ok = None if len(got) < 2 else all(v >= goal for _, v in got)
        bar(f"135M {streams} streams >= {goal:,.0f} tok/s", got, ok)
    ttft = figures.ttft_p50.get("e135", {})
    got = [(d, ttft[(d, 256)]) for d in ("greedy", "sampling") if (d, 256) in ttft]
    bar(
        f"135M 256 streams TTFT p50 <= {TTFT_P50_MS_256:g} ms",
        got,
        None if len(got) < 2 else all(v <= TTFT_P50_MS_256 for _, v in got),
    )
    for streams, limit in STEP_RATIO.items():
        got = [
            (d, round(e135[(d, streams)].step_ms / e135[(d, streams)].replay_ms, 2))
            for d in ("greedy", "sampling")
            if (d, streams) in e135
        ]
        bar(
            f"135M step / graph replay at {streams} <= {limit:g}x",
            got,
            None if len(got) < 2 else all(v <= limit for _, v in got),
        )
    for streams in (1, 64, 256):
        if ("greedy", streams) in e135 and ("sampling", streams) in e135:
            ratio = e135[("sampling", streams)].aggregate / e135[("greedy", streams)].aggregate
            bar(
                f"greedy within {GREEDY_OVER_SAMPLING:g}x of sampling at {streams}",
                [("sampling/greedy", round(ratio, 3))],
                ratio <= GREEDY_OVER_SAMPLING,
            )
        else:
            bar(f"greedy within {GREEDY_OVER_SAMPLING:g}x of sampling at {streams}", [], None)
    serve = [
        (f"{d} {n}", level.serve_ratio)
        for (d, n), level in sorted(e135.items())
        if level.serve_ratio is not None
    ]
    bar(
        f"135M >= {OVER_SERVE:g}x transformers serve at every level",
        serve,  # type: ignore[arg-type]
        None if not serve else all(v >= OVER_SERVE for _, v in serve),
    )  # type: ignore[operator]
    compiled = figures.levels.get("e135_compile", {})
    got = [(d, compiled[(d, 1)].step_ms) for d in ("greedy", "sampling") if (d, 1) in compiled]
    bar(
        f"--compile 1-row step <= {COMPILED_STEP_MS_1:g} ms",
        got,
        None if not got else all(v <= COMPILED_STEP_MS_1 for _, v in got),
    )
    e1p7 = figures.levels.get("e1p7", {})
    got = [(d, e1p7[(d, 64)].aggregate) for d in ("greedy", "sampling") if (d, 64) in e1p7]
    bar(
        f"1.7B 64 streams >= {AGGREGATE_1P7B_64:,.0f} tok/s",
        got,
        None if not got else all(v >= AGGREGATE_1P7B_64 for _, v in got),
    )
    files = figures.test_files
    passed = sum(1 for outcome in files.values() if outcome == "rc=0")
    bar(
        "CUDA engine and migration tests all pass",
        [("files passed", passed), ("of", len(files)), ("failed tests", len(figures.failed_tests))],
        None if not files else passed == len(files) and not figures.failed_tests,
    )
    judge = figures.judge
    for key, goal, name in (
        ("wall_ratio", JUDGE_WALL_RATIO, "judge: incremental >= 5x faster than re-judging"),
        ("judge_tokens_ratio", JUDGE_TOKENS_RATIO, "judge: >= 10x fewer judge tokens"),
        ("16_over_1", JUDGE_16_OVER_1, "judge: 16 streams >= 4x the chunks/s of 1"),
    ):
        bar(
            name,
            [(key, judge[key])] if key in judge else [],
            judge[key] >= goal if key in judge else None,
        )
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    figures = read([Path(p).read_text() for p in sys.argv[1:]])
    for verdict, name, measured in verdicts(figures):
        print(f"{verdict:>10}  {name}: {measured}")
    if figures.failed_tests:
        print("failed: " + " ".join(sorted(set(figures.failed_tests))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
