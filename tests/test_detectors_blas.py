"""numpy's OpenBLAS on one thread in the processes that serve detectors
(`detectors.runtime.one_blas_thread_per_process`): their heads' small products, split over two
threads with the other core busy, cost 5-110x (bench/blas_threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from detectors.prompt_injection import head_path, head_probabilities, load_head
from tests.engine_processes import child_environment

# the variables OpenBLAS reads for its thread count when it loads
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")

# a service's start-up (a config that is not there: it stops right after), then numpy loads, as
# with the first model; prints OpenBLAS's thread counts
PROBE = """
import json, sys
entry = sys.argv[1]
if entry == "loaded":  # numpy already there: the setting reaches it all the same
    import numpy
    from detectors.runtime import one_blas_thread_per_process
    one_blas_thread_per_process()
elif entry != "none":
    main = __import__(entry + ".__main__", fromlist=["main"]).main
    assert main(["serve", "--config", "/nonexistent/config.yaml"]) != 0
import numpy
from threadpoolctl import threadpool_info
libs = [lib for lib in threadpool_info() if lib["internal_api"] == "openblas"]
print(json.dumps([lib["num_threads"] for lib in libs]))
"""


def blas_threads_after(entry: str) -> list[int]:
    env = {k: v for k, v in child_environment().items() if k not in BLAS_VARIABLES}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, entry], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("entry", ["orchestrator", "detectors", "loaded"])
def test_a_service_process_runs_numpy_on_one_blas_thread(entry: str) -> None:
    assert blas_threads_after(entry) == [1]


def test_without_the_setting_openblas_takes_a_thread_per_core() -> None:
    """What the test above rules out (where the machine has more than one core)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: OpenBLAS's default is one thread anyway")
    assert blas_threads_after("none") == [len(os.sched_getaffinity(0))]


def test_the_injection_head_scores_alike_on_one_or_two_blas_threads() -> None:
    """16 windows: a product OpenBLAS splits between threads. The sums run in another order,
    so the scores agree within float tolerance, not bitwise."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 384)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    head = load_head(head_path("injection_mlp.npz"))
    blas = ThreadpoolController().select(internal_api="openblas")
    with blas.limit(limits=1):
        one = head_probabilities(head, x)
    with blas.limit(limits=2):
        two = head_probabilities(head, x)
    assert two == pytest.approx(one, rel=1e-5, abs=1e-7)
