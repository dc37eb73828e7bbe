"""Issue 32, items 5 and 6 (DESIGN 4.6b): punctuation is a boundary, and combining marks,
right-to-left overrides and dot look-alikes do not hide PII or profanity.

First each string of the issue, with its exact span (the regex detector on the normalised view);
then the neighbours that must still not make a value (1.2.3.4.5, a digit run inside a longer
one, a decimal fraction); the view's map back with marks (the marks drawn on a value's last
character are its own); text under a right-to-left override, judged in both orders; the
profanity built-in judging the view; a hypothesis property (any e-mail, phone, SSN or card
number with punctuation around it, combining marks after its characters, zero-width characters
inside it and full-width digits is found, its span exactly the decorated value); and the content
endpoint redacting such values end to end.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import detectors
from detectors.normalise import (
    display_order,
    judged_texts,
    normalise,
    reversed_runs,
    view_text,
)
from detectors.regex_pii import find_pii
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import SCRIPT, Orchestrator, native_config

KINDS = ["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]
CONTENT = "/api/v2/text/detection/content"


def pii(text: str) -> list[tuple[int, int, str, str]]:
    return [(d.start, d.end, d.detection, d.text) for d in find_pii(text, KINDS, {})]


MARKED_EMAIL = "".join(ch + "\u0332" for ch in "jo@example.com")  # a low line under each

# (text, [(start, end, kind)]): the strings of issue 32 and their relatives
FOUND = [
    # markup decoded once can hide what a reader of the raw text sees (on 1def789 `%55` read as
    # a `U` and `&#555` as one character, and the phone numbers were not found): both views
    ("Call %555-123-4567.", [(6, 18, "phone")]),
    ("&#555-123-4567", [(2, 14, "phone")]),
    ("\\(555) 123-4567", [(0, 15, "phone")]),  # a Markdown escape, covered whole
    ("jo%40example.com", [(0, 16, "email")]),
    # item 5: punctuation next to PII
    ("jo@example.com--he", [(0, 14, "email")]),
    ("-jo@example.com", [(1, 15, "email")]),
    ("_jo@example.com", [(1, 15, "email")]),
    (".jo@example.com", [(1, 15, "email")]),
    ("+jo@example.com", [(1, 15, "email")]),
    ("jo@example.com\u2013", [(0, 14, "email")]),  # en dash
    ("jo@example.com_", [(0, 14, "email")]),
    ("SSN 123-45-6789-", [(4, 15, "ssn")]),
    ("-123-45-6789", [(1, 12, "ssn")]),
    ("_123-45-6789_", [(1, 12, "ssn")]),
    ("-4111111111111111", [(1, 17, "credit_card")]),
    ("_4111111111111111_", [(1, 17, "credit_card")]),
    ("card:4111-1111-1111-1111-", [(5, 24, "credit_card")]),
    ("1,4111111111111111", [(2, 18, "credit_card")]),  # a list, not a decimal
    ("555-123-4567_", [(0, 12, "phone")]),
    ("(555-123-4567)", [(1, 13, "phone")]),
    ("_+44 20 7946 0958_", [(1, 17, "phone")]),
    ("_192.168.0.1_", [(1, 12, "ipv4")]),
    ("range 10.0.0.1-10.0.0.9", [(6, 14, "ipv4"), (15, 23, "ipv4")]),
    ("v.10.0.0.1.", [(2, 10, "ipv4")]),
    ("_fe80::1_", [(1, 8, "ipv6")]),
    # item 6: combining marks
    ("jo@exa\u0301mple.com", [(0, 15, "email")]),
    (MARKED_EMAIL, [(0, 28, "email")]),  # the mark under the last m is the value's
    ("4111\u0301 1111 1111 1111", [(0, 20, "credit_card")]),
    ("5\u03325\u03325-123-4567", [(0, 14, "phone")]),
    ("1\u032023-45-6789", [(0, 12, "ssn")]),
    ("call 555-123-456\u20dd7\u20dd now", [(5, 19, "phone")]),  # enclosing circles (Me)
    ("j\u00f6@ex\u00e4mple.com", [(0, 14, "email")]),  # precomposed: o and a with a diaeresis
    # item 6: dot look-alikes, dots between card digit groups
    ("jo@example\u3002com", [(0, 14, "email")]),  # ideographic full stop
    ("jo@example\uff61com", [(0, 14, "email")]),  # half-width ideographic full stop
    ("jo@example\u00b7com", [(0, 14, "email")]),  # middle dot
    ("ip 192\u3002168\u30020\u30021", [(3, 14, "ipv4")]),
    ("4111.1111.1111.1111", [(0, 19, "credit_card")]),
    ("0.4111.1111.1111.1111", [(2, 21, "credit_card")]),  # grouped: no fraction
]


@pytest.mark.parametrize(("text", "want"), FOUND)
def test_pii_next_to_punctuation_or_under_marks_is_found(
    text: str, want: list[tuple[int, int, str]]
) -> None:
    assert pii(text) == [(s, e, kind, text[s:e]) for s, e, kind in want]


@pytest.mark.parametrize(
    "text",
    [
        "1.2.3.4.5",  # a dotted run of five numbers is no IPv4 address
        "x1.2.3.4",
        "1.2.3.4.5\u3002",
        "12-123-45-6789",  # an SSN's `-` next to a digit continues the run
        "123-45-6789-0",
        "123-45-67890",
        "1123-45-6789",
        "5555-123-4567",  # a phone number inside a longer digit run
        "555-123-45678",
        "0.4111111111111111",  # a decimal fraction, not a card number
        "p = 3.4111111111111111.",
        "id4111111111111111",  # letters and digits continue a token; only the others bound it
        "ssn123-45-6789",
    ],
)
def test_a_value_inside_a_longer_token_is_not_found(text: str) -> None:
    """No value cut out of a longer token. The whole token may be a phone number: a
    number-shaped run is one unless proven otherwise (issue 34), and reporting it whole leaves
    nothing of it outside the span."""
    found = pii(text)
    assert all((s, e, kind) == (0, len(text), "phone") for s, e, kind, _ in found), found


# --- the view: marks ---------------------------------------------------------------------------


def test_marks_are_dropped_and_spans_map_back_through_them() -> None:
    text = "ab\u0301\u200b\u0301\u200bc d\u0332"
    view = normalise(text)
    assert view.text == "abc d"
    assert [view.position(v) for v in range(len(view.text))] == [0, 1, 6, 7, 8]
    assert view.span(0, 2) == (0, 5)  # "ab": the marks drawn on b, not the last invisible one
    assert view.span(1, 3) == (1, 7)  # "bc": everything between, inside
    assert view.span(2, 3) == (6, 7)  # "c": the marks before it are b's
    assert view.span(4, 5) == (8, 10)  # "d": its mark at the very end
    assert view.span(0, 5) == (0, 10)


def test_a_precomposed_letter_and_its_decomposed_form_have_one_view() -> None:
    assert normalise("\u00e9t\u00e9").text == normalise("e\u0301te\u0301").text == "ete"
    assert normalise("\u1e9b\u0323").text == "s"  # long s with dot above, then dot below


# --- right-to-left overrides --------------------------------------------------------------------


def test_reversed_runs_follow_the_bidi_control_stack() -> None:
    text = "a\u202ebc\u202ade\u202cfg\u202c hi \u202ejk\nlm \u2067\u202eno\u2069pq"
    assert [text[s:e] for s, e in reversed_runs(text)] == ["bc", "fg", "jk", "no"]
    assert reversed_runs("plain") == [] and display_order("plain") is None


def test_display_order_reverses_an_override_in_place_marks_with_their_letter() -> None:
    text = "x\u202em\u0301oc\u202c y"
    shown, order = display_order(text)  # type: ignore[misc]
    assert shown == "x\u202ecom\u0301\u202c y"
    assert order == [0, 1, 5, 4, 2, 3, 6, 7, 8]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("\u202emoc.elpmaxe@oj", [(1, 15, "email")]),  # shows jo@example.com
        ("mail \u202emoc.elpmaxe@oj\u202c now", [(6, 20, "email")]),
        ("\u202e1234-567-555 llac", [(1, 13, "phone")]),  # shows "call 555-765-4321"
        # shows "call 555-123-4567": straddles the override; "555-7654-321" is no number
        ("call 555-\u202e7654-321\u202c.", [(5, 18, "phone")]),
        ("\u202ejo@example.com", [(1, 15, "email")]),  # the logical order leaks it too
    ],
)
def test_text_under_a_right_to_left_override_is_judged_as_shown(
    text: str, want: list[tuple[int, int, str]]
) -> None:
    assert pii(text) == [(s, e, kind, text[s:e]) for s, e, kind in want]


# --- classifiers judge the view -------------------------------------------------------------


async def test_profanity_scores_marked_letters_like_plain_ones() -> None:
    det = detectors.build("profanity", {"min_score": 0.0})
    plain, marked, underlined = await det.detect(
        ["shit", "s\u0301h\u0301i\u0301t\u0301", "".join(c + "\u0332" for c in "shit")]
    )
    assert plain[0].score > 0.5
    assert marked[0].score == pytest.approx(plain[0].score)
    assert underlined[0].score == pytest.approx(plain[0].score)
    assert (marked[0].start, marked[0].end) == (0, 8)  # the whole original content


async def test_classifiers_judge_overridden_text_as_shown_too() -> None:
    """`\u202etihs` shows "shit": the classifiers' text holds the view in both orders."""
    assert view_text("\u202etihs\u202c!") == "tihs!\nshit!"
    assert view_text("caf\u00e9") == "cafe"
    # and the order shown alone, which no reversed line beside it dilutes
    assert judged_texts("\u202etihs\u202c!") == ["tihs!\nshit!", "shit!"]
    assert judged_texts("caf\u00e9") == ["cafe"]
    det = detectors.build("profanity", {"min_score": 0.0})
    plain, shown = await det.detect(["shit!", "\u202etihs\u202c!"])
    assert plain[0].score > 0.5
    assert shown[0].score == pytest.approx(plain[0].score)  # was 0.04: "tihs!" alone


