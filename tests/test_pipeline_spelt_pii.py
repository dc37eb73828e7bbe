"""PII a model writes in a disguised form when asked to (digits as words, one digit per space or
line, look-alike letters among digits, a number over table cells, an e-mail spaced out, in
words or backwards), end to end through enforced guardrails: the real orchestrator on
127.0.0.1, a fake native engine answering each prompt with its script token by token, and the
shipped `regex` built-in redacting (`pii`) or blocking (`pii_block`) in-process.

Every string of every event the client gets is checked: no word or digit of the number, no part
of the address, in any field. On 82d0c00 every one of these reached the client raw (find_pii
found none of them), and a prompt with a spelt SSN reached the engine as it was."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import pytest

from tests.fakes.engine import FakeEngine, prompt_text
from tests.orchestrator_support import (
    Orchestrator,
    guarded_config,
    regex_pii,
    stream_cut_answer,
    terminal,
)
from tests.test_pipeline_disguised_text import raw_stream, released, strings

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
GERMAN_WORDS = (
    "null",
    "eins",
    "zwei",
    "drei",
    "vier",
    "f\u00fcnf",
    "sechs",
    "sieben",
    "acht",
    "neun",
)
FRENCH_WORDS = ("z\u00e9ro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf")

# name -> (answer tokens, what the client reads, pieces that must not reach it)
ANSWERS: dict[str, tuple[list[str], str, tuple[str, ...]]] = {
    "phone-in-words": (
        [
            "Call",
            " five",
            " five",
            " five,",
            " one",
            " two",
            " three,",
            " four",
            " five",
            " six",
            " seven",
            ".",
        ],
        "Call [phone].",
        NUMBER_WORDS,
    ),
    "phone-in-words-with-double-and-oh": (
        [
            "Call",
            " nine",
            " one",
            " seven,",
            " double",
            " five",
            " five,",
            " oh",
            " one",
            " double",
            " oh",
            ".",
        ],
        "Call [phone].",
        (*NUMBER_WORDS, "oh", "double"),
    ),
    "ssn-in-words": (
        [
            "SSN",
            " five",
            " three",
            " two,",
            " one",
            " nine,",
            " eight",
            " seven",
            " six",
            " five",
            ".",
        ],
        "SSN [ssn].",
        NUMBER_WORDS,
    ),
    # a model asked for the number "in German" or "in French" (bench/disguised_pii.py: none of
    # 3,000 such spellings in five languages was found before the words were known)
    "phone-in-german-words": (
        [
            "Ruf",
            " f\u00fcnf",
            " f\u00fcnf",
            " f\u00fcnf,",
            " eins",
            " zwei",
            " drei,",
            " vier",
            " f\u00fcnf",
            " sechs",
            " sieben",
            ".",
        ],
        "Ruf [phone].",
        GERMAN_WORDS,
    ),
    "phone-in-german-words-a-word-per-line": (
        ["Ruf:\n", *[f"{GERMAN_WORDS[int(d)]}\n" for d in "5552184697"], "Danke."],
        "Ruf:\n[phone]\nDanke.",
        GERMAN_WORDS,
    ),
    "ssn-in-french-words": (
        [
            "NSS",
            " cinq",
            " trois",
            " deux,",
            " un",
            " neuf,",
            " huit",
            " sept",
            " six",
            " cinq",
            ".",
        ],
        "NSS [ssn].",
        FRENCH_WORDS,
    ),
    # Chinese numerals, a digit each (Unicode gives them no digit value: the view kept them)
    "phone-in-chinese-numerals": (
        [
            "\u7535\u8bdd",
            "\u4e94\u4e94\u4e94-",
            "\u4e00\u4e8c\u4e09-",
            "\u56db\u4e94",
            "\u516d\u4e03",
            "\u3002",
        ],
        "\u7535\u8bdd[phone]\u3002",
        ("\u4e94\u4e94\u4e94", "\u4e00\u4e8c\u4e09", "\u56db\u4e94", "\u516d\u4e03"),
    ),
    # digits written onto the words around them, as Chinese, Japanese and Thai are written (no
    # spaces between words) and Korean particles are: a letter beside a value glued it to a
    # longer token, so none of these was found
    "phone-glued-to-chinese": (
        ["\u8bf7\u62e8\u6253", "555-", "123-", "4567", "\u3002"],
        "\u8bf7\u62e8\u6253[phone]\u3002",
        ("555", "123", "4567"),
    ),
    "phone-glued-to-japanese": (
        ["\u96fb\u8a71\u306f", "555-", "123-", "4567", "\u3067\u3059\u3002"],
        "\u96fb\u8a71\u306f[phone]\u3067\u3059\u3002",
        ("555", "123", "4567"),
    ),
    "phone-glued-to-a-korean-particle": (
        ["\uc804\ud654 ", "010-", "1234-", "5678", "\ub85c", " \uc5f0\ub77d\uc8fc\uc138\uc694."],
        "\uc804\ud654 [phone]\ub85c \uc5f0\ub77d\uc8fc\uc138\uc694.",
        ("010", "1234", "5678"),
    ),
    "card-glued-to-thai": (
        ["\u0e1a\u0e31\u0e15\u0e23", "4111 ", "1111 ", "1111 ", "1111", "\u0e04\u0e48\u0e30"],
        "\u0e1a\u0e31\u0e15\u0e23[credit_card]\u0e04\u0e48\u0e30",
        ("4111", "1111"),
    ),
    "phone-a-digit-per-space": (
        ["Call", " 5", " 5", " 5", " 2", " 1", " 8", " 4", " 6", " 9", " 7", "."],
        "Call [phone].",
        tuple("0123456789"),
    ),
    "phone-a-digit-per-line": (
        ["Call:\n", "5\n", "5\n", "5\n", "2\n", "1\n", "8\n", "4\n", "6\n", "9\n", "7\n", "Bye."],
        "Call:\n[phone]\nBye.",
        tuple("0123456789"),
    ),
    "card-a-digit-per-space": (
        ["Card", *[f" {d}" for d in "4111111111111111"], "."],
        "Card [credit_card].",
        tuple("0123456789"),
    ),
    "phone-with-look-alike-letters": (
        ["Call", " 555-", "l23-", "4S67", "."],
        "Call [phone].",
        ("555", "l23", "4S67", "23", "67"),
    ),
    "phone-over-table-cells": (
        ["| Name | Phone |\n", "| 555", " | 123", " | 4567", " |\n", "Bye."],
        "| Name | Phone |\n| [phone] |\nBye.",
        ("555", "123", "4567"),
    ),
    # internationalized addresses (RFC 6531): a local part and a domain in another script; the
    # ASCII pattern found none, or only `bah@example.com` of a Cyrillic `\u0438\u0432\u0430\u043d` (its look-alikes)
    "email-in-cyrillic": (
        [
            "\u041f\u0438\u0448\u0438\u0442\u0435",
            " \u0438\u0432\u0430\u043d@",
            "\u043f\u0440\u0438\u043c\u0435\u0440",
            ".\u0440\u0444",
            ".",
        ],
        "\u041f\u0438\u0448\u0438\u0442\u0435 [email].",
        ("\u0438\u0432\u0430\u043d", "\u043f\u0440\u0438\u043c\u0435\u0440"),
    ),
    "email-with-a-cyrillic-local-part": (
        ["Mail", " \u0438\u0432\u0430\u043d", "@example", ".com", " now."],
        "Mail [email] now.",
        ("\u0438\u0432\u0430\u043d", "example"),
    ),
    "email-with-a-greek-local-part": (
        ["Mail", " \u03b4\u03b7\u03bc\u03ae\u03c4\u03c1\u03b7\u03c2", "@example", ".gr", " now."],
        "Mail [email] now.",
        ("\u03b4\u03b7\u03bc\u03ae\u03c4\u03c1\u03b7\u03c2", "example"),
    ),
    "email-in-japanese": (
        ["\u30e1\u30fc\u30eb\uff1a", "\u5c71\u7530@", "\u4f8b\u3048", ".jp", " \u307e\u3067\u3002"],
        "\u30e1\u30fc\u30eb\uff1a[email] \u307e\u3067\u3002",
        ("\u5c71\u7530", "\u4f8b\u3048"),
    ),
    "email-spaced": (
        ["Mail", " john", " .", " smith", " @", " example", " .", " com", " now."],
        "Mail [email] now.",
        ("john", "smith", "example"),
    ),
    "email-in-words": (
        ["Mail", " john", " dot", " smith", " at", " example", " dot", " com", " now."],
        "Mail [email] now.",
        ("john", "smith", "example"),
    ),
    "email-in-base64": (
        ["Mail", " am9obi5zbWl0", "aEBleGFtcGxl", "LmNvbQ==", " now."],
        "Mail [email] now.",
        ("am9obi5zbWl0", "aEBleGFtcGxl", "LmNvbQ"),
    ),
    "email-backwards": (
        ["Mail", " moc.", "elpm", "axe@", "nhoj", " now."],
        "Mail [email] now.",
        ("moc", "elpm", "axe", "nhoj"),
    ),
}


def spelt_config(engine_url: str, on_detection: str) -> dict[str, Any]:
    pii = regex_pii(on_detection=on_detection, redact_with="[{entity}]")
    return guarded_config(engine_url, {"pii": pii}, ("input", "output"))


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def _stack(on_detection: str) -> AsyncIterator[tuple[FakeEngine, Orchestrator]]:
    scripts = {name: tokens for name, (tokens, _, _) in ANSWERS.items()}
    engine = FakeEngine(script_for=lambda prompt: scripts.get(prompt, ["Fine", "."]))
    await engine.start()
    try:
        async with Orchestrator(spelt_config(engine.url, on_detection)) as orch:
            yield engine, orch
    finally:
        await engine.close()


@pytest.fixture
async def redacting() -> AsyncIterator[tuple[FakeEngine, Orchestrator]]:
    async for stack in _stack("redact"):
        yield stack


@pytest.fixture
async def blocking() -> AsyncIterator[tuple[FakeEngine, Orchestrator]]:
    async for stack in _stack("block"):
        yield stack


def _words(sent: str) -> set[str]:
    return {w.strip(".,:|").lower() for w in sent.split()}


def _leaked(sent: str, pieces: tuple[str, ...]) -> list[str]:
    """The pieces found in what was sent: number words and short ones as whole words (`one`
    is in `phone`), longer ones anywhere."""
    words = _words(sent)
    return [p for p in pieces if (p.lower() in words if len(p) <= 6 else p in sent)]


@pytest.mark.parametrize("name", list(ANSWERS))
async def test_a_disguised_value_in_the_output_is_redacted_whole(
    redacting: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    _, orch = redacting
    _, want, pieces = ANSWERS[name]
    raw, events = await raw_stream(orch, name)
    assert terminal(events).name == "completed", raw
    assert released(events) == want, raw
    sent = " ".join(strings([e.data for e in events]))
    assert _leaked(sent, pieces) == [], raw


@pytest.mark.parametrize("name", list(ANSWERS))
async def test_a_disguised_value_in_the_output_is_blocked_before_any_of_it_is_sent(
    blocking: tuple[FakeEngine, Orchestrator], name: str
) -> None:
    _, orch = blocking
    _, _, pieces = ANSWERS[name]
    raw, events = await raw_stream(orch, name)
    end = terminal(events)
    assert end.name == "incomplete", raw
    assert end.data["incomplete_details"] == {"reason": "content_filter"}
    sent = " ".join(strings([e.data for e in events]))
    assert _leaked(sent, pieces) == [], raw


PROMPTS = [
    ("My SSN is five three two, one nine, eight seven six five.", "My SSN is [ssn]."),
    ("Call me on 5 5 5 2 1 8 4 6 9 7 please.", "Call me on [phone] please."),
    ("Write to john dot smith at example dot com please.", "Write to [email] please."),
    ("Call 555-l23-4S67 please.", "Call [phone] please."),
    (
        "Meu cart\u00e3o: quatro um um um, um um um um, um um um um, um um um um.",
        "Meu cart\u00e3o: [credit_card].",
    ),
    (
        "Mi tel\u00e9fono es cinco cinco cinco, uno dos tres, cuatro cinco seis siete.",
        "Mi tel\u00e9fono es [phone].",
    ),
    (
        "\u6211\u7684\u7535\u8bdd\u662f555-123-4567\u3002",
        "\u6211\u7684\u7535\u8bdd\u662f[phone]\u3002",
    ),
    (
        "Write to \u0438\u0432\u0430\u043d@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444 please.",
        "Write to [email] please.",
    ),
]


@pytest.mark.parametrize(("prompt", "want"), PROMPTS)
async def test_a_disguised_value_in_the_prompt_is_redacted_before_the_engine(
    redacting: tuple[FakeEngine, Orchestrator], prompt: str, want: str
) -> None:
    engine, orch = redacting
    _, events = await raw_stream(orch, prompt)
    assert terminal(events).name == "completed"
    assert [prompt_text(r.body) for r in engine.requests] == [want]


# A card spelt out can be longer than a seam window's SEAM_CHARS (64): 16 words of 4-5 letters
LONG_CARD = " ".join(NUMBER_WORDS[int(d)] for d in "4378378737873782")  # 92 characters


async def _stream_answer(answer: str, on_detection: str, max_chars: int, max_new_tokens: int):  # type: ignore[no-untyped-def]
    """`answer` one character per token, cut after `max_new_tokens`, through `pii`."""
    config_for = partial(spelt_config, on_detection=on_detection)
    return await stream_cut_answer(answer, config_for, max_chars, max_new_tokens)


@pytest.mark.parametrize("on_detection", ["redact", "block"])
@pytest.mark.parametrize("max_chars", [16, 500])
async def test_a_spelt_number_longer_than_a_seam_window_is_never_released_in_part(
    on_detection: str, max_chars: int
) -> None:
    answer = f"Sure. Card {LONG_CARD} thanks. Bye."
    events = await _stream_answer(answer, on_detection, max_chars, len(answer))
    sent = " ".join(strings([e.data for e in events]))
    assert _leaked(sent, NUMBER_WORDS) == [], sent
    if on_detection == "redact":
        assert released(events) == "Sure. Card [credit_card] thanks. Bye."


@pytest.mark.parametrize("on_detection", ["redact", "block"])
async def test_a_stream_cut_inside_a_spelt_number_withholds_it(on_detection: str) -> None:
    """DESIGN 4.6a: a tail that could still grow into a match is not released raw. Cut by the
    token budget after `five five five, one two three, four`."""
    answer = "Sure. Call five five five, one two three, four five six seven."
    cut = answer.index(" five six")
    events = await _stream_answer(answer, on_detection, 500, cut)
    sent = " ".join(strings([e.data for e in events]))
    assert _leaked(sent, NUMBER_WORDS) == [], sent
    if on_detection == "redact":
        assert released(events) == "Sure. Call [phone]"


@pytest.mark.parametrize("on_detection", ["redact", "block"])
@pytest.mark.parametrize(
    "number",
    ["555-123-4567", "\u4e94\u4e94\u4e94-\u4e00\u4e8c\u4e09-\u56db\u4e94\u516d\u4e03"],
)
async def test_a_stream_cut_inside_a_number_glued_to_chinese_withholds_it(
    on_detection: str, number: str
) -> None:
    """As above, for a number written onto the Chinese word before it (in either digits), cut
    after its eighth character."""
    answer = f"\u597d\u7684\u3002\u7535\u8bdd{number}\u3002"
    cut = answer.index(number) + 9
    events = await _stream_answer(answer, on_detection, 500, cut)
    sent = " ".join(strings([e.data for e in events]))
    assert number[:3] not in sent and number[4:7] not in sent, sent
    if on_detection == "redact":
        assert released(events) == "\u597d\u7684\u3002\u7535\u8bdd[phone]"


@pytest.mark.parametrize("on_detection", ["redact", "block"])
async def test_a_stream_cut_inside_an_internationalized_address_withholds_it(
    on_detection: str,
) -> None:
    """As above, for `\u0438\u0432\u0430\u043d@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444` cut inside its domain."""
    answer = "\u041f\u0438\u0448\u0438\u0442\u0435: \u0438\u0432\u0430\u043d@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444 \u0441\u0435\u0433\u043e\u0434\u043d\u044f."
    cut = answer.index("\u043c\u0435\u0440")
    events = await _stream_answer(answer, on_detection, 500, cut)
    sent = " ".join(strings([e.data for e in events]))
    assert "\u0438\u0432\u0430\u043d" not in sent and "\u043f\u0440\u0438" not in sent, sent
    if on_detection == "redact":
        assert released(events) == "\u041f\u0438\u0448\u0438\u0442\u0435: [email]"


@pytest.mark.parametrize("on_detection", ["redact", "block"])
async def test_a_stream_cut_inside_a_number_in_chinese_numerals_withholds_it(
    on_detection: str,
) -> None:
    """As above, for `\u4e94\u4e94\u4e94-\u4e00\u4e8c\u4e09-\u56db\u4e94\u516d\u4e03` cut after its `\u56db`."""
    answer = "\u597d\u7684\u3002\u7535\u8bdd\u4e94\u4e94\u4e94-\u4e00\u4e8c\u4e09-\u56db\u4e94\u516d\u4e03\u3002"
    cut = answer.index("\u4e94\u516d")
    events = await _stream_answer(answer, on_detection, 500, cut)
    sent = " ".join(strings([e.data for e in events]))
    assert not any(p in sent for p in ("\u4e94\u4e94", "\u4e00\u4e8c", "\u56db")), sent
    if on_detection == "redact":
        assert released(events) == "\u597d\u7684\u3002\u7535\u8bdd[phone]"


@pytest.mark.parametrize("max_chars", [7, 12, 30, 500])
@pytest.mark.parametrize("on_detection", ["redact", "block"])
def test_a_spelt_card_streamed_a_character_at_a_time_is_never_released_in_part(
    max_chars: int, on_detection: str
) -> None:
    """The smallest windows a stream gets (each character judged as it comes: `paced`): a
    window that ends inside the 92 characters of the spelt card reports at most up to SEAM_CHARS
    before its end, which lies inside the card; what it released of it was its first words."""
    import asyncio

    from tests.test_pipeline_redaction_seams import check, pii, registry, run_stream

    text = f"Sure. Card {LONG_CARD} thanks. Bye now."
    first = text.index(LONG_CARD)

    async def one() -> None:
        blocked: list[Any] = []
        frames = await run_stream(
            list(text),
            [pii(on_detection, "s")],
            registry(max_chars),
            blocked if on_detection == "block" else None,
            paced=True,
        )
        released_text = "".join(f.text for f in frames)
        if on_detection == "block":
            assert blocked and len(released_text) <= first, released_text
        else:
            assert released_text == "Sure. Card [credit_card] thanks. Bye now."
            await check(text, frames)

    asyncio.run(one())


@pytest.mark.parametrize("max_chars", [16, 30])
def test_a_blocking_guardrail_holds_a_chunk_a_spelt_card_goes_on_across(max_chars: int) -> None:
    """Block, five words a token, each judged as it comes: a chunk was posted once SEAM_CHARS of
    text followed its end, and the 92-character card had not ended there, so `Card four three`
    went out before the card was whole (and then it never was, in any window)."""
    import asyncio
    import re

    from tests.test_pipeline_redaction_seams import pii, registry, run_stream

    text = f"Sure. Card {LONG_CARD} thanks. Bye now."
    words = re.findall(r"\S+\s*", text)
    # five words a token: no window sees a prefix of the card that is a phone or an SSN spelt
    # (7, 9 or 10 digits), so only the whole card is found (with other token sizes a prefix
    # read as a phone blocked the stream in time)
    deltas = ["".join(words[:2])] + ["".join(words[i : i + 5]) for i in range(2, len(words), 5)]

    async def one() -> None:
        blocked: list[Any] = []
        frames = await run_stream(
            deltas, [pii("block", "s")], registry(max_chars), blocked, paced=True
        )
        released_text = "".join(f.text for f in frames)
        assert blocked and len(released_text) <= text.index(LONG_CARD), released_text

    asyncio.run(one())
