"""Preparing a generation request, the same for every surface (FMS task, Chat Completions,
Responses, completions-detection): find the model once, check the request against its limits and
its replicas' advertised bounds, add the request's detectors to the model's enforced guardrails
(resolved once at start-up: `EnforcedGuardrails`), fill the decoding defaults in one place, and
build the one guarded pipeline. Every 4xx of a generation request is raised here (DESIGN 4).

Each surface only says what its request asks for (`GenerationAsk`); `prepare` runs inside the
serving loop (handlers/serving.py), after the request took its stream slot: checking the
advertised bounds may ask an engine, which a request refused with 429/503 must not cost.
Admission control itself (the slots) is handlers/stream_slots.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from aiohttp import web

from servicekit.auth import UNAUTHORIZED_MESSAGE

from ..api.errors import ApiError, ErrorType, invalid, not_found
from ..api.fms_requests import DetectorMap
from ..api.input_pieces import label_of, request_field_chars, request_field_pieces
from ..api.openai_chat import (
    TOOL_FIELDS,
    TOOLS_WHY,
    ChatDetectors,
    check_extra_honoured,
    check_forwardable,
    check_native_tools,
)
from ..clients.advertised_limits import EngineLimitError
from ..clients.backend import ChatMessage, GenerationParams, GenerationRequest, ModelBackend
from ..clients.registry import DetectorRegistry, EnforcedGuardrails, RequestedDetector
from ..config import DecodingDefaults, ManagedBackend, ModelConfig, NativeBackend, OpenAIBackend
from ..state import AppState
from ..streaming.guarded_generation import GuardedGeneration
from ..streaming.text_judgement import InputPiece
from ..tenants import CALLER, Caller, Tenant


@dataclass(frozen=True)
class Decoding:
    """A request's decoding choices; None means the request left it unset (the model's
    `decoding_defaults` apply, then ours: `decoding_params`)."""

    # None: from the temperature (OpenAI's surfaces: 0 is greedy, anything else samples)
    method: Literal["GREEDY", "SAMPLING"] | None = None
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    top_k: int = 0
    min_new_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_time: float = 0.0


@dataclass(frozen=True)
class GenerationAsk:
    """What a generation request asks for, whatever its surface: the surfaces differ on the
    wire, not in what the pipeline needs. `*_field` name the request's own fields in errors."""

    model: str
    prompt: str  # what the engine generates from (the last user message on the OpenAI surfaces)
    inputs: str | list[InputPiece]  # what the input detectors judge
    input_chars: int  # checked against the model's max_input_chars
    input_field: str
    max_tokens: int | None
    max_tokens_field: str
    decoding: Decoding
    input_detectors: DetectorMap | None
    output_detectors: DetectorMap | None
    input_detectors_field: str
    output_detectors_field: str
    stream: bool  # a stream gets keep-alives
    request_id: str = ""
    # the conversation (OpenAI surfaces; the chat template always applies); None: `prompt` alone
    messages: tuple[ChatMessage, ...] | None = None
    chat: bool | None = None  # the chat template on `prompt`; None: as the model's config says
    masks: list[tuple[int, int]] | None = None  # FMS: input spans the request's detectors skip
    masks_field: str = "masks"
    min_tokens_field: str = "min_new_tokens"
    # fields guardstream does not interpret (Chat Completions): refused unless every backend of
    # the model forwards them untouched (an `openai` backend with `api: chat`)
    extra: dict[str, Any] = field(default_factory=dict)
    # their pieces (`request_field_pieces`, labels included: counted against max_input_chars,
    # judged by the input detectors where a backend receives them), made once with the rest of
    # the ask: off the event loop for a large body (serving.bulk_ask); they were walked twice on
    # it, 0.7 s each for 1 MiB of `logit_bias`
    extra_pieces: tuple[InputPiece, ...] = ()
    # the tenant (tenants.py): the models it sees, its guardrails and limits; None: no tenant
    # applies (the model's own guardrails and limits)
    caller: Caller | None = None
    # the request's own name of an engine parameter where it differs (`stop_sequences` is
    # `stop` on the OpenAI surfaces); max/min tokens and the prompt are named by the fields above
    param_fields: Mapping[str, str] = field(default_factory=dict)

    def request_field(self, engine_field: str) -> str:
        """The request's name for an engine field path (`stop_sequences[2]` -> `stop[2]`,
        `messages[1].role` stays where `messages` is the request's field)."""
        base, bracket, rest = engine_field.partition("[")
        suffix = bracket + rest
        if base == "max_new_tokens":
            return self.max_tokens_field
        if base == "min_new_tokens":
            return self.min_tokens_field
        if base in ("prompt", "messages", "chat"):
            # an index into the engine's messages is one into the request's only where the
            # request's field is the same list (Chat Completions `messages`)
            return self.input_field + (suffix if self.input_field == "messages" else "")
        return self.param_fields.get(base, base) + suffix

    def restate(self, exc: EngineLimitError) -> ApiError:
        """An advertised-limit refusal in this request's words: `<field>: ...` names the
        request's field first (OpenAI's `param`), then the engine's whole reason."""
        problem = exc.problem
        name = self.request_field(problem.field)
        text = problem.text
        if text.startswith(f"{problem.field}: "):  # `tools: ...`: named once
            text = text[len(problem.field) + 2 :]
        elif problem.field != "prompt":  # `stop_sequences has ...`: in the request's words
            text = text.replace(problem.field, name, 1)
        return invalid(f"{name}: model `{exc.model_id}`: {text}")