# --- the property -------------------------------------------------------------------------------

ENTITIES = [
    ("jo@example.com", "email"),
    ("a.b+tag@mail.example.co.uk", "email"),
    ("x_9@b.io", "email"),
    ("555-123-4567", "phone"),
    ("(555) 123-4567", "phone"),
    ("+1 415 555 2671", "phone"),
    ("+44 20 7946 0958", "phone"),
    ("123-45-6789", "ssn"),
    ("078 05 1120", "ssn"),
    ("4111 1111 1111 1111", "credit_card"),
    ("5500-0000-0000-0004", "credit_card"),
    ("378282246310005", "credit_card"),
    ("4111.1111.1111.1111", "credit_card"),
]
# Punctuation and symbols of several scripts; `+` only after a value (before a phone number it
# makes an international one, which is a longer value)
PUNCTUATION = [
    *"-_.,;:!?'\"()[]{}<>/\\|*&^%$#~`=@",
    *("\u2013", "\u2014", "\u00bf", "\u3001", "\u3002", "\u300c", "\u2026"),
]
MARKS = ["\u0301", "\u0332", "\u0320", "\u0308", "\u20dd", "\u0489"]
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\u00ad", "\ufeff"]


@st.composite
def decorated(draw: Any) -> tuple[str, str, str, str]:
    """(left neighbours, decorated value, right neighbours, kind): each character of the value
    maybe written full-width (digits), maybe followed by combining marks, with zero-width
    characters maybe between characters; one or two punctuation characters on either side,
    themselves maybe marked."""
    value, kind = draw(st.sampled_from(ENTITIES))
    units = []
    for ch in value:
        if ch.isdigit() and draw(st.booleans()):
            ch = chr(ord(ch) + 0xFEE0)
        units.append(ch + "".join(draw(st.lists(st.sampled_from(MARKS), max_size=2))))
    gaps = draw(st.sets(st.integers(1, len(units) - 1), max_size=4))
    for gap in sorted(gaps, reverse=True):
        units.insert(gap, "".join(draw(st.lists(st.sampled_from(INVISIBLE), min_size=1))))

    def side(extra: list[str]) -> str:
        chars = draw(st.lists(st.sampled_from(PUNCTUATION + extra), max_size=2))
        return "".join(c + draw(st.sampled_from(["", "\u0301"])) for c in chars)

    return side([]), "".join(units), side(["+"]), kind


