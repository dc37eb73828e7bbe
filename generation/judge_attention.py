"""The attention of judge passes: the model's own attention function, routed to the pass.

Why. A judge pass (judge_sessions.py's packed pass, judge_graphs.py's static one) reads keys and
values that are not the model's cache: a session's own buffer, or its slot of a pool. The model
calls its attention function by name from transformers' global registry; `install` wraps the
registered function so that, while this thread runs a judge pass (`active`), the call goes to
the pass's `attend` with the model's own function as `base`, and otherwise to that function
unchanged (generation is untouched).

Grouped-query attention (`grouped_attention`): each key/value head's query heads go in as one
group of rows (`[b, kv_heads, groups * t, d]`), so the attention reads the keys as they lie:
transformers' functions would repeat every key/value head per query head whenever a mask is
given (`repeat_kv`), a copy of the whole prefix per layer and pass.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch


class JudgePass(Protocol):
    """A pass whose attention the dispatcher routes to it."""

    def attend(
        self, base: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None]: ...


#: The judge pass this thread is running (`pass_`; None: the model's ordinary forward).
_ACTIVE = threading.local()


def active(judge_pass: JudgePass | None) -> None:
    """Route this thread's attention calls to `judge_pass` (None: back to the model's own)."""
    _ACTIVE.pass_ = judge_pass


def mask_kind(implementation: str) -> str:
    """How a pass's masks are handed to the attention function: "eager" additive (the dtype's
    minimum, as transformers builds them), "sdpa" additive with -inf: what SDPA makes of a
    boolean mask at every call (a `where` per session and layer: on CUDA two more launches each),
    made once per pass, the same values and so the same bits; "boolean" for the others (the
    batch-invariant functions read a boolean mask as it is)."""
    return implementation if implementation in ("eager", "sdpa") else "boolean"


def as_kind(visible: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as `mask_kind` hands it over."""
    if kind == "boolean":
        return visible
    fill = torch.finfo(dtype).min if kind == "eager" else -math.inf
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill(~visible, fill)


def _attention_of(
    module: torch.nn.Module, original: Callable[..., Any] | None
) -> Callable[..., Any]:
    """The model's own attention function: `original` (registered: sdpa, batch_invariant's,
    flash) or, for "eager", the function of the module's modeling file."""
    if original is not None:
        return original
    return sys.modules[type(module).__module__].eager_attention_forward  # type: ignore[no-any-return]


def _dispatching(original: Callable[..., Any] | None) -> Callable[..., Any]:
    """The attention function registered under the model's implementation name: the original
    one, unless this thread runs a judge pass."""

    def attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # (a compiled step is never a judge pass: dynamo does not trace the thread-local)
        judge_pass: JudgePass | None = (
            None if torch.compiler.is_compiling() else getattr(_ACTIVE, "pass_", None)
        )
        if judge_pass is None:
            return _attention_of(module, original)(module, *args, **kwargs)
        return judge_pass.attend(_attention_of(module, original), module, *args, **kwargs)

    attention._gs_judge_dispatch = True  # type: ignore[attr-defined]
    return attention


def install(implementation: str) -> None:
    """Route `implementation`'s attention through `_dispatching` (idempotent). Threads that run
    no judge pass get the original function, so generation is unchanged; it is global because
    transformers looks attention functions up by name in one global registry."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    current = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if current is not None and getattr(current, "_gs_judge_dispatch", False):
        return
    AttentionInterface.register(implementation, _dispatching(current))


def grouped_attention(
    base: Callable[..., Any],
    module: torch.nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """`base` over `query` `[b, heads, t, d]` and `keys`/`values` `[b, kv_heads, n, d]` as they
    lie; `mask` `[b, 1, groups * t, n]` (each query row once per query head of its group).
    Returns `[b, t, heads, d]`."""
    b, heads, t, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if getattr(base, "takes_grouped_keys", False):  # the Triton kernel: no regrouping (it
        # limits each query row causally by its index), each query's mask row once
        out, _ = base(module, query, keys, values, mask[:, :, :t], **kwargs)
        return out  # type: ignore[no-any-return]
    if groups > 1:  # [b, heads, t, d] -> [b, kv_heads, groups * t, d]: no repeated keys
        module = _Ungrouped(module)  # type: ignore[assignment]
        query = query.reshape(b, kv_heads, groups * t, dim)
    out, _ = base(module, query, keys, values, mask, **kwargs)
    if groups > 1:  # [b, groups * t, kv_heads, d] -> [b, t, heads, d]
        out = out.reshape(b, groups, t, kv_heads, dim).permute(0, 2, 3, 1, 4)
        out = out.reshape(b, t, heads, dim)
    return out  # type: ignore[no-any-return]


class _Ungrouped:
    """An attention module as the attention function sees it once the queries are grouped by
    key/value head (`grouped_attention`): one query head per key/value head, nothing to repeat.
    Every other attribute is the module's."""

    __slots__ = ("_module",)
    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
