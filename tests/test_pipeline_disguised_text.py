"""Enforced guardrails see through text disguised by its characters (DESIGN 4.6b), in both
directions, end to end: the real orchestrator on 127.0.0.1, a fake native engine that records
the prompts it receives and answers each prompt with its own script, and the shipped built-ins
in-process as the enforced guardrails (`pii`: regex, redact; `hap`: profanity, block).

Each disguise is checked against its plain twin first (the same text without the trick is
flagged by the same detector), so a failure is a bypass, not a detector's plain miss. Every
string of every event the client gets is checked: no digit group of the phone number, no
letter run of the word, in any field.

On 321ae20 each of these got through: ASCII control characters and private-use characters
inside a value (`5\\x0755-123-4567` released `5\\x07` beside the mask, `f\\x00uck` passed
`hap`), em dashes and horizontal bars as a phone number's separators, Braille blanks between
its groups, dingbat circled digits, regional-indicator and small-capital letters; and markup a
chat interface renders or a program decodes: HTML tags and comments inside a value, character
references (`&#64;`, `&commat;`), `\\u0040` and `%40` escapes, Markdown escapes, emphasis and
links inside a value. Once markup was decoded (2bf42a8), an e-mail of escapes longer than a
seam window's run, and a stream cut inside one of its escapes, still got through."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchestrator.app import STREAMING_PATH
from orchestrator.streaming.detector_queue import seam_bounds
from tests.fakes.engine import FakeEngine, prompt_text
from tests.orchestrator_support import (
    MODEL,
    Orchestrator,
    SseEvent,
    frames,
    guarded_config,
    regex_pii,
    sse_events,
    stream_cut_answer,
    terminal,
)
from tests.test_detectors_decode import _tags


def disguised_config(engine_url: str) -> dict[str, Any]:
    """The shipped detectors' built-ins, enforced both ways: `pii` redacts, `hap` blocks."""
    return guarded_config(
        engine_url,
        {
            "pii": regex_pii(
                on_detection="redact",
                redact_with="[{entity}]",
                # an operator's phrases in scripts the view folds (see BLOCKED_PHRASES)
                params={"patterns": {"codeword": "(?i)бомба|café noir|Ωμέγα"}},
            ),
            "hap": {
                "type": "text_contents",
                "builtin": "profanity",
                "chunker_id": "sentence",
                "on_detection": "block",
            },
        },
        ("input", "output"),
    )


