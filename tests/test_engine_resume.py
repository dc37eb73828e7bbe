"""Exact continuation (DESIGN section 7): generating N tokens at once equals generating k, then
resuming with `resume = {token_ids: first k, text: what was delivered}`, for EVERY k, in token
ids, concatenated text, finish reason and counts; greedy and seeded sampling; stop sequences that
span the resume point; emoji/CJK in the prompt and in the output. Real tiny-random server."""

from __future__ import annotations

from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine_processes import ThreadedServer
from tests.engine_support import DECODINGS, RESUME_PROMPTS, check_every_split, generate, run

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run: a deterministic suite
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY
@given(prompt=RESUME_PROMPTS, n=st.integers(1, 20), decoding=DECODINGS, chat=st.booleans())
def test_resume_equals_uninterrupted(
    tiny_server: ThreadedServer, prompt: str, n: int, decoding: dict[str, Any], chat: bool
) -> None:
    body = {"prompt": prompt, "chat": chat, "max_new_tokens": n, "decoding": decoding}
    run(check_every_split(tiny_server.url, body))


@PROPERTY
@given(
    prompt=RESUME_PROMPTS,
    decoding=DECODINGS,
    start=st.integers(0, 200),
    length=st.integers(1, 6),
    min_new=st.sampled_from([0, 3]),
)
def test_resume_with_stop_sequence(
    tiny_server: ThreadedServer,
    prompt: str,
    decoding: dict[str, Any],
    start: int,
    length: int,
    min_new: int,
) -> None:
    """The stop sequence is a piece of the free-running output, so it really occurs; across
    every k, some resume points fall inside it (held-back text) and some after it."""

    async def scenario() -> None:
        body = {
            "prompt": prompt,
            "max_new_tokens": 24,
            "min_new_tokens": min_new,
            "decoding": decoding,
        }
        async with aiohttp.ClientSession() as session:
            free = await generate(session, tiny_server.url, body)
        text = free.text
        at = start % max(1, len(text))
        stop = text[at : at + length] or "zz"
        stopped = await check_every_split(
            tiny_server.url, {**body, "stop_sequences": [stop, "\u2603never"]}
        )
        if stop in text:
            assert stopped.finish_reason == "STOP_SEQUENCE"
            assert stop not in stopped.text
            assert stopped.text == text[: text.find(stop)]

    run(scenario())


def test_stop_sequence_spanning_tokens_and_resume_point(tiny_server: ThreadedServer) -> None:
    """A stop sequence made of the end of one token's text and the start of the next one's."""

    async def scenario() -> None:
        body = {"prompt": "Tell me about cats.", "max_new_tokens": 40}
        async with aiohttp.ClientSession() as session:
            free = await generate(session, tiny_server.url, body)
        texts = free.texts
        for i in range(3, len(texts) - 1):
            if len(texts[i]) >= 2 and texts[i + 1] and "\ufffd" not in texts[i] + texts[i + 1]:
                break
        else:
            raise AssertionError(f"no two adjacent multi-character tokens in {texts}")
        stop = texts[i][-2:] + texts[i + 1][:1]
        stopped = await check_every_split(tiny_server.url, {**body, "stop_sequences": [stop]})
        assert stopped.finish_reason == "STOP_SEQUENCE"
        assert stopped.text == free.text[: free.text.find(stop)]
        # the text before the stop sequence was held back while the stop sequence was possible
        assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]

    run(scenario())


@settings(PROPERTY, max_examples=15)
@given(decoding=DECODINGS)
def test_emoji_and_cjk_output_resume_exactly(
    tiny_server: ThreadedServer, decoding: dict[str, Any]
) -> None:
    """Forced output text with multi-byte characters split over byte-level tokens: every resume
    point after it, with any delivered prefix, completes the text without U+FFFD."""
    tokenizer_text = "😀 東京 한국 — naïve 🎉"

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                tiny_server.url + "/v1/tokenize", json={"prompt": tokenizer_text}
            )
            forced = (await resp.json())["token_ids"]
            body = {
                "prompt": "東京 😀 Émilie",
                "max_new_tokens": len(forced) + 12,
                "decoding": decoding,
            }
            full = await check_every_split(tiny_server.url, body, forced=forced)
            assert full.text.startswith(tokenizer_text)
            # the forced text arrives whole, never as replacement characters
            assert "\ufffd" not in full.items[0]["text"][: len(tokenizer_text)]
            for k in range(1, len(forced)):
                partial = await generate(
                    session,
                    tiny_server.url,
                    {
                        "input_ids": full.prompt_token_ids,
                        "resume": {"token_ids": forced[:k], "text": ""},
                        "max_new_tokens": k,
                    },
                )
                # the budget is used up by resumed tokens: the stream flushes their text
                assert partial.token_ids == [] and partial.finish_reason == "MAX_TOKENS"
                assert len(partial.items) == 1

    run(scenario())
