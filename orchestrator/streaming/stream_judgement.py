"""Text in, judged releases out: the per-request machinery shared by the generation pipeline and the
stream-content endpoint (chunk fan-out, one DetectorQueue per detector, the FrameAggregator).

It is driven by its owner: `feed` (or `feed_deltas`) and `end` take text, the detector queues
post verdicts to the owner's inbox, and the owner hands each verdict back to `accept`, which
returns what became releasable. Nothing here emits on its own, and a block is a returned verdict.

The generation pipeline sends all engine text through this stage, detectors or not: without a
gating detector `feed_deltas` returns the releases at once, and without any detector it passes
each engine chunk through as its own release (the one that finishes the text is the final one)
without buffering, chunking or copying anything.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ..clients.registry import ChunkerRegistry, RequestedDetector
from .aggregation import FrameAggregator
from .detector_queue import DetectorFinished, DetectorQueue, Result
from .fanout import ChunkFanout
from .findings import Finding, sort_findings
from .inbox import Inbox
from .redaction import StreamRedactor


@dataclass(slots=True)
class Release:
    """Text every gating detector has judged, with its detections: what this stage lets go.
    Indices refer to the text the client receives (redacted, when a detector redacts);
    `source_end` is its end in the generated text (where a detector redacts); `final` marks the
    last release of the text. Complete when it leaves the stage: its owner builds the event it
    sends from it (the generation pipeline's `Frame` adds the stream's counters)."""

    start: int
    end: int
    text: str
    detections: list[Finding] = field(default_factory=list)
    final: bool = False
    source_end: int | None = None


@dataclass(slots=True)
class Verdict:
    """What one detector message made releasable; `blocked` holds the detections of a blocking
    detector that flagged text (DESIGN 4.6): the owner must stop and refuse."""

    releases: list[Release] = field(default_factory=list)
    blocked: list[Finding] | None = None


class TextBuffer:
    """The generated text not yet released; releases take from its head. Joining only the pending
    part keeps the cost per frame proportional to that frame, not to the whole stream."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.released = 0
        self.length = 0

    def append(self, delta: str) -> None:
        if delta:
            self._parts.append(delta)
            self.length += len(delta)

    def take(self, end: int) -> str:
        pending = "".join(self._parts)
        n = end - self.released
        out, rest = pending[:n], pending[n:]
        self._parts = [rest] if rest else []
        self.released = end
        return out


Spawn = Callable[[Coroutine[Any, Any, None]], None]


