"""A piece of a text judged alone (an input's chunk or seam window, an output stream's chunk or
window) is read after the bidi controls open where it starts (DESIGN 4.6b): a right-to-left
override in an earlier piece reverses this one for a reader, so the detector gets those controls
(`detectors.normalise.BidiStack.opened`, at most MAX_DEPTH of them) put before the piece, and its
spans are moved back onto the piece itself. The whole text's pieces (text_judgement.py) and a
stream's (detector_queue.py) share this and the state machine behind it."""

from __future__ import annotations

from detectors.api import Detection


def shifted(detections: list[Detection], by: int) -> list[Detection]:
    """Detections in a content read after `by` characters of open bidi controls, in positions
    of the piece itself (a span that began in the controls begins with the piece)."""
    if not by:
        return detections
    return [
        d.model_copy(update={"start": max(d.start - by, 0), "end": max(d.end - by, 0)})
        for d in detections
    ]


def read_back(replies: list[list[Detection]], opened: list[str]) -> list[list[Detection]]:
    """Each content's reply (`replies[i]` to `opened[i]` + its piece) in positions of its
    piece."""
    if not any(opened):
        return replies
    return [shifted(dets, len(o)) for dets, o in zip(replies, opened, strict=True)]
