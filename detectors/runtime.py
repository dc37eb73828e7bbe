"""Shared model runtimes: each model is loaded once per (model, device) and process, and runs in
a worker thread, never on the event loop.

Detectors that use the same model (two `topic` detectors with different topics, two
`hf_classifier` ids on one folder) share its weights. Every torch model on one device shares ONE
worker thread: torch's OpenMP pool is per calling thread, and once a process has more OpenMP
teams than cores, libgomp stops spinning between parallel regions, which doubled the latency of
a one-text MiniLM forward pass (5 ms to 10 ms on 2 cores) when topic and hf_classifier each had
a thread. The cores are shared anyway, so serialising the forward passes costs nothing on a CPU.
scikit-learn models (no OpenMP in their sparse predict) keep a thread each. One thread per
executor also keeps non-thread-safe tokenizer state on one thread, and never occupies the
default executor that the rest of the process (regex on long texts) uses.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def quiet_sklearn_unpickling() -> None:
    """The bundled scikit-learn models were pickled with an older scikit-learn; they load and
    predict correctly, but each load warns. Silence exactly that warning category, process-wide
    (warnings.catch_warnings is not thread-safe, and models load in worker threads)."""
    try:
        from sklearn.exceptions import InconsistentVersionWarning
    except ImportError:  # older scikit-learn: no such warning
        return
    warnings.filterwarnings("ignore", category=InconsistentVersionWarning)


BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


def one_blas_thread_per_process() -> None:
    """numpy's and scipy's OpenBLAS on one thread in this process (and the processes it
    starts), unless OPENBLAS_NUM_THREADS says otherwise: called first thing by each process that
    serves detectors. Their models' products are small (a window's 384 numbers by a head's
    768 x 384 weights) and run in many detector threads at once; OpenBLAS's own threads only
    oversubscribe the cores, and a product split over two threads waits for a core that is
    busy: on 2 cores with the other one taken, `prompt_injection`'s MLP on 4-64 windows and
    `topic`'s similarities to 512 examples took 4-110x the one-thread time
    (bench/blas_threads.py; the scikit-learn heads' sparse products use no BLAS). Scores change
    within float tolerance (the products sum in another order), not bitwise. OpenBLAS reads the
    variable when it loads, which is after this call in the services (numpy loads with the
    first model); a library loaded before is set through threadpoolctl, from this thread."""
    threads = os.environ.setdefault(BLAS_THREADS_ENV, "1")
    if "numpy" in sys.modules and threads.isdigit():
        from threadpoolctl import ThreadpoolController

        ThreadpoolController().select(internal_api="openblas").limit(limits=int(threads))


def check_device(device: str) -> str:
    """`auto`, `cpu`, `cuda`, `cuda:N` or `mps`; ValueError otherwise (no torch import)."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ValueError(f"device: expected auto, cpu, cuda, cuda:N or mps, got {device!r}")
    return device


def resolve_device(device: str) -> str:
    """`auto` is CUDA when torch sees a GPU, else CPU."""
    check_device(device)
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ModelRuntime:
    """A lazily loaded model and the single worker thread it runs in."""

    def __init__(
        self, key: tuple[Hashable, ...], loader: Callable[[], Any], executor: ThreadPoolExecutor
    ) -> None:
        self.key = key
        self._loader = loader
        self._value: Any = None
        self._lock = threading.Lock()
        self.loads = 0
        self.executor = executor

    @property
    def loaded(self) -> bool:
        return self._value is not None

    def get(self) -> Any:
        """The loaded model (loads it on first call; call from the worker thread)."""
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._loader()
                    self.loads += 1
        return self._value

    async def load(self) -> Any:
        """Loads the model in its worker thread without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.get)


_RUNTIMES: dict[tuple[Hashable, ...], ModelRuntime] = {}
_EXECUTORS: dict[Hashable, ThreadPoolExecutor] = {}
_RUNTIMES_LOCK = threading.Lock()


def get_runtime(
    key: tuple[Hashable, ...], loader: Callable[[], Any], *, thread: Hashable = None
) -> ModelRuntime:
    """The process-wide runtime for `key` ((kind, path, device)); created on first request.
    Runtimes naming the same `thread` share one worker thread (torch models: `torch_thread`);
    by default a runtime has a thread of its own."""
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            name = thread if thread is not None else key
            executor = _EXECUTORS.get(name)
            if executor is None:
                label = "-".join(str(p) for p in (name if isinstance(name, tuple) else (name,)))
                executor = _EXECUTORS[name] = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"detector-{label[:40]}"
                )
            runtime = _RUNTIMES[key] = ModelRuntime(key, loader, executor)
        return runtime


def torch_thread(device: str) -> tuple[str, str]:
    """The worker thread shared by every torch model on `device` (see the module docstring)."""
    return ("torch", device)


def loaded_runtimes() -> list[tuple[Hashable, ...]]:
    """Keys of the models loaded so far (tests check that loads are shared)."""
    with _RUNTIMES_LOCK:
        return [key for key, rt in _RUNTIMES.items() if rt.loaded]
