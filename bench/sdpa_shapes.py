"""First use of each attention shape against the second, per SDPA backend (issue 21's greedy gap).

    python bench/sdpa_shapes.py [--device cuda] [--rows 1,64] [--widths 100:228]

The engine's eager decode step calls `scaled_dot_product_attention` with a padding mask whose
width grows by one every step, so every step of a stream's first pass is a shape the process has
not seen. On an H100 with a recent torch (CUDA 13 builds, cuDNN > 9.15) the dispatcher puts
cuDNN attention first, and cuDNN builds an execution graph per new shape; the second pass over
the same widths hits its cache. `bench/engine.py` ran greedy first on every fresh engine, so
greedy paid those builds and sampling, run next at the same widths, did not: 1 and 64 streams
2-5x slower greedy, 256 streams (shapes already seen at 64 rows) equal.

This times one decode-shaped call (smollm2-135m's 9 query and 3 KV heads of 64, bf16 on CUDA,
float32 on a CPU) at each width, a first pass and a second pass, with the default backend order
and with cuDNN attention disabled. A first pass far slower than the second with the default
order only confirms it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def sweep(device: torch.device, rows: int, widths: range, dtype: torch.dtype) -> list[float]:
    """Seconds of one masked decode-shaped attention call per width, in order."""
    heads, kv_heads, dim = 9, 3, 64
    out = []
    for width in widths:
        q = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype)
        k = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype)
        v = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype)
        lengths = torch.randint(width // 2, width + 1, (rows,), device=device)
        mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
        mask = mask[:, None, None, :]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - start)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--widths", default="100:228", help="first:last (exclusive)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    first, last = (int(x) for x in args.widths.split(":"))
    widths = range(first, last)
    settings = [("default order", True)]
    if device.type == "cuda":
        settings.append(("cuDNN attention disabled", False))
    for name, cudnn in settings:
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for rows in [int(r) for r in args.rows.split(",") if r]:
            a = sweep(device, rows, widths, dtype)
            b = sweep(device, rows, widths, dtype)
            print(
                f"{name:>24}, {rows:>3} rows, widths {first}-{last - 1}: first pass "
                f"{1e3 * statistics.median(a):7.3f} ms median ({1e3 * sum(a):8.1f} ms total), "
                f"second pass {1e3 * statistics.median(b):7.3f} ms median "
                f"({1e3 * sum(b):8.1f} ms total)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
