"""Street addresses and postal codes (detectors/address.py) as the shipped `pii` (`pii_ner`)
reports them: one exact span over the street, city, state and code, in US, Canadian and
British forms inside sentences; a bare number is no ZIP code; hostile input costs linear
time (RE2)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    ("text", "address"),
    [
        (
            "Meine neue Adresse lautet Musterstraße 12, 10115 Berlin.",
            "Musterstraße 12, 10115 Berlin",
        ),
        (
            "Die Rechnung geht an Anne-Katrin-Trubin-Straße 72/12, 40957 Schrobenhausen bitte.",
            "Anne-Katrin-Trubin-Straße 72/12, 40957 Schrobenhausen",
        ),
        ("Lieferanschrift: Häringgasse 3-6, 39819 Cuxhaven", "Häringgasse 3-6, 39819 Cuxhaven"),
        ("Adresse : 12 rue de la Paix, 75002 Paris, merci.", "12 rue de la Paix, 75002 Paris"),
        (
            "Livrez au 36, boulevard Bruneau, 57342 Delannoy-sur-Boulanger demain.",
            "36, boulevard Bruneau, 57342 Delannoy-sur-Boulanger",
        ),
        ("Envoyez-le rue Mathieu, 58213 Sainte Marc.", "rue Mathieu, 58213 Sainte Marc"),
        ("Mijn adres is Damrak 1, 1012 LG Amsterdam.", "Damrak 1, 1012 LG Amsterdam"),
        ("Afleveradres: Jornstraat 62, 4668LP, Maurik", "Jornstraat 62, 4668LP, Maurik"),
        ("Ik woon in 9908 AD Lottum.", "9908 AD Lottum"),
        ("Il mio indirizzo è Via Roma 1, 00184 Roma.", "Via Roma 1, 00184 Roma"),
        (
            "Consegna: Via Mario, 281 Appartamento 1, 23032, Bormio (SO) entro lunedì",
            "Via Mario, 281 Appartamento 1, 23032, Bormio (SO)",
        ),
        ("Mi dirección es Calle Mayor 5, 28013 Madrid.", "Calle Mayor 5, 28013 Madrid"),
        (
            "Envíelo a Camino Alba Aguirre 85 Puerta 0, Almería, 43790 por favor",
            "Camino Alba Aguirre 85 Puerta 0, Almería, 43790",
        ),
        (
            "Moro na Rua Augusta, 1500, 01304-001 São Paulo.",
            "Rua Augusta, 1500, 01304-001 São Paulo",
        ),
        ("Bahnhofstrasse 1, 8001 Zürich", "Bahnhofstrasse 1, 8001 Zürich"),
        (
            "Deliver to Flat 8, Jane Ramp, Shawtown, LU74 8GA today.",
            "Flat 8, Jane Ramp, Shawtown, LU74 8GA",
        ),
        (
            "As promised, here's her address:\\n\\nHenschelring 8218, 60374 Kitzingen",
            "Henschelring 8218, 60374 Kitzingen",
        ),
    ],
)
def test_a_continental_or_british_address_is_one_exact_span(text: str, address: str) -> None:
    """Continental Europe's layouts (the street's name, then its number; a French number
    first; Dutch, Portuguese and Brazilian postcodes; an Italian province) and British streets
    whatever their street word: one span over street, number, postal code and city, which
    before held the street alone (`Musterstraße 12, 10115`: the city was released) or
    nothing (`12 rue de la Paix`, `Damrak 1`); after a literal `\\n` too."""
    start = text.index(address)
    assert address_spans(text) == [(start, start + len(address), "address")]
    assert found(text) == [("address", address)]


@pytest.mark.parametrize(
    "text",
    [
        "Windows 10, 20000 Users upgraded.",
        "Table 2, 10000 Samples were drawn.",
        "Figure 3, 50000 Iterations later",
        "Windows 10, Seattle, 98052",
        "In 2024 EU Summit talks resumed.",
        "Paragraph 5 10115 Berlin",
        "Die Firma hat 80000 Mitarbeiter in 12 Ländern.",
        "Python 3, 2020 Update",
        "Bestellnummer 12345678, Betrag 1.234,56 €.",
        "Il lotto 382061 scade il 22.09.2012.",
        "Rechnung Nr. 2026-36166 vom 2011-09-03.",
        "It is 3 Square Feet wide.",
        "Top 10 Place Names in Europe",
        "The 4 Route Options are listed.",
    ],
)
def test_counts_references_and_years_beside_words_are_no_continental_address(text: str) -> None:
    """A street without a street word is an address only with an unambiguous postal code
    after a comma and a city that is no ordinary English word; a bare number and a noun are
    none (`20000 Users`, `80000 Mitarbeiter`, `2024 EU Summit`); a French street word that is
    an English one too is one only lower-cased (`3 Square Feet` is none)."""
    assert address_spans(text) == []


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
    "Damrak 1, " * 10_000,
    "Via Roma 1, 00184 " * 5_555,
    "12 rue de la " * 8_333,
    "Flat 1, Jane Ramp, " * 5_263,
    "1012 LG Amsterdam " * 5_555,
    "Musterstraße 12, 10115 Berlin Mitte " * 2_777,
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
async def test_hostile_input_is_scanned_in_linear_time(text: str) -> None:
    """100,000 characters of digit runs, street-like words, cities and codes without an end:
    RE2 scans each in linear time (20-70 ms on 2 busy cores; pyap2's backtracking patterns
    took seconds to minutes). A generous deadline only, never a timing assertion."""
    async with within(30, "an address scan of 100,000 hostile characters"):
        await asyncio.to_thread(address_spans, text)


# digits, separators, street words, postcodes' letters and city names: what the patterns are
# made of, in any order
_PIECES = st.sampled_from(
    [
        *"0123456789",
        " ", ", ", "-", "/", ".", "(", ")", "\\n",
        "12", "1012", "10115", "01304-001", "LG", "AB", "(RM)",
        "Via", "rue", "de la", "Calle", "Flat", "Musterstraße", "Damrak", "Roma", "Berlin",
        "Sainte Marc", "NW1 6XE", "Users",
    ]
)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(st.lists(_PIECES, max_size=40).map("".join))
def test_random_numbers_and_street_words_scan_safely_and_each_find_stands_alone(
    text: str,
) -> None:
    """Whatever the mix: the finds lie inside the text, sorted and apart; each one, scanned
    alone (as a stream's window that holds it whole sees it), is found whole; and the text
    repeated to some 20,000 characters scans in linear time (a generous deadline only)."""
    found_spans = address_spans(text)
    for (s, e, _), nxt in itertools.zip_longest(found_spans, found_spans[1:]):
        assert 0 <= s < e <= len(text)
        assert nxt is None or e <= nxt[0]
    for s, e, kind in found_spans:
        assert address_spans(text[s:e]) == [(0, e - s, kind)], text[s:e]

    async def scan_long() -> None:
        async with within(30, "an address scan of 20,000 random characters"):
            await asyncio.to_thread(address_spans, text * (20_000 // max(1, len(text))))

    asyncio.run(scan_long())


def test_an_address_beside_a_phone_number_keeps_its_part_outside_the_number() -> None:
    """Spans never overlap: where a `regex` number runs into an address's house number, the
    number stays a phone and the rest of the address is still an address (it was dropped
    whole, street and ZIP code released)."""
    text = "Dial 907 62631 3782 Custer Street, Springfield, IL 62704 now."
    assert [(k, t) for s, e, k in spans(text) for t in [text[s:e]]] == [
        ("phone", "907 62631 3782"),
        ("address", "Custer Street, Springfield, IL 62704"),
    ]
