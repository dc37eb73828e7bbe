"""The FMS task request (DESIGN 4.2) as a generation ask; shared by the streaming and the unary
task endpoints (and generation-detection), which hand `prepare` to the serving loop."""

from __future__ import annotations

from aiohttp import web

from ..api.fms_requests import GuardrailsHttpRequest
from ..tenants import CALLER
from .prepare import Decoding, GenerationAsk

# the engine's parameters are `text_gen_parameters`' own fields (DESIGN 4.2)
FMS_PARAM_FIELDS = {
    name: f"text_gen_parameters.{name}"
    for name in (
        "decoding_method",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "seed",
        "stop_sequences",
        "max_time",
    )
}


def task_ask(
    request: web.Request, body: GuardrailsHttpRequest, *, streaming: bool
) -> GenerationAsk:
    params = body.text_gen_parameters
    given = params.model_fields_set
    guardrails = body.guardrail_config
    return GenerationAsk(
        model=body.model_id,
        prompt=body.inputs,
        inputs=body.inputs,
        input_chars=len(body.inputs),
        input_field="inputs",
        max_tokens=params.max_new_tokens,
        max_tokens_field="text_gen_parameters.max_new_tokens",
        min_tokens_field="text_gen_parameters.min_new_tokens",
        decoding=Decoding(
            method=params.decoding_method,
            # unset fields: the model's decoding_defaults, then the API's defaults
            temperature=params.temperature if "temperature" in given else None,
            top_p=params.top_p if "top_p" in given else None,
            repetition_penalty=params.repetition_penalty if "repetition_penalty" in given else None,
            top_k=params.top_k,
            min_new_tokens=params.min_new_tokens,
            seed=params.seed,
            stop=tuple(params.stop_sequences),
            max_time=params.max_time,
        ),
        input_detectors=guardrails.input.models if guardrails.input else None,
        output_detectors=guardrails.output.models if guardrails.output else None,
        input_detectors_field="guardrail_config.input.models",
        output_detectors_field="guardrail_config.output.models",
        masks=guardrails.input.masks if guardrails.input else None,
        masks_field="guardrail_config.input.masks",
        stream=streaming,
        request_id=request.get("request_id", ""),
        caller=request.get(CALLER),
        param_fields=FMS_PARAM_FIELDS,
    )
