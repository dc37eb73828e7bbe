"""Incremental detokenization (stop sequences are `servicekit.text_gate`'s, shared with the
orchestrator).

`IncrementalDetokenizer` is the prefix-offset / read-offset technique of vLLM and TGI: each new
token is decoded together with the few tokens before it (so tokenizers that strip a leading space
or merge bytes see their context), and the difference to the previous window's text is the delta.
A delta whose text ends in U+FFFD is held back: the last token ended inside a multi-byte character
that a later token completes. Work per token is bounded by the window, not by the stream length.

A window that keeps ending in U+FFFD (a run of bytes that never forms a character: a random
model repeating a lone byte token, greedy) would grow without bound, each token re-decoding the
whole run: O(n) per token, O(n^2) per stream. So once more than `HOLD_LIMIT` tokens are pending,
the text before the last `SETTLE_TOKENS` tokens is released when it is settled: each of those
tokens carries at least one byte, so the bytes before them are followed by 4 or more bytes, and
no UTF-8 character spans more than 4, so later tokens cannot change that text. It is released
only if the window's own decode agrees with it (it starts with that text, and decoding from the
new context gives the same remainder), else the window stays held as before.

`StreamDetokenizer` runs the same algorithm inside `tokenizers` (`DecodeStream`, Rust) for fast
tokenizers: the same deltas (tested), about 2.5x cheaper per token, because the window slicing and
the two decodes per released token stay in Rust. `make_detokenizer` picks it when it can.

`WholeTokenDetokenizer` skips even that for most tokens of a byte-level BPE tokenizer (GPT-2's
decoder: SmolLM2, Llama 3, Qwen), whose decode is the UTF-8 decoding (lossy) of the tokens' bytes
put end to end. After a release that left nothing pending, the window's bytes end with a whole
character, so what comes next decodes on its own: a token whose bytes are whole characters by
themselves releases exactly its own text (a table, built once), and the window restarts after it.
Other tokens (a byte of a character, a skipped special token) go through a `StreamDetokenizer`
started at that point, until it has nothing pending again. Same deltas (tested); at 256 rows the
per-token `DecodeStream.step` was the largest share of the worker's per-row work (issue 35).

Invariant (tested): the concatenated deltas plus `flush()` equal
`tokenizer.decode(all ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`.
Special tokens (EOS, chat markers) are skipped: a generated EOS is reported in `token_ids` but
never appears in `text`. Clean-up of tokenization spaces is off because it rewrites text across
token boundaries (" ." → "."), which no incremental scheme can reproduce exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
HOLD_LIMIT = 8  # pending tokens (decoded, no text released) before settled text is released
SETTLE_TOKENS = 4  # tokens kept pending after a settled release (>= 4 bytes: a UTF-8 character)


class Detokenizer(Protocol):
    """Token ids in, text deltas out; `flush` at the end of the stream."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def make_detokenizer(tokenizer: object) -> Callable[[], Detokenizer]:
    """A factory of per-stream detokenizers: whole tokens from a table for a byte-level BPE
    tokenizer, `DecodeStream` for the rest of a fast tokenizer's, else Python."""
    decode = make_decoder(tokenizer)
    skipped = skipped_ids(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _has_decode_stream():

        def stream() -> Detokenizer:
            return StreamDetokenizer(backend, decode, skipped)

        if not byte_level(backend):
            return stream
        whole = whole_tokens(backend, skipped)
        decode = byte_level_decoder(backend, decode)

        def whole_first() -> Detokenizer:
            return WholeTokenDetokenizer(whole, stream)

        return whole_first

    def python() -> Detokenizer:
        return IncrementalDetokenizer(decode, skipped)

    return python


def skipped_ids(tokenizer: object) -> frozenset[int]:
    """The ids `make_decoder`'s decode drops: the Rust backend's special added tokens (its
    `skip_special_tokens`). A skipped id adds no text and changes no other token's text, so the
    detokenizers leave it out of their windows: a model repeating one (greedy decoding of random
    weights) would otherwise hold a window that grows with every token. Empty for a tokenizer
    without a Rust backend (nothing is left out there)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    added = getattr(backend, "get_added_tokens_decoder", None)
    if backend is None or not hasattr(backend, "decode") or added is None:
        return frozenset()
    return frozenset(int(i) for i, token in added().items() if getattr(token, "special", False))


def byte_level(backend: object) -> bool:
    """Whether the Rust tokenizer decodes with GPT-2's byte-level decoder alone: the UTF-8
    decoding of its tokens' bytes put end to end (`WholeTokenDetokenizer` relies on it)."""
    from tokenizers.decoders import ByteLevel

    return isinstance(getattr(backend, "decoder", None), ByteLevel)


def whole_tokens(backend: object, skipped: Collection[int]) -> dict[int, str]:
    """Each token whose bytes are whole characters (its text alone has no U+FFFD), with that
    text; skipped ids map to "" (they add no text wherever they stand)."""
    size = backend.get_vocab_size(with_added_tokens=True)  # type: ignore[attr-defined]
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)  # type: ignore[attr-defined]
    whole = {i: text for i, text in enumerate(texts) if text and REPLACEMENT not in text}
    whole.update(dict.fromkeys(skipped, ""))
    return whole


