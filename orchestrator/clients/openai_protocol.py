"""The OpenAI protocol as guardstream speaks it to a server (clients/openai.py): the request
bodies of both modes (`completions_body`, `chat_body`), the finish-reason vocabulary, and what a
server was found to take (`ServerTraits`: learnt from its refusals, never assumed).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..control_text import defang, defang_strings
from .backend import (
    ChatMessage,
    Continuation,
    GenerationError,
    GenerationRequest,
    unavailable,
)

log = logging.getLogger("guardstream.openai")

# fields of a chat request that only guardstream sets: `extra` never overrides them
_OWN_FIELDS = ("model", "messages", "stream")
# protocol fields only some servers take: left out (and the dispatch retried) once a server
# refuses them by name. The chat resume fields are not among them: without them a server would
# start a fresh answer, so refusing them makes the resume itself fail (`CannotContinue`: the
# answer is then replayed where it can be, clients/replay.py).
OPTIONAL_FIELDS = frozenset({"return_token_ids", "stream_options", "generation_config"})
# transformers serve samples only when the model's generation_config.json says `do_sample: true`
# (it sets do_sample only to false, for temperature 0): without this, `temperature` > 0 would be
# silently greedy there. vLLM ignores the field; a server that refuses it by name gets it no more.
SAMPLE = '{"do_sample": true}'
RESUME_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})
# sampling fields beyond OpenAI's, sent only when the client set them: a server that refuses one
# cannot honour the request, which is then the client's 422 (the name is the client's)
EXTENSION_FIELDS = {
    "min_tokens": "min_new_tokens",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
}


@dataclass
class ServerTraits:
    """What one replica's server was found to take, learnt from its answers (never assumed
    from its name): vLLM and SGLang keep every default; transformers serve ends with
    `token_ids`, `token_prompt` and `tokenize` false and the optional fields refused."""

    refused: set[str] = field(default_factory=set)  # fields the server named in a 400/422
    token_ids: bool = True  # completions events carry token ids
    token_prompt: bool = True  # `prompt` may be a list of token ids
    tokenize: bool = True  # `POST /tokenize` exists


def named_fields(message: str, fields: Any) -> set[str]:
    """The fields a server's error message names, as whole words (quoted or not)."""
    return {
        f for f in fields if re.search(rf"(?<![A-Za-z0-9_]){re.escape(f)}(?![A-Za-z0-9_])", message)
    }


def loads(payload: bytes) -> Any:
    """orjson (several times faster than json: this runs once per streamed token), else json for
    what orjson refuses and json accepts (NaN, lone surrogates; undecodable bytes replaced, as a
    text decode would)."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(payload.decode("utf-8", "replace"))
    except RecursionError:  # nested past the interpreter's limit: undecodable, not a crash
        raise ValueError("nested too deeply") from None


def map_finish(name: str, finish: str, stop_reason: Any) -> str:
    """OpenAI finish reasons in the native vocabulary. A stop string matched when the server
    names it (vLLM's `stop_reason`, SGLang's `matched_stop` is a string). A failed request is
    migratable; an upstream content filter is not (see ChatStream)."""
    if finish == "stop":
        return "STOP_SEQUENCE" if isinstance(stop_reason, str) else "EOS_TOKEN"
    if finish == "length":
        return "MAX_TOKENS"
    if finish in ("abort", "error"):
        raise unavailable(f"replica {name}: the server ended the request ({finish})")
    if finish == "content_filter":
        raise GenerationError(
            f"replica {name}: the upstream's content filter stopped the generation",
            error_type="generation_error",
            code=502,
        )
    if finish in ("tool_calls", "function_call"):
        return "EOS_TOKEN"  # the model ended its turn with calls (the writers say `tool_calls`)
    log.warning("replica %s: unknown finish_reason %r, treated as EOS_TOKEN", name, finish)
    return "EOS_TOKEN"


def completions_body(
    model: str,
    request: GenerationRequest,
    prompt: str | list[int],
    delivered: int,
    refused: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The request; optional sampling knobs are sent only when set, for servers other than vLLM,
    and `return_token_ids` only to a server that did not refuse it."""
    p = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "return_token_ids": True,
        "max_tokens": max(1, p.max_new_tokens - delivered),
        "temperature": p.temperature if p.decoding_method == "SAMPLING" else 0.0,
    }
    sampling_fields(body, request, delivered)
    for name in refused & (OPTIONAL_FIELDS | p.defaulted):
        body.pop(name, None)
    return body


def sampling_fields(body: dict[str, Any], request: GenerationRequest, delivered: int) -> None:
    """The knobs beyond the OpenAI basics, sent only when set (vLLM and SGLang take them)."""
    p = request.params
    if p.decoding_method == "SAMPLING":
        body["generation_config"] = SAMPLE
        if p.top_p != 1.0:
            body["top_p"] = p.top_p
        if p.top_k > 0:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
    if p.repetition_penalty != 1.0:
        body["repetition_penalty"] = p.repetition_penalty
    if p.stop_sequences:
        body["stop"] = list(p.stop_sequences)
    if p.min_new_tokens > delivered:
        body["min_tokens"] = p.min_new_tokens - delivered


def wire_messages(messages: tuple[ChatMessage, ...] | None, prompt: str) -> list[dict[str, Any]]:
    """A conversation as an OpenAI-compatible server receives it: `messages`, or `prompt` as
    one user message, with the client's control-token look-alikes written apart (control_text:
    the server renders and tokenizes them with special tokens parsed, so a message could
    otherwise forge a turn that the input guardrails judged as plain text)."""
    if messages is not None:
        return [defang_strings(m.wire()) for m in messages]
    return [{"role": "user", "content": defang(prompt)}]


def chat_messages(request: GenerationRequest) -> list[dict[str, Any]]:
    """The conversation: the request's messages, or its prompt as one user message. An FMS prompt
    goes as a user message even when `chat` is false: a chat endpoint has no raw-prompt mode."""
    return wire_messages(request.messages, request.prompt)


def chat_body(
    model: str,
    request: GenerationRequest,
    continuation: Continuation | None,
    refused: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The chat request. `request.extra` goes first, untouched, so that everything guardstream
    sets wins (and `model`, `messages`, `stream` are always its own); `stream_options` is merged
    so that usage is always asked for. A resume appends the delivered text as the final assistant
    message (or extends the client's own prefill) and asks the server to continue it."""
    p = request.params
    body: dict[str, Any] = {k: v for k, v in request.extra.items() if k not in _OWN_FIELDS}
    messages = chat_messages(request)
    delivered = 0
    if continuation is not None:
        delivered = continuation.generated_token_count or len(continuation.token_ids)
        prefill = request.extra.get("continue_final_message") is True
        if prefill and messages and messages[-1]["role"] == "assistant":
            last = messages[-1]
            messages[-1] = {**last, "content": last["content"] + continuation.text}
        else:
            messages.append({"role": "assistant", "content": continuation.text})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if "tools" in body:  # the server renders their descriptions into the prompt
        body["tools"] = defang_strings(body["tools"])
    options = body.get("stream_options")
    body.update(
        model=model,
        messages=messages,
        stream=True,
        stream_options={**(options if isinstance(options, dict) else {}), "include_usage": True},
        max_tokens=max(1, p.max_new_tokens - delivered),
        temperature=p.temperature if p.decoding_method == "SAMPLING" else 0.0,
    )
    sampling_fields(body, request, delivered)
    for name in refused & (OPTIONAL_FIELDS | p.defaulted):
        body.pop(name, None)
    return body


class NoTokenize(GenerationError):
    """The server has no `/tokenize` (HTTP 404)."""
