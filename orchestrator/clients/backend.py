"""Types shared by the generation backends and the streaming pipeline (DESIGN section 7).

The pipeline sees only these: a `ModelBackend` per model_id whose `stream()` yields
`EngineDelta`s and raises `GenerationError` when generation cannot go on. Which replica serves
a request, and how many times it migrated, stays behind this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol

FINISH_REASONS = ("EOS_TOKEN", "STOP_SEQUENCE", "MAX_TOKENS", "TIME_LIMIT")
# invalid_request: an engine's 400/413/422, the client's mistake (422, never migrated)
ERROR_TYPES = (
    "generation_error",
    "generation_unavailable",
    "timeout",
    "invalid_request",
    "overloaded",  # every replica answered 429: the client retries after Retry-After
)


@dataclass(frozen=True)
class GenerationParams:
    """The request's text_gen_parameters, already validated by the handler."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    decoding_method: Literal["GREEDY", "SAMPLING"] = "GREEDY"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop_sequences: tuple[str, ...] = ()
    max_time: float = 0.0
    # max_new_tokens is the model's default, not the client's: a prompt too long for it gets
    # what fits in the context instead (vLLM's behaviour for an unset max_tokens)
    budget_is_default: bool = False
    # fields the model's decoding_defaults set, not the client: a server that refuses one gets
    # the request without it (the operator's preference), never a 422 the client cannot explain
    defaulted: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat conversation (OpenAI surfaces); content is plain text. A `tool`
    message names the call it answers (`tool_call_id`); an assistant message may carry the
    calls it made (`tool_calls`, OpenAI's wire objects, forwarded as the client sent them).
    `name` is the speaker's, as the client sent it: the chat template renders it where it
    uses names (a conversation of several parties)."""

    role: str
    content: str
    tool_call_id: str | None = None
    tool_calls: tuple[dict[str, Any], ...] | None = None
    name: str | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = list(self.tool_calls)
            if not self.content:
                out["content"] = None  # an assistant turn that only called tools
        return out


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate. Exactly one of a prompt (FMS endpoints; `chat` applies the template to
    it as one user message) or `messages` (OpenAI surfaces; the template always applies).
    `extra` holds fields of an OpenAI request that guardstream does not interpret: only an
    `openai` backend with `api: chat` forwards them, untouched."""

    prompt: str
    params: GenerationParams
    chat: bool = False
    request_id: str = ""
    messages: tuple[ChatMessage, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class GenerationError(Exception):
    """Generation cannot go on; what reaches the client (`code`, `error_type`, message).

    `migratable` marks failures of one replica (another replica may continue the request); the
    pipeline only ever sees errors that migration could not absorb. `replica_fault` False: the
    replica was alive and answered an internal error (HTTP 500) for this request, which may be
    the request's own doing: it is tried elsewhere without quarantining the replica
    (migration.py). `busy`: the replica is alive and at its bound (HTTP 429): the request goes
    elsewhere, never to it again, and it is neither quarantined nor counted as failing."""

    def __init__(
        self,
        message: str,
        *,
        error_type: str = "generation_error",
        code: int = 502,
        migratable: bool = False,
        replica_fault: bool = True,
        busy: bool = False,
    ) -> None:
        super().__init__(message)
        if error_type not in ERROR_TYPES:
            error_type = "generation_error"
        self.message = message
        self.error_type = error_type
        self.code = code
        self.migratable = migratable
        self.replica_fault = replica_fault
        self.busy = busy

    def __repr__(self) -> str:
        return (
            f"GenerationError({self.message!r}, error_type={self.error_type!r}, "
            f"code={self.code}, migratable={self.migratable})"
        )


class CannotContinue(GenerationError):
    """A replica was asked to continue a partial answer and cannot (a chat server that refuses
    `continue_final_message`). Not a failure of the replica: MigratingStream regenerates the
    answer there instead where the decoding is deterministic (a replay), else gives up."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_type="generation_unavailable", code=503)


class GenerationStream(Protocol):
    """What `ModelBackend.stream()` gives the pipeline (migration.MigratingStream is the one
    implementation): EngineDeltas, in bursts with `next_batch`, and the counters of the
    whole generation across replicas. Declared here, where the pipeline looks, so that neither
    it nor this module depends on how migration works."""

    @property
    def migrations(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def generated_token_count(self) -> int: ...
    @property
    def input_token_count(self) -> int | None: ...
    @property
    def seed(self) -> int | None: ...

    def __aiter__(self) -> GenerationStream: ...
    async def __anext__(self) -> EngineDelta: ...
    async def next_batch(self, max_items: int = ...) -> list[EngineDelta]:
        """The next chunk and every further one already buffered, up to `max_items`."""
        ...

    async def aclose(self) -> None:
        """Drop the engine connection now; nothing is dispatched after this."""
        ...

    async def __aenter__(self) -> GenerationStream: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class ModelBackend(ABC):
    """Every replica of one configured model_id, behind one interface (see backends.py)."""

    model_id: str

    @abstractmethod
    def stream(self, request: GenerationRequest) -> GenerationStream:
        """An async iterator of EngineDelta; call `aclose()` (or use `async with`) after."""

    @abstractmethod
    async def tokenize(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int:
        """Token count of a prompt (or of `messages` under the chat template) on any healthy
        replica; GenerationError when none answers."""

    async def count_privately(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int | None:
        """The token count of a prompt the input guardrails refused, without sending it to a
        server outside this deployment (DESIGN 4.5: the refused input never reaches the
        model's server); None where nothing can count it so. The default counts with
        `tokenize` (a backend whose replicas are all this deployment's own)."""
        try:
            return await self.tokenize(prompt, chat, messages)
        except GenerationError:
            return None

    async def validate(self, request: GenerationRequest) -> GenerationRequest:
        """Checks a request against what the replicas advertise (context length, parameter
        bounds) before any response byte; raises the API's 422. Returns the request to run (a
        default budget may shrink to fit the context). The default checks nothing."""
        return request

    @abstractmethod
    async def start(self) -> None:
        """Start managed engine processes and background health polling."""

    @abstractmethod
    async def close(self) -> None:
        """Stop polling and managed processes (graceful, then killed)."""

    @abstractmethod
    def info(self) -> list[dict[str, Any]]:
        """Per replica, from cached health only (never blocks)."""


# -- the contract between MigratingStream and one replica's client --------------------------------


@dataclass(frozen=True)
class Continuation:
    """What a replacement dispatch must continue from: the prompt as the first replica tokenized
    it, and every token and character already delivered to the client."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    # the seed the first replica drew for an unseeded sampling request: resumes stay exact
    seed: int | None = None
    # tokens delivered so far: len(token_ids), or MigratingStream's count where the backend sends
    # no token ids (`openai` with `api: chat`), which is what the remaining budget is taken from
    generated_token_count: int = 0


# Per-token objects are plain slotted dataclasses, not frozen ones: a frozen __init__ sets each
# field through object.__setattr__ (about 0.9 us against 0.26 us here), and each token makes two
# of them (the replica's delta, the stream's). Nothing mutates them.
@dataclass(slots=True)
class EngineDelta:
    """One step of generated text, the same word from the engine (generation/jobs.py's wire
    item) through the clients to the pipeline: a replica's stream yields them as it parsed them,
    and MigratingStream hands the pipeline its own, with the stream's counters across
    migrations. The `text` deltas of a stream concatenate to the whole generated text."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # EOS_TOKEN | STOP_SEQUENCE | MAX_TOKENS | TIME_LIMIT
    prompt_token_ids: tuple[int, ...] | None = None
    input_token_count: int | None = None
    seed: int | None = None  # the engine's seed, reported on the first item of a sampling stream
    # generated tokens this delta stands for when the backend sends no token ids (`api: chat`);
    # None: len(token_ids)
    token_count: int | None = None
    # every token delivered so far, across migrations (MigratingStream's deltas; 0 on a
    # replica's own)
    generated_token_count: int = 0
    # tool-call fragments of this step (`api: chat`), beside the text, never inside it
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of one tool call as an OpenAI chat stream sends it (`delta.tool_calls[]`): the
    call's `index` in the answer, and what this fragment adds: the `id` and function `name`
    (usually on the call's first fragment only) and a piece of the `arguments` JSON string.
    The fragments of one index concatenate to the whole call."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class EngineStream(ABC):
    """One dispatch to one replica. Iteration ends only after the backend's end-of-stream marker
    was seen (and nothing after it); every other end raises GenerationError."""

    def __aiter__(self) -> EngineStream:
        return self

    @abstractmethod
    async def __anext__(self) -> EngineDelta: ...

    @abstractmethod
    def close(self) -> None:
        """Drop the connection now (the engine notices its client left and stops)."""


class ReplicaClient(ABC):
    """Talks to one replica of one backend type."""

    type: str
    url: str

    @abstractmethod
    def generate(
        self,
        request: GenerationRequest,
        continuation: Continuation | None,
        *,
        stall_timeout_s: float,
        max_time: float,
    ) -> EngineStream:
        """Start a dispatch; the connection is made on the first `__anext__`."""

    @abstractmethod
    async def tokenize(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int: ...

    @abstractmethod
    async def health(self, timeout_s: float) -> bool: ...

    def continuation_refused(self) -> str | None:
        """Why this replica cannot go on from a Continuation, as far as its client knows (a
        refusal is learnt on the first try, which raises `CannotContinue`); None where it can.
        MigratingStream then sends the request as it came and replays the delivered prefix."""
        return None


def unavailable(message: str, *, replica_fault: bool = True, busy: bool = False) -> GenerationError:
    """A replica-level failure another replica may absorb."""
    return GenerationError(
        message,
        error_type="generation_unavailable",
        code=503,
        migratable=True,
        replica_fault=replica_fault and not busy,
        busy=busy,
    )
