"""Batch-invariant Triton kernels: `--batch-invariant` on CUDA (batch_invariant.py installs them).

Why. On a GPU a row's logits depend on its batch through the libraries' kernel choice: cuBLAS
picks a kernel (tile shape, split-K) per problem shape, so one row's product differs between
M=1, M=7 and M=64; torch's reductions (`mean`, `cumsum`) pick thread layouts from the tensor's
shape. The CPU mode's workaround (1-row GEMMs and attention as trees of elementwise ops) is
exact on a GPU only where the elementwise ops are, and costs 95% of the throughput there (many
tiny launches). These kernels fix every reduction's order by construction instead:

- `matmul`: `x @ w` with one tile configuration per dtype (`_tiles`), never chosen by M, and no
  split-K: each output element sums K in BLOCK_K steps from 0 to K, one `tl.dot` per step, in
  the same order whatever the number of rows or the row's place among them. Rows past M are
  masked loads (zeros) that no real row reads.
- `rms_norm`, `layer_norm`: one program per row; the row (the hidden size) is reduced in one
  fixed-shape `tl.sum`.
- `attention`: one program per (batch row, query head, query position), over the keys in blocks
  of `KEY_BLOCK` from key 0 upwards, online softmax in float32. A masked key weighs exactly 0 and
  its key and value are never read, so a block past a query's last visible key changes nothing
  (its running max, sum and accumulator stay bit for bit): a query's result is the same whether
  the keys after it are padding, a longer prefill, the static cache's masked columns, or absent.
  Decode (one query) and prefill (many) run the same loop per query, so a resumed row's prefill
  equals its token-by-token decode.

Nothing is autotuned (autotuning keys on shapes, M included); each kernel is compiled once per
(dtype, constexpr) and, on CUDA, compiled by the warm-up runs before the decode graphs are
captured (decode_graphs.StaticDecoder.capture), so the graphs replay the kernels.

Without CUDA (tests), the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set here
when no GPU is present): NumPy executes each program, slowly, with the same reduction structure.
One interpreter difference: its `tl.dot` is NumPy's `matmul` (OpenBLAS), which multiplies
bfloat16 operands as raw uint16 bits (triton 3.6-3.8) and whose float32 result for a row depends
on the row's place in the tile (measured); so under the interpreter the matmul's tiles are
widened to float32, multiplied elementwise and summed over K in index order (`INTERPRETED`). On a
GPU `tl.dot` is the tensor cores' MMA (float32 tiles: "ieee", no TF32), whose result for an
element does not depend on the other rows of the tile; that half is checked on CUDA only.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # no GPU to compile for: run the kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

# (imported after the interpreter switch: triton reads it when each kernel is defined)
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Keys per attention block: a query's keys are reduced block by block, in order, from key 0.
KEY_BLOCK = 32


# ----- matrix products ---------------------------------------------------------------------------


def _tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `dtype`: fixed per dtype, never
    chosen by the problem's shape (an M-dependent choice would change a row's K order)."""
    if dtype in (torch.bfloat16, torch.float16):
        return 64, 64, 64, 4, 3
    return 32, 64, 32, 4, 2


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # M tiles vary fastest: the programs that share a weight tile run side by side (L2 reuse)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):  # K from 0 upwards, one tile at a time: no split
        ks = step * BLOCK_K + inner
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=(ks[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        if INTERPRETED:  # NumPy: products, then a sum over K in index order (docstring)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w (+ bias)` for `x` `[M, K]` and `w` `[K, N]` (any strides: `linear.weight.t()`
    is a view), in `x`'s dtype, float32 accumulation; a row's bits do not depend on M."""
    rows, inner = x.shape
    cols = w.shape[1]
    if w.shape[0] != inner:
        raise ValueError(f"matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not chain")
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, block_n, block_k, warps, stages = _tiles(x.dtype)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n),)
    _matmul_kernel[grid](
        x,
        w,
        bias if bias is not None else out,
        out,
        rows,
        cols,
        inner,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INTERPRETED=_INTERPRET,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    return out


# ----- per-row normalisation -------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=live, other=0.0)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / H
    y = (h * tl.math.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=live, other=0.0)
    # weight * y in the input dtype, as transformers' Llama RMSNorm (one rounding of the product)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension, one program per row (`x` any leading shape)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    if flat.shape[0]:
        hidden = flat.shape[1]
        _rms_norm_kernel[(flat.shape[0],)](
            flat,
            weight,
            out,
            flat.stride(0),
            out.stride(0),
            hidden,
            eps,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(*x.shape[:-1], x.shape[-1])


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    stride_x,
    stride_o,
    H,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < H
    h = tl.load(x_ptr + row * stride_x + offs, mask=live, other=0.0).to(tl.float32)
    mean = tl.sum(h, axis=0) / H
    centred = tl.where(live, h - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / H
    y = centred * tl.math.rsqrt(variance + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=live)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension (GPT-2's), one program per row."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        hidden = flat.shape[1]
        _layer_norm_kernel[(flat.shape[0],)](
            flat,
            weight if weight is not None else flat,
            bias if bias is not None else flat,
            out,
            flat.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape)


# ----- attention -------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    H,
    GROUPS,
    Lq,
    Lk,
    D,
    scale,
    sq_b,
    sq_h,
    sq_l,
    sk_b,
    sk_h,
    sk_l,
    sv_b,
    sv_h,
    sv_l,
    sm_b,
    sm_l,
    sm_k,
    so_b,
    so_l,
    so_h,
    HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # (batch, head, query), query fastest
    query = pid % Lq
    head = (pid // Lq) % H
    batch = pid // (Lq * H)
    kv_head = head // GROUPS
    dims = tl.arange(0, BLOCK_D)
    live_d = dims < D
    q = tl.load(q_ptr + batch * sq_b + head * sq_h + query * sq_l + dims, mask=live_d, other=0.0)
    q = q.to(tl.float32)
    # causal: the queries are the last Lq positions; keys past this one are never visible, so
    # the loop may stop at its block (blocks after it would add exact zeros)
    last = Lk - Lq + query
    peak = tl.full([], -float("inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for block in range(0, tl.cdiv(last + 1, BLOCK_N)):
        keys = block * BLOCK_N + offs
        visible = keys <= last
        if HAS_MASK:
            allowed = tl.load(
                mask_ptr + batch * sm_b + query * sm_l + keys * sm_k, mask=visible, other=0
            )
            visible = visible & (allowed != 0)
        both = visible[:, None] & live_d[None, :]
        k = tl.load(
            k_ptr + batch * sk_b + kv_head * sk_h + keys[:, None] * sk_l + dims[None, :],
            mask=both,
            other=0.0,
        )
        scores = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * scale
        scores = tl.where(visible, scores, -float("inf"))
        new_peak = tl.maximum(peak, tl.max(scores, axis=0))
        # a block with nothing visible yet (left padding) keeps everything at exact zero
        base = tl.where(new_peak == -float("inf"), 0.0, new_peak)
        rescale = tl.exp(peak - base)
        weights = tl.where(visible, tl.exp(scores - base), 0.0)
        v = tl.load(
            v_ptr + batch * sv_b + kv_head * sv_h + keys[:, None] * sv_l + dims[None, :],
            mask=both,
            other=0.0,
        )
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
        peak = new_peak
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + batch * so_b + query * so_l + head * so_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=live_d,
    )


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention: `query` `[B, H, Lq, d]` (the last Lq positions), `key`/`value`
    `[B, Hkv, Lk, d]` (H a multiple of Hkv; any strides with unit stride on d), `mask` boolean
    `[B or 1, 1, Lq or 1, Lk]` (True: attend) or None; returns `[B, Lq, H, d]` in `query`'s
    dtype. Per query, keys reduce in KEY_BLOCK blocks from key 0 (module docstring)."""
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    out = torch.empty((batch, q_len, heads, head_dim), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    if mask is not None:
        if mask.dtype != torch.bool:  # an additive float mask: 0 keeps, -inf/min drops
            mask = mask == 0
        mask = mask.expand(batch, mask.shape[1], q_len, k_len)[:, 0]
        mask_strides = mask.stride()
        mask_arg: torch.Tensor = mask
    else:
        mask_strides = (0, 0, 0)
        mask_arg = out
    _attention_kernel[(batch * heads * q_len,)](
        query,
        key,
        value,
        mask_arg,
        out,
        heads,
        heads // key.shape[1],
        q_len,
        k_len,
        head_dim,
        scale,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        *mask_strides,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HAS_MASK=mask is not None,
        BLOCK_N=KEY_BLOCK,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
