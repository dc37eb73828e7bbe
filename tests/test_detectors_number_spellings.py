"""Numbers written so that a digit pattern misses them (detectors/number_spellings.py), found by
the `regex` built-in with exact spans over the whole spelling; the near misses ordinary text is
full of (counts, lists, matrices, decades, parcel numbers, tables of amounts) are not; a stream
cut inside one withholds it (`open_tail`) and a window cut inside one carries it
(`held_from`). On 82d0c00 find_pii found none of the values below."""

from __future__ import annotations

import base64

import pytest

import detectors
from detectors.number_spellings import number_view, run_across
from detectors.regex_pii import KINDS, find_pii, open_tail

REGEX = detectors.build("regex")


def finds(text: str) -> list[tuple[str, str]]:
    return [(d.detection, d.text) for d in find_pii(text, list(KINDS), {})]


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("five five five, one two three, four five six seven", "phone"),
        ("Five Five Five - One Two Three - Four Five Six Seven", "phone"),
        ("five-five-five one-two-three four-five-six-seven", "phone"),
        ("five five five one two three four five six seven", "phone"),
        ("nine one seven, double five five, oh one double oh", "phone"),
        ("triple five, one two three, four five six seven", "phone"),
        ("five three two, one nine, eight seven six five", "ssn"),
        ("one two three, four five, six seven eight nine", "ssn"),  # grouped: no count
        ("5 3 2 1 9 8 7 6 5", "ssn"),
        ("5 5 5 2 1 8 4 6 9 7", "phone"),
        ("5\n5\n5\n2\n1\n8\n4\n6\n9\n7", "phone"),
        ("4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", "credit_card"),
        ("four one one one, one one one one, one one one one, one one one one", "credit_card"),
        ("555-l23-4S67", "phone"),
        ("SSS-lZ3-4S67", "phone"),
        ("4111-llll-llll-llll", "credit_card"),
        ("five 5 5, two one 8, four 6 nine 7", "phone"),
        # the digits' words of German, French, Spanish, Italian and Portuguese, accents and all
        ("f\u00fcnf f\u00fcnf f\u00fcnf, eins zwei drei, vier f\u00fcnf sechs sieben", "phone"),
        ("null eins f\u00fcnf, zwo drei acht, neun neun null eins", "phone"),
        ("cinq trois deux, un neuf, huit sept six cinq", "ssn"),
        ("cinco cinco cinco, uno dos tres, cuatro cinco seis siete", "phone"),
        ("quattro uno uno uno, uno uno uno uno, uno uno uno uno, uno uno uno uno", "credit_card"),
        ("nove um sete, meia dois tr\u00eas, oito oito zero um", "phone"),
        # Chinese numerals, a digit each (`\u5e7a` for 1, `\u3007` and `\u96f6` for 0)
        ("\u4e94\u4e94\u4e94-\u4e00\u4e8c\u4e09-\u56db\u4e94\u516d\u4e03", "phone"),
        ("\u4e94\u4e09\u4e8c-\u4e00\u4e5d-\u516b\u4e03\u516d\u4e94", "ssn"),
        ("\u5e7a\u4e09\u516b \u3007\u4e00\u4e8c\u4e09 \u96f6\u4e94\u516d\u4e03", "phone"),
    ],
)
def test_a_spelt_number_is_found_over_its_whole_spelling(value: str, kind: str) -> None:
    text = f"Sure, it is {value}. Anything else?"
    assert finds(text) == [(kind, value)]


def test_a_number_over_table_cells_is_found() -> None:
    text = "| Name | Phone |\n|---|---|\n| 555 | 123 | 4567 |\n| 4111 | 1111 | 1111 | 1111 |\n"
    assert finds(text) == [
        ("phone", "555 | 123 | 4567"),
        ("credit_card", "4111 | 1111 | 1111 | 1111"),
    ]


def test_an_email_written_backwards_is_found() -> None:
    text = "Mail moc.elpmaxe@nhoj today."
    assert finds(text) == [("email", "moc.elpmaxe@nhoj")]


