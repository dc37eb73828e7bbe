"""GET /openapi.json, generated from the pydantic models of orchestrator/api (never by hand)."""

from __future__ import annotations

from functools import cache
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .. import __version__
from ..api import openai_responses
from ..api.errors import ErrorBody
from ..api.fms_detection import (
    ChatDetectionRequest,
    ContextDetectionRequest,
    DetectionsResponse,
    GeneratedDetectionRequest,
    GenerationDetectionRequest,
    GenerationDetectionResponse,
)
from ..api.fms_requests import (
    ContentDetectionRequest,
    DetectorParams,
    GuardrailsHttpRequest,
    StreamContentLine,
)
from ..api.fms_responses import (
    ClassifiedFrame,
    ClassifiedGeneratedTextResult,
    ContentDetectionResponse,
    HealthResponse,
    InfoResponse,
    RefusalDelta,
    RefusalDone,
    StreamContentResult,
    TerminalSummary,
)
from ..api.openai_chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ModelList,
    OpenAIErrorBody,
)
from ..api.openai_completions import Completion, CompletionRequest
from ..state import STATE
from ..tenants import CALLER
from .health import AUTHENTICATED

_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": _json(ErrorBody)} for c in codes}


# Paths answered without a key when server.api_keys_env is set (app.PROBE_PATHS), and /metrics
# with server.public_metrics
PUBLIC_PATHS = frozenset({"/health", "/info", "/openapi.json"})
# Errors any /api/* request can get before its work starts (validation, auth, size, overload).
CLIENT_ERRORS = (400, 401, 404, 413, 415, 422, 429)
# Errors of the service or of what it depends on; draining answers 503 on every /api/* route.
SERVER_ERRORS = (500, 502, 503, 504)


def _sse_event() -> dict[str, Any]:
    """One event of the streaming endpoint (OpenAPI 3.1: the schema of a `text/event-stream`
    describes each event). A frame has no `event:` line, which SSE readers report as `message`;
    every `data:` is JSON of the model its event names."""

    def event(names: list[str], model: type[BaseModel]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["data"],
            "properties": {
                "event": {"enum": names},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": _ref(model),
                },
            },
        }

    return {
        "oneOf": [
            event(["message"], ClassifiedFrame),
            event(["completed", "incomplete", "failed"], TerminalSummary),
            event(["error"], ErrorBody),
            event(["refusal.delta"], RefusalDelta),
            event(["refusal.done"], RefusalDone),
        ]
    }


def _responses_operation(errors: tuple[int, ...]) -> dict[str, Any]:
    """POST /v1/responses (DESIGN 4.9): one JSON object, or with `stream: true` SSE events whose
    `event:` line names the `type` of their `data:` JSON; errors have OpenAI's body."""
    r = openai_responses
    events = [
        {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string"},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": _ref(model),
                },
            },
        }
        for model in r.STREAM_EVENT_MODELS
    ]
    error = {"description": "error", "content": _json(r.OpenAIErrorBody)}
    return {
        "post": {
            "operationId": "createResponse",
            "summary": "OpenAI Responses API with guardrails and the OpenResponses events",
            "description": "Stateless: `previous_response_id`, `store: true`, `background`, "
            "`conversation`, `prompt` and hosted tools are 400; function tools go to an `openai` "
            "chat backend or a native engine whose chat template takes them. Errors found before the reply starts "
            "are real HTTP errors. A stream ends with exactly one of `response.completed`, "
            "`response.incomplete`, `response.failed`, or `error` (no response was created).",
            "requestBody": {"required": True, "content": _json(r.ResponsesRequest)},
            "responses": {
                "200": {
                    "description": "the response object, or its SSE events with `stream: true`",
                    "content": {
                        **_json(r.ResponseObject),
                        "text/event-stream": {"schema": {"oneOf": events}},
                    },
                },
                **{str(c): error for c in errors},
            },
        }
    }


