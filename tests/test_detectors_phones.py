"""Phone numbers in the `regex` detector (issue 34): international `+CC` forms, North American
and other national layouts, found with their exact spans; the numbers that share their digits and
separators (dates, cards, SSNs, IPv4 addresses, versions, order numbers) not reported as phones;
and the property the stream's seams rest on (DESIGN 4.6a): a window of the text that starts at
whitespace or at a detection, and holds a whole number, finds what the whole text finds."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.regex_pii import KINDS, find_pii
from tests.wait_support import within


def found(text: str, kinds: list[str] | None = None) -> list[tuple[str, int, int, str]]:
    return [(d.detection, d.start, d.end, d.text) for d in find_pii(text, kinds or list(KINDS), {})]


PHONES = [
    # international, `+CC` and spaces, dots, dashes, brackets
    "+44 20 7946 0958",
    "+33 1 42 68 53 00",
    "+49 (0)30 1234 5678",
    "+41 (0)76 806 36 49",
    "+46.8.123.456.78",
    "+1-212-555-0100",
    "+447700011186",
    "0044 20 7946 0958",  # the international prefix instead of `+`
    # North American
    "(212) 555-0100",
    "212.555.0100",
    "123-456-7890",  # issue 34: passed the old pattern's gaps in an answer
    "2125550100",
    "(260)154-4554x667",
    "555-123-4567x890",
    "(260)154-4554 ext.667",
    # other national layouts
    "020 7946 0958",  # UK
    "07700 900123",
    "(07700)034176",
    "07299949525",  # a contiguous trunk number
    "018310480",  # Italy: a trunk number of 9 digits, valid there (libphonenumber)
    "096375283",
    "+49 (0)30 1234-5678",  # Germany, with the trunk `(0)` and a dash
    "06 12 34 56 78",  # France, mobile
    "(020) 7946 0958",  # UK, the area code in brackets
    "030/12345678",  # Germany
    "030 12345678",
    "01.33.43.04.02",  # France
    "06 12345678",  # Netherlands
    "53-29-14-27",  # Denmark
    "0421 96 07 27",  # Switzerland
    "091 234 56 78",
    "0664 518 37 71",  # Austria
    "612 345 678",  # Spain
    "(02) 4075 2559",  # Australia
    "(85) 9334-4656",  # Brazil
    "98765 43210",  # India
    # shorter local numbers (issue 34: most of the phones `regex` still missed)
    "555-1234",  # North American, without the area code
    "795 2525",  # 7 digits, 3-4 (Iceland, Estonia, many local numbers)
    "9357 8533",  # 8 digits, 4-4 (Denmark, Norway, Singapore)
    "89 97 11",  # 6 digits, 2-2-2 (Greenland, the Faroes)
    "00585253127",  # the international prefix, contiguous (libphonenumber: a possible number)
]


@pytest.mark.parametrize("value", PHONES)
def test_phone_numbers_are_found_with_their_exact_spans(value: str) -> None:
    text = f"Call {value}, thanks"
    assert found(text) == [("phone", 5, 5 + len(value), value)]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Phone:\\n416-721-8778\\n\\nE-mail", "416-721-8778"),  # escapes written out
        ("Fax:\\t+41 33 652 34 25\\r", "+41 33 652 34 25"),
        ("Desk: (07700) 881 362\\nFax", "(07700) 881 362"),
        ("Mobile: 0430-7695593-Office", "0430-7695593"),
        ("(call 0421 96 07 27)", "0421 96 07 27"),
        ("was 2125550100.", "2125550100"),
    ],
)
def test_a_phone_number_beside_an_escape_or_punctuation_is_found(text: str, value: str) -> None:
    start = text.index(value)
    assert found(text) == [("phone", start, start + len(value), value)]


def test_a_phone_number_before_more_digit_groups_is_found_up_to_them() -> None:
    """A phone number followed by a space and more digits is the longest phone-shaped part of
    the run: the groups after it are not hidden in it, nor do they hide it."""
    text = "Call 0421 96 07 27 2023 tomorrow"
    assert found(text) == [("phone", 5, 18, "0421 96 07 27")]


@pytest.mark.parametrize(
    ("text", "others"),
    [
        ("invoice 2024-01-15", []),  # dates, also with their time
        ("on 15.01.2024", []),
        ("at 2024-01-15 10:30", []),
        ("at 15/01/2024 10:30", []),
        ("from 2020-2023", []),  # a range of years
        ("card 4111 1111 1111 1112", []),  # a Luhn-invalid card and its pieces
        # its last two groups hold a 4-4 local number (`9357 8533`), which a window that
        # starts at `9012` sees alone (see the window property below): the whole text finds it
        ("order 1234 5678 9012 3456", [("phone", 16, 25, "9012 3456")]),
        ("order 1234 5678 1234 5678", []),
        ("card 4111-1111-1111-1112", []),
        ("ref 12 4111 1111 1111 1111", [("credit_card", 7, 26, "4111 1111 1111 1111")]),
        ("host 192.168.10.20", [("ipv4", 5, 18, "192.168.10.20")]),
        ("SSN 123-45-6789", [("ssn", 4, 15, "123-45-6789")]),
        ("SSN 123 45 6789", [("ssn", 4, 15, "123 45 6789")]),
        ("Order 123456789", []),  # order numbers: plain runs are no phones
        ("order #20231234", []),
        ("order 0001234567", []),
        ("ref 088706524", []),  # 9 digits from the trunk `0`, valid in none of IT/BE/AT/DE
        ("id 012345", []),  # too short for a trunk number
        ("version 3.11.4 and 1.2.3.4.5", []),
        ("ZIP 12345-6789", []),
        ("ISBN 978-3-16-148410-0", []),
        ("pages 100-1000", []),  # a range: no local number starts with 0 or 1
        ("from 1999 2000", []),  # years; and 4-4 pieces of cards (see near misses)
        ("cut 4111 1111", []),
        ("on 15 01 24", []),  # 2-2-2 that reads as a date
        ("pi 314.1592", []),  # a decimal
        ("code 00999123456", []),  # no country code 999: a plain run of digits
        ("short 12 34", []),
        ("total 1 234 567", []),
        ("total 1,234,567.89", []),
        ("pi 3.14159265", []),
        ("at 10:30:45", []),
        ("born 1985 and 2001", []),
        ("ids 12/34/5678", []),
    ],
)
def test_other_numbers_are_not_phones(text: str, others: list[tuple[str, int, int, str]]) -> None:
    assert found(text) == others


# --- window consistency (the seams' property) ------------------------------------------------

PIECES = [
    *PHONES,
    "2024-01-15",
    "4111 1111 1111 1111",
    "1234 5678 9012 3456",
    "123-45-6789",
    "192.168.1.1",
    "12345",
    "2023",
    "\\n",
]

text_of_numbers = st.lists(
    st.one_of(
        st.sampled_from(PIECES),
        st.sampled_from([" ", "  ", "\n", ", ", ". ", "-", "(", ")", "x", "Call ", "tel:"]),
        st.text(alphabet="0123456789 .-()/x", max_size=8),
    ),
    min_size=1,
    max_size=12,
).map("".join)


def phones(text: str) -> list[tuple[int, int]]:
    return [(d.start, d.end) for d in find_pii(text, ["phone"], {})]


@settings(max_examples=300, deadline=None)
@given(text_of_numbers)
def test_a_window_holding_a_whole_number_finds_what_the_whole_text_finds(text: str) -> None:
    """A stream's detector judges windows (DESIGN 4.6a): each starts at whitespace or at the
    start of a detection of the window before, and what it reports ends at least SEAM_CHARS
    before its end. Both must find there exactly what the whole text finds, or the seam
    releases a number or redacts what the whole text does not."""
    whole = phones(text)
    starts = {0, *(i for i in range(1, len(text)) if text[i - 1].isspace()), *(s for s, _ in whole)}
    for q in sorted(starts):
        if any(s < q < e for s, e in whole):
            continue  # the window before holds that number whole, and reports it
        assert phones(text[q:]) == [(s - q, e - q) for s, e in whole if s >= q], q
    margin = 64  # orchestrator.streaming.detector_queue.SEAM_CHARS
    for b in range(len(text)):
        head = [(s, e) for s, e in phones(text[:b]) if e <= b - margin]
        assert head == [(s, e) for s, e in whole if e <= b - margin], b


def test_a_rejected_candidate_is_judged_again_from_each_later_start() -> None:
    """`2024-01-15 555 123 456` is no phone number (a date first), but a window that starts at
    `555` sees `555 123 456`, which is phone-shaped: the whole text must find it too, or the
    seams disagree (a scan that resumed after the rejected candidate found nothing here, and
    the window found the number). The price: the last groups of a long run of digit groups may
    be found as a phone number."""
    text = "on 2024-01-15 555 123 456 ok"
    assert phones(text[14:]) == [(0, 11)]
    assert phones(text) == [(14, 25)]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0/(260)154-4554 ext.667", []),
        ("tel:(260)154-4554 ext.667", [(4, 25)]),
        ("n\\n(260)154-4554 ext.667", [(3, 24)]),
    ],
)
def test_a_window_from_a_detection_of_one_pattern_agrees_with_the_others(
    text: str, want: list[tuple[int, int]]
) -> None:
    """A window may start at a detection (DESIGN 4.6a) and so see no neighbour before it: every
    phone pattern must judge the neighbour there alike. With a rule of its own for each, the
    North American form was found after `0/` and the national one (with the extension) was not:
    the window from that detection found the extension, the whole text did not."""
    assert phones(text) == want
    for s, _ in want:
        assert phones(text[s:]) == [(a - s, b - s) for a, b in want if a >= s]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="0123456789 .-()/+x", min_size=1, max_size=40))
def test_random_digits_and_separators_scan_in_linear_time_without_a_crash(text: str) -> None:
    """Every phone pattern, and the libphonenumber checks behind them (`00` runs, 9-digit trunk
    numbers), on a random run of digits and separators repeated to some 40,000 characters:
    spans in order inside the text, none overlapping, each holding a digit; and a generous
    deadline only (RE2 is linear; a check per candidate is bounded)."""
    long_text = text * (40_000 // len(text))

    async def scan() -> list[tuple[int, int]]:
        async with within(30, "a phone scan of 40,000 random digits and separators"):
            return await asyncio.to_thread(phones, long_text)

    found = asyncio.run(scan())
    for i, (s, e) in enumerate(found):
        assert 0 <= s < e <= len(long_text) and any(ch.isdigit() for ch in long_text[s:e])
        assert i + 1 == len(found) or e <= found[i + 1][0]
