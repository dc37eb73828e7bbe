"""The FMS task request (DESIGN 4.2) turned into the guarded pipeline; shared by the streaming
and the unary task endpoints, which read the body and hand this to the serving loop (it runs
once the request holds a stream slot)."""

from __future__ import annotations

from aiohttp import web

from ..api.errors import invalid
from ..api.fms_requests import GuardrailsHttpRequest, TextGenParameters
from ..clients.backend import GenerationParams, GenerationRequest
from ..state import STATE
from ..streaming.guarded_generation import GuardedGeneration
from .admission import (
    budget,
    build_pipeline,
    check_input_size,
    find_model,
    resolve_detectors,
)


async def prepare_task(
    request: web.Request, body: GuardrailsHttpRequest, *, streaming: bool
) -> GuardedGeneration:
    state = request.app[STATE]
    target = find_model(state, body.model_id)
    params = body.text_gen_parameters
    check_input_size(target, len(body.inputs), "inputs")
    max_new = budget(target, params.max_new_tokens, "text_gen_parameters.max_new_tokens")
    if params.min_new_tokens > max_new:
        raise invalid("text_gen_parameters.min_new_tokens: must not exceed max_new_tokens")
    guardrails = body.guardrail_config
    masks = guardrails.input.masks if guardrails.input else None
    for start, end in masks or []:
        if end > len(body.inputs):
            raise invalid(
                f"guardrail_config.input.masks: [{start}, {end}] lies beyond the "
                f"{len(body.inputs)} characters of inputs"
            )
    input_dets = resolve_detectors(
        state,
        target,
        "input",
        guardrails.input.models if guardrails.input else None,
        "guardrail_config.input.models",
    )
    output_dets = resolve_detectors(
        state,
        target,
        "output",
        guardrails.output.models if guardrails.output else None,
        "guardrail_config.output.models",
    )
    defaults = target.config.decoding_defaults
    gen_request = GenerationRequest(
        prompt=body.inputs,
        params=GenerationParams(
            max_new_tokens=max_new,
            budget_is_default=params.max_new_tokens is None,
            min_new_tokens=params.min_new_tokens,
            decoding_method=params.decoding_method,
            temperature=_or_default(params, "temperature", defaults.temperature),
            top_k=params.top_k,
            top_p=_or_default(params, "top_p", defaults.top_p),
            seed=params.seed,
            repetition_penalty=_or_default(
                params, "repetition_penalty", defaults.repetition_penalty
            ),
            stop_sequences=tuple(params.stop_sequences),
            max_time=params.max_time,
            defaulted=frozenset(
                name
                for name in ("temperature", "top_p", "repetition_penalty")
                if name not in params.model_fields_set and getattr(defaults, name) is not None
            ),
        ),
        chat=target.config.chat,
        request_id=request.get("request_id", ""),
    )
    return await build_pipeline(
        request,
        target,
        gen_request,
        inputs=body.inputs,
        masks=masks,
        input_detectors=input_dets,
        output_detectors=output_dets,
        keepalive=streaming,
    )


def _or_default(params: TextGenParameters, name: str, default: float | None) -> float:
    """The request's value when it set one, else the model's configured default, else ours."""
    value: float = getattr(params, name)
    if name in params.model_fields_set or default is None:
        return value
    return default
