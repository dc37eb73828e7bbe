"""Street addresses and postal codes (detectors/address.py) as the shipped `pii` (`pii_ner`)
reports them: one exact span over the street, city, state and code, in US, Canadian and
British forms inside sentences; a bare number is no ZIP code; hostile input costs linear
time (RE2)."""

from __future__ import annotations

import asyncio

import pytest

import detectors
from detectors.address import address_spans
from tests.wait_support import within

NER = detectors.build("pii_ner")


def found(text: str) -> list[tuple[str, str]]:
    [hits] = asyncio.run(NER.detect([text], {}))
    return [(h.detection, h.text) for h in hits if h.detection in ("address", "postal_code")]


def spans(text: str) -> list[tuple[int, int, str]]:
    [hits] = asyncio.run(NER.detect([text], {}))
    return [(h.start, h.end, h.detection) for h in hits]


@pytest.mark.parametrize(
    ("text", "address"),
    [
        (
            "Please send it to 1600 Pennsylvania Avenue NW, Washington, DC 20500 by Monday.",
            "1600 Pennsylvania Avenue NW, Washington, DC 20500",
        ),
        ("Write to 221B Baker Street, London NW1 6XE please.", "221B Baker Street, London NW1 6XE"),
        (
            "The office is at 10 Downing Street, London SW1A 2AA, as you know.",
            "10 Downing Street, London SW1A 2AA",
        ),
        (
            "Visit us at 290 Bremner Blvd, Toronto, ON M5V 3L9 today.",
            "290 Bremner Blvd, Toronto, ON M5V 3L9",
        ),
        (
            "I moved to 742 Evergreen Terrace, Springfield, OR 97477-1234 last year.",
            "742 Evergreen Terrace, Springfield, OR 97477-1234",
        ),
        (
            "Ship it to 12 W 34th St, Apt 5B, New York, NY 10001 please.",
            "12 W 34th St, Apt 5B, New York, NY 10001",
        ),
        (
            "Our office: 4308 Morris Street Suite 472 Seguin Texas",
            "4308 Morris Street Suite 472 Seguin Texas",
        ),
        ("I'll meet you at 2272 Cedarstone Drive after the concert.", "2272 Cedarstone Drive"),
    ],
)
def test_an_address_in_a_sentence_is_one_exact_span(text: str, address: str) -> None:
    start = text.index(address)
    assert (start, start + len(address), "address") in spans(text)
    assert found(text) == [("address", address)]
    # nothing else of it is reported: the place names and numbers in it are the address's
    assert [s for s in spans(text) if s[0] < start + len(address) and start < s[1]] == [
        (start, start + len(address), "address")
    ]


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("Send it to Boise, ID 83702 by Friday.", ("address", "Boise, ID 83702")),
        ("The parcel goes to IL 62704 tomorrow.", ("postal_code", "IL 62704")),
        ("My zip code is 02134, thanks.", ("postal_code", "zip code is 02134")),
        ("Postcode: EC1A 1BB.", ("postal_code", "Postcode: EC1A 1BB")),
        ("It was posted from SW1A 2AA yesterday.", ("postal_code", "SW1A 2AA")),
    ],
)
def test_a_postal_code_in_an_address_context_is_found(text: str, code: tuple[str, str]) -> None:
    assert found(text) == [code]


@pytest.mark.parametrize(
    "text",
    [
        "We had 20500 visitors and 100 staff in 2024.",
        "Your order number is 62704 and your user ID 83702.",
        "Read chapter 3 The Road is long, then page 12.",
        "The meeting is at 5 PM Drive home safely.",
        "An MP3 4GB player costs 30 dollars.",
        "Ok 200 items shipped, or 97477 of them.",
        "Version 3.11 Main Street edition",
    ],
)
def test_a_bare_number_or_a_number_beside_words_is_no_address(text: str) -> None:
    assert found(text) == []


def test_a_street_cut_by_a_sentence_end_is_found_in_both_pieces() -> None:
    """`St. ` is a natural cut (the model and the patterns read each piece alone): both
    halves are addresses, so nothing of it is released."""
    text = "Meet at 12 Main St. Springfield, IL 62704 at noon."
    assert found(text) == [("address", "12 Main St."), ("address", "Springfield, IL 62704")]


HOSTILE = [
    "1 " * 50_000,
    "1" * 100_000,
    "123 Main " * 11_111,
    "123 Main Street, " * 5_882,
    "Springfield, IL " * 6_250,
    "zip code is 1" * 7_692,
    "AB1 2CD " * 12_500,
    "Lorem Ipsum Dolor " * 5_555,
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
async def test_hostile_input_is_scanned_in_linear_time(text: str) -> None:
    """100,000 characters of digit runs, street-like words, cities and codes without an end:
    RE2 scans each in linear time (20-70 ms on 2 busy cores; pyap2's backtracking patterns
    took seconds to minutes). A generous deadline only, never a timing assertion."""
    async with within(30, "an address scan of 100,000 hostile characters"):
        await asyncio.to_thread(address_spans, text)


def test_an_address_beside_a_phone_number_keeps_its_part_outside_the_number() -> None:
    """Spans never overlap: where a `regex` number runs into an address's house number, the
    number stays a phone and the rest of the address is still an address (it was dropped
    whole, street and ZIP code released)."""
    text = "Dial 907 62631 3782 Custer Street, Springfield, IL 62704 now."
    assert [(k, t) for s, e, k in spans(text) for t in [text[s:e]]] == [
        ("phone", "907 62631 3782"),
        ("address", "Custer Street, Springfield, IL 62704"),
    ]
