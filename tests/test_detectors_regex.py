"""The regex PII detector: exact spans for every kind, near misses that must not match (a
Luhn-invalid card, an out-of-range IPv4, times and C++ scopes that look like IPv6), kinds
selection, custom patterns, and a custom pattern that does not compile (InvalidParams → 422)."""

from __future__ import annotations

import unicodedata
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import detectors
from detectors import InvalidParams, regex_pii
from detectors.regex_pii import find_pii, luhn_ok


def spans(text: str, **params: object) -> list[tuple[str, int, int, str]]:
    p = detectors.detector_class("regex").parse_params(params)
    from detectors.regex_pii import compile_pattern

    compiled = {n: compile_pattern(rx) for n, rx in p.patterns.items()}
    return [(d.detection, d.start, d.end, d.text) for d in find_pii(text, p.kinds, compiled)]


def at(text: str, needle: str) -> tuple[int, int]:
    start = text.index(needle)
    return start, start + len(needle)


FOUND = [
    ("email", "john.doe+tag@mail.example.co.uk"),
    ("email", "a@b.io"),
    ("phone", "(555) 123-4567"),
    ("phone", "555-123-4567"),
    ("phone", "555.123.4567"),
    ("phone", "+1 415 555 2671"),
    ("phone", "+14155552671"),
    ("phone", "+44 20 7946 0958"),
    ("phone", "+33 1 42 68 53 00"),
    ("phone", "+1 (555) 123-4567"),
    ("ssn", "123-45-6789"),
    ("ssn", "123 45 6789"),
    ("credit_card", "4111 1111 1111 1111"),
    ("credit_card", "4111-1111-1111-1111"),
    ("credit_card", "4111111111111111"),
    ("credit_card", "3782 822463 10005"),
    ("credit_card", "5500 0000 0000 0004"),
    ("credit_card", "501800000009"),  # Maestro: 12 digits (ISO/IEC 7812 IIN 50, 56-69)
    ("credit_card", "675900000000"),
    ("ipv4", "192.168.1.1"),
    ("ipv4", "8.8.8.8"),
    ("ipv6", "2001:db8::1"),
    ("ipv6", "2001:0db8:85a3:0000:0000:8a2e:0370:7334"),
    ("ipv6", "fe80::1ff:fe23:4567:890a"),
    ("ipv6", "::1"),
    ("ipv6", "::ffff:192.0.2.1"),
]


@pytest.mark.parametrize(("kind", "value"), FOUND)
def test_each_kind_found_with_its_exact_span(kind: str, value: str) -> None:
    text = f"Contact: {value}. Thanks"
    start, end = at(text, value)
    assert spans(text) == [(kind, start, end, value)]


@pytest.mark.parametrize(
    "value",
    [
        "123-456-7890",  # issue 34: a model wrote it into an answer, unredacted
        "2125550100",
        "1-800-555-0199",
        "+49 (0)30 1234 5678",
        "+44 (0) 20 7946 0958",
        "+91-9876543210",
    ],
)
def test_north_american_and_international_phone_numbers_are_found_whole(value: str) -> None:
    text = f"Call {value} today"
    assert spans(text) == [("phone", *at(text, value), value)]


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112 declined",  # Luhn-invalid
        "card 4111111111111112 declined",  # Luhn-invalid, contiguous
        "ref 411100000008 and 501800000008",  # 12 digits: no Maestro IIN; Luhn-invalid
        "order 1234 5678 1234 5678",  # Luhn-invalid
        "invoice 2024-01-15 at 10:30:00",  # a date and a time
        "version 1.2.3.4.5 and 999.1.1.1 and 192.168.01.1",  # not IPv4 addresses
        "std::vector and Foo::Bar::baz",  # C++ scopes
        "MAC 00:1A:2B:3C:4D:5E",  # not IPv6
        "SSN 000-12-3456 or 666-12-3456 or 123-00-4567",  # never issued
        "short 12345 and 12 345",  # too short for a phone number
        "card 4111 1111 1111 and 4111 1111",  # pieces of a card cut by a chunk: no phones
        "I looked at this dot com bubble (at least) at noon",  # no address spelt
        "meet (at) the office. Then {dot} matrix at home dot org",
        "the ratio is 3.14159265358979323846",
        "",
    ],
)
def test_near_misses_do_not_match(text: str) -> None:
    assert spans(text) == []