# (plain tokens, disguised tokens): the engine's answer to the prompt `name`, streamed token by
# token so that the disguise straddles tokens as a model would write it
PHONES: dict[str, tuple[list[str], list[str]]] = {
    "bell-inside-digits": (
        ["Call", " 555", "-123", "-4567", "."],
        ["Call", " 5\x07", "55-", "123-", "4567", "."],
    ),
    "escape-and-delete": (
        ["Call", " 555", "-123", "-4567", "."],
        ["Call", " 55\x1b5", "-1\x7f23", "-4567", "."],
    ),
    "em-dashes": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 555\u2014", "123\u2014", "4567", "."],
    ),
    "horizontal-bars": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 555\u2015123\u20154567", "."],
    ),
    "dingbat-digits": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " \u278e\u278e\u278e-", "\u278a\u278b\u278c-", "\u278d\u278e\u278f\u2790", "."],
    ),
    "private-use-inside-digits": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 5\ue000", "55-123-4567", "."],
    ),
    "braille-blanks-between-groups": (
        ["Call", " 555", " 123", " 4567", "."],
        ["Call", " 555\u2800", "123\u2800", "4567", "."],
    ),
    "html-tags-inside-digits": (
        ["Call", " 555", "-123", "-4567", "."],
        ["Call", " 5<b>", "</b>55", "-<i>123</i>", "-4567", "."],
    ),
    "character-references": (
        ["Call", " 555", "-123", "-4567", "."],
        ["Call", " &#53;55", "-12&#x33;", "&hyphen;4567", "."],
    ),
    "emphasis-inside-the-number": (
        ["Call", " 555", "-123", "-4567", "."],
        ["Call", " 555-**", "123**", "-4567", "."],
    ),
    # what East Asian keyboards give for a dash between digits (on 7c96083: no phone number)
    "katakana-long-vowel-marks": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 555\u30fc", "123\uff70", "4567", "."],
    ),
    "hangul-eu-as-dashes": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 555\u3161", "123\u3161", "4567", "."],
    ),
    "ideograph-one-as-dashes": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 555\u4e00", "123\u4e00", "4567", "."],
    ),
    "box-drawing-lines-as-dashes": (
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " 555\u2500", "123\u2501", "4567", "."],
    ),
    "parenthesized-digits": (  # NFKD: (5)(5)(5)-(1)(2)(3)-...
        ["Call", " 555", "-123", "-4567", "."],
        ["Call", " \u2478\u2478\u2478", "-\u2474\u2475\u2476", "-\u2477\u2478\u2479\u247a", "."],
    ),
    "digits-with-full-stops": (  # NFKD: 5.5.5.-1.2.3.-...
        ["Call", " 555-", "123-", "4567", "."],
        ["Call", " \u248c\u248c\u248c-", "\u2488\u2489\u248a-", "\u248b\u248c\u248d\u248e", "."],
    ),
}
EMAILS: dict[str, tuple[list[str], list[str]]] = {
    "named-entity": (["Mail", " jo@example.com", "."], ["Mail", " jo&commat;", "example.com", "."]),
    "json-escape": (["Mail", " jo@example.com", "."], ["Mail", " jo\\u0040", "example.com", "."]),
    "percent-escape": (["Mail", " jo@example.com", "."], ["Mail", " jo%40", "example%2Ecom", "."]),
    "markdown-escape": (["Mail", " jo@example.com", "."], ["Mail", " jo\\@", "example.com", "."]),
    "html-comment": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo@exa<!-- -->", "mple.com", "."],
    ),
    "markdown-link": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo@[exa", "mple](https://x.org)", ".com", "."],
    ),
    "parenthesized-letters": (  # NFKD: (j)(o)@(e)(x)...
        ["Mail", " jo@example.com", "."],
        [
            "Mail",
            " \u24a5\u24aa@",
            "\u24a0\u24b3\u249c\u24a8\u24ab\u24a7\u24a0.\u249e\u24aa\u24a8",
            ".",
        ],
    ),
    "cyrillic-letters-drawn-as-small-capitals": (  # Cyrillic em and te, as exaᴍple.coᴍ
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo@exa", "\u043cple.co\u043c", "."],
    ),
    "cyrillic-em-ending-the-domain": (  # the rest Cyrillic look-alikes UTS #39 maps
        ["Mail", " jo@example.com", "."],
        ["Mail", " j\u043e@\u0435\u0445\u0430mple.\u0441\u043e", "\u043c", "."],
    ),
    # an address spelt out for a human reader (a marker in brackets): on 7c96083 none matched
    "bracketed-at-and-dots": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo [at] ", "example [dot", "] com", "."],
    ),
    "parenthesized-at": (["Mail", " jo@example.com", "."], ["Mail", " jo(at)", "example.com", "."]),
    "braced-at-and-a-dot-in-words": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo{AT}example", " dot com", "."],
    ),
    "at-sign-and-bracketed-dot": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo@example", "(dot)", "com", "."],
    ),
    # Greek letters UTS #39 maps to no ASCII letter, which a reader takes for Latin ones in an
    # address (on 7c96083: no e-mail)
    "greek-epsilon-and-chi": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo@\u03b5", "\u03c7ample.com", "."],
    ),
    # an address in tag characters: invisible, but a program or a model reading the answer
    # decodes it (on 7c96083 the view removed them and the address left whole)
    "tag-characters": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " " + _tags("jo@exa"), _tags("mple.com"), "."],
    ),
    "last-character-escaped": (
        ["Mail", " jo@example.com", "."],
        ["Mail", " jo@example.co", "&#109;", "."],
    ),
}
CURSES: dict[str, tuple[list[str], list[str]]] = {
    "nul-inside-word": (
        ["What", " the", " fuck", " is", " this", "."],
        ["What", " the", " f\x00", "uck", " is", " this", "."],
    ),
    "regional-indicators": (
        ["What", " the", " fuck", " is", " this", "."],
        ["What", " the", " \U0001f1eb\U0001f1fa", "\U0001f1e8\U0001f1f0", " is", " this", "."],
    ),
    "small-capitals": (
        ["What", " the", " fuck", " is", " this", "."],
        ["What", " the", " \ua730\u1d1c", "\u1d04\u1d0b", " is", " this", "."],
    ),
    "html-tag-inside-word": (
        ["What", " the", " fuck", " is", " this", "."],
        ["What", " the", " f<b>", "</b>uck", " is", " this", "."],
    ),
    # markup a renderer hides, and the view with it: a client that does not render it (an API
    # client, a log) shows it, and a model reads it (on 7c96083 the view dropped both)
    "curse-in-an-html-comment": (
        ["What", " the", " fuck", " is", " this", "."],
        ["What", " the", " <!-- ", "fuck -->", " is", " this", "."],
    ),
    "curse-in-an-image-alt-text": (
        ["What", " the", " fuck", " is", " this", "."],
        ["What", " the", ' <img alt="what the ', 'fuck">', " is", " this", "."],
    ),
}
# The censored spellings people use to get a swear word past a filter, each streamed so that
# the disguise straddles tokens (a word cut between two chunks of the stream): on 6a2408a
# `profanity` scored every one under 0.5 (its tokenizer drops single letters and cuts at
# symbols: `f**k` was nothing to it, `sh!t` the word `sh`) and the blocking `hap` released it.
# (plain tokens, disguised tokens, the disguised word as a reader sees it)
CENSORED: dict[str, tuple[list[str], list[str], str]] = {
    "starred-vowel": (["What", " the", " fuck", "."], ["What", " the", " f*", "ck", "."], "f*ck"),
    "starred-inside": (["What", " the", " fuck", "."], ["What", " the", " f*", "*k", "."], "f**k"),
    "starred-tail": (["What", " the", " fuck", "."], ["What", " the", " f*", "**", "."], "f***"),
    "symbols": (["This", " is", " shit", "."], ["This", " is", " sh", "!t", "."], "sh!t"),
    "dollars": (["You", " asshole", "."], ["You", " a$", "$hole", "."], "a$$hole"),
    "digit": (["Shut", " up", " bitch", "."], ["Shut", " up", " b1", "tch", "."], "b1tch"),
    "spaced-letters": (["fuck", " off", "."], ["f", " u", " c", " k", " off", "."], "f u c k"),
    "dotted-letters": (["fuck", " off", "."], ["f.", "u.", "c.", "k", " off", "."], "f.u.c.k"),
    "a-letter-per-line": (["fuck", " off", "."], ["f\n", "u\n", "c\n", "k", " off", "."], "f\nu\nc\nk"),
    "stretched": (["What", " the", " fuck", "."], ["What", " the", " fuu", "uuuck", "."], "fuuuuuck"),
    "phonetic": (["fuck", " off", "."], ["ph", "uck", " off", "."], "phuck"),
    "fullwidth": (["fuck", " off", "."], ["\uff46\uff55", "\uff43\uff4b", " off", "."], "\uff46\uff55\uff43\uff4b"),
    "zero-width-joiners": (["fuck", " off", "."], ["f\u200du", "\u200dc\u200dk", " off", "."], "f\u200du\u200dc\u200dk"),
    "combining-marks": (["fuck", " off", "."], ["f\u0336u\u0336", "c\u0336k\u0336", " off", "."], "f\u0336u\u0336c\u0336k\u0336"),
    "cyrillic-es": (["fuck", " off", "."], ["fu", "\u0441k", " off", "."], "fu\u0441k"),
    "base64": (
        ["You", " are", " a", " stupid", " fucking", " idiot", "."],
        ["WW91IGFyZSBh", "IHN0dXBpZCBmdWNr", "aW5nIGlkaW90"],
        "WW91IGFyZSBhIHN0dXBpZCBmdWNraW5nIGlkaW90",
    ),
    "reversed": (
        ["You", " are", " a", " stupid", " fucking", " idiot", "."],
        ["toidi", " gnikcuf", " diputs", " a", " era", " uoY"],
        "toidi gnikcuf diputs a era uoY",
    ),
}  # fmt: skip
# A custom pattern written in the script of the phrase it blocks: on 7c96083 it ran on the
# folded view only, where Cyrillic о and а, Greek Ο and accents are folded to ASCII, so
# `бомба` was `бoмбa` there and matched nothing, not even the plain word.
BLOCKED_PHRASES: dict[str, tuple[list[str], list[str]]] = {
    "cyrillic-phrase": (["Say", " бомба", "."], ["Say", " Б\u200bОМ", "БА", "."]),
    "accented-phrase": (["Say", " café noir", "."], ["Say", " CAFÉ", " NOIR", "."]),
    "greek-phrase": (["Say", " Ωμέγα", "."], ["Say", " ΩΜ", "ΈΓΑ", "."]),
}
SCRIPTS = {
    f"{name} {form}": tokens
    for name, pair in (PHONES | EMAILS | CURSES | BLOCKED_PHRASES).items()
    for form, tokens in zip(("plain", "disguised"), pair, strict=True)
} | {
    f"{name} {form}": tokens
    for name, (plain, disguised, _) in CENSORED.items()
    for form, tokens in (("plain", plain), ("disguised", disguised))
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def stack() -> AsyncIterator[tuple[FakeEngine, Orchestrator]]:
    engine = FakeEngine(script_for=lambda prompt: SCRIPTS.get(prompt, ["Fine", "."]))
    await engine.start()
    try:
        async with Orchestrator(disguised_config(engine.url)) as orch:
            yield engine, orch
    finally:
        await engine.close()


async def raw_stream(orch: Orchestrator, inputs: str) -> tuple[str, list[SseEvent]]:
    """The streaming endpoint's response body as it came off the socket, and its events."""
    assert orch.session is not None
    body = {"model_id": MODEL, "inputs": inputs}
    async with orch.session.post(orch.url + STREAMING_PATH, json=body) as r:
        raw = (await r.read()).decode()
        assert r.status == 200, raw
    return raw, sse_events(raw)


def strings(value: Any) -> list[str]:
    """Every string in a decoded JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def released(events: list[SseEvent]) -> str:
    return "".join(f.get("generated_text") or "" for f in frames(events))


@pytest.mark.parametrize("name", list(PHONES))
async def test_a_disguised_phone_number_in_the_output_is_redacted_whole(
    stack: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    _, orch = stack
    for form in ("plain", "disguised"):
        raw, events = await raw_stream(orch, f"{name} {form}")
        assert terminal(events).name == "completed", (form, raw)
        assert released(events) == "Call [phone].", (form, raw)
        sent = "".join(strings([e.data for e in events]))  # every field of every event
        for digits in ("555", "123", "4567", "\u278e", "\u278a\u278b\u278c"):
            assert digits not in sent, (form, digits, raw)


@pytest.mark.parametrize("name", list(EMAILS))
async def test_an_escaped_email_in_the_output_is_redacted_whole(
    stack: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    _, orch = stack
    for form in ("plain", "disguised"):
        raw, events = await raw_stream(orch, f"{name} {form}")
        assert terminal(events).name == "completed", (form, raw)
        assert released(events) == "Mail [email].", (form, raw)
        sent = "".join(strings([e.data for e in events]))
        for part in ("jo", "example", "com", "mple"):
            assert part not in sent, (form, part, raw)


def assert_filtered(events: list[Any], form: str, raw: str) -> None:
    """A Responses stream the output guardrail ended: incomplete for content_filter, with a
    refusal in place of the withheld text."""
    end = terminal(events)
    assert end.name == "incomplete", (form, raw)
    assert end.data["incomplete_details"] == {"reason": "content_filter"}
    assert [e.name for e in events if e.name.startswith("refusal")] == [
        "refusal.delta",
        "refusal.done",
    ]


@pytest.mark.parametrize("name", list(CURSES))
async def test_a_disguised_curse_in_the_output_is_blocked(
    stack: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    _, orch = stack
    for form, tokens in zip(("plain", "disguised"), CURSES[name], strict=True):
        raw, events = await raw_stream(orch, f"{name} {form}")
        assert_filtered(events, form, raw)
        sent = "".join(strings([e.data for e in events]))
        assert "uck" not in sent and tokens[3] not in sent, (form, raw)  # the word's tail token


@pytest.mark.parametrize("name", list(CENSORED))
async def test_a_censored_swear_word_in_the_output_is_blocked(
    stack: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    """DESIGN 4.6: the frame holding the flagged text is not sent; nothing of the disguised word
    leaves the service, in any field or in the raw bytes (JSON escapes included)."""
    _, orch = stack
    _, disguised, word = CENSORED[name]
    for form in ("plain", "disguised"):
        raw, events = await raw_stream(orch, f"{name} {form}")
        assert_filtered(events, form, raw)
        assert released(events) == "", (form, raw)
    # the disguised word, and each token of it of four characters or more
    sent = "".join(strings([e.data for e in events]))
    pieces = [t.strip() for t in disguised if len(t.strip()) >= 4 and t.strip() in word]
    for piece in ("".join(disguised), word, *pieces):
        assert piece not in sent, (piece, raw)
        assert piece not in raw and json.dumps(piece)[1:-1] not in raw, (piece, raw)


@pytest.mark.parametrize("name", list(BLOCKED_PHRASES))
async def test_a_custom_pattern_in_a_script_the_view_folds_is_found(
    stack: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    engine, orch = stack
    for form, tokens in zip(("plain", "disguised"), BLOCKED_PHRASES[name], strict=True):
        raw, events = await raw_stream(orch, f"{name} {form}")
        assert terminal(events).name == "completed", (form, raw)
        assert released(events) == "Say [codeword].", (form, raw)
        prompt = "Write" + "".join(tokens[1:]) + " please"
        _, events = await raw_stream(orch, prompt)
        assert released(events) == "Fine."
    prompts = [prompt_text(r.body) for r in engine.requests]
    assert prompts[1::2] == ["Write [codeword]. please"] * 2


# (plain prompt, disguised prompt, what the engine must receive for both)
PROMPTS = [
    (
        "Write to jo@example.com please.",
        "Write to jo\x1b@example.com please.",
        "Write to [email] please.",
    ),
    ("Call 555-123-4567 please.", "Call 555\u2014123\u20144567 please.", "Call [phone] please."),
    ("SSN 123-45-6789 please.", "SSN 12\x003-45-6789 please.", "SSN [ssn] please."),
    (
        "Write to jo@example.com please.",
        "Write to jo&#64;example.com please.",
        "Write to [email] please.",
    ),
    ("Call 555-123-4567 please.", "Call 555-<b>123</b>-4567 please.", "Call [phone] please."),
    (
        "Write to jo.smith@example.com please.",
        "Write to jo dot smith [at] example [dot] com please.",
        "Write to [email] please.",
    ),
]


@pytest.mark.parametrize(("plain", "disguised", "want"), PROMPTS)
async def test_a_disguised_value_in_the_prompt_is_redacted_before_the_engine(
    stack: tuple[FakeEngine, Orchestrator], plain: str, disguised: str, want: str
) -> None:
    engine, orch = stack
    for prompt in (plain, disguised):
        _, events = await raw_stream(orch, prompt)
        assert terminal(events).name == "completed"
        assert released(events) == "Fine."
    assert [prompt_text(r.body) for r in engine.requests] == [want, want]


async def test_a_disguised_curse_in_the_prompt_is_refused_before_the_engine(
    stack: tuple[FakeEngine, Orchestrator],
) -> None:
    engine, orch = stack
    for prompt in (
        "What the fuck is this?",
        "What the f\x00uck is this?",
        "What the \ua730\u1d1c\u1d04\u1d0b is this?",
    ):
        _, events = await raw_stream(orch, prompt)
        assert [
            d["detector_id"] for d in frames(events)[0]["token_classification_results"]["input"]
        ] == ["hap"], prompt
        assert terminal(events).data["incomplete_details"] == {"reason": "content_filter"}
    assert engine.requests == []


@pytest.mark.parametrize("name", list(CENSORED))
async def test_a_censored_swear_word_in_the_prompt_is_refused_before_the_engine(
    stack: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    """DESIGN 4.5: the input detection frame names `hap`, the stream ends `content_filter`,
    and the engine is never called."""
    engine, orch = stack
    prompt = "".join(CENSORED[name][1])
    raw, events = await raw_stream(orch, prompt)
    results = frames(events)[0]["token_classification_results"]["input"]
    assert [d["detector_id"] for d in results] == ["hap"], raw
    assert terminal(events).data["incomplete_details"] == {"reason": "content_filter"}
    assert engine.requests == []


# -- seams: an escaped value is as long as it shows ------------------------------------------

LONG_EMAIL = "jo@" + "x1." * 40 + "com"  # 123 characters
ESCAPED_EMAIL = "".join(f"&#x{ord(c):06x};" for c in LONG_EMAIL)  # 1,230, shows as LONG_EMAIL


def test_a_seam_window_counts_an_escape_as_the_one_character_it_shows() -> None:
    """On 2bf42a8 each character of an escape counted, so the 1,230-character run of an
    e-mail of 123 characters written as references was past SEAM_RUN_CHARS (1,024): a window
    around a cut inside it held part of it, and what fell outside was released raw."""
    text = f"Sure. Mail {ESCAPED_EMAIL} now." + " Bye now." * 20
    at = text.index(ESCAPED_EMAIL)
    for boundary in (at + 10, at + len(ESCAPED_EMAIL) // 2, at + len(ESCAPED_EMAIL) - 10):
        start, end, complete = seam_bounds(text, 0, len(text), boundary)
        assert start <= at and end >= at + len(ESCAPED_EMAIL) and complete, boundary


async def stream_answer(answer: str, max_chars: int, max_new_tokens: int) -> list[SseEvent]:
    """`answer` streamed one character per token, cut after `max_new_tokens`, through the
    enforced guardrails with the sentence chunker's `max_chars` set."""
    return await stream_cut_answer(answer, disguised_config, max_chars, max_new_tokens)


@pytest.mark.parametrize("max_chars", [16, 500])
async def test_an_escaped_email_longer_than_the_seam_run_is_redacted(max_chars: int) -> None:
    answer = f"Sure. Mail {ESCAPED_EMAIL} now. Bye."
    events = await stream_answer(answer, max_chars, len(answer))
    assert released(events) == "Sure. Mail [email] now. Bye."
    assert "&#x" not in "".join(strings([e.data for e in events]))


@pytest.mark.parametrize("cut", [len(ESCAPED_EMAIL) // 2 + 3, len(ESCAPED_EMAIL) - 5])
async def test_a_stream_cut_inside_an_escape_of_an_email_withholds_it(cut: int) -> None:
    """DESIGN 4.6a: a tail that could still grow into a match is redacted. On 2bf42a8 a token
    budget that ended inside an escape (`...x1.&#x00`) released the e-mail so far raw: its
    view ended with `&#x00`, which is no part of an e-mail."""
    answer = f"Sure. Mail {ESCAPED_EMAIL} now."
    events = await stream_answer(answer, 500, len("Sure. Mail ") + cut)
    assert cut % 10  # the cut is inside an escape (each is 10 characters)
    assert released(events) == "Sure. Mail [email]"
    assert "&#x" not in "".join(strings([e.data for e in events]))


def test_a_seam_window_steps_over_a_run_of_invisible_characters_at_once(monkeypatch) -> None:
    """Repro: the walk out from a chunk boundary looked at each character of up to
    SEAM_RAW_CHARS each side, so every boundary in a run of zero-width spaces cost 16,000
    Python steps (15x the cost of judging ordinary text; a 1 MiB input took longer than the
    detector timeout). A run of characters that are neither visible nor whitespace is one
    step; counted here as the calls asking whether a character is visible."""
    from orchestrator.streaming import detector_queue

    calls = 0
    visible = detector_queue._visible

    def counting(ch: str) -> bool:
        nonlocal calls
        calls += 1
        return visible(ch)

    monkeypatch.setattr(detector_queue, "_visible", counting)
    text = "jo" + "\u200b" * 20_000 + "@example.com"
    boundary = 10_000
    raw = detector_queue.SEAM_RAW_CHARS
    # the count's walk and the run's walk each stop at the raw bound: a run of hidden ones
    window = (boundary - 2 * raw, boundary + 2 * raw, True)
    assert detector_queue.seam_window(text, 0, len(text), boundary) == window
    assert seam_bounds(text, 0, len(text), boundary) == window
    assert calls < 100


SPELT_EMAIL = "jo.smith [at] mail [dot] example [dot] com"


@pytest.mark.parametrize("cut", [len("jo.smith [at] ma"), len("jo.smith [at] mail [do")])
async def test_a_stream_cut_inside_a_spelt_email_withholds_it(cut: int) -> None:
    """DESIGN 4.6a: a tail that could still grow into a match is redacted, a spelt-out e-mail's
    (its marker in brackets) as an e-mail's."""
    answer = f"Sure. Mail {SPELT_EMAIL} now."
    events = await stream_answer(answer, 500, len("Sure. Mail ") + cut)
    assert released(events) == "Sure. Mail [email]"
    assert "smith" not in "".join(strings([e.data for e in events]))