def _chat_operation(operation_id: str, errors: tuple[int, ...]) -> dict[str, Any]:
    """POST /v1/chat/completions and its FMS alias (DESIGN 4.8): one `chat.completion`, or with
    `stream: true` SSE `data:` lines (chunks, at most one in-band error object, then `[DONE]`);
    errors before the reply starts have OpenAI's body."""

    def data(schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "required": ["data"], "properties": {"data": schema}}

    def json_of(model: type[BaseModel]) -> dict[str, Any]:
        return {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": _ref(model),
        }

    error = {"description": "error", "content": _json(OpenAIErrorBody)}
    return {
        "post": {
            "operationId": operation_id,
            "summary": "OpenAI Chat Completions with guardrails",
            "description": "`detectors: {input, output}` (through an SDK's `extra_body`) adds "
            "detectors to the model's enforced guardrails; `n` must be 1; `tools` go to an "
            "`openai` chat backend or a native engine whose chat template takes them (else "
            "422); the legacy functions and audio are 422. Errors found before the reply starts are real HTTP errors. A stream "
            "is `data:` lines of ChatCompletionChunk objects with exactly one `finish_reason` "
            "(`stop`, `length`, `content_filter`, `tool_calls`) or one in-band OpenAIErrorBody, then "
            "`data: [DONE]` last. A block or an input hit ends with a `refusal` and "
            "`content_filter`; detections ride in the `detections` extension.",
            "requestBody": {"required": True, "content": _json(ChatCompletionRequest)},
            "responses": {
                "200": {
                    "description": "the completion, or its SSE chunks with `stream: true`",
                    "content": {
                        **_json(ChatCompletion),
                        "text/event-stream": {
                            "schema": {
                                "oneOf": [
                                    data(json_of(ChatCompletionChunk)),
                                    data(json_of(OpenAIErrorBody)),
                                    data({"const": "[DONE]"}),
                                ]
                            }
                        },
                    },
                },
                **{str(c): error for c in errors},
            },
        }
    }


def _name_deployment(
    schemas: dict[str, Any], model_ids: tuple[str, ...], detector_ids: tuple[str, ...]
) -> None:
    """Narrows `model_id` and every detector map's keys to what this deployment serves, so
    clients and fuzzers see the ids that exist (anything else is a 404 with the error body)."""
    if model_ids:
        schemas["GuardrailsHttpRequest"]["properties"]["model_id"]["enum"] = list(model_ids)
        schemas["GenerationDetectionRequest"]["properties"]["model_id"]["enum"] = list(model_ids)
        schemas["CompletionRequest"]["properties"]["model"]["enum"] = list(model_ids)
        schemas["ResponsesRequest"]["properties"]["model"]["enum"] = list(model_ids)
        schemas["ChatCompletionRequest"]["properties"]["model"]["enum"] = list(model_ids)
    if not detector_ids:
        return
    params_ref = _ref(DetectorParams)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and node.get("additionalProperties") == params_ref:
                node["propertyNames"] = {"enum": list(detector_ids)}
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schemas)


def _fms_detection_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """The FMS orchestrator's detection endpoints beyond `content` (issue 40)."""

    def op(op_id: str, summary: str, request: type[BaseModel], reply: type[BaseModel]) -> Any:
        return {
            "post": {
                "operationId": op_id,
                "summary": summary,
                "requestBody": {"required": True, "content": _json(request)},
                "responses": {"200": {"description": "result", "content": _json(reply)}, **errors},
            }
        }

    return {
        "/api/v2/text/detection/chat": op(
            "detectChat",
            "Detectors on a conversation: text_chat detectors judge it whole, text_contents "
            "detectors each message",
            ChatDetectionRequest,
            DetectionsResponse,
        ),
        "/api/v2/text/detection/context": op(
            "detectContext",
            "text_context_doc detectors on a text against its context documents",
            ContextDetectionRequest,
            DetectionsResponse,
        ),
        "/api/v2/text/detection/generated": op(
            "detectGenerated",
            "Detectors on a prompt and its generated text: text_generation detectors judge "
            "both, text_contents detectors the generated text",
            GeneratedDetectionRequest,
            DetectionsResponse,
        ),
        "/api/v2/text/generation-detection": op(
            "generationWithDetection",
            "Generate (the model's limits and enforced guardrails apply), then judge the prompt "
            "and the generated text",
            GenerationDetectionRequest,
            GenerationDetectionResponse,
        ),
        "/api/v2/text/completions-detection": {
            "post": {
                "operationId": "completionsWithDetection",
                "summary": "OpenAI Completions with input and output detectors (FMS shape)",
                "description": "Unary: one `text_completion` (Completion). With `stream: true`: "
                "SSE of `data:` Completion chunks, `data: [DONE]` last; an error after the "
                "first chunk is `event: error` with an ErrorBody, then `[DONE]`.",
                "requestBody": {"required": True, "content": _json(CompletionRequest)},
                "responses": {
                    "200": {
                        "description": "the completion, or its chunks",
                        "content": {
                            **_json(Completion),
                            # each event: `data:` a Completion chunk or `[DONE]`; `error`
                            "text/event-stream": {
                                "schema": {
                                    "type": "object",
                                    "required": ["data"],
                                    "properties": {
                                        "event": {"enum": ["message", "error"]},
                                        "data": {"type": "string"},
                                    },
                                }
                            },
                        },
                    },
                    **errors,
                },
            }
        },
    }