def test_several_kinds_in_one_text_sorted_by_start() -> None:
    text = (
        "Mail jane@corp.com, call (555) 123-4567 or +44 20 7946 0958; SSN 078-05-1121; "
        "card 4111-1111-1111-1111 (not 4111-1111-1111-1112); host 10.0.0.1 / 2001:db8::42."
    )
    expected = [
        ("email", "jane@corp.com"),
        ("phone", "(555) 123-4567"),
        ("phone", "+44 20 7946 0958"),
        ("ssn", "078-05-1121"),
        ("credit_card", "4111-1111-1111-1111"),
        ("ipv4", "10.0.0.1"),
        ("ipv6", "2001:db8::42"),
    ]
    assert spans(text) == [(k, *at(text, v), v) for k, v in expected]


def test_contained_builtin_match_is_reported_once_as_the_longer() -> None:
    text = "call +1 555-123-4567 now, or ::ffff:10.1.2.3"
    assert spans(text) == [
        ("phone", *at(text, "+1 555-123-4567"), "+1 555-123-4567"),
        ("ipv6", *at(text, "::ffff:10.1.2.3"), "::ffff:10.1.2.3"),
    ]


def test_card_inside_a_longer_run_of_digit_groups() -> None:
    text = "ref 12 4111 1111 1111 1111 ok"
    assert spans(text) == [("credit_card", *at(text, "4111 1111 1111 1111"), "4111 1111 1111 1111")]


def test_luhn() -> None:
    assert luhn_ok("4111111111111111")
    assert luhn_ok("378282246310005")
    assert not luhn_ok("4111111111111112")


def test_kinds_select_what_runs() -> None:
    text = "a@b.com 192.168.0.1"
    assert spans(text, kinds=["ipv4"]) == [("ipv4", 8, 19, "192.168.0.1")]
    assert spans(text, kinds=[]) == []


def test_custom_patterns_with_exact_spans_alongside_builtins() -> None:
    text = "Employee EMP-004211 mailed x@y.org about ticket JIRA-77."
    found = spans(text, patterns={"employee_id": r"EMP-\d{6}", "ticket": r"\b[A-Z]+-\d+\b"})
    assert found == [
        ("employee_id", *at(text, "EMP-004211"), "EMP-004211"),
        ("ticket", *at(text, "EMP-004211"), "EMP-004211"),
        ("email", *at(text, "x@y.org"), "x@y.org"),
        ("ticket", *at(text, "JIRA-77"), "JIRA-77"),
    ]


def test_custom_pattern_that_matches_empty_strings_yields_only_real_matches() -> None:
    assert spans("ab", kinds=[], patterns={"opt_b": "b*"}) == [("opt_b", 1, 2, "b")]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"patterns": {"broken": "(unclosed"}},
            "patterns.broken: does not compile as an RE2 pattern: missing ): (unclosed",
        ),
        (
            {"patterns": {"lookbehind": "(?<=x)y"}},
            "patterns.lookbehind: does not compile as an RE2 pattern: invalid perl operator",
        ),
        ({"patterns": {"x": "a" * 600}}, "patterns: pattern 'x' must be 1-512 characters"),
        ({"patterns": {f"p{i}": "a" for i in range(40)}}, "patterns: at most 32 patterns"),
        ({"patterns": {"email": "x"}}, "is a built-in kind"),
        ({"patterns": {"bad name": "x"}}, "pattern name 'bad name'"),
        ({"patterns": {"n": 5}}, "patterns.n: Input should be a valid string"),
        ({"kinds": ["emial"]}, "kinds.0: Input should be"),
        ({"kinds": "email"}, "kinds: Input should be a valid list"),
        (
            {"kind": ["email"]},
            "kind: unknown parameter "
            "(expected one of: allow_request_patterns, kinds, patterns, threshold)",
        ),
    ],
)
def test_bad_params_are_invalid_params_naming_the_param(params: dict, message: str) -> None:
    with pytest.raises(InvalidParams) as info:
        detectors.validate_params("regex", params)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidParams):
        detectors.build("regex", params)


