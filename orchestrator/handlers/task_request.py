"""Validation shared by both task endpoints: everything that can be wrong with a request is found
here, before any response byte is sent (DESIGN section 4)."""

from __future__ import annotations

from aiohttp import web

from ..api.errors import invalid, not_found
from ..api.requests import GuardrailsHttpRequest
from ..clients.generation import GenerationParams, GenerationRequest
from ..state import STATE
from ..streaming.guarded_generation import GuardedGeneration
from .body import read_model


async def prepare_generation(request: web.Request) -> GuardedGeneration:
    state = request.app[STATE]
    body = await read_model(request, GuardrailsHttpRequest)
    model = state.config.models.get(body.model_id)
    backend = state.backends.get(body.model_id)
    if model is None or backend is None:
        raise not_found(f"model `{body.model_id}` not found")
    params = body.text_gen_parameters
    limits = model.limits
    if len(body.inputs) > limits.max_input_chars:
        raise invalid(
            f"inputs: {len(body.inputs)} characters exceed this model's limit of "
            f"{limits.max_input_chars}"
        )
    max_new = params.max_new_tokens or min(limits.default_max_new_tokens, limits.max_new_tokens)
    if max_new > limits.max_new_tokens:
        raise invalid(
            f"text_gen_parameters.max_new_tokens: {max_new} exceeds this model's limit of "
            f"{limits.max_new_tokens}"
        )
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
    assert state.detectors is not None
    input_dets = (
        state.detectors.resolve(guardrails.input.models, "input", "guardrail_config.input.models")
        if guardrails.input
        else []
    )
    output_dets = (
        state.detectors.resolve(
            guardrails.output.models, "output", "guardrail_config.output.models"
        )
        if guardrails.output
        else []
    )
    gen_request = GenerationRequest(
        prompt=body.inputs,
        params=GenerationParams(
            max_new_tokens=max_new,
            min_new_tokens=params.min_new_tokens,
            decoding_method=params.decoding_method,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            repetition_penalty=params.repetition_penalty,
            stop_sequences=tuple(params.stop_sequences),
            max_time=params.max_time,
        ),
        chat=model.chat,
        request_id=request.get("request_id", ""),
    )
    return GuardedGeneration(
        backend=backend,
        request=gen_request,
        inputs=body.inputs,
        masks=masks,
        input_detectors=input_dets,
        output_detectors=output_dets,
        chunkers=state.chunkers,
        timeout_s=state.config.server.request_timeout_s,
        seed=params.seed,
        observer=state.metrics.observer(),
    )
