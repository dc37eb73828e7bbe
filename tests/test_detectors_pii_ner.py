"""`pii_ner` (issue 34): names, places, organisations, dates and IBANs found by spaCy's small
English model shipped on PyPI, beside every `regex` kind; exact spans in the client's text,
off the event loop, and no leak at chunk seams when it redacts a stream.

The spaCy model loads once per process (the runtime cache), about a second on 2 cores."""

from __future__ import annotations

import asyncio
import threading

import pytest

import detectors
from detectors.pii_ner import PiiNerDetector
from orchestrator.clients.detectors import InProcessDetectorClient
from orchestrator.clients.registry import RequestedDetector
from orchestrator.config import DetectorConfig
from orchestrator.streaming.findings import Finding
from orchestrator.streaming.redaction import redact_text
from tests import test_pipeline_redaction_seams as seams

NER = detectors.build("pii_ner")


def found(text: str, params: dict | None = None) -> list[tuple[str, int, int, str]]:
    [hits] = asyncio.run(NER.detect([text], params))
    assert all(h.detection_type == "pii" and h.score == 1.0 for h in hits)
    return [(h.detection, h.start, h.end, h.text) for h in hits]


def at(text: str, needle: str) -> tuple[int, int]:
    start = text.index(needle)
    return start, start + len(needle)


def test_names_places_dates_and_regex_kinds_with_exact_spans() -> None:
    text = (
        "Write to Angela Merkel in Berlin today. Or call 555-123-4567, please. "
        "Mail jo@example.com, born 12/29/1944."
    )
    assert found(text) == [
        ("person", *at(text, "Angela Merkel"), "Angela Merkel"),
        ("location", *at(text, "Berlin"), "Berlin"),
        ("phone", *at(text, "555-123-4567"), "555-123-4567"),
        ("email", *at(text, "jo@example.com"), "jo@example.com"),
        ("date", *at(text, "12/29/1944"), "12/29/1944"),
    ]


def test_an_iban_is_reported_whole_not_as_the_phone_its_digits_look_like() -> None:
    text = "Pay to GB82 WEST 1234 5698 7654 32 by Friday."
    iban = "GB82 WEST 1234 5698 7654 32"
    assert ("iban", *at(text, iban), iban) in found(text)
    assert [k for k, *_ in found(text) if k == "phone"] == []
    bad = "Pay to GB83 WEST 1234 5698 7654 32 by Friday."  # check digits wrong: no IBAN
    assert [k for k, *_ in found(bad) if k == "iban"] == []


def test_an_invisible_character_inside_a_name_is_inside_its_span() -> None:
    text = "Angela Mer\u200bkel visited Berlin."
    assert found(text) == [
        ("person", 0, 14, "Angela Mer\u200bkel"),
        ("location", *at(text, "Berlin"), "Berlin"),
    ]


def test_kinds_select_what_is_reported() -> None:
    text = "Write to Angela Merkel in Berlin or jo@example.com today."
    assert found(text, {"kinds": ["location"], "regex_kinds": []}) == [
        ("location", *at(text, "Berlin"), "Berlin")
    ]
    assert found(text, {"kinds": [], "regex_kinds": ["email"]}) == [
        ("email", *at(text, "jo@example.com"), "jo@example.com")
    ]


def test_the_model_runs_in_its_worker_thread_never_on_the_loop() -> None:
    threads: list[str] = []
    forward = PiiNerDetector._forward

    def spy(self: PiiNerDetector, items: list[str]):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return forward(self, items)

    async def run() -> None:
        PiiNerDetector._forward = spy  # type: ignore[method-assign]
        try:
            await NER.detect(["Angela Merkel", "Berlin"])
        finally:
            PiiNerDetector._forward = forward  # type: ignore[method-assign]

    asyncio.run(run())
    assert threads and all(name.startswith("detector-spacy") for name in threads)
    assert threading.main_thread().name not in threads


@pytest.mark.parametrize(
    "params",
    [{"model_path": "/etc"}, {"kinds": ["weapon"]}, {"batching": False}],
)
def test_a_request_can_set_only_the_kinds_and_threshold(params: dict) -> None:
    with pytest.raises(detectors.InvalidParams):
        detectors.validate_request_params("pii_ner", None, params)


def ner_pii(chunker: str) -> RequestedDetector:
    client = InProcessDetectorClient("pii", DetectorConfig(builtin="pii_ner"), NER)
    return RequestedDetector("pii", client, chunker, 0.5, "redact", {}, "[{entity}]")  # type: ignore[arg-type]


@pytest.mark.parametrize("max_chars", [12, 500])
def test_a_redacting_stream_leaks_no_name_at_any_split(max_chars: int) -> None:
    """The pipeline's chunkers, seam windows and redactor with pii_ner: every offset as the
    token boundary releases the redacted whole, whatever chunk boundaries cut the names."""
    text = "Write to Angela Merkel in Berlin today. Or call 555-123-4567, please."
    det = ner_pii("s")

    async def all_splits() -> None:
        [hits] = await NER.detect([text], {})
        findings = [
            Finding(h.start, h.end, h.text, h.detection, h.detection_type, "pii", h.score)
            for h in hits
        ]
        want, _ = redact_text(text, findings, {"pii": det})
        assert want == "Write to [person] in [location] today. Or call [phone], please."
        for k in range(len(text) + 1):
            frames = await seams.run_stream([text[:k], text[k:]], [det], seams.registry(max_chars))
            assert "".join(f.text for f in frames) == want, k

    asyncio.run(all_splits())


def test_a_date_needs_a_year_a_numeric_date_or_a_month_and_an_age_is_an_age() -> None:
    """The model labels durations, decades and bare numbers (house numbers, postcodes) DATE:
    no PII, and 8% of its dates on the bench's dev split. An age it labels DATE is an age."""
    text = (
        "A salesperson with 8+ years of experience, a fan of the 60s, at the age of 35, "
        "born on 5/26/1980, moved to 48396 Plattenstrasse in May 2013."
    )
    kinds = [(k, t) for k, _, _, t in found(text) if k in ("date", "age")]
    assert kinds == [("age", "the age of 35"), ("date", "5/26/1980"), ("date", "May 2013")]


@pytest.mark.parametrize(
    "text",
    [
        "I have lost my card. Could you please block my credit card ASAP ? Thanks.",
        "Here's my SSN: 223-41-7871",
        "A problem with a wire transfer using this IBAN GB82 WEST 1234 5698 7654 32",
    ],
)
def test_abbreviations_and_names_of_pii_kinds_are_no_organisations(text: str) -> None:
    assert [t for k, _, _, t in found(text) if k == "organization"] == []
