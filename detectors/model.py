"""Base classes of the model-backed detectors: a shared model runtime plus a micro-batcher."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from .api import Detection
from .base import SCORED_REQUEST_PARAMS, Detector, ScoredParams, whole_content
from .batching import MicroBatcher
from .errors import DetectorError
from .normalise import judged_texts
from .runtime import ModelRuntime, check_device
from .windows import judge_windows

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def require_finite(name: str, results: list[R]) -> list[R]:
    """`results`, or DetectorError when a number in them is NaN or infinite. A model that
    yields NaN (a float16 overflow, a corrupt weight) has not judged that text, and NaN passes
    no threshold (`NaN >= t` is false) and hides in a maximum: taken as a score, it released
    what the model would have flagged. Failing the call fails closed; the micro-batcher then
    judges each caller's items alone, so only the streams whose text did it fail."""
    if _non_finite(results):
        raise DetectorError(f"{name}: the model's output is not a number (NaN or infinity)")
    return results


def _non_finite(value: object) -> bool:
    """Whether a NaN or an infinity lies anywhere in `value`: floats, NumPy arrays, and the
    lists, tuples and dataclasses holding them (a batch's results)."""
    if isinstance(value, float | np.floating):
        return not math.isfinite(value)
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "fc" and not bool(np.isfinite(value).all())
    if isinstance(value, list | tuple):
        return any(_non_finite(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_non_finite(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


class BatchedDetector(Detector, Generic[T, R]):
    """A detector whose model runs in its runtime's worker thread, fed by a MicroBatcher.

    The model loads on first use (or `warmup()`), so building a detector is cheap and a config
    can be validated and served without paying for models nobody calls.
    """

    def __init__(self, params: Mapping[str, Any] | None = None, *, device: str = "auto") -> None:
        super().__init__(params, device=check_device(device))
        p = self.params
        if p.max_wait_ms:
            log.warning(
                "%s: max_wait_ms is ignored: an idle model is called at once, and batches form "
                "from the requests that queue while it is busy",
                self.name,
            )
        self._runtime = self._make_runtime()
        self._batcher: MicroBatcher[T, R] = MicroBatcher(
            self._judged,
            max_batch_size=p.max_batch_size,
            max_queue=p.max_queue,
            enabled=p.batching,
            executor=self._runtime.executor,
            name=self.name,
        )

    @abstractmethod
    def _make_runtime(self) -> ModelRuntime:
        """The shared runtime of this detector's model (not loaded yet)."""

    @abstractmethod
    def _forward(self, items: list[T]) -> list[R]:
        """One batched model call; runs in the runtime's worker thread."""

    def _judge(self, items: list[T]) -> list[R]:
        """`_forward` on what the model should see (subclasses hand it the normalised view of
        DESIGN 4.6b, computed off the loop)."""
        return self._forward(items)

    def _judged(self, items: list[T]) -> list[R]:
        """What the batcher calls, in the worker thread: `_judge`, refused when the model's
        output holds a NaN or an infinity (`require_finite`)."""
        return require_finite(self.name, self._judge(items))

    @property
    def runtime(self) -> ModelRuntime:
        return self._runtime

    @property
    def batcher(self) -> MicroBatcher[T, R]:
        return self._batcher

    async def warmup(self) -> None:
        await self._runtime.load()

    async def close(self) -> None:
        await self._batcher.close()


class ScoredTextDetector(BatchedDetector[str, float]):
    """A binary text classifier: one whole-content detection per content whose score (the
    model's probability of the flagged class) reaches the `min_score`/`threshold` floor.
    The score is the maximum over the content's windows (its sentences and overlapping spans,
    DESIGN 4.6b), so benign padding cannot dilute a hit; the span stays the whole content.
    Blank contents are not sent to the model and never yield a detection."""

    Params: ClassVar[type[ScoredParams]] = ScoredParams
    REQUEST_PARAMS: ClassVar[frozenset[str]] = SCORED_REQUEST_PARAMS
    label: ClassVar[str] = ""
    detection_type: ClassVar[str] = ""
    # Span windows of the bag-of-words models: 512 characters (about 100 tokens, a paragraph)
    # every 256, so any passage of up to 256 characters (an injection of a few sentences that
    # each look benign alone) lies whole inside one window, with at most ~450 characters of
    # padding beside it where the text has no sentence boundary. Text is read twice over, on
    # top of its sentences: about 3x the characters of one whole-text call.
    window_chars: ClassVar[int | None] = 512
    window_step: ClassVar[int] = 256

    def span_window(self) -> tuple[int | None, int]:
        """(width, step) of the span windows in characters; width None: the model windows long
        texts itself (to its own length), so the whole text is one of its windows."""
        return self.window_chars, self.window_step

    def views(self, text: str) -> tuple[list[str], bool]:
        """Other readings of `text` judged beside it (its score is the maximum: payloads decoded
        out of it, disguised words read back), and whether it held more of them than are
        judged (it then scores 1.0: fail closed). None here."""
        return [], False

    def _judge(self, items: list[str]) -> list[float]:
        """Each item and its `views` are judged alike, in the one model call (`_window_scores`);
        an item scores the maximum, or 1.0 when its views overflowed."""
        found = [self.views(item) for item in items]
        texts = [[item, *views] for item, (views, _) in zip(items, found, strict=True)]
        scores = self._window_scores([t for ts in texts for t in ts])
        out, at = [], 0
        for ts, (_, overflowed) in zip(texts, found, strict=True):
            out.append(1.0 if overflowed else max(scores[at : at + len(ts)]))
            at += len(ts)
        return out

    def _window_scores(self, items: list[str]) -> list[float]:
        """The model scores the normalised view (invisible characters removed, look-alikes
        folded), so `f\u200buck` or a Cyrillic homoglyph does not lower the score, and the
        words markup hid from it (an instruction in an HTML comment, which the guarded model
        reads: `judged_texts`); every window of every item goes into one `_forward` call, each
        distinct window once."""
        width, step = self.span_window()
        texts = [judged_texts(text) for text in items]
        rows, owned = judge_windows([t for ts in texts for t in ts], width, step)
        # checked before the maximum: max() skips a NaN after a number, so a window the model
        # could not score would pass as the best of the others
        scores = require_finite(self.name, self._forward(rows))
        out, at = [], 0
        for ts in texts:  # an item's view, and what markup hid from it (`judged_texts`)
            out.append(max(scores[r] for own in owned[at : at + len(ts)] for r in own))
            at += len(ts)
        return out

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        p = self.effective_params(params)
        todo = [i for i, c in enumerate(contents) if c.strip()]
        scores = await self._batcher.submit([contents[i] for i in todo])
        out: list[list[Detection]] = [[] for _ in contents]
        for n, (i, score) in enumerate(zip(todo, scores, strict=True)):
            if n % 512 == 511:  # thousands of detections: let other requests run in between
                await asyncio.sleep(0)
            if score >= p.floor:
                out[i] = [
                    whole_content(
                        contents[i],
                        label=self.label,
                        detection_type=self.detection_type,
                        score=score,
                    )
                ]
        return out