def byte_level_decoder(
    backend: object, fallback: Callable[[Sequence[int]], str]
) -> Callable[[Sequence[int]], str]:
    """`make_decoder`'s decode for a byte-level tokenizer (`byte_level`), in Python: the tokens'
    bytes (GPT-2's byte alphabet; a token outside it, its own UTF-8) put end to end, decoded as
    UTF-8 with U+FFFD for each maximal invalid part, as the Rust decoder's `from_utf8_lossy`
    does (tested equal). Why by hand: a detokenizer window is a few tokens, and a call into the
    Rust tokenizer costs 1-6 us for it (a random model repeating a byte token decodes 2-3
    windows per token), this ~0.3 us. Ids it does not know go to `fallback`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    size = backend.get_vocab_size(with_added_tokens=True)  # type: ignore[attr-defined]
    special = {
        i
        for i, token in backend.get_added_tokens_decoder().items()  # type: ignore[attr-defined]
        if token.special
    }
    table: list[bytes] = []
    for i in range(size):
        token = backend.id_to_token(i)  # type: ignore[attr-defined]
        if token is None or i in special:  # unknown, or skipped as decode skips it
            table.append(b"")
            continue
        try:
            table.append(bytes(alphabet[char] for char in token))
        except KeyError:
            table.append(token.encode())

    def decode(ids: Sequence[int]) -> str:
        try:
            return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        except IndexError:
            return fallback(ids)

    return decode


def _has_decode_stream() -> bool:
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:  # tokenizers < 0.21
        return False
    return True


def make_decoder(tokenizer: object) -> Callable[[Sequence[int]], str]:
    """The exact decode function streams must agree with; the Rust backend when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):

        def decode_fast(ids: Sequence[int]) -> str:
            return backend.decode(list(ids), skip_special_tokens=True)

        return decode_fast

    def decode_slow(ids: Sequence[int]) -> str:
        return tokenizer.decode(  # type: ignore[attr-defined]
            list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    return decode_slow


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character."""

    __slots__ = ("_decode", "_prefix_offset", "_prefix_text", "_read_offset", "_skipped", "ids")

    def __init__(
        self, decode: Callable[[Sequence[int]], str], skipped: Collection[int] = frozenset()
    ) -> None:
        self._decode = decode
        self._skipped = skipped  # ids `decode` drops (skipped special tokens): never in `ids`
        self.ids: list[int] = []  # the stream's ids less the skipped ones: what is decoded
        self._prefix_offset = 0  # window start: context for the next decode
        self._read_offset = 0  # ids before this have had their text emitted
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), cached

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if token_id in self._skipped:  # no text, and decode drops it wherever it stands
            return ""
        self.ids.append(token_id)
        return self._advance()

    def _advance(self) -> str:
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT):
            # Incomplete character (or a skipped special token): wait for more tokens.
            if len(self.ids) - self._read_offset > HOLD_LIMIT:
                return self._release_settled(new_text)
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        return delta

    def _release_settled(self, new_text: str) -> str:
        """A long-held window: release its text before the last SETTLE_TOKENS tokens when that
        text is settled (module docstring), so the window stops growing."""
        ids, cut = self.ids, len(self.ids) - SETTLE_TOKENS
        if any(not self._decode(ids[i : i + 1]) for i in range(cut, len(ids))):
            return ""  # a token without bytes (a skipped special token) settles nothing
        head = self._decode(ids[self._prefix_offset : cut])
        if len(head) <= len(self._prefix_text) or not new_text.startswith(head):
            return ""
        context = self._decode(ids[self._read_offset : cut])
        if self._decode(ids[self._read_offset :]) != context + new_text[len(head) :]:
            return ""  # a decoder that reads context differently: keep holding
        delta = head[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset, self._prefix_text = self._read_offset, cut, context
        return delta

    @property
    def pending(self) -> bool:
        """Whether tokens are held back (their text not released yet)."""
        return self._read_offset < len(self.ids)

    def flush(self) -> str:
        """End of stream: release held-back text, replacement characters included."""
        new_text = self._decode(self.ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.ids)
        self._prefix_text = ""
        return delta


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s algorithm run by `tokenizers.decoders.DecodeStream`.

    `DecodeStream` keeps its window in Rust; this class mirrors only the two offsets (integers)
    so that `flush` (which `DecodeStream` lacks) can release the held-back tail, and so that a
    decoder that rewrites earlier text (where `DecodeStream` raises instead of emitting) falls back
    to the Python detokenizer from the same state, mid-stream.
    """

    __slots__ = (
        "_backend",
        "_decode",
        "_fallback",
        "_prefix_offset",
        "_read_offset",
        "_skipped",
        "_stream",
        "ids",
    )

    def __init__(
        self,
        backend: object,
        decode: Callable[[Sequence[int]], str],
        skipped: Collection[int] = frozenset(),
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._decode = decode
        self._skipped = skipped  # as in IncrementalDetokenizer: never stepped, never in `ids`
        self._stream = DecodeStream(skip_special_tokens=True)
        self._fallback: IncrementalDetokenizer | None = None
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if self._fallback is not None:
            return self._fallback.push(token_id)
        if token_id in self._skipped:
            return ""
        self.ids.append(token_id)
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception:  # DecodeStreamError::InvalidPrefix: continue in Python, same state
            self._fallback = self._python_state()
            return self._fallback._advance()
        if chunk is None:
            if len(self.ids) - self._read_offset > HOLD_LIMIT:
                # DecodeStream's window would grow for ever: continue in Python, which
                # releases settled text (IncrementalDetokenizer._release_settled)
                self._fallback = self._python_state()
                return self._fallback._advance()
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return chunk

    @property
    def pending(self) -> bool:
        """Whether tokens are held back (their text not released yet)."""
        if self._fallback is not None:
            return self._fallback.pending
        return self._read_offset < len(self.ids)

    def flush(self) -> str:
        """End of stream: release held-back text, replacement characters included."""
        if self._fallback is None:
            self._fallback = self._python_state()
        return self._fallback.flush()

    def _python_state(self) -> IncrementalDetokenizer:
        python = IncrementalDetokenizer(self._decode, self._skipped)
        python.ids = self.ids  # shared: `ids` stays this stream's id list
        python._prefix_offset = self._prefix_offset
        python._read_offset = self._read_offset
        python._prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        return python


class WholeTokenDetokenizer:
    """For a byte-level decoder (`byte_level`): a token whose text is whole (`whole_tokens`),
    pushed while nothing is pending, releases that text at once; any other token goes through
    the row's `StreamDetokenizer` (made at its first such token), until that has nothing pending
    again (module docstring: why the deltas are those of one detokenizer over the whole stream,
    and why the tokens it skipped in between do not matter to it)."""

    __slots__ = ("_pending", "_slow", "_stream", "_whole")

    def __init__(self, whole: dict[int, str], stream: Callable[[], StreamDetokenizer]) -> None:
        self._whole = whole
        self._stream = stream
        self._slow: StreamDetokenizer | None = None  # made at the first token not in `whole`
        self._pending = False  # `_slow` holds tokens back

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if not self._pending:
            text = self._whole.get(token_id)
            if text is not None:
                return text
        slow = self._slow
        if slow is None:  # once per stream at most: making one costs ~4 us
            slow = self._slow = self._stream()
        text = slow.push(token_id)
        self._pending = slow.pending
        return text

    def flush(self) -> str:
        """End of stream: release held-back text, replacement characters included."""
        if not self._pending or self._slow is None:
            return ""
        self._pending = False
        return self._slow.flush()