_COUNT = {"type": "integer", "minimum": 0}
USAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "object",
        "tenant",
        "requests",
        "prompt_tokens",
        "generated_tokens",
        "detections",
        "refusals",
    ],
    "properties": {
        "object": {"const": "usage"},
        "tenant": {"type": "string"},
        "requests": _COUNT,
        "prompt_tokens": _COUNT,
        "generated_tokens": _COUNT,
        "detections": _COUNT,
        "refusals": _COUNT,
    },
}
RELOADED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["reloaded", "tenants"],
    "properties": {
        "reloaded": {"const": True},
        "tenants": {"type": "array", "items": {"type": "string"}},
    },
}
RELOAD_ERRORS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["code", "details", "type", "errors"],
    "properties": {
        "code": {"const": 422},
        "details": {"type": "string"},
        "type": {"const": "invalid_request"},
        "errors": {"type": "array", "items": {"type": "string"}},
    },
}
RELOAD_PARTIAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["code", "details", "type", "errors"],
    "properties": {
        "code": {"const": 500},
        "details": {"type": "string"},
        "type": {"const": "server_error"},
        "errors": {"type": "array", "items": {"type": "string"}},
    },
}


def _plain_json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


@cache
def build_openapi(
    auth: bool = False,
    model_ids: tuple[str, ...] = (),
    detector_ids: tuple[str, ...] = (),
    public_metrics: bool = False,
) -> dict[str, Any]:
    """The document. `auth` adds the bearer requirement to every path but PUBLIC_PATHS
    (server.api_keys_env set; /metrics too unless `public_metrics`); `model_ids` and
    `detector_ids` name what the deployment serves."""
    models: list[type[BaseModel]] = [
        GuardrailsHttpRequest,
        ContentDetectionRequest,
        ChatDetectionRequest,
        ContextDetectionRequest,
        GeneratedDetectionRequest,
        GenerationDetectionRequest,
        DetectionsResponse,
        GenerationDetectionResponse,
        CompletionRequest,
        Completion,
        StreamContentLine,
        ClassifiedFrame,
        ClassifiedGeneratedTextResult,
        ContentDetectionResponse,
        StreamContentResult,
        TerminalSummary,
        RefusalDelta,
        RefusalDone,
        ErrorBody,
        HealthResponse,
        InfoResponse,
        *openai_responses.OPENAPI_MODELS,
        ChatCompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
        OpenAIErrorBody,
        ModelList,
    ]
    _, schema = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas: dict[str, Any] = schema.get("$defs", {})
    _name_deployment(schemas, model_ids, detector_ids)
    errors = _errors(*CLIENT_ERRORS, *SERVER_ERRORS)
    task_body = {"required": True, "content": _json(GuardrailsHttpRequest)}
    ndjson = "application/x-ndjson"
    paths: dict[str, Any] = {
        "/api/v1/task/server-streaming-classification-with-text-generation": {
            "post": {
                "operationId": "streamingClassificationWithGeneration",
                "summary": "Generation streamed through detectors: SSE of classified frames and "
                "one terminal event",
                "description": "Validation errors are real HTTP errors sent before any byte of "
                "the stream. After them the reply is `text/event-stream`: `data:` messages "
                "without an `event:` line are ClassifiedFrame objects; then exactly one terminal "
                "event: `completed` or `incomplete` (TerminalSummary), `failed` (TerminalSummary "
                "with `error`), or `error` (ErrorBody). A blocking detection sends "
                "`refusal.delta` (RefusalDelta) and `refusal.done` (RefusalDone) before "
                "`incomplete`.",
                "requestBody": task_body,
                "responses": {
                    "200": {
                        "description": "SSE of classified frames and one terminal event",
                        "content": {"text/event-stream": {"schema": _sse_event()}},
                    },
                    **errors,
                },
            }
        },
        "/api/v1/task/classification-with-text-generation": {
            "post": {
                "operationId": "classificationWithGeneration",
                "summary": "The same, folded into one JSON object",
                "requestBody": task_body,
                "responses": {
                    "200": {
                        "description": "result",
                        "content": _json(ClassifiedGeneratedTextResult),
                    },
                    **errors,
                },
            }
        },
        "/api/v2/text/detection/content": {
            "post": {
                "operationId": "detectContent",
                "summary": "Detectors on a given text; spans relative to the whole content",
                "requestBody": {"required": True, "content": _json(ContentDetectionRequest)},
                "responses": {
                    "200": {
                        "description": "detections",
                        "content": _json(ContentDetectionResponse),
                    },
                    **errors,
                },
            }
        },
        **_fms_detection_paths(errors),
        "/api/v2/text/detection/stream-content": {
            "post": {
                "operationId": "detectStreamContent",
                "summary": "NDJSON text in, NDJSON detections out",
                "description": "The body is NDJSON: each array item below is one line. The "
                "first line names the detectors, later lines must not. The reply is NDJSON, one "
                "StreamContentResult per judged chunk; an error after the reply started is one "
                "last ErrorBody line.",
                "requestBody": {
                    "required": True,
                    "content": {
                        ndjson: {
                            "schema": {
                                "type": "array",
                                "minItems": 1,
                                "items": _ref(StreamContentLine),
                            }
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "NDJSON of StreamContentResult (and at most one final "
                        "ErrorBody line)",
                        "content": {ndjson: {"schema": {"type": "string"}}},
                    },
                    **errors,
                },
            }
        },
        "/v1/responses": _responses_operation((*CLIENT_ERRORS, *SERVER_ERRORS)),
        "/v1/chat/completions": _chat_operation(
            "createChatCompletion", (*CLIENT_ERRORS, *SERVER_ERRORS)
        ),
        "/api/v2/chat/completions-detection": _chat_operation(
            "createChatCompletionDetection", (*CLIENT_ERRORS, *SERVER_ERRORS)
        ),
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The configured model ids, in OpenAI's list shape",
                "responses": {
                    "200": {"description": "the models", "content": _json(ModelList)},
                    "401": {"description": "error", "content": _json(OpenAIErrorBody)},
                },
            }
        },
        "/v1/usage": {
            "get": {
                "operationId": "usage",
                "summary": "The calling tenant's own counters (its key says which tenant)",
                "responses": {
                    "200": {"description": "the counters", "content": _plain_json(USAGE_SCHEMA)},
                    "401": {"description": "error", "content": _json(OpenAIErrorBody)},
                },
            }
        },
        "/admin/reload": {
            "post": {
                "operationId": "reloadConfig",
                "summary": "Read the config file again and apply its tenants, keys, limits and "
                "guardrails (an admin key: server.admin_keys_env)",
                "responses": {
                    "200": {"description": "applied", "content": _plain_json(RELOADED_SCHEMA)},
                    "401": {"description": "error", "content": _json(ErrorBody)},
                    "422": {
                        "description": "not applied: every error of the file, nothing changed",
                        "content": _plain_json(RELOAD_ERRORS_SCHEMA),
                    },
                    "500": {
                        "description": "server.workers > 1: applied by the worker that answers, "
                        "not by every other (`errors`: each such worker and why)",
                        "content": _plain_json(RELOAD_PARTIAL_SCHEMA),
                    },
                },
            }
        },
        "/health": {
            "get": {
                "operationId": "health",
                "summary": "Liveness",
                "responses": {"200": {"description": "alive", "content": _json(HealthResponse)}},
            }
        },
        "/info": {
            "get": {
                "operationId": "info",
                "summary": "Readiness: every replica, detector and chunker",
                "responses": {
                    "200": {"description": "ready", "content": _json(InfoResponse)},
                    "503": {"description": "not ready", "content": _json(InfoResponse)},
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
    }
    if auth:
        public = PUBLIC_PATHS | {"/metrics"} if public_metrics else PUBLIC_PATHS
        for path, item in paths.items():
            if path not in public:
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "guardstream orchestrator", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def handle(request: web.Request) -> web.Response:
    """With auth on, the model and detector ids are named only to a caller with a key (as on
    /v1/models and /info): without one, the document is the generic API."""
    server = request.app[STATE].config.server
    config = request.app[STATE].config
    auth = bool(server.api_keys_env or config.tenants)
    named = not auth or request.get(AUTHENTICATED, False)
    caller = request.get(CALLER)
    document = build_openapi(
        auth,
        tuple(m for m in config.models if caller is None or caller.tenant.sees(m)) if named else (),
        tuple(config.detectors) if named else (),
        server.public_metrics,
    )
    return web.json_response(document)
