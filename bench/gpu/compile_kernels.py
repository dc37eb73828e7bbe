"""Compile the batch-invariant Triton kernels (generation/invariant_kernels.py) for a GPU target
without a GPU: triton's own front end and the ptxas in its wheel, down to a cubin.

    TRITON_INTERPRET=0 python bench/gpu/compile_kernels.py [--arch 90]

Why: on a machine without a GPU the kernels run in triton's interpreter, which executes the
Python of each program and never compiles it; a kernel that the interpreter accepts may still
not compile (types of loop-carried values, `tl.dot` shapes, globals a kernel may not read). This
compiles every kernel with the constexprs the engine launches it with, for bf16 and float32,
and prints one line per kernel. It does not run anything: speed and bits need the GPU.

Attention is compiled from its launches (`invariant_kernels._attention_launch` on CPU tensors:
decode steps over a static cache, prefills alone, padded batches with boolean and additive masks,
odd lengths and offsets), through Triton's own argument specialization for the target: they must
all select one compilation, the one binary that makes a query's result the same in every launch
(invariant_kernels.py's docstring); the script fails when they do not.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before torch (which imports triton) and the kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from generation import invariant_kernels as ik

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(target: GPUTarget, fn: object, signature: dict[str, str], constexprs: dict, **options):
    """Compile `fn` (a JITFunction) for `target`; the compiled kernel."""
    names = fn.arg_names  # type: ignore[attr-defined]
    full = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(
        fn=fn,
        signature={name: full[name] for name in names},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    return triton.compile(source, target=target, options=options)


#: Head sizes whose attention launches are checked: smollm2's (and GPT-2's), and one that is not
#: a multiple of 16 (every tensor copied to padded rows).
HEAD_SIZES = (64, 24)


def attention_launches(dtype: torch.dtype, dim: int) -> list[tuple[str, list[object], dict]]:
    """The attention launches of one dtype and head size that must share a binary: (what,
    arguments, constexprs and options), as `invariant_kernels.attention` makes them."""
    heads, kv_heads, longest = 9, 3, 40  # smollm2's heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    q, k, v = (
        rand(8, heads, longest, dim),
        rand(8, kv_heads, longest, dim),
        rand(8, kv_heads, longest, dim),
    )
    cases: list[tuple[str, tuple]] = []
    for n in (1, 17, 38):  # a prefill alone, no mask, lengths 1 and odd
        cases.append(
            (f"prefill alone, {n} tokens", (q[1:2, :, :n], k[1:2, :, :n], v[1:2, :, :n], None))
        )
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    for rows in (1, 7):  # a right-padded batch, boolean and additive masks
        ends = torch.arange(rows)[:, None] + 30
        mask = (torch.arange(longest)[None, :] < ends)[:, None, None, :] & causal
        cases.append((f"padded prefill of {rows}", (q[:rows], k[:rows], v[:rows], mask)))
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
        cases.append(
            (f"padded prefill of {rows}, additive mask", (q[:rows], k[:rows], v[:rows], additive))
        )
    for width in (64, 128, 48):  # decode steps over a static cache: one query, masked columns
        cache_k, cache_v = rand(8, kv_heads, width, dim), rand(8, kv_heads, width, dim)
        step = rand(8, heads, 1, dim)
        for rows in (1, 3, 8):
            mask = (torch.arange(width)[None, :] < torch.arange(rows)[:, None] + 20)[:, None, None]
            cases.append(
                (
                    f"decode of {rows} over {width}",
                    (step[:rows], cache_k[:rows], cache_v[:rows], mask),
                )
            )
    cases.append(("an odd offset", (q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], None)))
    out = []
    for what, (query, key, value, mask) in cases:
        _grid, args, options, _out = ik._attention_launch(query, key, value, mask, dim**-0.5)
        out.append((what, args, options))
    return out


def build_from_launches(target: GPUTarget, fn, launches: list[tuple[str, list[object], dict]]):
    """Compile `fn` as Triton would for `target` at each launch (its own specialization of the
    arguments); raises SystemExit naming the launches when they select more than one binary."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    keys: dict[str, list[str]] = {}
    bound = specialization = options = None
    for what, args, kwargs in launches:
        constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        bound, specialization, _ = binder(*args, **constexprs)
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        keys.setdefault(repr((specialization, sorted(options.items()))), []).append(what)
    if len(keys) != 1:
        raise SystemExit(
            f"{fn.__name__}: {len(keys)} binaries for one dtype: {list(keys.values())}"
        )
    opts, signature, constexprs, attrs = fn._pack_args(
        backend, options, bound, specialization, options
    )
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=opts.__dict__), len(launches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100)")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for name, dtype in DTYPES.items():
        block_m, block_n, block_k, warps, stages = ik._tiles(dtype)
        precision = "ieee" if dtype == torch.float32 else "tf32"
        pointer = f"*{name}"
        kernels = [
            (
                "matmul",
                ik._matmul_kernel,
                {
                    **dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "out_ptr"), pointer),
                    **dict.fromkeys(
                        "M N K stride_xm stride_xk stride_wk stride_wn stride_om stride_on".split(),
                        "i32",
                    ),
                },
                {
                    "HAS_BIAS": True,
                    "BLOCK_M": block_m,
                    "BLOCK_N": block_n,
                    "BLOCK_K": block_k,
                    "INTERPRETED": False,
                    "PRECISION": precision,
                },
                {"num_warps": warps, "num_stages": stages},
            ),
            (
                "rms_norm",
                ik._rms_norm_kernel,
                {
                    **dict.fromkeys(("x_ptr", "w_ptr", "out_ptr"), pointer),
                    **dict.fromkeys(("R", "stride_x", "stride_o", "H"), "i32"),
                    "eps": "fp32",
                },
                {"ROWS": ik.NORM_ROWS, "BLOCK": 1024},
                {},
            ),
            (
                "layer_norm",
                ik._layer_norm_kernel,
                {
                    **dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "out_ptr"), pointer),
                    **dict.fromkeys(("R", "stride_x", "stride_o", "H"), "i32"),
                    "eps": "fp32",
                },
                {"HAS_WEIGHT": True, "HAS_BIAS": True, "ROWS": ik.NORM_ROWS, "BLOCK": 1024},
                {},
            ),
        ]
        for label, fn, signature, constexprs, options in kernels:
            compiled = build(target, fn, signature, constexprs, **options)
            print(f"sm_{args.arch} {name} {label}: cubin {len(compiled.asm['cubin'])} bytes")
        for dim in HEAD_SIZES:
            compiled, launches = build_from_launches(
                target, ik._attention_kernel, attention_launches(dtype, dim)
            )
            print(
                f"sm_{args.arch} {name} attention, head size {dim}: cubin"
                f" {len(compiled.asm['cubin'])} bytes, one binary for {launches} launches"
                " (decode, prefill alone, padded batches)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
