"""Engine building blocks without HTTP: incremental detokenizers (Python and DecodeStream),
stop-sequence gate, the seeded uniform, the tiny-random build, the transformers KV-cache layout the
batcher relies on, and the slot KV cache (sampling itself: test_engine_sampling.py)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache, DynamicLayer

from generation import models
from generation.detokenizer import (
    HOLD_LIMIT,
    REPLACEMENT,
    Detokenizer,
    IncrementalDetokenizer,
    StreamDetokenizer,
    WholeTokenDetokenizer,
    byte_level_decoder,
    make_decoder,
    make_detokenizer,
    skipped_ids,
    whole_tokens,
)
from generation.jobs import EngineDelta, Job, StreamError, WorkerTimes
from generation.kv_cache import SlotCache
from generation.output_processor import _Mailbox
from generation.sampling import SamplingParams, uniform
from generation.scheduler import PREFILL_PADDING, prefill_groups
from servicekit.text_gate import TextGate

TEXTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
DETOKENIZERS = ["python", "stream", "whole"]


def new_detokenizer(
    model: models.LoadedModel, kind: str, decode: Callable[[list[int]], str] | None = None
) -> Detokenizer:
    """A detokenizer of `kind` over `model`'s tokenizer (`decode`: a spy in its place)."""
    skipped = skipped_ids(model.tokenizer)  # what the engine's detokenizers leave out
    backend = model.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    if kind == "whole":
        whole, byte_decode = _whole_tables(model)
        decode = decode or byte_decode  # as the engine makes it: the byte-level decode
        return WholeTokenDetokenizer(whole, lambda: StreamDetokenizer(backend, decode, skipped))
    decode = decode or make_decoder(model.tokenizer)
    if kind == "python":
        return IncrementalDetokenizer(decode, skipped)
    return StreamDetokenizer(backend, decode, skipped)


_WHOLE: dict[str, tuple[dict[int, str], Callable[[list[int]], str]]] = {}


def _whole_tables(model: models.LoadedModel) -> tuple[dict[int, str], Callable[[list[int]], str]]:
    """A model's whole-token table and byte-level decode (once per model: the engine makes them
    once per engine)."""
    if model.name not in _WHOLE:
        backend = model.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
        _WHOLE[model.name] = (
            whole_tokens(backend, skipped_ids(model.tokenizer)),
            byte_level_decoder(backend, make_decoder(model.tokenizer)),
        )
    return _WHOLE[model.name]


def stream_text(
    model: models.LoadedModel, ids: list[int], kind: str = "stream"
) -> tuple[list[str], str]:
    detok = new_detokenizer(model, kind)
    deltas = [detok.push(t) for t in ids]
    return deltas, "".join(deltas) + detok.flush()


def reference(model: models.LoadedModel, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 685), max_size=60), cut=st.integers(0, 60))
def test_detokenizers_match_full_decode_and_each_other_on_any_ids(
    tiny_model: models.LoadedModel, ids: list[int], cut: int
) -> None:
    """Arbitrary id sequences (invalid UTF-8 byte runs, special tokens) included: the
    DecodeStream detokenizer emits exactly the Python one's deltas, flush included, so a stream
    resumed on a replica with the other implementation continues identically."""
    python, stream = stream_text(tiny_model, ids, "python"), stream_text(tiny_model, ids, "stream")
    assert python == stream == stream_text(tiny_model, ids, "whole")
    assert stream[1] == reference(tiny_model, ids)
    # a flush in the middle (a stream that ends there) releases the same text too
    a, b, c = (new_detokenizer(tiny_model, kind) for kind in DETOKENIZERS)
    for token in ids[:cut]:
        assert a.push(token) == b.push(token) == c.push(token)
    assert a.flush() == b.flush() == c.flush()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=TEXTS, kind=st.sampled_from(DETOKENIZERS))
def test_detokenizer_never_splits_characters(
    tiny_model: models.LoadedModel, text: str, kind: str
) -> None:
    """Text that round-trips: no delta ever carries U+FFFD, whatever the byte split of tokens."""
    ids = tiny_model.tokenizer(text)["input_ids"]
    deltas, joined = stream_text(tiny_model, ids, kind)
    assert joined == text == reference(tiny_model, ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=TEXTS)
