"""Replay: how a stream moves to a replica that cannot continue a partial answer (DESIGN
section 7; a chat server without `continue_final_message`, such as `transformers serve`).

The pipeline has received the delivered text already (its detectors have seen it, some of it may
have reached the client), so the answer cannot start over. Where the decoding is deterministic
(greedy, or sampling with the request's seed), the new replica regenerates the answer from the
request as it came; `Replay` checks that what it regenerates begins with the delivered text (and
token ids, where both sides have them), swallows that prefix and lets through what follows.
Anything else is a mismatch: the stream cannot go on without contradicting what was delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .backend import EngineDelta, GenerationParams


class ReplayMismatch(Exception):
    """The regenerated answer is not the delivered one; `why` says where it departs."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def replayable(params: GenerationParams) -> bool:
    """Whether a regeneration may give the delivered answer again: greedy decoding, or sampling
    with the request's own seed (which the replay sends again; a seed a native engine drew is
    not the request's, and an OpenAI server reseeds every request)."""
    return params.decoding_method == "GREEDY" or params.seed is not None


class Replay:
    """The delivered prefix one replay dispatch must regenerate before its text is new.

    `take` gets the dispatch's items in order. Until the delivered text is regenerated (`done`)
    items are swallowed and `tokens` counts what they stood for: the stream's count restarts from
    it, so that it ends as the new replica's own count. Token ids are compared where both sides
    have them; delivered ids whose text was still held back (a stop sequence's possible start)
    may come after the text is done: they are checked and taken off the items that carry them,
    which still count in full (their tokens were not in `tokens`)."""

    __slots__ = ("_at", "_ids", "_ids_at", "_no_ids", "_text", "done", "tokens")

    def __init__(self, text: str, token_ids: tuple[int, ...]) -> None:
        self._text = text
        self._ids = token_ids
        self._at = 0  # characters of the prefix regenerated so far
        self._ids_at = 0  # token ids of the prefix regenerated so far (items with ids only)
        self.tokens = 0
        self.done = False
        self._no_ids = False  # the replica sends text without ids: there are none to compare

    @property
    def finished(self) -> bool:
        """Nothing more to check: the text is regenerated and so are the delivered ids (or the
        replica has none)."""
        return self.done and (self._ids_at == len(self._ids) or self._no_ids)

    def take(self, item: EngineDelta) -> EngineDelta | None:
        """The part of `item` past the delivered prefix; None while it is all within it.
        Raises ReplayMismatch where the regenerated answer differs from the delivered one."""
        ids = item.token_ids
        if item.text and not ids:
            self._no_ids = True
        count = len(ids) if item.token_count is None else item.token_count
        rest_ids = self._match_ids(ids) if ids and self._ids_at < len(self._ids) else ids
        if item.finish_reason is not None and self._ids_at < len(self._ids) and not self._no_ids:
            raise ReplayMismatch(
                f"ended after {self._ids_at} of the {len(self._ids)} delivered tokens"
            )
        if self.done:
            if len(rest_ids) == len(ids):
                return item
            return replace(item, token_ids=rest_ids, token_count=count)
        text = item.text
        rest_text = self._match_text(text)
        if self._at < len(self._text):
            if item.finish_reason is not None or item.tool_calls:
                what = "ended" if item.finish_reason is not None else "made a tool call"
                raise ReplayMismatch(
                    f"{what} after {self._at} of the {len(self._text)} delivered characters"
                )
            self.tokens += count
            return None
        self.done = True
        if len(rest_text) == len(text) and len(rest_ids) == len(ids):
            return item  # the prefix ended exactly before this item
        if not rest_text and not rest_ids and item.finish_reason is None and not item.tool_calls:
            self.tokens += count  # the item ends exactly where the prefix does
            return None
        # a token that straddles the prefix's end is a new one: the item counts in full here
        return replace(item, token_ids=rest_ids, text=rest_text, token_count=count)

    def _match_text(self, text: str) -> str:
        n = _within(self._text, self._at, text, "character")
        self._at += n
        return text[n:]

    def _match_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        n = _within(self._ids, self._ids_at, ids, "token")
        self._ids_at += n
        return ids[n:]


def _within(prefix: Sequence[object], at: int, got: Sequence[object], unit: str) -> int:
    """How many of `got` (from position `at` of the answer) fall within the delivered `prefix`;
    ReplayMismatch where they differ from it."""
    n = min(len(got), len(prefix) - at)
    if got[:n] != prefix[at : at + n]:
        differs = next(i for i in range(n) if got[i] != prefix[at + i])
        raise ReplayMismatch(
            f"differs from the {len(prefix)} delivered {unit}s at {unit} {at + differs}"
        )
    return n
