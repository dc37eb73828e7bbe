"""Client of an OpenAI-compatible server (vLLM, SGLang, TGI, Ollama, `transformers serve`, a
Dynamo frontend, LiteLLM, OpenAI itself; DESIGN section 7). Two modes, the backend's `api`:

`completions`: `POST /v1/completions` with `stream: true` and vLLM's `return_token_ids: true`:
every streamed choice carries the delta's `token_ids` and the first one the `prompt_token_ids`,
which is what a token-exact resume needs: `prompt` as token ids (prompt ids + delivered ids) and
the remaining budget. A chat request (`messages`, or an FMS prompt with `chat`) is turned into
token ids by the server's `/tokenize`, which applies the chat template. A server without these
(`transformers serve`: no `return_token_ids`, no token-id prompts, no `/tokenize`) is served by
text: the prompt is text (templated with the backend's `tokenizer` folder), and a resume sends
the prompt text plus the delivered text (see `ServerTraits`).

`chat`: `POST /v1/chat/completions` with `stream: true` and `stream_options.include_usage`. There
are no token ids: a resume sends the conversation plus the delivered text as a final assistant
message with `continue_final_message: true, add_generation_prompt: false` (vLLM and SGLang honour
these). A server that refuses them (transformers serve) cannot continue a partial answer: the
refusal is learnt (`CannotContinue`), and MigratingStream then replays a greedy or seeded answer
there instead (regenerates it from the request as it came, checks the delivered prefix and
skips it; clients/replay.py). See ChatStream for what is counted how.

What a server can do is learnt, not assumed: a 400/422 that names a field guardstream sent
(`{"detail": "Unexpected fields in the request: {'return_token_ids'}"}` from transformers serve,
"Unrecognized request argument supplied: ..." from OpenAI) is remembered per replica; a protocol
field is then left out and the dispatch retried at once, a sampling field the client asked for
(`min_tokens`, `top_k`, `repetition_penalty`) makes the request a 422: never silently ignored.

In both modes an in-band error event (`{"error": ...}` or `{"object": "error", ...}`),
`finish_reason: "abort"`, `[DONE]` without a finish reason, or the end of the body before a
finish reason is a migratable failure; the end of the body right after the finish reason is a
normal end (transformers serve sends no `[DONE]`); events without choices or without a delta, and
SSE comments (keep-alives), are skipped. Neither resets the stall timer: only an event with
text, a tool call, a finish reason or reasoning does (line_transport.HttpLineStream._stall_wait).
Where guardstream reads text without token ids, it also enforces the stop sequences itself
(transformers serve stops after a stop string but sends it; OpenAI's contract is to leave it out).

Resumes on such servers are seamless in text but, unlike the native engine, not guaranteed to be
token-identical to an uninterrupted run: the server reseeds sampling per request and checks stop
strings only in newly generated text (a chat template may also retokenize the partial message);
a resume by text re-tokenizes prompt + delivered text, which equals the generated tokens only
where the tokenizer's canonical split of that text is the one the model produced.
"""

from __future__ import annotations

import json
import logging
import ssl
from typing import Any, Literal

import aiohttp

from .backend import (
    CannotContinue,
    ChatMessage,
    Continuation,
    GenerationError,
    GenerationRequest,
    unavailable,
)
from .chat_template import ChatTemplateError, LocalTokenizer
from .line_transport import HttpReplicaClient, error_message, int_list, parse_reply
from .openai_protocol import (
    EXTENSION_FIELDS,
    OPTIONAL_FIELDS,
    RESUME_FIELDS,
    NoTokenize,
    ServerTraits,
    chat_messages,
    named_fields,
    sampling_fields,
    wire_messages,
)
from .openai_streams import ChatStream, OpenAIStream, SseStream

log = logging.getLogger("guardstream.openai")


def token_list(raw: bytes) -> tuple[int, ...] | None:
    """The token ids of a `/tokenize` reply (`tokens`); None for a malformed one."""
    try:
        return int_list(json.loads(raw)["tokens"])
    except (ValueError, KeyError, TypeError):
        return None