@settings(max_examples=200, deadline=None)
@given(decorated(), st.sampled_from(["", "see ", "\u00e9t\u00e9 "]), st.sampled_from(["", " ok"]))
def test_no_decoration_hides_pii_and_the_span_is_exactly_the_value(
    case: tuple[str, str, str, str], prefix: str, suffix: str
) -> None:
    left, value, right, kind = case
    text = f"{prefix}{left}{value}{right}{suffix}"
    start = len(prefix) + len(left)
    found = pii(text)
    # a backslash before the value's first punctuation is a Markdown escape of it (`\(555) ...`
    # shows `(555) ...`): the span covers the escape whole, as every escape's (DESIGN 4.6b)
    trailing = len(left) - len(left.rstrip("\\"))  # an even run escapes itself
    escaped = trailing % 2 == 1 and not value[0].isalnum()
    first = start - 1 if escaped else start
    assert (first, start + len(value), kind, text[first : start + len(value)]) in found, (
        left,
        value,
        right,
        found,
    )


# --- end to end ---------------------------------------------------------------------------------


async def test_the_content_endpoint_redacts_decorated_values() -> None:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    dets = {"pii": {"builtin": "regex", "chunker_id": "sentence"}}
    values = [
        "jo@example.com",
        "4111\u0301 1111 1111 1111",
        "5\u03325\u03325-123-4567",
        "\u202emoc.elpmaxe@oj",
        "123-45-6789",
    ]
    content = "Mail -{}--he, card _{}_, call {}_ or {}\u202c; SSN {}-.".format(*values)
    try:
        async with Orchestrator(native_config(engine.url, detectors=dets)) as orch:
            status, body = await orch.post(
                CONTENT, {"content": content, "detectors": {"pii": {}}, "redact": True}
            )
    finally:
        await engine.close()
    assert status == 200, body
    redacted = body["redacted_content"]
    assert redacted == (
        "Mail -[email]--he, card _[credit_card]_, call [phone]_ or \u202e[email]\u202c; SSN [ssn]-."
    )  # the override stays: the value is what it reversed, not the control
    assert [(d["detection"], redacted[d["start"] : d["end"]]) for d in body["detections"]] == [
        ("email", "[email]"),
        ("credit_card", "[credit_card]"),
        ("phone", "[phone]"),
        ("email", "[email]"),
        ("ssn", "[ssn]"),
    ]


