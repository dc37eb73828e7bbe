"""Replay (orchestrator/clients/replay.py): a replica that cannot continue a partial answer
regenerates it, and the delivered prefix is checked and swallowed. Properties over random
splits: what comes out is exactly the answer past what was delivered, every regenerated token is
counted once (swallowed or passed on), and any difference inside the prefix is a mismatch that
lets nothing through. The streams themselves are tested against real sockets in
tests/test_clients_openai_traits.py and tests/test_clients_transformers_serve.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.clients.backend import EngineDelta, GenerationParams
from orchestrator.clients.replay import Replay, ReplayMismatch, replayable

PROPERTY = settings(max_examples=60, deadline=None, database=None)

pieces = st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=12)


def chat_items(parts: list[str]) -> list[EngineDelta]:
    """A chat server's items: text, one token an event, no ids; the last one finishes."""
    return [
        EngineDelta((), p, "EOS_TOKEN" if i == len(parts) - 1 else None, token_count=1)
        for i, p in enumerate(parts)
    ]


def run(replay: Replay, items: list[EngineDelta]) -> list[EngineDelta]:
    out = []
    for item in items:
        rest = replay.take(item)
        if rest is not None:
            out.append(rest)
    return out


@PROPERTY
@given(parts=pieces, data=st.data())
def test_the_regenerated_answer_goes_on_after_the_delivered_text(
    parts: list[str], data: st.DataObject
) -> None:
    """The delivered text is any prefix of the answer (a cut may fall inside an event): the
    items let through carry exactly the rest, the finish reason on the last, and the tokens of
    the regeneration are counted once."""
    answer = "".join(parts)
    cut = data.draw(st.integers(0, len(answer)), label="cut")
    replay = Replay(answer[:cut], ())
    out = run(replay, chat_items(parts))
    assert "".join(i.text for i in out) == answer[cut:]
    assert out and out[-1].finish_reason == "EOS_TOKEN"
    assert [i.finish_reason for i in out[:-1]] == [None] * (len(out) - 1)
    assert replay.done and replay.finished
    assert replay.tokens + sum(i.token_count or 0 for i in out) == len(parts)


@PROPERTY
@given(parts=pieces, data=st.data())
def test_a_difference_inside_the_delivered_text_lets_nothing_through(
    parts: list[str], data: st.DataObject
) -> None:
    answer = "".join(parts)
    cut = data.draw(st.integers(1, len(answer)), label="cut")
    at = data.draw(st.integers(0, cut - 1), label="at")
    delivered = answer[:at] + chr(ord(answer[at]) ^ 1) + answer[at + 1 : cut]
    replay = Replay(delivered, ())
    out: list[EngineDelta] = []
    with pytest.raises(ReplayMismatch) as info:
        out.extend(run(replay, chat_items(parts)))
    assert out == []
    assert info.value.why == (f"differs from the {cut} delivered characters at character {at}")


def test_an_answer_that_ends_inside_the_delivered_text_is_a_mismatch() -> None:
    replay = Replay("Once upon a time", ())
    with pytest.raises(ReplayMismatch) as info:
        run(replay, chat_items(["Once", " upon"]))
    assert info.value.why == "ended after 9 of the 16 delivered characters"


@PROPERTY
@given(
    ids=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    data=st.data(),
)
def test_token_ids_are_checked_and_taken_off_once(ids: list[int], data: st.DataObject) -> None:
    """A replica with token ids (one token an item, its text `t<id>`): the delivered ids may run
    ahead of the delivered text (text held back at the failure); the ids let through are the
    ones after the delivered ids, the text the one after the delivered text, and each token is
    counted once."""
    texts = [f"t{i}" for i in ids]
    items = [
        EngineDelta((i,), t, "EOS_TOKEN" if n == len(ids) - 1 else None)
        for n, (i, t) in enumerate(zip(ids, texts, strict=True))
    ]
    held = data.draw(st.integers(0, len(ids)), label="delivered ids")
    shown = data.draw(st.integers(0, held), label="items whose text was delivered")
    replay = Replay("".join(texts[:shown]), tuple(ids[:held]))
    out = run(replay, items)
    assert "".join(i.text for i in out) == "".join(texts[shown:])
    assert [t for i in out for t in i.token_ids] == ids[held:]
    assert replay.tokens + sum(i.token_count or len(i.token_ids) for i in out) == len(ids)
    assert replay.finished


def test_a_different_token_id_is_a_mismatch() -> None:
    replay = Replay("ab", (1, 2))
    with pytest.raises(ReplayMismatch) as info:
        run(replay, [EngineDelta((1,), "a"), EngineDelta((3,), "b")])
    assert info.value.why == "differs from the 2 delivered tokens at token 1"


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (GenerationParams(), True),
        (GenerationParams(decoding_method="SAMPLING", seed=3), True),
        (GenerationParams(decoding_method="SAMPLING"), False),
    ],
)
def test_only_greedy_or_seeded_decoding_is_replayed(
    params: GenerationParams, expected: bool
) -> None:
    assert replayable(params) is expected