@dataclass(frozen=True)
class ModelTarget:
    model_id: str
    config: ModelConfig
    backend: ModelBackend
    enforced: EnforcedGuardrails


def find_model(state: AppState, model_id: str, tenant: Tenant | None = None) -> ModelTarget:
    """The model, with the guardrails that judge `tenant`'s requests to it. A model the tenant
    cannot see is 404 with exactly the body of a model that does not exist, and the ids listed
    are the tenant's: nothing tells it that another tenant's model exists."""
    visible = sorted(m for m in state.config.models if tenant is None or tenant.sees(m))
    model = state.config.models.get(model_id)
    backend = state.backends.get(model_id)
    if model is None or backend is None or model_id not in visible:
        raise not_found(f"model `{model_id}` not found (available: {', '.join(visible) or 'none'})")
    # resolved at start-up: a missing entry is a bug, never "no guardrails"
    enforced = state.enforced[model_id] if tenant is None else tenant.enforced[model_id]
    return ModelTarget(model_id, model, backend, enforced)


def budget(
    target: ModelTarget, requested: int | None, field: str, tenant: Tenant | None = None
) -> int:
    """The token budget: the request's, else the model's default; never above the model's
    limit, nor the tenant's (a request cannot raise either)."""
    limits = target.config.limits
    ceiling = limits.max_new_tokens
    tenant_max = tenant.limits.max_new_tokens if tenant is not None else None
    max_new = requested or min(limits.default_max_new_tokens, ceiling, tenant_max or ceiling)
    if max_new > ceiling:
        raise invalid(f"{field}: {max_new} exceeds this model's limit of {ceiling}")
    if tenant_max is not None and max_new > tenant_max:
        raise invalid(f"{field}: {max_new} exceeds this tenant's limit of {tenant_max}")
    return max_new


def decoding_params(
    defaults: DecodingDefaults, asked: Decoding, max_new: int, *, budget_is_default: bool
) -> GenerationParams:
    """The one place decoding defaults are filled in: the request's value, else the model's
    `decoding_defaults`, else ours (temperature and top_p 1, no repetition penalty). A
    temperature of 0 (OpenAI's surfaces) asks for greedy decoding. What the model's defaults
    filled in is `defaulted` (a server that refuses one gets the request without it)."""

    def chosen(name: str, asked_value: float | None) -> float:
        if asked_value is not None:
            return asked_value
        default: float | None = getattr(defaults, name)
        return 1.0 if default is None else default

    temperature = chosen("temperature", asked.temperature)
    method = asked.method or ("GREEDY" if temperature == 0 else "SAMPLING")
    return GenerationParams(
        max_new_tokens=max_new,
        budget_is_default=budget_is_default,
        min_new_tokens=asked.min_new_tokens,
        decoding_method=method,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=asked.top_k,
        top_p=chosen("top_p", asked.top_p),
        seed=asked.seed,
        repetition_penalty=chosen("repetition_penalty", asked.repetition_penalty),
        stop_sequences=asked.stop,
        max_time=asked.max_time,
        defaulted=frozenset(
            name
            for name in ("temperature", "top_p", "repetition_penalty")
            if getattr(asked, name) is None and getattr(defaults, name) is not None
        ),
    )