def test_detokenizer_on_smollm2_tokenizer(smollm2_model: models.LoadedModel, text: str) -> None:
    ids = smollm2_model.tokenizer(text, add_special_tokens=False)["input_ids"] + [2]  # + EOS
    deltas, joined = stream_text(smollm2_model, ids)
    assert (deltas, joined) == stream_text(smollm2_model, ids, "python")
    assert (deltas, joined) == stream_text(smollm2_model, ids, "whole")
    assert joined == reference(smollm2_model, ids)
    if joined == text and "\ufffd" not in text:  # (its GGUF vocabulary lacks a few rare bytes)
        assert all("\ufffd" not in d for d in deltas)


def test_engine_uses_decode_stream_for_fast_tokenizers(tiny_model: models.LoadedModel) -> None:
    """A byte-level tokenizer (tiny-random's, SmolLM2's): whole tokens from a table, the rest
    through DecodeStream; a tokenizer without a Rust backend: Python."""
    detok = make_detokenizer(tiny_model.tokenizer)()
    assert isinstance(detok, WholeTokenDetokenizer)
    assert isinstance(detok._stream(), StreamDetokenizer)

    class Slow:  # a tokenizer without a Rust backend
        def decode(self, ids: list[int], **_: object) -> str:
            return "".join(chr(97 + i) for i in ids)

    detok = make_detokenizer(Slow())()
    assert isinstance(detok, IncrementalDetokenizer)
    assert [detok.push(t) for t in (0, 1, 2)] == ["a", "b", "c"]


def test_decode_stream_error_falls_back_to_python_mid_stream(
    tiny_model: models.LoadedModel,
) -> None:
    """`DecodeStream` raises when a decoder rewrites earlier text; the stream continues in Python
    from the same offsets, with the Python detokenizer's output."""
    ids = tiny_model.tokenizer("The quick brown fox 😀 東京")["input_ids"]
    python = new_detokenizer(tiny_model, "python")
    stream = new_detokenizer(tiny_model, "stream")
    assert isinstance(stream, StreamDetokenizer)
    half = len(ids) // 2
    out = [stream.push(t) for t in ids[:half]]

    class Broken:  # what DecodeStream.step does on DecodeStreamError::InvalidPrefix
        def step(self, tokenizer: object, token: int) -> str:
            raise Exception("Invalid prefix encountered")

    stream._stream = Broken()  # type: ignore[assignment]
    out += [stream.push(t) for t in ids[half:]]
    assert out == [python.push(t) for t in ids]
    assert stream.flush() == python.flush()


def test_emoji_split_over_byte_tokens_is_held_back(tiny_model: models.LoadedModel) -> None:
    ids = tiny_model.tokenizer("😀")["input_ids"]
    assert len(ids) == 3  # the tiny vocabulary has no token for it: three byte tokens
    for kind in DETOKENIZERS:
        deltas, joined = stream_text(tiny_model, ids, kind)
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


_LONE: dict[str, list[int]] = {}