async def test_detect_one_list_per_content_and_request_params_merge_over_built() -> None:
    det = detectors.build("regex", {"kinds": ["email"], "patterns": {"order": r"ORD\d+"}})
    contents = ["x@y.com ORD12", "nothing here", "10.0.0.1"]
    out = await det.detect(contents)
    assert [[(d.detection, d.text) for d in per] for per in out] == [
        [("email", "x@y.com"), ("order", "ORD12")],
        [],
        [],
    ]
    out = await det.detect(contents, {"kinds": ["ipv4"]})  # patterns still come from the build
    assert [[d.detection for d in per] for per in out] == [["order"], [], ["ipv4"]]
    with pytest.raises(InvalidParams, match="patterns: custom patterns come from the detector's"):
        await det.detect(contents, {"patterns": {"order": r"ORD\d+"}})
    opened = detectors.build("regex", {"kinds": ["email"], "allow_request_patterns": True})
    with pytest.raises(InvalidParams, match=r"patterns\.bad: does not compile as an RE2 pattern"):
        await opened.detect(contents, {"patterns": {"bad": "[a-"}})
    out = await opened.detect(contents, {"patterns": {"order": r"ORD\d+"}})
    assert [[d.detection for d in per] for per in out] == [["email", "order"], [], []]
    assert all(d.score == 1.0 and d.detection_type == "pii" for d in out[0] + out[2])


async def test_large_contents_are_scanned_off_the_loop_with_the_same_result() -> None:
    det = detectors.build("regex")
    filler = "lorem ipsum dolor sit amet " * 4000
    text = filler + "card 4111 1111 1111 1111"
    (found,) = await det.detect([text])
    assert [(d.detection, d.start, d.end) for d in found] == [
        ("credit_card", len(filler) + 5, len(text))
    ]


def test_describe_lists_params_and_defaults() -> None:
    info = detectors.build("regex").describe()
    assert info["builtin"] == "regex"
    assert info["defaults"]["kinds"] == ["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]
    assert "patterns" in info["schema"]["properties"]


def test_unknown_builtin_and_device() -> None:
    with pytest.raises(ValueError, match="unknown built-in detector 'nope'"):
        detectors.build("nope")
    with pytest.raises(ValueError, match="unknown built-in detector"):
        detectors.validate_params("nope", {})
    with pytest.raises(ValueError, match="device"):
        detectors.build("regex", device="tpu")


# Texts dense in what the built-in kinds look for: digits, separators, @, dots, colons, hex.
_PII_ALPHABET = "0123456789" * 4 + " .-:@+()_/abcdefxyzABCF" + "é€😀"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=_PII_ALPHABET, max_size=80))
def test_the_character_gates_never_skip_a_match(text: str) -> None:
    """`could_match` only skips a kind whose every match needs characters the text lacks: with
    the gates, every text gives exactly what scanning every kind gives."""
    kinds = list(regex_pii.KINDS)
    gated = find_pii(text, kinds, {})
    with patch.object(regex_pii, "could_match", lambda *_: True):
        assert find_pii(text, kinds, {}) == gated


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(FOUND),
    st.text(alphabet="abcXYZ ,;!?'é", max_size=30),
    st.text(alphabet="abcXYZ ,;!?'é", max_size=30),
)
def test_each_kind_is_found_with_the_fewest_characters_its_gate_needs(
    found: tuple[str, str], before: str, after: str
) -> None:
    """The known values (some exactly at a gate: `8.8.8.8`, `::1`, a 9-digit SSN) amid text
    without digits, `@`, dots or colons: the gates let each through."""
    kind, value = found
    text = f"{before} {value} {after}"
    gated = find_pii(text, list(regex_pii.KINDS), {})
    assert (kind, value) in [(d.detection, d.text) for d in gated]
    with patch.object(regex_pii, "could_match", lambda *_: True):
        assert find_pii(text, list(regex_pii.KINDS), {}) == gated


