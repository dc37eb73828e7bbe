"""The FMS writer's hand-built frame dict (the hot path) equals the pydantic wire model's dump."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.streaming.events import Frame
from orchestrator.streaming.findings import Finding
from orchestrator.streaming.fms_writer import classified_frame, frame_dict
from tests.test_finding_wire import findings


@given(
    start=st.integers(0, 1000),
    text=st.text(max_size=20),
    detections=st.lists(findings, max_size=3),
    final=st.booleans(),
    judged=st.booleans(),
    finish=st.sampled_from([None, "EOS_TOKEN", "MAX_TOKENS"]),
    count=st.one_of(st.none(), st.integers(0, 100)),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)
def test_frame_dict_equals_the_wire_model(
    start, text, detections, final, judged, finish, count, seed
) -> None:
    frame = Frame(
        start=start,
        end=start + len(text),
        text=text,
        detections=detections if judged else [],
        final=final,
        finish_reason=finish,
        generated_token_count=count,
        input_token_count=count,
        seed=seed,
        judged=judged,
    )
    assert frame_dict(frame) == classified_frame(frame).dump()


def test_a_lone_surrogate_quoted_back_does_not_break_the_stream() -> None:
    """JSON allows "\\ud800"; a detection can quote it back; the frame still serialises."""
    import json

    from orchestrator.streaming.fms_writer import sse_event

    text = "mail \ud800 me"
    finding = Finding(0, 4, text, "x", "y", "d", 1.0)
    frame = Frame(start=0, end=len(text), text=text, detections=[finding], judged=True)
    data = sse_event(frame).decode("utf-8", "surrogatepass")
    assert json.loads(data.removeprefix("data: "))["generated_text"] == text
