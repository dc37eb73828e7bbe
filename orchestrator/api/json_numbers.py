"""Numbers as JSON Schema means them, shared by every request model: pydantic's lax mode would
take `true` or "5" for a number, and Python's JSON parser yields NaN, Infinity (`1e400`) and
integers no float can hold (`1` and 400 zeros), each of which must be a 422, never a 500."""

from __future__ import annotations

import math
from typing import Any


def json_number(v: Any) -> Any:
    """A finite number (None passes: optional fields)."""
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError("must be a finite number")
    try:
        as_float = float(v)  # an int beyond a float's range raises here, not in isfinite
    except OverflowError:
        raise ValueError("must be a finite number") from None
    if not math.isfinite(as_float):
        raise ValueError("must be a finite number")
    return v


def json_integer(v: Any) -> Any:
    """An integer; 5.0 stays valid, as in JSON Schema (None passes: optional fields)."""
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError("must be an integer")
    if isinstance(v, float) and not v.is_integer():  # inf and NaN included (int() raises)
        raise ValueError("must be an integer")
    return int(v)
