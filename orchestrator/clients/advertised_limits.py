"""Advertised limits (DESIGN section 4): what each engine replica accepts, as it says in
`GET /v1/models` (its context length and the range of every generation parameter), and the
check of a request against what every replica of a model accepts, before any response byte.

A request may migrate to any replica, so it is checked against the intersection of what they
advertise (`merge_limits`); a client mistake is a 422 `invalid_request` here, never a 5xx later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from ..api.errors import ApiError, ErrorType
from .backend import GenerationError, GenerationParams, GenerationRequest

log = logging.getLogger("guardstream.native")


class AdvertisingReplica(Protocol):
    """A replica that can be asked for its limits (the native client)."""

    name: str
    url: str

    async def advertised(self, timeout_s: float) -> EngineLimits | None: ...


R = TypeVar("R", bound=AdvertisingReplica)


Number = int | float


def _number(value: Any) -> Number | None:
    """A finite JSON number, kept as it came (an int bound like 2**63-1 stays exact)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _tighter(a: Number | None, b: Number | None, pick: Any) -> Number | None:
    return b if a is None else a if b is None else pick(a, b)


@dataclass(frozen=True)
class ParamRange:
    """One advertised numeric range (JSON-Schema keywords of `GET /v1/models`)."""

    minimum: Number | None = None
    exclusive_minimum: Number | None = None
    maximum: Number | None = None
    exclusive_maximum: Number | None = None

    @classmethod
    def parse(cls, raw: Any) -> ParamRange:
        raw = raw if isinstance(raw, dict) else {}
        return cls(
            minimum=_number(raw.get("minimum")),
            exclusive_minimum=_number(raw.get("exclusiveMinimum")),
            maximum=_number(raw.get("maximum")),
            exclusive_maximum=_number(raw.get("exclusiveMaximum")),
        )

    def contains(self, value: Number) -> bool:
        return not (
            (self.minimum is not None and value < self.minimum)
            or (self.exclusive_minimum is not None and value <= self.exclusive_minimum)
            or (self.maximum is not None and value > self.maximum)
            or (self.exclusive_maximum is not None and value >= self.exclusive_maximum)
        )

    def intersect(self, other: ParamRange) -> ParamRange:
        """What both accept (a request may migrate to any replica)."""
        return ParamRange(
            minimum=_tighter(self.minimum, other.minimum, max),
            exclusive_minimum=_tighter(self.exclusive_minimum, other.exclusive_minimum, max),
            maximum=_tighter(self.maximum, other.maximum, min),
            exclusive_maximum=_tighter(self.exclusive_maximum, other.exclusive_maximum, min),
        )

    def describe(self) -> str:
        """`between 0 and 100`, `greater than 0 and at most 1`, `at least 0`."""
        low = high = None
        if self.exclusive_minimum is not None:
            low = f"greater than {_fmt(self.exclusive_minimum)}"
        if self.minimum is not None and (
            self.exclusive_minimum is None or self.minimum > self.exclusive_minimum
        ):
            low = f"at least {_fmt(self.minimum)}"
        if self.exclusive_maximum is not None:
            high = f"less than {_fmt(self.exclusive_maximum)}"
        if self.maximum is not None and (
            self.exclusive_maximum is None or self.maximum < self.exclusive_maximum
        ):
            high = f"at most {_fmt(self.maximum)}"
        if low and high and low.startswith("at least") and high.startswith("at most"):
            return f"between {_fmt(self.minimum)} and {_fmt(self.maximum)}"
        return " and ".join(p for p in (low, high) if p) or "any value"


