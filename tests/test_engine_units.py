"""Engine building blocks without HTTP: incremental detokenizer, stop-sequence gate, seeded
sampling, the tiny-random build, and the transformers KV-cache layout the batcher relies on."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache, DynamicLayer

from generation import models
from generation.detokenizer import IncrementalDetokenizer, TextGate, make_decoder
from generation.sampling import SamplingParams, sample, uniform

TEXTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


def stream_text(model: models.LoadedModel, ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(make_decoder(model.tokenizer))
    deltas = [detok.push(t) for t in ids]
    return deltas, "".join(deltas) + detok.flush()


def reference(model: models.LoadedModel, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 685), max_size=60))
def test_detokenizer_matches_full_decode_on_any_ids(
    tiny_model: models.LoadedModel, ids: list[int]
) -> None:
    """Arbitrary id sequences (invalid UTF-8 byte runs, special tokens) included."""
    _, text = stream_text(tiny_model, ids)
    assert text == reference(tiny_model, ids)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=TEXTS)
def test_detokenizer_never_splits_characters(tiny_model: models.LoadedModel, text: str) -> None:
    """Text that round-trips: no delta ever carries U+FFFD, whatever the byte split of tokens."""
    ids = tiny_model.tokenizer(text)["input_ids"]
    deltas, joined = stream_text(tiny_model, ids)
    assert joined == text == reference(tiny_model, ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=TEXTS)
def test_detokenizer_on_smollm2_tokenizer(smollm2_model: models.LoadedModel, text: str) -> None:
    ids = smollm2_model.tokenizer(text, add_special_tokens=False)["input_ids"] + [2]  # + EOS
    deltas, joined = stream_text(smollm2_model, ids)
    assert joined == reference(smollm2_model, ids)
    if joined == text and "\ufffd" not in text:  # (its GGUF vocabulary lacks a few rare bytes)
        assert all("\ufffd" not in d for d in deltas)


def test_emoji_split_over_byte_tokens_is_held_back(tiny_model: models.LoadedModel) -> None:
    ids = tiny_model.tokenizer("😀")["input_ids"]
    assert len(ids) == 3  # the tiny vocabulary has no token for it: three byte tokens
    deltas, joined = stream_text(tiny_model, ids)
    assert deltas == ["", "", "😀"] and joined == "😀"


def test_detokenizer_window_stays_small(tiny_model: models.LoadedModel) -> None:
    """Work per token is bounded: the decoded window never grows with the stream."""
    decode = make_decoder(tiny_model.tokenizer)
    sizes: list[int] = []

    def spy(ids: list[int]) -> str:
        sizes.append(len(ids))
        return decode(ids)

    detok = IncrementalDetokenizer(spy)
    ids = tiny_model.tokenizer("The quick brown fox 😀 東京 " * 40)["input_ids"]
    for token in ids:
        detok.push(token)
    assert len(ids) > 300 and max(sizes) <= 8


def _gate(text_parts: list[str], stops: list[str], delivered: int = 0) -> tuple[str, TextGate]:
    gate = TextGate(stops, already_delivered=delivered)
    out = []
    for part in text_parts:
        gate.push(part)
        out.append(gate.release())
    gate.finish()
    out.append(gate.release())
    return "".join(out), gate


@settings(max_examples=500, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_gate_releases_exactly_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parts = [text[a:b] for a, b in itertools.pairwise(points)]
    released, gate = _gate(parts, stops)
    if gate.stop_at is None:
        assert released == text and not any(s in text for s in stops)
    else:
        assert released == text[: gate.stop_at]
        assert any(text.startswith(s, gate.stop_at) for s in stops)
        # no stop sequence was complete in any earlier pushed prefix
        end = 0
        for part in parts:
            if any(s in text[:end] for s in stops):
                pytest.fail("a stop sequence was complete before the gate stopped")
            end += len(part)
            if gate.stop_at < end:
                break
    if len(parts) <= 1:  # one delta: the leftmost occurrence of any stop sequence wins
        found = [text.find(s) for s in stops if s in text]
        assert gate.stop_at == (min(found) if found else None)


def test_gate_holds_a_possible_stop_prefix() -> None:
    gate = TextGate(["STOP"])
    gate.push("hello ST")
    assert gate.release() == "hello "
    gate.push("O")
    assert gate.release() == ""
    gate.push("RM")
    assert gate.release() == "STORM"
    gate.push(" and STOP here")
    assert gate.release() == " and "
    assert gate.stop_at == len("hello STORM and ")


def test_gate_with_already_delivered_text() -> None:
    released, _ = _gate(["abc", "def"], [], delivered=4)
    assert released == "ef"


def test_uniform_is_a_pure_function_of_seed_and_position() -> None:
    assert uniform(42, 7) == uniform(42, 7)
    draws = [uniform(42, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert len({uniform(s, 0) for s in range(1000)}) == 1000


def test_sample_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    params = SamplingParams(greedy=False, seed=9)
    counts = [0, 0, 0]
    for position in range(6000):
        counts[sample(logits, params, position)] += 1
    assert [round(c / 6000, 1) for c in counts] == [0.5, 0.3, 0.2]
    top1 = SamplingParams(greedy=False, seed=9, top_k=1)
    assert {sample(logits, top1, p) for p in range(50)} == {0}
    nucleus = SamplingParams(greedy=False, seed=9, top_p=0.6)
    assert {sample(logits, nucleus, p) for p in range(200)} == {0, 1}


def test_tiny_random_build_is_deterministic(
    tmp_path: pytest.TempPathFactory, tiny_model: models.LoadedModel
) -> None:
    from generation.tiny import build_tiny_random

    build_tiny_random(tmp_path / "again")  # type: ignore[operator]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_model.path / name).read_bytes()  # type: ignore[operator]


@pytest.mark.parametrize("which", ["tiny_model", "smollm2_model"])
def test_kv_cache_layout_and_padded_merge(which: str, request: pytest.FixtureRequest) -> None:
    """Pins what the batcher relies on in transformers' cache API: DynamicCache of DynamicLayers
    with [batch, heads, seq, dim] `.keys/.values`, and a zero-left-padded, masked row decoding
    like the same row unpadded."""
    model: models.LoadedModel = request.getfixturevalue(which)
    rng = random.Random(0)
    short = [rng.randrange(3, 600) for _ in range(5)]
    long = [rng.randrange(3, 600) for _ in range(9)]
    with torch.inference_mode():
        a = model.model(input_ids=torch.tensor([short]), use_cache=True)
        b = model.model(input_ids=torch.tensor([long]), use_cache=True)
        cache = a.past_key_values
        assert isinstance(cache, DynamicCache)
        assert all(type(layer) is DynamicLayer for layer in cache.layers)
        assert cache.layers[0].keys.shape[:3] == (1, cache.layers[0].keys.shape[1], 5)
        next_a, next_b = int(a.logits[0, -1].argmax()), int(b.logits[0, -1].argmax())
        solo = model.model(
            input_ids=torch.tensor([[next_a]]),
            position_ids=torch.tensor([[5]]),
            past_key_values=cache,
            use_cache=True,
        ).logits[0, -1]
        # rebuild the batch: row 0 = short prompt padded to 9 columns, row 1 = long prompt
        a2 = model.model(input_ids=torch.tensor([short]), use_cache=True).past_key_values
        for la, lb in zip(a2.layers, b.past_key_values.layers, strict=True):
            la.keys = torch.cat([torch.nn.functional.pad(la.keys, (0, 0, 4, 0)), lb.keys])
            la.values = torch.cat([torch.nn.functional.pad(la.values, (0, 0, 4, 0)), lb.values])
        mask = torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
        batched = model.model(
            input_ids=torch.tensor([[next_a], [next_b]]),
            attention_mask=mask,
            position_ids=torch.tensor([[5], [9]]),
            past_key_values=a2,
            use_cache=True,
        ).logits[:, -1]
    tolerance = 1e-9 if model.dtype == torch.float64 else 1e-3
    assert torch.allclose(batched[0], solo, atol=tolerance, rtol=0)
    assert int(batched[0].argmax()) == int(solo.argmax())
