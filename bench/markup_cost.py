"""CPU cost of the markup view on tag-dense text (DESIGN 4.6b), against prose of the same size.

    PYTHONPATH=$PWD python bench/markup_cost.py [--sizes 65536 262144 1048576] [--only view_text]

For each text (`<b>` repeated, other markup, and English prose) and size: the CPU seconds of `normalise`,
`view_text` (a classifier's text) and `judge_text` with the built-in regex detector on a
sentence chunker with `max_chars` 500 (a blocking input guardrail, as the orchestrator runs
it), and the load average at the start. Run it with another tree's PYTHONPATH in the same
sitting to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/detectors.py would shadow the package: PYTHONPATH alone picks the tree under test
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import detectors  # noqa: E402
from detectors.normalise import normalise, view_text  # noqa: E402
from orchestrator.clients.detectors import InProcessDetectorClient  # noqa: E402
from orchestrator.clients.registry import ChunkerRegistry, RequestedDetector  # noqa: E402
from orchestrator.config import DetectorConfig  # noqa: E402
from orchestrator.streaming.text_judgement import judge_text  # noqa: E402

PROSE = "The committee reviewed the quarterly budget after a long meeting on Tuesday. "
# tags back to back; tags between letters (a walk's count of visible characters stops at
# each); block tags (each shows a line break); character references; emphasis; prose
TEXTS = {
    "tags": "<b>",
    "tag+a": "<b>a",
    "br": "<br>",
    "&#97;": "&#97;",
    "**a": "**a",
    "prose": PROSE,
}


def cpu(fn: Callable[[], object]) -> float:
    """CPU seconds of the whole process (judge_text's work runs in its bulk threads)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--only", nargs="+", default=["normalise", "view_text", "judge_text"])
    args = parser.parse_args()
    regex = detectors.build("regex")
    client = InProcessDetectorClient("pii", DetectorConfig(builtin="regex"), regex)
    pii = RequestedDetector("pii", client, "s", 0.5, "block", {})  # type: ignore[arg-type]
    chunkers = ChunkerRegistry({"s": {"type": "sentence", "max_chars": 500}})
    print(f"load average {os.getloadavg()}")
    for name, unit in TEXTS.items():
        for size in args.sizes:
            text = (unit * (size // len(unit) + 1))[:size]
            row = [f"{name:6} {size:>8}"]
            if "normalise" in args.only:
                row.append(f"normalise {cpu(lambda t=text: normalise(t)):6.2f} s")
            if "view_text" in args.only:
                row.append(f"view_text {cpu(lambda t=text: view_text(t)):6.2f} s")
            if "judge_text" in args.only:
                spent = cpu(lambda t=text: asyncio.run(judge_text(t, [pii], chunkers)))
                row.append(f"judge_text {spent:6.2f} s")
            print("  ".join(row), flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