def lone_byte_tokens(model: models.LoadedModel) -> list[int]:
    """Ids whose text alone is U+FFFD: single bytes of multi-byte characters (per model, once:
    SmolLM2 has 49k ids)."""
    if model.name not in _LONE:
        backend = model.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
        texts = backend.decode_batch([[i] for i in range(model.vocab_size)])
        _LONE[model.name] = [i for i, text in enumerate(texts) if text == REPLACEMENT]
    return _LONE[model.name]


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_a_run_of_lone_bytes_is_released_in_bounded_windows(
    tiny_model: models.LoadedModel, kind: str
) -> None:
    """Greedy decoding of a random model can repeat one lone byte token for ever (issue 21's
    random-weight benchmarks). Its text is U+FFFD after U+FFFD; every window ended in U+FFFD,
    so nothing was released and each token re-decoded the whole run (O(n) per token, O(n^2)
    per stream). Now the settled text leaves and the decoded windows stay small."""
    decode = make_decoder(tiny_model.tokenizer)
    sizes: list[int] = []

    def spy(ids: list[int]) -> str:
        sizes.append(len(ids))
        return decode(ids)

    lone = lone_byte_tokens(tiny_model)
    assert len(lone) > 60
    for token in (lone[0], lone[-1]):  # a lead byte and a continuation byte, say
        detok = new_detokenizer(tiny_model, kind, spy)
        sizes.clear()
        deltas = [detok.push(token) for _ in range(400)]
        released = "".join(deltas)
        assert released + detok.flush() == reference(tiny_model, [token] * 400)
        assert len(released) >= 400 - HOLD_LIMIT - 1  # all but the last few tokens' text
        assert sizes and max(sizes) <= 2 * HOLD_LIMIT  # characters re-decoded per token: bounded


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_a_run_of_special_tokens_is_decoded_in_bounded_windows(
    tiny_model: models.LoadedModel, kind: str
) -> None:
    """Greedy decoding of a random model can repeat a special token for ever (issue 35: greedy
    slower than sampling on the GPU). Its text is skipped, so no window ever released anything
    and the settled release cannot apply (a special token carries no bytes): each token
    re-decoded the whole run, O(n) per token. A skipped token now never enters the window."""
    decode = make_decoder(tiny_model.tokenizer)
    sizes: list[int] = []

    def spy(ids: list[int]) -> str:
        sizes.append(len(ids))
        return decode(ids)

    skipped = skipped_ids(tiny_model.tokenizer)
    specials = sorted(skipped)
    assert specials == [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|>
    words = tiny_model.tokenizer(" the 😀")["input_ids"]
    for special in specials:
        ids = words + [special] * 400 + words
        detok = new_detokenizer(tiny_model, kind, spy)
        sizes.clear()
        text = "".join(detok.push(token) for token in ids) + detok.flush()
        assert text == reference(tiny_model, ids) == " the 😀 the 😀"
        assert max(sizes, default=0) <= 2 * HOLD_LIMIT  # tokens decoded at once: bounded


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_settled_releases_match_full_decode_on_byte_runs(
    tiny_model: models.LoadedModel, data: st.DataObject
) -> None:
    """Long runs of lone bytes mixed with characters split over byte tokens, whole words and
    special tokens: both detokenizers (settled releases included) give the same deltas, and
    together with flush the full decode."""
    lone = lone_byte_tokens(tiny_model)
    words = tiny_model.tokenizer(" the 😀 東京 é")["input_ids"]
    special = sorted(tiny_model.eos_token_ids)
    pool = st.one_of(st.sampled_from(lone), st.sampled_from(words), st.sampled_from(special))
    runs = data.draw(
        st.lists(st.tuples(pool, st.integers(1, 20)), max_size=12), label="runs of one token"
    )
    ids = [token for token, count in runs for _ in range(count)]
    python, stream = stream_text(tiny_model, ids, "python"), stream_text(tiny_model, ids, "stream")
    assert python == stream == stream_text(tiny_model, ids, "whole")
    assert stream[1] == reference(tiny_model, ids)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_byte_level_decode_in_python_equals_the_tokenizers(
    tiny_model: models.LoadedModel, smollm2_model: models.LoadedModel, data: st.DataObject
) -> None:
    """The byte-level decode the engine's detokenizers use (bytes put end to end, UTF-8 with
    U+FFFD for what is not) equals the Rust tokenizer's on any ids: lone bytes of multi-byte
    characters, special and added tokens, ids past the vocabulary."""
    for model in (tiny_model, smollm2_model):
        backend = model.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
        size = backend.get_vocab_size(with_added_tokens=True)
        rust = make_decoder(model.tokenizer)
        python = _whole_tables(model)[1]
        byte_tokens = lone_byte_tokens(model)
        pool = st.one_of(
            st.integers(0, size + 2), st.sampled_from(byte_tokens), st.integers(0, 300)
        )
        ids = data.draw(st.lists(pool, max_size=16), label=model.name)
        assert python(ids) == rust(ids)


def test_whole_tokens_are_released_without_decoding(tiny_model: models.LoadedModel) -> None:
    """Greedy decoding of a random model repeats one token (issue 35): a whole token (its bytes
    whole characters) costs a table look-up, no decode, however long the run; a character split
    over byte tokens still goes through a decoder, which is dropped once nothing is pending."""
    calls: list[list[int]] = []
    decode = make_decoder(tiny_model.tokenizer)

    def spy(ids: list[int]) -> str:
        calls.append(list(ids))
        return decode(ids)

    the = tiny_model.tokenizer(" the", add_special_tokens=False)["input_ids"]
    emoji = tiny_model.tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(the) == 1 and len(emoji) == 3
    detok = new_detokenizer(tiny_model, "whole", spy)
    assert isinstance(detok, WholeTokenDetokenizer)
    assert [detok.push(the[0]) for _ in range(500)] == [" the"] * 500
    assert calls == [] and detok._slow is None
    assert [detok.push(t) for t in emoji] == ["", "", "😀"]
    assert not detok._pending  # the next whole token is a look-up again
    assert detok.push(the[0]) == " the" and detok.flush() == ""


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


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    parts=st.lists(st.text(alphabet="abc", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=2),
    delivered=st.integers(0, 10),
)
def test_a_transparent_gate_releases_each_delta_as_pushed(
    parts: list[str], stops: list[str], delivered: int
) -> None:
    """`transparent` (no stop sequences, nothing held or owed): from then on each release is
    exactly the delta pushed, so the engine's decode step may skip the gate (and push into it
    later, at the row's end)."""
    gate = TextGate(stops, already_delivered=delivered)
    transparent_from: int | None = None
    for i, part in enumerate(parts):
        if transparent_from is None and gate.transparent:
            transparent_from = i
        gate.push(part)
        out = gate.release()
        if transparent_from is not None:
            assert out == part and gate.transparent
    if stops:
        assert transparent_from is None and not gate.transparent
    elif delivered == 0:
        assert transparent_from == (0 if parts else None)
    elif sum(map(len, parts)) < delivered:  # the client still has text these parts lack
        assert transparent_from is None


def test_mailbox_hands_a_step_as_it_came_and_groups_steps_a_loop_fell_behind_on() -> None:
    """The worker's delivery to a loop (output_processor._Mailbox): one post (the loop kept up)
    goes out event by event, in order, without grouping; posts that piled up while the loop was
    busy reach each sink in one call (one socket write per stream for all its steps)."""
    calls: list[tuple[str, list[str]]] = []

    class Sink:
        def __init__(self, name: str) -> None:
            self.name = name

        def put_many(self, events: list[EngineDelta | StreamError]) -> None:
            calls.append((self.name, [e.text for e in events if isinstance(e, EngineDelta)]))

    loop = asyncio.new_event_loop()
    try:
        a, b = (Job([1], 4, SamplingParams(greedy=True), loop, Sink(name)) for name in ("a", "b"))
        times = WorkerTimes()
        box = _Mailbox(times)

        def delta(text: str) -> EngineDelta:
            return EngineDelta([5], text, 1)

        assert box.post([(a, delta("a1")), (b, delta("b1")), (a, delta("a2"))]) is False
        box.deliver()
        assert calls == [("a", ["a1"]), ("b", ["b1"]), ("a", ["a2"])]
        calls.clear()
        assert box.post([(a, delta("a1")), (b, delta("b1"))]) is False
        assert box.post([(b, delta("b2")), (a, delta("a2"))]) is True  # a wake-up is pending
        box.deliver()
        assert calls == [("a", ["a1", "a2"]), ("b", ["b1", "b2"])]
        # two deliveries, the second carrying two posts (the loop was behind), and their time
        assert (times.deliveries, times.delivered_posts) == (2, 3) and times.delivery_ns > 0
    finally:
        loop.close()


def test_uniform_is_a_pure_function_of_seed_and_position() -> None:
    assert uniform(42, 7) == uniform(42, 7)
    draws = [uniform(42, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert len({uniform(s, 0) for s in range(1000)}) == 1000


def test_tiny_random_build_is_deterministic(
    tmp_path: pytest.TempPathFactory, tiny_model: models.LoadedModel
) -> None:
    from generation.tiny import build_tiny_random

    build_tiny_random(tmp_path / "again")  # type: ignore[operator]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_model.path / name).read_bytes()  # type: ignore[operator]


@pytest.mark.parametrize("which", ["tiny_model", "smollm2_model"])
def test_slot_cache_rows_join_and_leave_and_decode_like_alone(
    which: str, request: pytest.FixtureRequest
) -> None:
    """Pins what the batcher relies on: a prefill's DynamicCache of DynamicLayers with
    [batch, heads, seq, dim] `.keys/.values`; rows copied into a SlotCache at different times,
    right-padded and masked, decode like each row alone; a leave moves only the last row into
    the freed slot (the order the scheduler follows), and decode steps never reallocate."""
    model: models.LoadedModel = request.getfixturevalue(which)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 600) for _ in range(n)] for n in (5, 9, 3)]
    steps = 6
    tolerance = 1e-9 if model.dtype == torch.float64 else 1e-3
    device = model.device  # the test device (tests/engine_support.py)
    with torch.inference_mode():
        alone: list[list[torch.Tensor]] = []
        for prompt in prompts:
            out = model.model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
            logits, cache, length = [out.logits[0, -1]], out.past_key_values, len(prompt)
            for _ in range(steps):
                token = int(logits[-1].argmax())
                out = model.model(
                    input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[length]], device=device),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits.append(out.logits[0, -1])
                length += 1
            alone.append(logits)

        kv = SlotCache(model.model.config.num_hidden_layers, 8, model.max_context)
        rows: list[list[int]] = []  # [prompt index, tokens generated]

        def join(i: int) -> None:
            out = model.model(input_ids=torch.tensor([prompts[i]], device=device), use_cache=True)
            cache = out.past_key_values
            assert isinstance(cache, DynamicCache)
            assert all(type(layer) is DynamicLayer for layer in cache.layers)
            assert cache.layers[0].keys.shape[0] == 1 and cache.layers[0].keys.shape[2] == len(
                prompts[i]
            )
            before = kv.copied_bytes
            kv.add_rows(cache, [0], [len(prompts[i])])
            joined_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
            assert kv.copied_bytes - before == joined_bytes  # the joiner's tokens only
            rows.append([i, 0])

        join(0)
        join(1)
        moved_nothing = False
        for step in range(steps + 2):
            if step == 2:
                join(2)
            if step == 3:  # row 0 leaves: row 2 (the last) moves into slot 0
                before = kv.copied_bytes
                assert kv.keep([1, 2]) == [2, 1]
                rows = [rows[2], rows[1]]
                assert kv.copied_bytes - before == kv._row_bytes(kv.lengths[0])
            if not rows:
                break
            pointer = kv.layers[0].keys.data_ptr()
            positions = kv.begin_step()
            inputs = [[int(alone[i][n].argmax())] for i, n in rows]
            out = model.model(
                input_ids=torch.tensor(inputs, device=device),
                attention_mask=kv.attention_mask(),
                position_ids=positions[:, None],
                past_key_values=kv,
                use_cache=True,
            )
            kv.end_step()
            assert kv.layers[0].keys.data_ptr() == pointer  # written in place
            for j, row in enumerate(rows):
                i, n = row
                expected = alone[i][n + 1]
                assert torch.allclose(out.logits[j, -1], expected, atol=tolerance, rtol=0)
                assert int(out.logits[j, -1].argmax()) == int(expected.argmax())
                row[1] += 1
            done = [j for j, (_, n) in enumerate(rows) if n >= steps]
            if done:
                before = kv.copied_bytes
                keep = [j for j in range(len(rows)) if j not in done]
                order = kv.keep(keep)
                rows = [rows[j] for j in order]
                if keep == list(range(len(keep))):  # the last rows left: nothing moves
                    assert kv.copied_bytes == before
                    moved_nothing = True
        assert moved_nothing
        assert not rows and kv.rows == 0 and kv.nbytes == 0


@given(st.lists(st.integers(min_value=1, max_value=4096), max_size=64))
def test_prefill_groups_partition_and_bound_the_padding(lengths: list[int]) -> None:
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        tokens = sum(lengths[i] for i in group)
        rectangle = len(group) * max(lengths[i] for i in group)
        assert rectangle <= (1 + PREFILL_PADDING) * tokens
    # greedy by ascending length: groups cover consecutive ranges of the sorted lengths
    spans = [(min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_prefill_groups_join_similar_lengths() -> None:
    assert prefill_groups([40, 34, 49, 36, 38]) == [[1, 3, 4, 0, 2]]
    assert prefill_groups([10, 100, 11]) == [[0, 2], [1]]
    assert prefill_groups([]) == []
