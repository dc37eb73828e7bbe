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

from .backend import EngineItem, GenerationParams


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

    `take` gets the dispatch's items in order; `tokens` counts the tokens of the swallowed
    items (what the prefix cost the new replica: the stream's count restarts from it)."""

    __slots__ = ("_at", "_ids", "_ids_at", "_text", "done", "tokens")

    def __init__(self, text: str, token_ids: tuple[int, ...]) -> None:
        self._text = text
        self._ids = token_ids
        self._at = 0  # characters of the prefix regenerated so far
        self._ids_at = 0  # token ids of the prefix regenerated so far (items with ids only)
        self.tokens = 0
        self.done = not text and not token_ids

    def take(self, item: EngineItem) -> EngineItem | None:
        """The part of `item` past the delivered prefix; None while it is all within it.
        Raises ReplayMismatch where the regenerated answer differs from the delivered one."""
        if self.done:
            return item
        text, ids = item.text, item.token_ids
        rest_text = self._match_text(text)
        rest_ids = self._match_ids(ids) if ids and self._ids else ids
        text_done = self._at == len(self._text)
        # a replica without token ids cannot show them: the text is all there is to compare
        ids_done = self._ids_at == len(self._ids) or not ids
        if not (text_done and ids_done):
            if item.finish_reason is not None:
                raise ReplayMismatch(
                    f"ended after {self._at} of the {len(self._text)} delivered characters"
                )
            self.tokens += len(ids) if item.token_count is None else item.token_count
            return None
        self.done = True
        if rest_text == text and rest_ids == ids:
            return item  # the prefix ended exactly before this item
        if not rest_text and not rest_ids and item.finish_reason is None:
            # the item ends exactly at the prefix's end: it was delivered before
            self.tokens += len(ids) if item.token_count is None else item.token_count
            return None
        return EngineItem(
            token_ids=rest_ids,
            text=rest_text,
            finish_reason=item.finish_reason,
            prompt_token_ids=item.prompt_token_ids,
            input_token_count=item.input_token_count,
            seed=item.seed,
            # a token that straddles the prefix's end is a new one: it counts here
            token_count=len(rest_ids) if item.token_count is None else item.token_count,
        )

    def _match_text(self, text: str) -> str:
        prefix, at = self._text, self._at
        n = min(len(text), len(prefix) - at)
        if text[:n] != prefix[at : at + n]:
            differs = next(i for i in range(n) if text[i] != prefix[at + i])
            raise ReplayMismatch(
                f"differs from the {len(prefix)} delivered characters at character {at + differs}"
            )
        self._at = at + n
        return text[n:]

    def _match_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        prefix, at = self._ids, self._ids_at
        n = min(len(ids), len(prefix) - at)
        if ids[:n] != prefix[at : at + n]:
            differs = next(i for i in range(n) if ids[i] != prefix[at + i])
            raise ReplayMismatch(
                f"differs from the {len(prefix)} delivered tokens at token {at + differs}"
            )
        self._ids_at = at + n
        return ids[n:]