def _fmt(value: Number | None) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _count(raw: Any, key: str) -> int | None:
    value = raw.get(key) if isinstance(raw, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class EngineLimits:
    """What a native engine advertises in `GET /v1/models`: its context and the accepted range
    of each numeric parameter (by the engine's field name), stop sequences and messages."""

    model: str
    max_model_len: int
    ranges: dict[str, ParamRange] = field(default_factory=dict)
    max_stop_sequences: int | None = None
    min_stop_length: int | None = None
    max_stop_length: int | None = None
    max_messages: int | None = None
    roles: frozenset[str] | None = None
    decoding_methods: frozenset[str] | None = None
    chat_template: bool | None = None
    # the chat template takes tools and the engine parses the model's calls (None: an engine
    # that does not say, one older than tool calls: it refuses `tools` at dispatch)
    tools: bool | None = None

    NUMERIC = (
        "max_new_tokens",
        "min_new_tokens",
        "max_time",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "repetition_penalty",
    )

    @classmethod
    def parse(cls, body: Any) -> EngineLimits | None:
        """The first model of a `/v1/models` reply; None when it advertises no context (an
        engine of an older protocol, a fake): then nothing is checked against it."""
        data = body.get("data") if isinstance(body, dict) else None
        entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        length = entry.get("max_model_len", entry.get("max_context"))
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            return None
        params = entry.get("parameters")
        params = params if isinstance(params, dict) else {}
        stops = params.get("stop_sequences")
        stop_items = stops.get("items") if isinstance(stops, dict) else None
        messages = params.get("messages")
        roles = messages.get("roles") if isinstance(messages, dict) else None
        methods = params.get("decoding_method")
        methods = methods.get("enum") if isinstance(methods, dict) else None
        template = entry.get("chat_template")
        tools = entry.get("tools")
        return cls(
            model=str(entry.get("id", "")),
            max_model_len=length,
            ranges={k: ParamRange.parse(params[k]) for k in cls.NUMERIC if k in params},
            max_stop_sequences=_count(stops, "maxItems"),
            min_stop_length=_count(stop_items, "minLength"),
            max_stop_length=_count(stop_items, "maxLength"),
            max_messages=_count(messages, "maxItems"),
            roles=frozenset(r for r in roles if isinstance(r, str))
            if isinstance(roles, list)
            else None,
            decoding_methods=frozenset(m.lower() for m in methods if isinstance(m, str))
            if isinstance(methods, list)
            else None,
            chat_template=template if isinstance(template, bool) else None,
            tools=tools if isinstance(tools, bool) else None,
        )


# ----- checking a request against what the replicas advertise ------------------------------------

# Token count of a text, bounded from above without a tokenizer: byte-level BPE (GPT-2, Llama 3,
# Qwen, SmolLM) and SentencePiece with byte fallback (Llama 2, Mistral) never produce more tokens
# than the text has UTF-8 bytes (each token stands for at least one byte; an unknown character
# becomes at most its bytes), and a special token typed as text is one token for many bytes. What
# bytes do not bound is what the tokenizer and the chat template add: BOS/EOS, a dummy-prefix
# space, role headers, a default system prompt. These allowances cover the usual templates
# generously; a template that adds more only means the engine's own check rejects the request
# at dispatch (422 as well, never a 5xx: see http_error), a little later.
FIXED_SLACK_TOKENS = 256
MESSAGE_SLACK_TOKENS = 16


def token_upper_bound(request: GenerationRequest) -> int:
    """More tokens than the request's prompt can have (see FIXED_SLACK_TOKENS)."""
    if request.messages is not None:
        texts = [t for m in request.messages for t in (m.role, m.content, m.name or "")]
        texts += [json.dumps(c) for m in request.messages for c in m.tool_calls or ()]
        if request.extra.get("tools"):  # rendered into the prompt as JSON, about as sent
            texts.append(json.dumps(request.extra["tools"]))
        slack = FIXED_SLACK_TOKENS + MESSAGE_SLACK_TOKENS * len(request.messages)
    else:
        texts = [request.prompt]
        slack = FIXED_SLACK_TOKENS + (MESSAGE_SLACK_TOKENS if request.chat else 0)
    return slack + sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _common(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return b if a is None else a if b is None else a & b


def merge_limits(limits: list[EngineLimits]) -> EngineLimits:
    """What every replica accepts: a request may migrate to any of them."""
    merged = limits[0]
    for other in limits[1:]:
        ranges = dict(merged.ranges)
        for name, r in other.ranges.items():
            ranges[name] = ranges[name].intersect(r) if name in ranges else r
        templates = (merged.chat_template, other.chat_template)
        tools = (merged.tools, other.tools)
        merged = replace(
            merged,
            max_model_len=min(merged.max_model_len, other.max_model_len),
            ranges=ranges,
            max_stop_sequences=_least(merged.max_stop_sequences, other.max_stop_sequences),
            min_stop_length=_tighter(merged.min_stop_length, other.min_stop_length, max),
            max_stop_length=_least(merged.max_stop_length, other.max_stop_length),
            max_messages=_least(merged.max_messages, other.max_messages),
            roles=_common(merged.roles, other.roles),
            decoding_methods=_common(merged.decoding_methods, other.decoding_methods),
            chat_template=None if None in templates else all(templates),
            tools=False if False in tools else None if None in tools else True,
        )
    return merged


def _param_values(params: GenerationParams) -> dict[str, Number]:
    """The request's numeric parameters by the engine's field names (as native_body sends them)."""
    values: dict[str, Number] = {
        "max_new_tokens": params.max_new_tokens,
        "min_new_tokens": params.min_new_tokens,
        "max_time": params.max_time,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.seed is not None:
        values["seed"] = params.seed
    return values


@dataclass(frozen=True)
class LimitProblem:
    """Why the engines would refuse a request: `field` is the engine's name of what is wrong
    (`temperature`, `stop_sequences[1]`, `messages[2].role`), `text` says it in those names.
    The surface that took the request restates it in the request's own field names
    (`GenerationAsk.restate`): a Chat Completions client sent `stop`, not `stop_sequences`."""

    field: str
    text: str

    def __str__(self) -> str:
        return self.text


class EngineLimitError(ApiError):
    """A request the replicas' advertised limits refuse (422), with the problem kept whole so
    the surface can name its own request field."""

    def __init__(self, model_id: str, problem: LimitProblem) -> None:
        super().__init__(422, ErrorType.INVALID_REQUEST, f"model `{model_id}`: {problem}")
        self.model_id = model_id
        self.problem = problem


def request_problem(limits: EngineLimits, request: GenerationRequest) -> LimitProblem | None:
    """Why the engines would reject this request's parameters, or None. Named by the engine's
    parameter names (`max_new_tokens`, `temperature`, `stop_sequences[1]`, ...)."""
    p = request.params
    for name, value in _param_values(p).items():
        if isinstance(value, float) and not math.isfinite(value):
            return LimitProblem(name, f"{name} is {value}; it must be a finite number")
        allowed = limits.ranges.get(name)
        if allowed is not None and not allowed.contains(value):
            return LimitProblem(name, f"{name} is {_fmt(value)}; it must be {allowed.describe()}")
    method = p.decoding_method.lower()
    if limits.decoding_methods is not None and method not in limits.decoding_methods:
        known = ", ".join(sorted(limits.decoding_methods))
        return LimitProblem(
            "decoding_method",
            f"decoding method {p.decoding_method} is not supported (supported: {known})",
        )
    stops = p.stop_sequences
    if limits.max_stop_sequences is not None and len(stops) > limits.max_stop_sequences:
        return LimitProblem(
            "stop_sequences",
            f"stop_sequences has {len(stops)} entries; at most {limits.max_stop_sequences} "
            "are accepted",
        )
    for i, stop in enumerate(stops):
        where = f"stop_sequences[{i}]"
        if limits.max_stop_length is not None and len(stop) > limits.max_stop_length:
            return LimitProblem(
                where,
                f"{where} is {len(stop)} characters long; at most "
                f"{limits.max_stop_length} are accepted",
            )
        if limits.min_stop_length is not None and len(stop) < limits.min_stop_length:
            n = limits.min_stop_length
            return LimitProblem(
                where, f"{where} must be at least {n} character{'s' * (n != 1)} long"
            )
    if request.messages is not None:
        if limits.chat_template is False:
            return LimitProblem("messages", "messages: the model has no chat template")
        if limits.tools is not True and (why := _tools_problem(limits, request)) is not None:
            return why
        if limits.max_messages is not None and len(request.messages) > limits.max_messages:
            return LimitProblem(
                "messages",
                f"messages has {len(request.messages)} entries; at most {limits.max_messages} "
                "are accepted",
            )
        if limits.roles is not None:
            for i, message in enumerate(request.messages):
                if message.role not in limits.roles:
                    roles = ", ".join(sorted(limits.roles))
                    where = f"messages[{i}].role"
                    return LimitProblem(
                        where, f"{where} `{message.role}` is not accepted (use {roles})"
                    )
    elif request.chat and limits.chat_template is False:
        return LimitProblem("chat", "chat: the model has no chat template")
    return None


def tools_problem(limits: EngineLimits | None, request: GenerationRequest) -> LimitProblem | None:
    """`_tools_problem` for engines that advertised `limits`, or none at all (None)."""
    if limits is not None and limits.tools is True:
        return None
    return _tools_problem(limits, request)


def _tools_problem(limits: EngineLimits | None, request: GenerationRequest) -> LimitProblem | None:
    """Why a request that asks for tool calls (`tools`, or a conversation with calls in it)
    cannot go to engines whose chat template has no tool support, or that do not say (an
    engine older than tool calls: its own 422 would come at dispatch, naming no field of the
    request); None when it can."""
    if request.extra.get("tools") and request.extra.get("tool_choice") != "none":
        field = "tools"
    elif any(m.role == "tool" or m.tool_calls is not None for m in request.messages or ()):
        field = "messages"
    else:
        return None
    if limits is None or limits.tools is None:
        return LimitProblem(field, f"{field}: the model's engine does not say it takes tools")
    name = limits.model or "the model"
    return LimitProblem(field, f"{field}: model {name}'s chat template has no tool support")


def context_problem(
    limits: EngineLimits, prompt_tokens: int, max_new_tokens: int
) -> LimitProblem | None:
    """Why a prompt of `prompt_tokens` and this budget do not fit the context, or None: the
    prompt's fault (`prompt`) when it alone fills the context, else the budget's."""
    context = limits.max_model_len
    if prompt_tokens >= context:
        return LimitProblem(
            "prompt",
            f"the prompt has {prompt_tokens} tokens: it must be shorter than the model's "
            f"context of {context} tokens",
        )
    if prompt_tokens + max_new_tokens > context:
        return LimitProblem(
            "max_new_tokens",
            f"the prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
            f"{prompt_tokens + max_new_tokens} tokens exceed the model's context of {context} "
            f"tokens (at most {context - prompt_tokens} new tokens fit)",
        )
    return None


class AdvertisedLimits:
    """Each native replica's `GET /v1/models`, fetched lazily the first time a request needs it
    and cached by URL (a restarted managed engine on a new port is asked again). Concurrent
    requests share one fetch; a request waits at most `timeout_s` for it (a dead replica costs
    one bounded wait, then is not asked again for `retry_s`)."""

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._known: dict[str, EngineLimits | None] = {}
        self._retry_at: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Task[EngineLimits | None]] = {}

    def cached(self, client: AdvertisingReplica) -> EngineLimits | None:
        return self._known.get(client.url)

    async def gather(self, clients: list[R]) -> list[tuple[R, EngineLimits]]:
        """The replicas that advertise limits, with them; fetches what is not known yet."""
        now = self._clock()
        waiting: list[asyncio.Task[EngineLimits | None]] = []
        for client in clients:
            url = client.url
            if url in self._known or now < self._retry_at.get(url, -math.inf):
                continue
            task = self._inflight.get(url)
            if task is None:
                task = asyncio.ensure_future(self._fetch(client))
                self._inflight[url] = task
            waiting.append(task)
        if waiting:
            await asyncio.wait(waiting, timeout=self.timeout_s)
        out = []
        for client in clients:
            limits = self._known.get(client.url)
            if limits is not None:
                out.append((client, limits))
        return out

    async def _fetch(self, client: AdvertisingReplica) -> EngineLimits | None:
        url = client.url
        try:
            limits = await client.advertised(self.timeout_s)
        except Exception as exc:  # any failure: not known yet, ask again after retry_s
            self._retry_at[url] = self._clock() + self.retry_s
            detail = exc.message if isinstance(exc, GenerationError) else repr(exc)
            log.info("replica %s: no /v1/models yet (%s)", client.name, detail)
            return None
        else:
            self._known[url] = limits
            self._retry_at.pop(url, None)
            return limits
        finally:
            self._inflight.pop(url, None)

    async def close(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