class StreamJudge:
    """Runs a request's output detectors over a text that arrives in deltas.

    Detectors on `whole_doc_chunker` that only annotate do not gate releases: they judge the whole
    text once it is complete and their detections ride on the final frame. A blocking or
    redacting whole-doc detector does gate, so no text leaves before it has judged all of it.

    Redacting detectors (DESIGN 4.6a): their spans are replaced as text is released
    (`StreamRedactor`), and every detection is moved onto the released text. Without one, the
    releases are the generated text and nothing is mapped.
    """

    def __init__(
        self,
        detectors: list[RequestedDetector],
        chunkers: ChunkerRegistry,
        inbox: Inbox,
        conversation: tuple[tuple[str, str], ...] = (),
        ready: tuple[tuple[str, str], ...] | None = None,
        lead: str = "",
    ) -> None:
        """`conversation`: the request's (role, content) messages, for judges (DetectorQueue),
        and `ready`, them made judge-ready once (JudgeContext.ready); `lead`: the text the
        answer continues (the tail of a raw prompt), which the span detectors that redact or
        block judge the answer's start with (DetectorQueue)."""
        gating = [d for d in detectors if not (d.whole_doc and d.on_detection == "annotate")]
        self._aggregator: FrameAggregator[Finding] | None = (
            FrameAggregator(d.detector_id for d in gating) if gating else None
        )
        self._gating = {d.detector_id for d in gating}
        self.queues = [
            DetectorQueue(d, inbox, conversation=conversation, ready=ready, lead=lead)
            for d in detectors
        ]
        self._passthrough = not detectors  # see `feed_deltas`
        self._final_sent = False  # pass-through: the final frame went out with its chunk
        self._blocking = {d.detector_id for d in detectors if d.blocking}
        self._redactors = {d.detector_id: d for d in detectors if d.redacting}
        self._redactor = StreamRedactor() if self._redactors else None
        self._unfinished = {d.detector_id for d in detectors}
        self._fanout = ChunkFanout(chunkers, self.queues)
        self._text = TextBuffer()
        self._final: list[Finding] = []
        self._ended = False
        self._held: list[Release] = []

    def start(self, spawn: Spawn) -> None:
        """Starts one task per detector queue through the owner's `spawn`."""
        for q in self.queues:
            spawn(q.run())

    @property
    def gated(self) -> bool:
        """Some detector gates the releases: `feed` never returns one (only `accept` does)."""
        return self._aggregator is not None

    @property
    def released(self) -> int:
        return self._text.released

    @property
    def length(self) -> int:
        return self._text.length

    @property
    def unjudged(self) -> int:
        """Characters handed to the slowest detector and not answered yet."""
        queues = self.queues
        if len(queues) == 1:  # the common case, asked once per engine read
            return queues[0].unjudged
        return max(q.unjudged for q in queues)

    @property
    def done(self) -> bool:
        """The text ended and every detector judged all of it."""
        return self._ended and not self._unfinished

    def feed_deltas(self, deltas: list[str], finished: bool = False) -> list[Release]:
        """Deltas that arrived together (one engine read), chunked as one; `finished`: the
        last of them ends the text (the engine's finish). Without detectors each non-empty
        delta is its own frame, and the last one, when `finished`, is the final frame (an
        empty one where the finishing delta is empty)."""
        if not self._passthrough:
            return self.feed("".join(deltas))
        text = self._text
        releases: list[Release] = []
        last = len(deltas) - 1
        for i, delta in enumerate(deltas):
            if delta:
                start = text.released
                end = text.released = text.length = start + len(delta)
                releases.append(Release(start, end, delta, [], finished and i == last))
        if finished:
            if not (deltas and deltas[-1]):  # the finishing delta is empty: its own release
                end = text.released
                releases.append(Release(end, end, "", final=True))
            self._final_sent = True
        return releases

    def feed(self, delta: str) -> list[Release]:
        """New text; releases only come back at once when no detector gates them."""
        if not delta:
            return []
        self._text.append(delta)
        self._fanout.feed(delta)
        if self._aggregator is None:
            return self._release(self._text.length, [])
        return []

    def end(self, *, cut: bool = False) -> None:
        """The text is complete. Frames released from now on are held back so that the last one
        can carry what only the end knows (finish reason, whole-document detections). `cut`:
        the model did not end it (a token or time budget, a stop sequence; `cut_short`): a
        tail that could be the beginning of an entity is judged as one (DESIGN 4.6a)."""
        self._ended = True
        self._fanout.flush(cut=cut)

    def accept(self, message: Result | DetectorFinished) -> Verdict:
        if isinstance(message, DetectorFinished):
            self._unfinished.discard(message.detector_id)
            if self._aggregator is not None and message.detector_id in self._gating:
                self._aggregator.finish(message.detector_id)
                return Verdict(self._drain())
            return Verdict()
        flagged = [f for f in message.detections if not f.unjudged]
        if flagged and message.detector_id in self._blocking:
            # text judged clean before the offending chunk still goes out, even when it was
            # held back for the end of the stream
            held, self._held = self._held, []
            return Verdict(held, blocked=self._map(flagged))
        if self._redactor is not None and flagged:
            self._redactor.add(list(message.detections), self._redactors)
        if message.detector_id in self._gating:
            assert self._aggregator is not None
            self._aggregator.push(message)
            return Verdict(self._drain())
        self._final.extend(message.detections)
        return Verdict()

    def final_releases(self) -> list[Release]:
        """Once `done`: the held releases, the last one final, with the whole-document detections
        merged in; an empty frame at the end of the text when none was held (none at all when
        the pass-through released the final frame already)."""
        held, self._held = self._held, []
        if self._final_sent:
            return held
        if held:  # the last one held back is released as the final one
            last = held.pop()
            start, end, text, detections = last.start, last.end, last.text, last.detections
            source_end = last.source_end
        else:
            start = end = self._text.released
            if self._redactor is not None:
                start = end = self._redactor.out_released
            text, detections, source_end = "", [], None
        if self._final:
            detections = sort_findings(detections + self._map(self._final))
        held.append(Release(start, end, text, detections, final=True, source_end=source_end))
        return held

    def _drain(self) -> list[Release]:
        assert self._aggregator is not None
        out: list[Release] = []
        for frame in self._aggregator.pop_ready():
            detections = [d for r in frame.results for d in r.detections]
            out.extend(self._release(frame.end, detections))
        return out

    def _map(self, findings: list[Finding]) -> list[Finding]:
        """Findings on the text the client receives."""
        if self._redactor is None:
            return findings
        return self._redactor.map_findings(findings, self._redactors)

    def _release(self, end: int, detections: list[Finding]) -> list[Release]:
        start = self._text.released
        if end <= start and not detections:
            return []
        text = self._text.take(end)
        redactor = self._redactor
        if redactor is None:
            frame = Release(start, end, text, sort_findings(detections))
        else:
            out_start = redactor.out_released
            text = redactor.release(text, start, max(end, start))
            frame = Release(
                out_start,
                out_start + len(text),
                text,
                sort_findings(self._map(detections)),
                source_end=end,
            )
        if self._ended:
            self._held.append(frame)
            return []
        return [frame]
