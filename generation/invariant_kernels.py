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
- `rms_norm`, `layer_norm`: `NORM_ROWS` rows per program, each reduced along its own axis of one
  fixed tile shape (the hidden size, padded to a power of two); the row count is not
  specialized (Triton would compile one row apart: see `attention`), as `matmul`'s M.
- `attention`: one program per (batch row, query head, tile of `QUERY_BLOCK` positions), over
  the keys in blocks of `KEY_BLOCK` from key 0 upwards, online softmax in float32; the tile has
  the same shape in a decode step (one live query) as in a prefill, and a query's row of the
  tile's products does not depend on the other rows (as in `matmul`). A masked key's score is
  -inf and its weight exactly 0 (its value, finite like every cache entry, adds 0 * v = 0), so
  a block past a query's last visible key changes nothing (its running max, sum and
  accumulator stay bit for bit): a query's result is the same whether the keys after it are
  padding, a longer prefill, the static cache's masked columns, or absent. Decode and prefill
  run the same loop per query, so a resumed row's prefill equals its token-by-token decode.
  And they run the same binary: every launch of a dtype and head size is one compilation
  (`_attention_launch`). Triton compiles a kernel per specialization of its arguments (an int
  equal to 1 becomes a constant, ints and pointers divisible by 16 are marked so, and each
  constexpr such as a mask flag is its own variant), and the compiler lays out each variant on
  its own: on sm_90 the masked variant multiplies the softmax weights by the values with the
  keys permuted among the MMA instructions (`kWidth = 4`, the key order of the bf16 values
  before their widening) and the unmasked one without (`kWidth = 2`), so a query summed its
  keys in another grouping alone than in a padded batch (bf16 only: float32's "ieee" product
  is FMAs, not MMAs). So the mask is always read (a broadcast True when there is none), the
  lengths, head counts and the mask's layout are not specialized, and the tensors' strides and
  addresses are always multiples of 16 (a view that is not is copied: `_aligned`): the decode
  step (one query), a prefill alone and a padded batch, at any lengths and offsets, all run
  one program per dtype and head size (bench/gpu/compile_kernels.py checks the launches'
  specializations without a GPU).

Nothing is autotuned (autotuning keys on shapes, M included); each kernel is compiled once per
(dtype, constexpr) and, on CUDA, compiled by the warm-up runs before the decode graphs are
captured (decode_graphs.StaticDecoder.capture), so the graphs replay the kernels.

Without CUDA (tests), the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set here
when no GPU is present): NumPy executes each program, slowly, with the same reduction structure.
One interpreter difference: its `tl.dot` is NumPy's `matmul` (OpenBLAS), which multiplies
bfloat16 operands as raw uint16 bits (triton 3.6-3.8) and whose float32 result for a row depends
on the row's place in the tile (measured); so under the interpreter the products of `matmul`
and `attention` are widened to float32, multiplied elementwise and summed along the reduced
axis of a fixed-shape tile (`INTERPRETED`). On a GPU `tl.dot` is the tensor cores' MMA (float32
inputs: "ieee", no TF32; attention's softmax weights times values: TF32 for 16-bit models),
whose result for an element does not depend on the other rows of the tile; that half is
checked on CUDA only (bench/gpu/check.sh, part binv).
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
if _INTERPRET and type(tl.standard._sum_combine).__name__ == "JITFunction":
    # triton's own helpers (tl.sum's combine) were defined before the switch: `import torch`
    # imports triton when it is installed, so the switch must precede torch's import
    raise ImportError(
        "no GPU: the Triton kernels need triton's interpreter, i.e. TRITON_INTERPRET=1 in the "
        "environment before torch is imported"
    )

# Reductions are `tl.reduce` with `tl.sum`'s and `tl.max`'s own combine functions (the same
# reduction when compiled) rather than `tl.sum`/`tl.max` and `tl.cdiv`, which are @jit helpers:
# the interpreter re-patches triton.language on every call of one (~3 ms), but runs `tl.reduce`
# with these combine functions as `np.sum`/`np.nanmax`. Hand-written for the interpreter's speed.
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max

#: Keys per attention block: a query's keys are reduced block by block, in order, from key 0.
KEY_BLOCK = 32
#: Queries per attention program, decode (one live) and prefill alike: one tile shape, so one
#: reduction structure per query whatever the call.
QUERY_BLOCK = 16


# ----- matrix products ---------------------------------------------------------------------------