def test_the_character_gates_skip_prose() -> None:
    """A sentence with no @, colon, or enough digits for any kind costs no scan at all."""
    text = " Sentence12 talks about delta echo and the fox, then 3.4 of them."
    data = text.encode()
    digits = sum(ch.isdigit() for ch in text)
    assert [k for k in regex_pii.KINDS if regex_pii.could_match(k, data, digits)] == []


@pytest.mark.parametrize(
    "value",
    [
        "jo [at] example [dot] com",
        "jo(at)example.com",
        "jo{AT}example dot com",
        "jo@example(dot)com",
        "jo dot smith [at] mail.example.co.uk",
        "jo.smith < at > example [ DOT ] org",
        # in words, spaced out (on 82d0c00 none of these was found)
        "user at example dot com",
        "jo dot smith at mail dot example dot org",
        "jo . smith @ example . com",
        "jo @ example.com",
    ],
)
def test_an_email_spelt_out_for_a_reader_is_an_email(value: str) -> None:
    """An address spelt with a bracketed marker, in words or spaced out is written to be read
    as one (`looked at this dot com bubble` is a near miss above: its label is a word of
    prose)."""
    text = f"Write to {value}, thanks"
    assert spans(text) == [("email", *at(text, value), value)]


# Every decimal digit of every script Unicode has (category Nd: Arabic-Indic, Devanagari,
# Bengali, Thai, full-width, mathematical bold and monospace, ...), by its script's zero, and
# the digit-like symbols the view reads as digits (circled, superscript, subscript, with a stop)
_DIGIT_ZEROS = [
    cp for cp in range(0x110000) if unicodedata.decimal(chr(cp), None) == 0 and cp != 0x30
]
_DIGIT_SETS = [
    "".join(chr(z + d) for d in range(10))
    for z in _DIGIT_ZEROS
    if all(unicodedata.decimal(chr(z + d), None) == d for d in range(10))
] + [
    "\u24ea\u2460\u2461\u2462\u2463\u2464\u2465\u2466\u2467\u2468",  # circled
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079",  # superscript
    "".join(chr(0x2080 + d) for d in range(10)),  # subscript
    "\U0001f100" + "".join(chr(0x2488 + d) for d in range(9)),  # with a full stop
]
KINDS_LIST = list(regex_pii.KINDS)
_NUMBERS = ["555-123-4567", "(212) 555-0100", "532-19-8765", "4111 1111 1111 1111", "030/12345678"]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(_NUMBERS),
    st.lists(st.sampled_from(_DIGIT_SETS), min_size=1, max_size=3),
    st.randoms(use_true_random=False),
    st.sampled_from(["Call ", "\u7535\u8bdd", "\u96fb\u8a71\u306f", "\u0e42\u0e17\u0e23"]),
)
def test_a_number_in_any_script_s_digits_is_found_as_its_ascii_form_is(
    number: str, scripts: list[str], rnd: Any, before: str
) -> None:
    """For any digit script (one, or several mixed within the number), and written onto the
    words of a script without spaces (Chinese, Japanese, Thai) as well as after a Latin word:
    the number is found with the span and kind its ASCII form has."""
    written = "".join(rnd.choice(scripts)[int(c)] if c.isdigit() else c for c in number)
    want = [(d.detection, d.start, d.end) for d in find_pii(f"Call {number}.", KINDS_LIST, {})]
    assert want and want[0][1:] == (5, 5 + len(number))
    text = f"{before}{written}\u3002"
    got = [(d.detection, d.start, d.end) for d in find_pii(text, KINDS_LIST, {})]
    shift = len(before) - 5
    assert got == [(k, s + shift, e + shift) for k, s, e in want], (text, got)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # internationalized addresses (RFC 6531), whole, in their scripts
        (
            "Write to \u0438\u0432\u0430\u043d@example.com today",
            "\u0438\u0432\u0430\u043d@example.com",
        ),
        (
            "\u041f\u0438\u0448\u0438\u0442\u0435: \u0438\u0432\u0430\u043d@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444",
            "\u0438\u0432\u0430\u043d@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444",
        ),
        (
            "mail \u03b4\u03b7\u03bc\u03ae\u03c4\u03c1\u03b7\u03c2@example.gr ok",
            "\u03b4\u03b7\u03bc\u03ae\u03c4\u03c1\u03b7\u03c2@example.gr",
        ),
        (
            "\u30e1\u30fc\u30eb\uff1a\u5c71\u7530@\u4f8b\u3048.jp \u307e\u3067",
            "\u5c71\u7530@\u4f8b\u3048.jp",
        ),
        (
            "mail \u0930\u093e\u092e@\u0909\u0926\u093e\u0939\u0930\u0923.\u092d\u093e\u0930\u0924 ok",
            "\u0930\u093e\u092e@\u0909\u0926\u093e\u0939\u0930\u0923.\u092d\u093e\u0930\u0924",
        ),
        # a word of Japanese glued on before and after an ASCII address is not part of it
        ("\u30e1\u30fc\u30eb\u306fjo@example.com\u307e\u3067", "jo@example.com"),
        ("\u30e1\u30fc\u30eb\u306fjo@\u4f8b\u3048.jp\u307e\u3067", "jo@\u4f8b\u3048.jp"),
    ],
)
def test_an_internationalized_address_is_found_whole(text: str, want: str) -> None:
    assert [(d.detection, d.text) for d in find_pii(text, KINDS_LIST, {})] == [("email", want)]


