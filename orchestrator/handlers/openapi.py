"""GET /openapi.json, generated from the pydantic models of orchestrator/api (never by hand)."""

from __future__ import annotations

from functools import cache
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .. import __version__
from ..api.errors import ErrorBody
from ..api.requests import ContentDetectionRequest, GuardrailsHttpRequest, StreamContentLine
from ..api.responses import (
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

_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": _json(ErrorBody)} for c in codes}


@cache
def build_openapi() -> dict[str, Any]:
    models: list[type[BaseModel]] = [
        GuardrailsHttpRequest,
        ContentDetectionRequest,
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
    ]
    _, schema = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    client_errors = _errors(400, 401, 404, 413, 415, 422, 429)
    task_body = {"required": True, "content": _json(GuardrailsHttpRequest)}
    paths: dict[str, Any] = {
        "/api/v1/task/server-streaming-classification-with-text-generation": {
            "post": {
                "summary": "Generation streamed through detectors: SSE of classified frames and one terminal event",
                "requestBody": task_body,
                "responses": {
                    "200": {
                        "description": "SSE: `data:` frames (ClassifiedFrame), then one of the events completed|incomplete|failed (TerminalSummary), error (ErrorBody), refusal.delta/refusal.done",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                    **client_errors,
                },
            }
        },
        "/api/v1/task/classification-with-text-generation": {
            "post": {
                "summary": "The same, as one JSON object",
                "requestBody": task_body,
                "responses": {
                    "200": {
                        "description": "result",
                        "content": _json(ClassifiedGeneratedTextResult),
                    },
                    **client_errors,
                    **_errors(502, 503, 504),
                },
            }
        },
        "/api/v2/text/detection/content": {
            "post": {
                "summary": "Detectors on a given text",
                "requestBody": {"required": True, "content": _json(ContentDetectionRequest)},
                "responses": {
                    "200": {
                        "description": "detections",
                        "content": _json(ContentDetectionResponse),
                    },
                    **client_errors,
                    **_errors(502),
                },
            }
        },
        "/api/v2/text/detection/stream-content": {
            "post": {
                "summary": "NDJSON lines (StreamContentLine) in, NDJSON StreamContentResult out",
                "requestBody": {
                    "required": True,
                    "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
                },
                "responses": {
                    "200": {
                        "description": "NDJSON of StreamContentResult",
                        "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
                    },
                    **client_errors,
                },
            }
        },
        "/health": {
            "get": {
                "responses": {"200": {"description": "alive", "content": _json(HealthResponse)}}
            }
        },
        "/info": {
            "get": {
                "responses": {
                    "200": {"description": "ready", "content": _json(InfoResponse)},
                    "503": {"description": "not ready", "content": _json(InfoResponse)},
                }
            }
        },
        "/metrics": {
            "get": {
                "responses": {
                    "200": {
                        "description": "Prometheus text",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                }
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "guardstream orchestrator", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def handle(request: web.Request) -> web.Response:
    return web.json_response(build_openapi())
