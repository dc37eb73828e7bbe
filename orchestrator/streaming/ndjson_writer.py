"""stream-content's writer (DESIGN 4.1): one NDJSON line per judged frame,
`{detections, start_index, processed_index}`, and for a stream that broke one error line, the
FMS error body (`{code, details, type}`); a stream that completed ends with nothing more. The
reply starts at once: the first line of the body was validated before the pipeline was built,
so everything after that is in-band."""

from __future__ import annotations

from ..api.errors import ErrorBody, Failure
from ..api.fms_responses import StreamContentResult
from .events import Frame, Rendered, Terminal
from .finding_wire import content_model
from .wire_json import dumps

NDJSON_HEADERS = {"Content-Type": "application/x-ndjson"}


class NdjsonWriter:
    headers = NDJSON_HEADERS
    start_at_once = True

    def in_band(self, failure: Failure) -> bool:
        return True  # never asked: the reply has started

    def render(self, event: Rendered) -> bytes:
        if isinstance(event, Frame):
            return _result(event)
        if isinstance(event, Terminal) and event.error is not None:
            return dumps(ErrorBody.from_failure(event.error).dump()) + b"\n"
        return b""  # the end of a completed stream (its pipeline never refuses)


def _result(frame: Frame) -> bytes:
    # dumps, not model_dump_json: a detection can quote a lone surrogate the client sent, which
    # pydantic's serializer refuses (an exception after the reply started would leave it hanging)
    return (
        dumps(
            StreamContentResult(
                detections=[content_model(f) for f in frame.detections],
                start_index=frame.start,
                processed_index=frame.end,
            ).dump()
        )
        + b"\n"
    )