def _tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `dtype`: fixed per dtype, never
    chosen by the problem's shape (an M-dependent choice would change a row's K order)."""
    if _INTERPRET:  # NumPy: fewer, larger tiles (the interpreter's cost is per operation)
        return 32, 128, 128, 4, 1
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
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(
        0, (K + BLOCK_K - 1) // BLOCK_K
    ):  # K from 0 upwards, one tile at a time: no split
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
            acc += tl.reduce(a[:, :, None] * b[None, :, :], 1, _SUM)
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

#: Rows per normalisation program: a fixed tile (each row reduced along its own axis of one
#: `[NORM_ROWS, BLOCK]` shape), so a row's bits do not depend on which rows share its program.
NORM_ROWS = 4


@triton.jit(do_not_specialize=["R"])  # one binary whatever the row count (attention's docstring)
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, R, stride_x, stride_o, H, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    live = (rows[:, None] < R) & (offs[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=live, other=0.0)
    h = x.to(tl.float32)
    variance = tl.reduce(h * h, 1, _SUM) / H
    y = (h * tl.math.rsqrt(variance + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=offs < H, other=0.0)
    # weight * y in the input dtype, as transformers' Llama RMSNorm (one rounding of the product)
    out = w.to(tl.float32)[None, :] * y.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension (`x` any leading shape), NORM_ROWS rows per
    program; the result in the promoted dtype of `x` and `weight`, as transformers'."""
    flat = _rows(x)
    out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows, hidden = flat.shape
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, NORM_ROWS),)](
            flat,
            weight,
            out,
            rows,
            flat.stride(0),
            out.stride(0),
            hidden,
            eps,
            ROWS=NORM_ROWS,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(*x.shape[:-1], hidden)


@triton.jit(do_not_specialize=["R"])
def _layer_norm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    R,
    stride_x,
    stride_o,
    H,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    live = (rows[:, None] < R) & (offs[None, :] < H)
    h = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=live, other=0.0)
    h = h.to(tl.float32)
    mean = tl.reduce(h, 1, _SUM) / H
    centred = tl.where(live, h - mean[:, None], 0.0)
    variance = tl.reduce(centred * centred, 1, _SUM) / H
    y = centred * tl.math.rsqrt(variance + eps)[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=live,
    )


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension (GPT-2's), NORM_ROWS rows per program."""
    flat = _rows(x)
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    rows, hidden = flat.shape
    if rows:
        _layer_norm_kernel[(triton.cdiv(rows, NORM_ROWS),)](
            flat,
            weight if weight is not None else flat,
            bias if bias is not None else flat,
            out,
            rows,
            flat.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            ROWS=NORM_ROWS,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape)


# ----- attention -------------------------------------------------------------------------------


#: What selects the attention's compilation is only the dtype and the head size (module
#: docstring). Triton specializes an int on whether it is 1 or a multiple of 16 and a pointer on
#: 16-byte alignment (vectorized loads need them): the lengths, head counts and the mask's
#: strides and address are not specialized; the query's, keys', values' and output's strides
#: and addresses always are multiples of 16 (`_aligned` copies a view that is not).
_ATTENTION_UNSPECIALIZED = ["H", "GROUPS", "Lq", "Lk", "sm_b", "sm_l", "sm_k"]
_ALIGN = 16
#: The attention launch's warps and pipeline stages (Triton's defaults, fixed here).
ATTENTION_WARPS, ATTENTION_STAGES = 4, 3


@triton.jit(do_not_specialize=_ATTENTION_UNSPECIALIZED, do_not_specialize_on_alignment=["mask_ptr"])
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
    D: tl.constexpr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)  # (batch, head, query tile), query tile fastest
    tiles = (Lq + BLOCK_M - 1) // BLOCK_M
    tile = pid % tiles
    head = (pid // tiles) % H
    batch = pid // (tiles * H)
    kv_head = head // GROUPS
    queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live_q = queries < Lq
    dims = tl.arange(0, BLOCK_D)
    live_d = dims < D
    q = tl.load(
        q_ptr + batch * sq_b + head * sq_h + queries[:, None] * sq_l + dims[None, :],
        mask=live_q[:, None] & live_d[None, :],
        other=0.0,
    )
    # causal: the queries are the last Lq positions, query i sees keys up to Lk - Lq + i; the
    # loop stops at the tile's last query's block (later blocks would add exact zeros)
    last = Lk - Lq + queries
    peak = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offs = tl.arange(0, BLOCK_N)
    end = Lk - Lq + tl.minimum(tile * BLOCK_M + BLOCK_M, Lq)  # keys any live query sees
    for block in range(0, (end + BLOCK_N - 1) // BLOCK_N):
        keys = block * BLOCK_N + offs
        visible = (keys[None, :] <= last[:, None]) & live_q[:, None]  # [BLOCK_M, BLOCK_N]
        allowed = tl.load(  # always read: no masked/unmasked variants (module docstring)
            mask_ptr + batch * sm_b + queries[:, None] * sm_l + keys[None, :] * sm_k,
            mask=visible,
            other=0,
        )
        visible = visible & (allowed != 0)
        present = (keys < Lk)[:, None] & live_d[None, :]
        k = tl.load(
            k_ptr + batch * sk_b + kv_head * sk_h + keys[:, None] * sk_l + dims[None, :],
            mask=present,
            other=0.0,
        )
        v = tl.load(
            v_ptr + batch * sv_b + kv_head * sv_h + keys[:, None] * sv_l + dims[None, :],
            mask=present,
            other=0.0,
        )
        if INTERPRETED:  # products, then fixed-shape sums (NumPy's matmul: docstring)
            qf = q.to(tl.float32)
            scores = tl.reduce(qf[:, None, :] * k.to(tl.float32)[None, :, :], 2, _SUM)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(visible, scores * scale, -float("inf"))
        new_peak = tl.maximum(peak, tl.reduce(scores, 1, _MAX))
        # a row with nothing visible yet (left padding, a dead row) stays at exact zeros
        base = tl.where(new_peak == -float("inf"), 0.0, new_peak)
        rescale = tl.exp(peak - base)
        weights = tl.where(visible, tl.exp(scores - base[:, None]), 0.0)
        total = total * rescale + tl.reduce(weights, 1, _SUM)
        if INTERPRETED:
            part = tl.reduce(weights[:, :, None] * v.to(tl.float32)[None, :, :], 1, _SUM)
        else:
            part = tl.dot(weights, v.to(tl.float32), input_precision=PRECISION)
        acc = acc * rescale[:, None] + part
        peak = new_peak
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + batch * so_b + queries[:, None] * so_l + head * so_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live_q[:, None] & live_d[None, :],
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
    or additive, broadcastable to `[B, 1, Lq, Lk]` (True / 0: attend) or None; returns
    `[B, Lq, H, d]` in `query`'s dtype. Per query, keys reduce in KEY_BLOCK blocks from key 0,
    QUERY_BLOCK queries per program whether decoding or prefilling, one binary for every
    launch (module docstring)."""
    grid, args, options, out = _attention_launch(query, key, value, mask, scale)
    if out.numel():
        _attention_kernel[grid](*args, **options)
    return out if out.is_contiguous() else out.contiguous()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` if its address (bytes) and strides (elements) are multiples of `_ALIGN` but the
    last, unit stride; else a copy whose rows are padded to a multiple of `_ALIGN`."""
    strides = t.stride()
    if (
        strides[-1] == 1
        and t.data_ptr() % _ALIGN == 0
        and all(s % _ALIGN == 0 for s in strides[:-1])
    ):
        return t
    copy = _aligned_empty(tuple(t.shape), t)
    copy.copy_(t)
    return copy


def _aligned_empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised `shape` in `like`'s dtype and device, rows padded to `_ALIGN`."""
    width = -(-shape[-1] // _ALIGN) * _ALIGN
    full = torch.empty((*shape[:-1], width), dtype=like.dtype, device=like.device)
    return full[..., : shape[-1]]


def _attention_launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[tuple[int], list[object], dict[str, object], torch.Tensor]:
    """`attention`'s launch of `_attention_kernel`: (grid, arguments, constexprs and options,
    the output it writes). Apart from the tensors' dtype and the head size, nothing in it
    selects a compilation (bench/gpu/compile_kernels.py checks it)."""
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    query, key, value = _aligned(query), _aligned(key), _aligned(value)
    out = _aligned_empty((batch, q_len, heads, head_dim), query)
    if mask is None:  # every key allowed (the kernel applies the causal limit): one True, read
        # through zero strides, so the same program runs with and without a mask
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=query.device)
    elif mask.dtype != torch.bool:  # an additive float mask: 0 keeps, -inf/min drops
        mask = mask == 0
    mask = mask.expand(batch, mask.shape[1], q_len, k_len)[:, 0]
    tiles = triton.cdiv(q_len, QUERY_BLOCK)
    args: list[object] = [
        query,
        key,
        value,
        mask,
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
        *mask.stride(),
        out.stride(0),
        out.stride(1),
        out.stride(2),
    ]
    options: dict[str, object] = {
        "BLOCK_M": QUERY_BLOCK,
        "BLOCK_N": KEY_BLOCK,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "INTERPRETED": _INTERPRET,
        "PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
        "num_warps": ATTENTION_WARPS,
        "num_stages": ATTENTION_STAGES,
    }
    return (batch * heads * tiles,), args, options, out
