"""`redact` on a classifier redacts exactly the chunk its chunker gave it, judged alone, so
`redact` never catches less than `annotate` (DESIGN 4.6a; issue 32 item 2).

On de9ac67 the redaction windows made for span detectors were used for classifiers too: a
redacting `hap` (the sentence-level profanity classifier) judged the whole text, or windows of
several sentences, and scored the mixture. The content endpoint found the profane sentence with
`annotate` and nothing with `redact`; a six-sentence prompt holding it reached the engine
unchanged; a two-sentence prompt was replaced whole by `[profanity]`.

The real orchestrator on 127.0.0.1 with the built-in `profanity` (a scikit-learn model shipped on
PyPI) and `regex` detectors, a fake native engine that records every prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, prompt_text
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    frames,
    native_config,
    remote,
    terminal,
)

CONTENT = "/api/v2/text/detection/content"
TEXT = (
    "The sky is blue today. Mail jo@example.com or call 555-123-4567. This is shit. "
    "I like cats a lot."
)
SIX = (
    "The sky is blue today. Cats sleep a lot. This is shit. Dogs like walks. "
    "Birds sing at dawn. Fish swim in the sea."
)
SCRIPT = ["The sky", " is blue.", " This is", " shit.", " I like", " cats."]


def hap(start: int, end: int, text: str, score: float, **extra: Any) -> dict[str, Any]:
    return {
        "start": start,
        "end": end,
        "text": text,
        "detection": "profanity",
        "detection_type": "hap",
        "detector_id": "hap",
        "score": score,
        **extra,
    }


def config(engine: FakeEngine) -> dict[str, Any]:
    """`hap` redacts on the model's input and output, `pii` annotates only on requests."""
    return native_config(
        engine.url,
        detectors={
            "hap": {
                "builtin": "profanity",
                "chunker_id": "sentence",
                "on_detection": "redact",
                "redact_with": "[{entity}]",
            },
            "pii": {
                "builtin": "regex",
                "chunker_id": "sentence",
                "on_detection": "redact",
                "redact_with": "[{entity}]",
            },
        },
        model={"guardrails": {"input": {"hap": {}}, "output": {"hap": {}}}},
    )


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    e = FakeEngine(script=SCRIPT)
    await e.start()
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture
async def orch(engine: FakeEngine) -> AsyncIterator[Orchestrator]:
    async with Orchestrator(config(engine)) as o:
        yield o


async def test_content_redact_finds_what_annotate_finds(orch: Orchestrator) -> None:
    detectors = {"hap": {}, "pii": {}}
    status, annotated = await orch.post(CONTENT, {"content": TEXT, "detectors": detectors})
    assert status == 200, annotated
    [_, _, found] = annotated["detections"]
    score = found["score"]
    assert score > 0.99
    assert found == hap(65, 78, "This is shit.", score)
    body = {"content": TEXT, "detectors": detectors, "redact": True}
    status, redacted = await orch.post(CONTENT, body)
    assert status == 200, redacted
    assert redacted["redacted_content"] == (
        "The sky is blue today. Mail [email] or call [phone]. [profanity] I like cats a lot."
    )
    assert redacted["detections"][2] == hap(53, 64, "[profanity]", score, redacted=True)


@pytest.mark.parametrize(
    ("prompt", "received"),
    [
        (SIX, SIX.replace("This is shit.", "[profanity]")),
        ("This is shit. I like cats.", "[profanity] I like cats."),
    ],
    ids=["six sentences", "two sentences"],
)
async def test_input_redaction_replaces_exactly_the_flagged_sentence(
    engine: FakeEngine, orch: Orchestrator, prompt: str, received: str
) -> None:
    events = await orch.stream({"model_id": MODEL, "inputs": prompt})
    assert terminal(events).name == "completed"
    first = frames(events)[0]
    [found] = first["token_classification_results"]["input"]
    start = prompt.index("This is shit.")  # input spans: relative to the text the client sent
    assert (found["start"], found["end"], found["word"], found["redacted"]) == (
        start,
        start + len("This is shit."),
        "[profanity]",
        True,
    )
    status, reply = await orch.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": prompt}]},
    )
    assert status == 200, reply
    assert [prompt_text(r.body) for r in engine.requests] == [received, received]


async def test_output_redaction_replaces_exactly_the_flagged_sentence(
    orch: Orchestrator,
) -> None:
    expected = "The sky is blue. [profanity] I like cats."
    events = await orch.stream({"model_id": MODEL, "inputs": "Tell me."})
    assert terminal(events).name == "completed"
    released = frames(events)
    assert "".join(f["generated_text"] for f in released) == expected
    [found] = [d for f in released for d in f["token_classification_results"].get("output", [])]
    assert (found["start"], found["end"], found["word"], found["redacted"]) == (
        17,
        28,
        "[profanity]",
        True,
    )
    status, reply = await orch.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Tell me."}]},
    )
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == expected


async def test_a_remote_classifier_redacts_the_whole_chunk_it_flagged(engine: FakeEngine) -> None:
    """A remote detector configured `judges: chunks` gives a verdict on the chunk; it redacts
    that chunk (DESIGN 4.6a), whatever span its reply names. On 69e17fc a reply naming only the
    flagged word (as a detection service may: its span is informative) redacted that word,
    and the rest of the sentence the classifier flagged went out: " This is [toxic]"."""
    server = FakeDetectorServer()
    server.add("toxic", DetectorBehaviour(words={"shit": 0.9}, detection="toxic"))
    await server.start()
    try:
        cfg = native_config(
            engine.url,
            detectors={
                "toxic": {
                    **remote(server.url),
                    "judges": "chunks",
                    "on_detection": "redact",
                    "redact_with": "[{entity}]",
                }
            },
            model={"guardrails": {"input": {"toxic": {}}, "output": {"toxic": {}}}},
        )
        async with Orchestrator(cfg) as orch:
            events = await orch.stream({"model_id": MODEL, "inputs": "Tell me. This is shit."})
            assert terminal(events).name == "completed"
            released = frames(events)
            assert (
                "".join(f["generated_text"] for f in released)
                == "The sky is blue. [toxic] I like cats."
            )
            [found] = [
                d for f in released for d in f["token_classification_results"].get("output", [])
            ]
            assert (found["start"], found["end"], found["word"]) == (17, 24, "[toxic]")
            [inp] = released[0]["token_classification_results"]["input"]
            assert (inp["start"], inp["end"], inp["word"]) == (9, 22, "[toxic]")
            assert [prompt_text(r.body) for r in engine.requests] == ["Tell me. [toxic]"]
    finally:
        await server.close()
