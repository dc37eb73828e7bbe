"""Reading a JSON body into a pydantic model, with the API's 4xx errors for every way it can be
wrong (DESIGN section 4: a client mistake is never a 5xx)."""

from __future__ import annotations

import difflib
import json
import typing
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from ..api.errors import ApiError, ErrorType, invalid

M = TypeVar("M", bound=BaseModel)


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(model, err["loc"])
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _did_you_mean(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    """A hint for a misspelt or guessed field (`parameters` -> `text_gen_parameters`), from the
    fields of the model the unknown key sits in."""
    fields = _fields_at(model, loc[:-1])
    if not fields or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], fields, n=1, cutoff=0.6)
    if not close:
        return f" (expected one of: {', '.join(sorted(fields))})"
    return f" (did you mean `{close[0]}`?)"


def _fields_at(model: type[BaseModel] | None, path: tuple[Any, ...]) -> list[str]:
    """Field names of the (nested) model at `path`; [] when the path leaves pydantic models."""
    current: Any = model
    for part in path:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = _model_in(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [name for name, f in current.model_fields.items() if not f.exclude]
    return []


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside `X | None` (the only wrapping request models use for submodels)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def require_json_content_type(request: web.Request) -> None:
    ctype = request.content_type
    if ctype not in ("application/json", "") and not ctype.endswith("+json"):
        raise ApiError(
            415, ErrorType.INVALID_REQUEST, f"expected content-type application/json, got {ctype}"
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    try:
        # NaN and Infinity are not JSON; Python's parser accepts them unless told not to
        return json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, ErrorType.INVALID_REQUEST, f"invalid JSON body: {exc}") from None


def validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(describe_validation_error(exc, model)) from None


def too_large(limit: int) -> ApiError:
    """413 naming the limit, so a client knows how far to cut its request."""
    return ApiError(413, ErrorType.INVALID_REQUEST, f"request body too large (limit {limit} bytes)")


async def read_model(request: web.Request, model: type[M]) -> M:
    require_json_content_type(request)
    try:
        raw = await request.read()  # bounded by the app's client_max_size
    except web.HTTPRequestEntityTooLarge:
        raise too_large(request.client_max_size) from None
    return validate(model, parse_json(raw))
