"""Compile the batch-invariant Triton kernels (generation/invariant_kernels.py) for a GPU target
without a GPU: triton's own front end and the ptxas in its wheel, down to a cubin.

    TRITON_INTERPRET=0 python bench/gpu/compile_kernels.py [--arch 90]

Why: on a machine without a GPU the kernels run in triton's interpreter, which executes the
Python of each program and never compiles it; a kernel that the interpreter accepts may still
not compile (types of loop-carried values, `tl.dot` shapes, globals a kernel may not read). This
compiles every kernel with the constexprs the engine launches it with, for bf16 and float32,
and prints one line per kernel. It does not run anything: speed and bits need the GPU.
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
from triton.compiler import ASTSource

from generation import invariant_kernels as ik

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ATTENTION_INTS = (
    "H GROUPS Lq Lk D sq_b sq_h sq_l sk_b sk_h sk_l sv_b sv_h sv_l sm_b sm_l sm_k so_b so_l so_h"
).split()


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
        for has_mask in (True, False):
            kernels.append(
                (
                    f"attention{'' if has_mask else ' (no mask)'}",
                    ik._attention_kernel,
                    {
                        **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), pointer),
                        "mask_ptr": "*i1",
                        **dict.fromkeys(ATTENTION_INTS, "i32"),
                        "scale": "fp32",
                    },
                    {
                        "HAS_MASK": has_mask,
                        "BLOCK_M": ik.QUERY_BLOCK,
                        "BLOCK_N": ik.KEY_BLOCK,
                        "BLOCK_D": 64,
                        "INTERPRETED": False,
                        "PRECISION": precision,
                    },
                    {},
                )
            )
        for label, fn, signature, constexprs, options in kernels:
            compiled = build(target, fn, signature, constexprs, **options)
            print(f"sm_{args.arch} {name} {label}: cubin {len(compiled.asm['cubin'])} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