class OpenAIClient(HttpReplicaClient):
    """One OpenAI-compatible server, with what it was found to take (`traits`)."""

    type = "openai"

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        session: aiohttp.ClientSession,
        *,
        api: Literal["completions", "chat"] = "completions",
        api_key: str | None = None,
        ssl_context: ssl.SSLContext | bool | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(name, url, session, ssl_context=ssl_context, api_key=api_key)
        self.model = model
        self.api = api
        self.traits = ServerTraits()
        self.local = LocalTokenizer(tokenizer) if tokenizer else None

    def generate(
        self,
        request: GenerationRequest,
        continuation: Continuation | None,
        *,
        stall_timeout_s: float,
        max_time: float,
    ) -> SseStream:
        cls = ChatStream if self.api == "chat" else OpenAIStream
        return cls(self, request, continuation, stall_timeout_s, max_time)

    def learn(self, body: dict[str, Any], raw: bytes, soft: frozenset[str] = frozenset()) -> bool:
        """A 400/422 answer to `body`: remember what it refused; True when the request can be
        sent again without it. Raises when the refusal makes the request impossible here.
        `soft`: fields the operator's defaults set (dropped, never the client's 422)."""
        message = error_message(raw)
        named = named_fields(message, body.keys())
        traits = self.traits
        dropped = named & soft
        if dropped:
            traits.refused |= dropped
            named -= dropped
            log.warning(
                "replica %s: the server refuses %s (a model default); sending without",
                self.name,
                sorted(dropped),
            )
            if not named:
                return True
        if named & RESUME_FIELDS:
            traits.refused |= named & RESUME_FIELDS
            log.warning("replica %s: the server refuses %s", self.name, sorted(named))
            raise self.cannot_continue()
        extension = named & EXTENSION_FIELDS.keys()
        if extension:
            traits.refused |= extension
            self.check_honoured(body, soft)
        optional = named & OPTIONAL_FIELDS - traits.refused
        if optional:
            traits.refused |= optional
            if "return_token_ids" in optional:
                traits.token_ids = False
            log.warning(
                "replica %s: the server refuses %s; sending without", self.name, sorted(optional)
            )
            return True
        if isinstance(body.get("prompt"), list) and traits.token_prompt and "prompt" in named:
            traits.token_prompt = False  # transformers serve: "prompt must be a string."
            log.warning(
                "replica %s: the server takes no token-id prompts; resumes by text", self.name
            )
            return True
        return False

    def check_honoured(self, body: dict[str, Any], soft: frozenset[str] = frozenset()) -> None:
        """422 for a sampling field this server refused before: it would be ignored or refused."""
        refused = sorted(self.traits.refused & EXTENSION_FIELDS.keys() & body.keys() - soft)
        if refused:
            names = ", ".join(f"`{EXTENSION_FIELDS[f]}`" for f in refused)
            raise GenerationError(
                f"replica {self.name} cannot honour {names} (its server refuses "
                f"{', '.join(f'`{f}`' for f in refused)}); leave it unset for this model",
                error_type="invalid_request",
                code=422,
            )

    def unhonoured(self, request: GenerationRequest) -> list[str]:
        """The request's sampling fields (the client's names) this server was found to refuse:
        the backend's validate makes them a 422 before the response starts."""
        body: dict[str, Any] = {}
        sampling_fields(body, request, 0)
        refused = self.traits.refused & body.keys() - request.params.defaulted
        return [EXTENSION_FIELDS[f] for f in sorted(refused & EXTENSION_FIELDS.keys())]

    def continuation_refused(self) -> str | None:
        """`api: chat` continues a partial assistant message unless the server refused the
        resume fields; `api: completions` always can (by token ids or by text)."""
        if self.api == "chat" and self.traits.refused & RESUME_FIELDS:
            return self.cannot_continue().message
        return None

    def cannot_continue(self) -> CannotContinue:
        """A resume on a chat server that cannot continue a partial assistant message: a fresh
        answer would repeat or contradict what the client has, so this dispatch cannot go on
        from the delivered text (MigratingStream replays a deterministic answer instead)."""
        return CannotContinue(
            f"replica {self.name} cannot continue a partial answer (its server refuses "
            "`continue_final_message`)"
        )

    async def prompt_text(self, request: GenerationRequest) -> str:
        """A chat request's prompt as text, templated with the backend's `tokenizer` folder (a
        server without `/tokenize` cannot do it for us on the completions endpoint)."""
        if self.local is None:
            raise GenerationError(
                f"replica {self.name} cannot apply the chat template (its server has no "
                "/tokenize and the backend names no `tokenizer` folder; set one, or use "
                "`api: chat`)",
                error_type="generation_error",
                code=502,
            )
        try:
            return await self.local.render(chat_messages(request))
        except ChatTemplateError as exc:
            raise GenerationError(
                f"model {self.model}: {exc}", error_type="invalid_request", code=422
            ) from None

    async def tokenize_ids(
        self,
        prompt: str,
        chat: bool,
        messages: tuple[ChatMessage, ...] | None = None,
        *,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """vLLM's (and SGLang's) `/tokenize`: `messages`, or with `chat` the prompt as one user
        message, under the chat template with the generation prompt; else the raw prompt.
        NoTokenize when the server has none (remembered)."""
        if not self.traits.tokenize:
            raise NoTokenize(f"replica {self.name} has no /tokenize")
        body: dict[str, Any] = {"model": self.model}
        if messages is not None or chat:
            body["messages"] = wire_messages(messages or None, prompt)
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = prompt
            if add_special_tokens is not None:
                body["add_special_tokens"] = add_special_tokens
        try:
            raw = await self.post_json("/tokenize", body)
        except GenerationError as exc:
            if "(HTTP 404)" not in exc.message:
                raise
            self.traits.tokenize = False
            raise NoTokenize(f"replica {self.name} has no /tokenize") from None
        tokens = await parse_reply(raw, token_list)
        if tokens is None:
            raise unavailable(f"replica {self.name}: malformed tokenize reply")
        return list(tokens)

    async def tokenize(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int:
        """`api: chat` counts an FMS prompt as the one user message it sends (chat or not). A
        server without `/tokenize` is counted with the backend's `tokenizer` folder."""
        chat = chat or self.api == "chat" or messages is not None
        if self.traits.tokenize:
            try:
                return len(await self.tokenize_ids(prompt, chat, messages))
            except NoTokenize:
                if self.local is None:
                    raise
        if self.local is None:
            raise NoTokenize(f"replica {self.name} has no /tokenize")
        return await self.count_locally(prompt, chat, messages)

    async def count_locally(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int:
        """The count with the backend's `tokenizer` folder: nothing is sent to the server (a
        refused input must not reach it). `chat` as `tokenize` decides it."""
        assert self.local is not None
        wire = wire_messages(messages, prompt)
        try:
            text = await self.local.render(wire) if chat else prompt
            return await self.local.count(text)
        except ChatTemplateError as exc:
            raise GenerationError(
                f"model {self.model}: {exc}", error_type="invalid_request", code=422
            ) from None