@pytest.mark.parametrize(
    ("plain", "kind"),
    [
        ("john.smith@example.com", "email"),
        ("call 555-123-4567", "phone"),
        ("SSN 532-19-8765", "ssn"),
    ],
)
def test_a_value_in_base64_is_found_over_the_whole_run(plain: str, kind: str) -> None:
    encoded = base64.b64encode(plain.encode()).decode()
    text = f"Here it is: {encoded} (decode it)."
    assert finds(text) == [(kind, encoded)]
    url_safe = base64.urlsafe_b64encode(plain.encode()).decode().rstrip("=")
    assert finds(f"Here: {url_safe}.") == [(kind, url_safe)]


def test_base64_without_a_value_is_none() -> None:
    text = (
        "d41d8cd98f00b204e9800998ecf8427e 123e4567-e89b-12d3-a456-426614174000 "
        "internationalization " + base64.b64encode(b"hello world, how are you").decode()
    )
    assert finds(text) == []


def test_invisible_characters_inside_a_spelt_number_are_covered() -> None:
    value = "f\u200bive five five, one two three, four five six seve\u200bn"
    text = f"Call {value} now."
    [d] = find_pii(text, ["phone"], {})
    assert (d.start, d.end) == (5, 5 + len(value))


@pytest.mark.parametrize(
    "text",
    [
        "Count: one two three four five six seven eight nine.",  # a count
        "1 2 3 4 5 6 7 8 9 10",
        "9 8 7 6 5 4 3 2 1 liftoff",
        "x = [1, 2, 3, 4, 5, 6, 7, 8, 9]",  # a list: commas between ASCII digits
        "[5, 5, 5, 2, 1, 8, 4, 6, 9, 7]",
        "1 0 0\n0 1 0\n0 0 1",  # a matrix: its whitespace changes
        "0 0 0 0 0 0 0 0 0 0",  # one digit repeated
        "5 5 5 5 5 5 5 5 5 5",
        "one or two, three or four",
        "I have one cat, two dogs and three fish.",
        "The 1980s 1990s were fine, vitamins B12 B6 too.",
        "Tracking number 1Z5433965777440500, weight 77,8 kg.",
        "| 250 | 500 | 1000 |",  # round amounts
        "| Q1 | 555 | 123 | 4567 |",  # a label in the row
        "scores 1.5 2.5 3.5 4.5 5.5 6.5 7.5",
        "five o'clock, one o'clock, two o'clock",
        "oh one two",  # `oh` starts no run
        "un deux trois quatre cinq six sept",  # counts in other languages
        "uno, due, tre, quattro, cinque, sei, sette",
        "Ich habe eins oder zwei, drei Katzen und vier Hunde.",
        "Tenho um c\u00e3o, dois gatos e tr\u00eas peixes.",
        "\u4e00\u3001\u4e8c\u3001\u4e09\u3001\u56db\u3001\u4e94\u3001\u516d",  # a Chinese list's numbering
        "\u4e8c\u3007\u4e8c\u56db\u5e74\u4e00\u6708",  # a year and a month
        "\u4e09\u4e09\u4e09\u4e09\u4e09\u4e09",  # one digit repeated
        "HELLO WOOOOOORLD",
    ],
)
def test_near_misses_are_no_number(text: str) -> None:
    assert finds(text) == []


def test_the_view_leaves_text_without_a_spelling_alone() -> None:
    assert number_view("Call 555-123-4567 or write to jo@example.com.") is None
    assert number_view("One day, two friends met three strangers.") is None


def test_a_stream_cut_inside_a_spelt_number_has_an_open_tail() -> None:
    """DESIGN 4.6a: the tail that could still grow into a match is withheld."""
    assert open_tail("Call five five five, one two three,") == (5, "phone")
    assert open_tail("Call 5 5 5 2 1 8 ") == (5, "phone")
    assert open_tail("Call five five five, one two") is None  # five digits: no evidence
    assert open_tail("Call five five five, one two three, four five six seven") is None  # a find
    assert open_tail("I have one or two") is None


def test_a_window_cut_inside_a_spelt_number_holds_it_from_its_start() -> None:
    card = "four three seven eight three seven eight seven three seven eight seven three two"
    text = f"Sure. Card {card} thanks."
    at = text.index("eight seven three")  # (a cut at whitespace: the run goes on across it)
    assert REGEX.held_from(text, at) == text.index(card)
    assert run_across(text, text.index(" thanks")) is None  # the run ends there
    assert REGEX.held_from("I have one or two cats and three dogs", 11) is None
    assert REGEX.held_from(text, at, {"kinds": ["email"]}) is None