SPANS = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(SPANS, SPANS)
def test_the_unmarked_views_values_are_kept_unless_inside_a_decoded_ones(
    decoded: list[tuple[int, int]], unmarked: list[tuple[int, int]]
) -> None:
    """regex_pii._with_unmarked (one sweep, linear after sorting) keeps exactly what the plain
    rule says: every decoded-view value, and each unmarked-view value inside none of them."""
    from detectors.regex_pii import _with_unmarked

    found = [(s, s + n, "email") for s, n in decoded]
    more = [(s, s + n, "phone") for s, n in unmarked]
    inside = {m for m in more if any(s <= m[0] and m[1] <= e for s, e, _ in found)}
    assert _with_unmarked(found, more) == sorted(set(found) | (set(more) - inside))


def test_a_run_of_removed_characters_is_mapped_in_one_step(monkeypatch) -> None:
    """Repro: each removed character (a zero-width space, a soft hyphen) was one turn of the
    view's Python loop, so a text of them cost 12x what folding ordinary text does (0.35 s per
    MiB; a judged input reads each character in many seam windows). A run of them is now one
    step: counted here as the loop's `len` calls, which were one per character."""
    from detectors import normalise as normalise_module

    calls = 0

    def counting_len(obj: Any) -> int:
        nonlocal calls
        calls += 1
        return len(obj)

    monkeypatch.setattr(normalise_module, "len", counting_len, raising=False)
    text = "jo" + "\u200b" * 50_000 + "@example.com " + "\u00ad\u200d" * 25_000 + "x"
    view = normalise(text)
    assert view.text == "jo@example.com x"
    assert view.span(0, 14) == (0, 50_014)  # the e-mail, the run inside it included
    assert view.span(15, 16) == (len(text) - 1, len(text))
    assert calls < 100
