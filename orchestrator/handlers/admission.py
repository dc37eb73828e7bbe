"""What every generation endpoint (FMS task, Chat Completions, Responses) does before its first
byte: find the model, check the request against its limits and its replicas' advertised bounds,
resolve the requested detectors on top of the model's enforced guardrails, and build the one
guarded pipeline. Every 4xx of a generation request is raised here (DESIGN section 4).

It runs inside the serving loop (handlers/serving.py), after the request took its stream slot:
checking the advertised bounds may ask an engine, which a request refused with 429/503 must not
cost."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from ..api.errors import invalid, not_found
from ..api.fms_requests import DetectorMap, DetectorParams
from ..clients.backend import ChatMessage, GenerationParams, GenerationRequest, ModelBackend
from ..clients.registry import RequestedDetector
from ..config import ModelConfig
from ..state import STATE, AppState
from ..streaming.guarded_generation import GuardedGeneration
from ..streaming.text_judgement import InputPiece


@dataclass(frozen=True)
class ModelTarget:
    model_id: str
    config: ModelConfig
    backend: ModelBackend


def find_model(state: AppState, model_id: str) -> ModelTarget:
    model = state.config.models.get(model_id)
    backend = state.backends.get(model_id)
    if model is None or backend is None:
        raise not_found(
            f"model `{model_id}` not found "
            f"(available: {', '.join(sorted(state.config.models)) or 'none'})"
        )
    return ModelTarget(model_id, model, backend)


def check_input_size(target: ModelTarget, chars: int, field: str) -> None:
    limit = target.config.limits.max_input_chars
    if chars > limit:
        raise invalid(f"{field}: {chars} characters exceed this model's limit of {limit}")


def budget(target: ModelTarget, requested: int | None, field: str) -> int:
    """The token budget: the request's, else the model's default; never above its limit."""
    limits = target.config.limits
    max_new = requested or min(limits.default_max_new_tokens, limits.max_new_tokens)
    if max_new > limits.max_new_tokens:
        raise invalid(f"{field}: {max_new} exceeds this model's limit of {limits.max_new_tokens}")
    return max_new


def resolve_detectors(
    state: AppState,
    target: ModelTarget,
    direction: str,
    requested: DetectorMap | None,
    path: str,
) -> list[RequestedDetector]:
    """The model's enforced detectors for this direction, with their configured settings, plus
    the request's others. Naming an enforced detector again changes nothing about it: a client
    can add guardrails, never remove or weaken the operator's (DESIGN section 3)."""
    assert state.detectors is not None
    enforced_cfg: dict[str, dict[str, object]] = getattr(target.config.guardrails, direction)
    enforced = (
        [
            replace(d, enforced=True)
            for d in state.detectors.resolve(
                {k: DetectorParams.model_validate(v) for k, v in enforced_cfg.items()},
                direction,
                f"models.{target.model_id}.guardrails.{direction}",
            )
        ]
        if enforced_cfg
        else []
    )
    extra = (
        state.detectors.resolve(
            {k: v for k, v in requested.items() if k not in enforced_cfg}, direction, path
        )
        if requested
        else []
    )
    # the request's own entry for an enforced id is still checked (404s and 422s stay errors)
    if requested:
        named_enforced = {k: v for k, v in requested.items() if k in enforced_cfg}
        if named_enforced:
            state.detectors.resolve(named_enforced, direction, path)
    return sorted(enforced + extra, key=lambda d: d.detector_id)


