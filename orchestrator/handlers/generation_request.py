"""What every generation endpoint (FMS task, Chat Completions, Responses) does before its first
byte: find the model, check the request against its limits and its replicas' advertised bounds,
resolve the requested detectors on top of the model's enforced guardrails, and build the one
guarded pipeline. Every 4xx of a generation request is raised here (DESIGN section 4)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ..api.errors import invalid, not_found
from ..api.requests import DetectorMap, DetectorParams
from ..clients.generation import GenerationRequest, ModelBackend
from ..clients.registry import RequestedDetector
from ..config import ModelConfig
from ..state import STATE, AppState
from ..streaming.guarded_generation import GuardedGeneration


@dataclass(frozen=True)
class ModelTarget:
    model_id: str
    config: ModelConfig
    backend: ModelBackend


def find_model(state: AppState, model_id: str) -> ModelTarget:
    model = state.config.models.get(model_id)
    backend = state.backends.get(model_id)
    if model is None or backend is None:
        raise not_found(f"model `{model_id}` not found")
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
        state.detectors.resolve(
            {k: DetectorParams.model_validate(v) for k, v in enforced_cfg.items()},
            direction,
            f"models.{target.model_id}.guardrails.{direction}",
        )
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
    inputs: str,
    masks: list[tuple[int, int]] | None,
    input_detectors: list[RequestedDetector],
    output_detectors: list[RequestedDetector],
    keepalive: bool,
) -> GuardedGeneration:
    """Validates against the replicas' advertised bounds (the engine must never be the first to
    say no: its 4xx would come after the response started) and builds the pipeline."""
    state = request.app[STATE]
    await target.backend.validate(gen_request)
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
        observer=state.metrics.observer(),
        keepalive_s=server.sse_keepalive_s if keepalive else None,
    )
