"""Feeds the generated text to each distinct chunker once and each chunk to that chunker's
detectors (two detectors sharing a chunker share its chunks)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chunkers import Span

from ..clients.registry import ChunkerRegistry
from .detector_queue import DetectorQueue


class ChunkerFailure(Exception):
    """A chunker raised: the chunker_error of DESIGN section 4."""

    def __init__(self, chunker_id: str, message: str) -> None:
        super().__init__(f"chunker `{chunker_id}`: {message}")
        self.chunker_id = chunker_id


class ChunkFanout:
    def __init__(self, registry: ChunkerRegistry, queues: list[DetectorQueue]) -> None:
        groups: dict[str, list[DetectorQueue]] = defaultdict(list)
        for q in queues:
            groups[q.detector.chunker_id].append(q)
        self._groups: list[tuple[str, Any, list[DetectorQueue]]] = [
            (cid, registry.get(cid).incremental(), qs) for cid, qs in groups.items()
        ]

    def feed(self, delta: str) -> None:
        for cid, state, queues in self._groups:
            self._dispatch(cid, queues, lambda s=state: s.feed(delta))

    def flush(self, *, cut: bool = False) -> None:
        """End of text: the last chunks go out and every queue is closed (`cut`: the model did
        not end the text: DetectorQueue.close)."""
        for cid, state, queues in self._groups:
            self._dispatch(cid, queues, state.flush)
            for q in queues:
                q.close(cut=cut)

    @staticmethod
    def _dispatch(cid: str, queues: list[DetectorQueue], step: Any) -> None:
        try:
            spans: list[Span] = step()
        except Exception as exc:  # a chunker bug must end the request cleanly, not hang it
            raise ChunkerFailure(cid, f"{type(exc).__name__}: {exc}") from exc
        for span in spans:
            for q in queues:
                q.put(span)
