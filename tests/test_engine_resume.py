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
from tests.engine_support import Stream, generate, run

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run: a deterministic suite
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

PROMPTS = st.one_of(
    st.sampled_from(
        [
            "Hello",
            "東京は",
            "Emoji: 😀 🎉",
            "Émilie a mangé",
            "Tell me about cats.",
            "x",
            "서울 🐍 €",
        ]
    ),
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
    ),
)
DECODINGS = st.one_of(
    st.just({"method": "greedy"}),
    st.builds(
        lambda seed, temperature, top_k, top_p, penalty: {
            "method": "sampling",
            "seed": seed,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "repetition_penalty": penalty,
        },
        st.integers(0, 2**63 - 1),
        st.sampled_from([0.7, 1.0, 1.8]),
        st.sampled_from([0, 5, 50]),
        st.sampled_from([1.0, 0.9, 0.5]),
        st.sampled_from([1.0, 1.2]),
    ),
)


async def check_every_split(
    url: str, body: dict[str, Any], forced: list[int] | None = None
) -> Stream:
    """Run `body` once, then resume it at every k; every resumed stream must complete it exactly.

    With `forced`, the reference itself starts from resumed tokens the model did not choose
    (to put known emoji/CJK text in the output); splits then start after them."""
    async with aiohttp.ClientSession() as session:
        ref_body = dict(body)
        if forced:
            ref_body["resume"] = {"token_ids": forced, "text": ""}
        full = await generate(session, url, ref_body)
        assert full.completed, full.lines
        forced = forced or []
        ids = forced + full.token_ids
        text = full.text
        prompt_ids = full.prompt_token_ids
        base = {k: v for k, v in body.items() if k not in ("prompt", "chat")}
        ks = list(range(len(forced), len(ids) + 1))

        def delivered(k: int) -> str:
            got = full.delivered_text(k - len(forced))
            return got if k % 2 == 0 else got[: len(got) // 2]  # a client may hold less text

        resumed = await _gather(
            [
                generate(
                    session,
                    url,
                    {
                        **base,
                        "input_ids": prompt_ids,
                        "resume": {"token_ids": ids[:k], "text": delivered(k)},
                    },
                )
                for k in ks
            ]
        )
    for k, stream in zip(ks, resumed, strict=True):
        assert stream.completed, (k, stream.lines)
        assert ids[:k] + stream.token_ids == ids, k
        assert delivered(k) + stream.text == text, k
        assert stream.finish_reason == full.finish_reason, k
        assert stream.items[-1]["generated_token_count"] == len(ids), k
        assert stream.items[0]["input_token_count"] == len(prompt_ids)
        assert stream.prompt_token_ids == prompt_ids
    return full


async def _gather(coros: list[Any]) -> list[Stream]:
    import asyncio

    return list(await asyncio.gather(*coros))


@PROPERTY
@given(prompt=PROMPTS, n=st.integers(1, 20), decoding=DECODINGS, chat=st.booleans())
def test_resume_equals_uninterrupted(
    tiny_server: ThreadedServer, prompt: str, n: int, decoding: dict[str, Any], chat: bool
) -> None:
    body = {"prompt": prompt, "chat": chat, "max_new_tokens": n, "decoding": decoding}
    run(check_every_split(tiny_server.url, body))


@PROPERTY
@given(
    prompt=PROMPTS,
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
