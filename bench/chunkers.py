"""Chunker benchmark: batch vs incremental time on generated English text.

    python bench/chunkers.py [--size-mb 1] [--feed 4] [--repeat 5] [--seed 0] [--clock cpu|wall]

Builds about --size-mb MB of English prose offline (a seeded shuffle of a few hundred generated
sentences with abbreviations, numbers, quotes, brackets, ellipses, questions and numbered lists,
grouped into paragraphs), then for each chunker times `chunk(text)` and an incremental state fed
--feed characters at a time plus `flush()` (best of --repeat, the two interleaved), checks that
both give the same spans, and prints seconds, incremental/batch ratio and MB/s. Times are process
CPU seconds by default, which a busy shared machine disturbs far less than wall time. Targets
(DESIGN section 5): the incremental form within 1.5x of the batch one, the sentence chunker at
0.2 MB/s or more. For `paragraph` and `whole_doc` the batch form is nearly free, so their ratio
only shows the fixed cost of a feed call.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chunkers

SUBJECTS = [
    "The committee",
    "Dr. Smith",
    "Mr. Jones",
    "Our neighbour",
    "The U.S. delegation",
    "Prof. Miller",
    "A reporter from the Times",
    "The city council",
    "Mrs. Brown",
    "The team",
    "St. Mary's hospital",
    "The company (founded in 1998)",
    "Sen. Walker",
    "Everyone",
]
VERBS = [
    "announced",
    "reviewed",
    "questioned",
    "postponed",
    "celebrated",
    "criticised",
    "approved",
    "described",
    "ignored",
    "studied",
]
OBJECTS = [
    "the new stadium plans",
    "a 3.5% rise in interest rates",
    "the quarterly budget",
    "the recipe for sourdough bread",
    "an old map of the harbour",
    "the results of the trial",
    "the proposal, i.e. the revised one",
    "several options, e.g. trains and buses",
    "the report on Jan. 5",
    "a budget of $4.2 million",
    "the value of pi (about 3.14)",
]
TAILS = [
    "",
    " at 9 a.m. on Tuesday",
    " after a long meeting",
    " in Washington, D.C. last week",
    " while everyone waited outside in the rain",
    " before 5 p.m.",
    " at No. 10 Downing St.",
    " with help from Acme Inc. and others",
    " despite objections from the staff",
]
QUOTES = [
    'He said "Stop." Then he left.',
    "She asked, 'Is it ready?' Nobody answered.",
    "Wait... what happened next?",
    "Really?! That is surprising.",
    "The note read: (see p. 4.) It was short.",
    "Call me at 5 p.m. If I do not answer, leave a message.",
    "It costs 3.14 dollars. That is cheap!",
]


def make_text(size: int, seed: int) -> str:
    """About `size` characters of English prose, the same for the same seed."""
    rng = random.Random(seed)
    pool: list[str] = list(QUOTES)
    while len(pool) < 400:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(TAILS)}"
        pool.append(s + rng.choice([".", ".", ".", "!", "?", "..."]))
    paragraphs: list[str] = []
    total = 0
    while total < size:
        if rng.random() < 0.1:
            items = [f"{i}. {rng.choice(pool)}" for i in range(1, rng.randint(2, 5))]
            para = "\n".join(items)
        else:
            para = " ".join(rng.choice(pool) for _ in range(rng.randint(2, 8)))
        paragraphs.append(para)
        total += len(para) + 2
    return "\n\n".join(paragraphs)[:size]


def run(
    chunker: chunkers.Chunker, text: str, feed: int, repeat: int, clock: Callable[[], float]
) -> tuple[float, float]:
    deltas = [text[i : i + feed] for i in range(0, len(text), feed)]
    batch_times, inc_times = [], []
    expected: list[chunkers.Span] = []
    for _ in range(repeat):
        t0 = clock()
        expected = chunker.chunk(text)
        batch_times.append(clock() - t0)
        t0 = clock()
        state = chunker.incremental()
        got: list[chunkers.Span] = []
        for d in deltas:
            got += state.feed(d)
        got += state.flush()
        inc_times.append(clock() - t0)
        assert got == expected, f"{chunker!r}: incremental result differs from batch"
    assert "".join(s.text for s in expected) == text
    return min(batch_times), min(inc_times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1.0)
    ap.add_argument("--feed", type=int, default=4, help="characters per incremental feed")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    text = make_text(int(args.size_mb * 1_000_000), args.seed)
    mb = len(text.encode()) / 1e6
    print(
        f"text: {len(text):,} characters ({mb:.2f} MB), feed {args.feed} chars, best of "
        f"{args.repeat}, {args.clock} seconds; {platform.python_implementation()} "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    configs = [
        {"type": "sentence"},
        {"type": "words", "max_words": 50},
        {"type": "paragraph"},
        {"type": "whole_doc"},
    ]
    header = f"{'chunker':<22}{'chunks':>8}{'batch s':>10}{'incr s':>10}{'ratio':>8}"
    print(header + f"{'batch MB/s':>12}{'incr MB/s':>11}")
    print("-" * (len(header) + 23))
    for settings in configs:
        chunker = chunkers.build(settings)
        batch, inc = run(chunker, text, args.feed, args.repeat, clock)
        name = ",".join(f"{v}" if k == "type" else f"{k}={v}" for k, v in settings.items())
        count = len(chunker.chunk(text))
        # paragraph and whole_doc: the batch form is nearly free, a ratio would mean nothing
        ratio = f"{inc / batch:.2f}" if batch > 0.05 else "n/a"
        rate = f"{mb / batch:.1f}" if batch > 0.005 else ">200"
        print(
            f"{name:<22}{count:>8}{batch:>10.3f}{inc:>10.3f}{ratio:>8}{rate:>12}{mb / inc:>11.1f}"
        )


if __name__ == "__main__":
    main()
