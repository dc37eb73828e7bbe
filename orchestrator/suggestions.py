""" "Did you mean" for a misspelt key, id or value: one rule for the config's errors and the
API's. A typo (`hots`, `sentense`, `blok`) is the most common config mistake, and naming the
closest valid choice (or listing them all) saves a trip to the reference."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from pydantic import BaseModel


def did_you_mean(word: object, choices: Iterable[str], quote: str = "'") -> str:
    """` (did you mean 'x'?)` for the closest choice, else ` (expected one of: a, b)`; "" when
    there is nothing to choose from."""
    options = sorted(set(choices))
    if not options:
        return ""
    if isinstance(word, str):
        close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
        if close:
            return f" (did you mean {quote}{close[0]}{quote}?)"
    return f" (expected one of: {', '.join(options)})"


def closest(word: object, choices: Iterable[str], quote: str = "'") -> str:
    """` (did you mean 'x'?)` when a choice is close, else "" (for messages that already list
    the valid values)."""
    hint = did_you_mean(word, choices, quote)
    return hint if hint.startswith(" (did you mean") else ""


def fields_at(root: Any, loc: Sequence[Any]) -> list[str]:
    """Field names of the pydantic model reached from `root` (a model or an annotation) along a
    validation error's `loc`: model fields, dict keys, list indices and discriminated unions'
    tags (`models.m.backends.0.native`) are followed. [] when the path leaves the models."""
    current: Any = root
    for part in loc:
        current = _step(current, part)
        if current is None:
            return []
    model = _model(current)
    return [name for name, f in model.model_fields.items() if not f.exclude] if model else []


def _model(annotation: Any) -> type[BaseModel] | None:
    """The model `annotation` is, or the one model inside `X | None` / `Annotated[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        models = [m for a in typing.get_args(annotation) if (m := _model(a)) is not None]
        return models[0] if len(models) == 1 else None
    return None


def _step(annotation: Any, part: Any) -> Any:
    """What `annotation` holds at `part` (None if nothing)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _step(typing.get_args(annotation)[0], part)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(part))
        return None if field is None else field.annotation
    if origin is dict:
        return typing.get_args(annotation)[1] if isinstance(part, str) else None
    if origin in (list, tuple, set, frozenset):
        return typing.get_args(annotation)[0] if isinstance(part, int) else None
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        for member in members:  # a discriminated union's tag names its member
            model = _model(member)
            tag = model.model_fields.get("type") if model else None
            if tag is not None and part in typing.get_args(tag.annotation):
                return member
        for member in members:
            found = _step(member, part)
            if found is not None:
                return found
    return None
