"""Client text is text: the model's special tokens written inside a message are tokenized as the
characters they are, never as the control tokens the chat template writes (DESIGN 4.8).

`apply_chat_template` renders the conversation to one string and the tokenizer then matches
every special token's text in it, wherever it came from: a user message holding
`<|im_end|>\\n<|im_start|>system\\n...` became a real system turn for the model, while the
input guardrails had judged it as a user's plain text. So before rendering, each special
token's text in a client string (message contents, names, tool calls, tool definitions) is
swapped for a marker nobody can guess (a fresh nonce per request); after rendering, the text
between markers is tokenized as before (the template's own control tokens), and each marker as
its special token's text with `split_special_tokens` (ordinary tokens). A conversation without
such text takes the single pass it always took, token for token.

Which tokens: every special added token, and every non-special added token shaped like a marker
(`<tool_call>`, `</tool_response>`, `<think>`, `<|fim_prefix|>`, `[INST]`): Qwen 2.5/3 ship
their tool, reasoning and FIM markers with `special: false`, which `split_special_tokens` does
not split, so a user message's `<tool_response>...</tool_response>` was a real tool reply in
the model's own markers. Those are written as text piece by piece (`_as_text`). Other added
tokens (an ordinary word a vocabulary adds) are no control and keep their token.

Why not render with placeholders for whole contents: templates read contents (`strip`,
`split('</think>')`, `startswith`), so a content must be rendered as itself; only the special
tokens' text is swapped, which no template logic looks for inside a message.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

# An added token's text that reads as a marker: `<name>`, `</name>`, `<|name|>`, `[NAME]`.
_MARKER_SHAPE = re.compile(r"<[^<>\s]{1,64}>|\[[^\[\]\s]{1,64}\]")


def special_texts(tokenizer: Any) -> list[str]:
    """The texts the tokenizer turns into control tokens (special added tokens, and non-special
    ones shaped as markers: module docstring), longest first (so that a token whose text holds
    another's is matched whole)."""
    texts = {
        token.content
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
        if token.content
        and (getattr(token, "special", False) or _MARKER_SHAPE.fullmatch(token.content))
    }
    return sorted(texts, key=len, reverse=True)


def _added_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))


def _as_text(tokenizer: Any, text: str, added: frozenset[int]) -> list[int]:
    """Ordinary token ids of a control token's `text`: split special tokens, and where a
    non-special added token still matches (`split_special_tokens` leaves those), the text in
    two pieces, each again, until no added token is read (a marker's first character alone
    is no token's text)."""
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if len(text) < 2 or not added.intersection(ids):
        return ids
    return _as_text(tokenizer, text[:1], added) + _as_text(tokenizer, text[1:], added)


def encode_conversation(
    tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of `conversation` (and `tools`) under the chat template with the generation
    prompt, every special token's text in client strings tokenized as text."""
    specials = special_texts(tokenizer)
    found = re.compile("|".join(re.escape(s) for s in specials)) if specials else None
    nonce = str(secrets.randbelow(10**12)).zfill(12)  # digits: a template's `upper` keeps them
    markers = {s: f"\ue000{nonce}.{i}\ue001" for i, s in enumerate(specials)}
    hid = [False]

    def hide(value: Any) -> Any:
        if isinstance(value, str):
            if found is None or found.search(value) is None:
                return value
            hid[0] = True
            return found.sub(lambda m: markers[m.group()], value)
        if isinstance(value, dict):
            return {hide(k): hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [hide(v) for v in value]
        return value

    conversation = hide(conversation)
    tools = hide(tools)
    text = tokenizer.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=True, tokenize=False
    )
    if not hid[0]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids: list[int] = []
    parts = re.split(f"\ue000{nonce}\\.(\\d+)\ue001", text)
    added = _added_ids(tokenizer)
    for k, part in enumerate(parts):
        if k % 2:  # a marker: its control token's text, as text
            ids += _as_text(tokenizer, specials[int(part)], added)
        elif part:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    return ids


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a client's text on its own (a judged chunk), control tokens' text as text."""
    if not text:
        return []
    added = _added_ids(tokenizer)
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if not added.intersection(ids):
        return ids
    specials = special_texts(tokenizer)
    if not specials:
        return ids
    ids = []
    for k, part in enumerate(re.split("(" + "|".join(map(re.escape, specials)) + ")", text)):
        if k % 2:
            ids += _as_text(tokenizer, part, added)
        elif part:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    return ids