def with_enforced(
    registry: DetectorRegistry,
    enforced: tuple[RequestedDetector, ...],
    direction: str,
    requested: DetectorMap | None,
    path: str,
) -> list[RequestedDetector]:
    """The model's enforced detectors for this direction plus the request's others. Naming an
    enforced detector again changes nothing about it (its entry is still checked: 404s and 422s
    stay errors)."""
    if not requested:
        return list(enforced)
    resolved = registry.resolve(requested, direction, path)
    enforced_ids = {d.detector_id for d in enforced}
    extra = [d for d in resolved if d.detector_id not in enforced_ids]
    return sorted([*enforced, *extra], key=lambda d: d.detector_id)


async def prepare(state: AppState, ask: GenerationAsk) -> GuardedGeneration:
    """The guarded pipeline of a generation request (any surface)."""
    caller = ask.caller
    tenant = caller.current() if caller is not None else None
    if caller is not None and tenant is None:  # a reload took its key from this tenant
        raise ApiError(401, ErrorType.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
    # one snapshot of the config for the whole pipeline (a reload may swap it at any await)
    chunkers, server = state.chunkers, state.config.server
    target = find_model(state, ask.model, tenant)
    if caller is not None:
        caller.policy = caller.tenant.policies[target.model_id]  # x-guardstream-policy
    config = target.config
    limit = config.limits.max_input_chars
    if ask.input_chars > limit:
        raise invalid(
            f"{ask.input_field}: {ask.input_chars} characters exceed this model's limit of {limit}"
        )
    # an `openai` chat backend receives the labels (`user`, `metadata`, ...) beside the prompt:
    # judged there; any other backend drops them, and nothing judges what nothing receives
    receives_labels = any(isinstance(b, OpenAIBackend) and b.api == "chat" for b in config.backends)
    extra_pieces = [p for p in ask.extra_pieces if receives_labels or label_of(p) is None]
    if ask.extra:  # tool definitions and the like are prompt text too: they count
        extra_chars, fields = request_field_chars(extra_pieces)
        if ask.input_chars + extra_chars > limit:
            raise invalid(
                f"{fields[0]}: {extra_chars} characters, with the {ask.input_chars} of "
                f"{ask.input_field}, exceed this model's limit of {limit}"
            )
    max_new = budget(target, ask.max_tokens, ask.max_tokens_field, tenant)
    if caller is not None:
        # admitted and held in one step (no await since `current`): requests started together
        # each see the others' holds
        caller.hold_tokens(max_new, ask.input_chars)
    if ask.decoding.min_new_tokens > max_new:
        raise invalid(f"{ask.min_tokens_field}: must not exceed max_new_tokens")
    forwards = all(isinstance(b, OpenAIBackend) and b.api == "chat" for b in config.backends)
    # native engines take tools where the model's template does (the replicas say so:
    # `backend.validate` below); an `openai` chat backend forwards them
    takes_tools = all(
        isinstance(b, (NativeBackend, ManagedBackend))
        or (isinstance(b, OpenAIBackend) and b.api == "chat")
        for b in config.backends
    )
    if ask.extra and forwards:
        own = frozenset.intersection(*(frozenset(b.forward_fields) for b in config.backends))
        try:
            check_forwardable(ask.extra, ask.model, own)
        except ValueError as exc:
            raise invalid(str(exc)) from None
    if ask.extra and not forwards:
        extra = ask.extra
        try:
            if takes_tools:
                check_native_tools(extra, ask.model)
                extra = {k: v for k, v in extra.items() if k not in TOOL_FIELDS}
            check_extra_honoured(extra, ask.model)
        except ValueError as exc:
            raise invalid(str(exc)) from None
    if not takes_tools:
        for i, m in enumerate(ask.messages or ()):
            if m.role == "tool" or m.tool_calls is not None:
                raise invalid(
                    f"{ask.input_field}: message {i} of the conversation is part of a tool "
                    f"call, and {TOOLS_WHY} (model `{ask.model}`; an `openai` backend with "
                    "`api: chat` forwards them, the native engine renders them)"
                )
    for start, end in ask.masks or []:
        if end > len(ask.prompt):
            raise invalid(
                f"{ask.masks_field}: [{start}, {end}] lies beyond the "
                f"{len(ask.prompt)} characters of {ask.input_field}"
            )
    assert state.detectors is not None
    input_dets = with_enforced(
        state.detectors,
        target.enforced.input,
        "input",
        ask.input_detectors,
        ask.input_detectors_field,
    )
    output_dets = with_enforced(
        state.detectors,
        target.enforced.output,
        "output",
        ask.output_detectors,
        ask.output_detectors_field,
    )
    gen_request = GenerationRequest(
        prompt=ask.prompt,
        params=decoding_params(
            config.decoding_defaults,
            ask.decoding,
            max_new,
            budget_is_default=ask.max_tokens is None,
        ),
        chat=config.chat if ask.chat is None else ask.chat,
        request_id=ask.request_id,
        messages=ask.messages,
        extra=ask.extra,
    )
    # the engine must never be the first to say no: its 4xx would come after the response
    # started, so the replicas' advertised bounds are checked now
    try:
        gen_request = await target.backend.validate(gen_request)
    except EngineLimitError as exc:
        raise ask.restate(exc) from None
    return GuardedGeneration(
        backend=target.backend,
        request=gen_request,
        inputs=ask.inputs,
        masks=ask.masks,
        input_detectors=input_dets,
        output_detectors=output_dets,
        chunkers=chunkers,
        timeout_s=server.request_timeout_s,
        seed=gen_request.params.seed,
        observer=state.metrics.observer(
            target.model_id,
            tenant.id if tenant is not None else None,
            caller.settle_tokens if caller is not None else None,
        ),
        keepalive_s=server.sse_keepalive_s if ask.stream else None,
        read_coalesce_tokens=server.read_coalesce_tokens,
        read_coalesce_when=state.loop_lag.busy,
        offers_tools=bool(ask.extra.get("tools")),
        request_pieces=extra_pieces,
        input_verdicts=state.input_verdicts(caller),
    )


def conversation(
    messages: list[tuple[str, str]],
) -> tuple[str, tuple[ChatMessage, ...]]:
    """The engine's prompt (the last user message) and the conversation of an OpenAI-surface
    request. Chat templates know system, user and assistant; `developer` is OpenAI's newer name
    for the system role."""
    last_user = max(i for i, (role, _) in enumerate(messages) if role == "user")
    return messages[last_user][1], tuple(
        ChatMessage("system" if role == "developer" else role, text) for role, text in messages
    )


class OpenAISurfaceRequest(Protocol):
    """What Chat Completions, Responses and completions-detection requests have alike."""

    model: str
    stream: bool
    detectors: ChatDetectors | None


# The engine's parameters by the OpenAI surfaces' names (the others are the same, or come from
# the model's decoding_defaults, which no OpenAI request sets); greedy or sampling is what the
# request's temperature chose
OPENAI_PARAM_FIELDS = {"stop_sequences": "stop", "decoding_method": "temperature"}


def openai_ask(request: web.Request, body: OpenAISurfaceRequest, **asked: Any) -> GenerationAsk:
    """An OpenAI-surface request's ask: the model, the `detectors` extension, `stream` and the
    request id filled in the same way for every such surface; `asked` holds the rest."""
    detectors = body.detectors
    extra = asked.get("extra")
    return GenerationAsk(
        model=body.model,
        input_detectors=detectors.input if detectors else None,
        output_detectors=detectors.output if detectors else None,
        input_detectors_field="detectors.input",
        output_detectors_field="detectors.output",
        stream=body.stream,
        request_id=request.get("request_id", ""),
        caller=request.get(CALLER),
        param_fields=OPENAI_PARAM_FIELDS,
        extra_pieces=tuple(request_field_pieces(extra, labels=True)) if extra else (),
        **asked,
    )