@pytest.mark.parametrize(
    "text",
    [
        "\u0426\u0435\u043d\u0430 @ 5 \u0440\u0443\u0431.",
        "@\u7528\u6237 \u4f60\u597d",
        "\u0432\u0441\u0442\u0440\u0435\u0447\u0430 @\u0434\u043e\u043c\u0430",
    ],
)
def test_an_at_sign_in_prose_of_another_script_is_no_address(text: str) -> None:
    assert find_pii(text, KINDS_LIST, {}) == []


# -- an address's domain is at most 255 characters (RFC 5321): the stream sees it whole ---------

# three addresses glued together (hypothesis, tests/test_pipeline_continued_prompt.py): the
# first one's top-level label takes the second's `jo`, and the third's 64-character local part
# `x1. ... comjo` runs into a 483-character domain
GLUED = "".join("jo@" + "x1." * n + "com" for n in (38, 160, 160))


def test_a_domain_longer_than_255_characters_is_redacted_to_its_first_255() -> None:
    """A pattern match longer than RFC 5321 allows ends 255 characters after its `@`, and so
    does an `@` address padded past that with labels no top-level one ends yet: a window of a
    stream holds 64 + 1 + 255 characters of it, never all of an unbounded domain (DESIGN
    4.6a), and the whole text is judged as that window is."""
    spans = lambda text: [(d.start, d.end) for d in find_pii(text, ["email"], {})]  # noqa: E731
    assert spans("jo@" + "ab." * 160 + "com") == [(0, 3 + 255)]
    assert spans("jo@" + "x1." * 160 + "com") == [(0, 3 + 255)]
    assert spans("jo@" + "1." * 600 + "example.com and") == [(0, 3 + 255)]
    assert spans("jo@" + "x1." * 60 + "com") == [(0, 186)]  # within the bound: all of it
    # a run that starts no domain (no label and its dot first) is no padded address
    assert spans("a" * 64 + "@" + "-" * 300) == []
    assert spans("build@" + "0123456789abcdef" * 20 + ".tar") == []
    # the padded second address (its local part `x1. ... comjo`, the 64 before its `@`), and the
    # third read backwards (`moc.1x ... @oj.moc.1x ...`, padded too): one redaction to 864
    assert spans(GLUED) == [(0, 122), (58, 378), (353, 673), (544, 864)]