async def build_pipeline(
    request: web.Request,
    target: ModelTarget,
    gen_request: GenerationRequest,
    *,
    inputs: str | list[InputPiece],
    masks: list[tuple[int, int]] | None,
    input_detectors: list[RequestedDetector],
    output_detectors: list[RequestedDetector],
    keepalive: bool,
) -> GuardedGeneration:
    """Validates against the replicas' advertised bounds (the engine must never be the first to
    say no: its 4xx would come after the response started) and builds the pipeline."""
    state = request.app[STATE]
    gen_request = await target.backend.validate(gen_request)
    server = state.config.server
    return GuardedGeneration(
        backend=target.backend,
        request=gen_request,
        inputs=inputs,
        masks=masks,
        input_detectors=input_detectors,
        output_detectors=output_detectors,
        chunkers=state.chunkers,
        timeout_s=server.request_timeout_s,
        seed=gen_request.params.seed,
        observer=state.metrics.observer(target.model_id),
        keepalive_s=server.sse_keepalive_s if keepalive else None,
        read_coalesce_tokens=server.read_coalesce_tokens,
        read_coalesce_when=state.loop_lag.busy,
    )


@dataclass(frozen=True)
class Conversation:
    """What the OpenAI surfaces (Chat Completions, Responses) ask for, in one shape: their
    requests differ on the wire, not in what the pipeline needs."""

    model: str
    messages: list[tuple[str, str]]  # (role, text): what the engine receives
    pieces: list[InputPiece]  # every text the client sent: what input detectors judge
    input_field: str  # the request field the messages came from (for size errors)
    max_tokens: int | None
    max_tokens_field: str
    temperature: float | None
    top_p: float | None
    input_detectors: DetectorMap | None
    output_detectors: DetectorMap | None
    stream: bool
    seed: int | None = None
    stop: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def openai_params(
    target: ModelTarget,
    max_new: int,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: tuple[str, ...],
) -> GenerationParams:
    """The generation parameters of an OpenAI-surface request (chat, Responses, completions):
    OpenAI's default temperature is 1 (sampling) unless the model's config has its own
    defaults, 0 asks for greedy decoding; what the config filled in is `defaulted`."""
    defaults = target.config.decoding_defaults
    temp = temperature
    if temp is None:
        temp = 1.0 if defaults.temperature is None else defaults.temperature
    nucleus = top_p if top_p is not None else defaults.top_p
    return GenerationParams(
        max_new_tokens=max_new,
        budget_is_default=max_tokens is None,
        decoding_method="GREEDY" if temp == 0 else "SAMPLING",
        temperature=temp if temp > 0 else 1.0,
        top_p=1.0 if nucleus is None else nucleus,
        repetition_penalty=defaults.repetition_penalty or 1.0,
        defaulted=frozenset(
            name
            for name, given in (("temperature", temperature), ("top_p", top_p))
            if given is None and getattr(defaults, name) is not None
        )
        | ({"repetition_penalty"} if defaults.repetition_penalty is not None else set()),
        seed=seed,
        stop_sequences=stop,
    )


async def prepare_conversation(
    request: web.Request, conversation: Conversation
) -> GuardedGeneration:
    """The guarded pipeline of an OpenAI-surface request. Input detectors judge every piece of
    the conversation, each on its own (DESIGN 4.8)."""
    state = request.app[STATE]
    c = conversation
    target = find_model(state, c.model)
    check_input_size(target, sum(len(text) for _, text in c.messages), c.input_field)
    max_new = budget(target, c.max_tokens, c.max_tokens_field)
    last_user = max(i for i, (role, _) in enumerate(c.messages) if role == "user")
    input_dets = resolve_detectors(state, target, "input", c.input_detectors, "detectors.input")
    output_dets = resolve_detectors(state, target, "output", c.output_detectors, "detectors.output")
    gen_request = GenerationRequest(
        prompt=c.messages[last_user][1],
        params=openai_params(
            target,
            max_new,
            max_tokens=c.max_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=c.seed,
            stop=c.stop,
        ),
        chat=True,
        request_id=request.get("request_id", ""),
        # chat templates know system, user and assistant; `developer` is OpenAI's newer name
        # for the system role
        messages=tuple(
            ChatMessage("system" if role == "developer" else role, text)
            for role, text in c.messages
        ),
        extra=c.extra,
    )
    return await build_pipeline(
        request,
        target,
        gen_request,
        inputs=c.pieces,
        masks=None,
        input_detectors=input_dets,
        output_detectors=output_dets,
        keepalive=c.stream,
    )
