"""Attention backends for forward passes whose shapes are new at almost every call.

Why. torch on CUDA 13 with cuDNN > 9.15 puts cuDNN attention first among SDPA's backends on
sm90 (H100, H200): `check_prefer_cudnn_attention` in ATen's sdp_utils.cpp, in torch 2.10 already,
active from 2.11, whose wheels bundle a cuDNN past the threshold (huggingface/transformers#48163
traces it). cuDNN takes masked attention too (a boolean mask is converted to a bias:
pytorch/pytorch#130482, #139450), and builds an execution graph (a plan) for every new shape
before it runs it; the second call of a shape hits its cache. Others measured the build at up
to ~400 ms and saw it redone whenever the sequence grows (sgl-project/sglang#4650,
ml-explore/mlx#2743). Most of the engine's attention runs at
shapes that repeat: decode steps replay CUDA graphs captured at bucketed shapes, prefill is
padded to buckets warmed at start (model_runner.py). Three passes do not:
- a judge session's append (judge_sessions.py): its chunk's queries against its whole prefix,
  `[1, heads, chunk + tail, prefix + chunk + tail]`, a prefix that grows with every append;
- a chunk of a long prompt's prefill (`ModelRunner.prefill_chunk`): the chunk against all the
  chunks before it;
- the eager decode step (`ModelRunner._eager_step`, a model without the static step): one
  column wider every step.
On an H200 a judge pass cost ~60 ms whatever its tokens (1 stream: 140 appends of ~60 tokens in
8.4 s; re-judging 1,056-token prefixes in 10.1 s): a per-pass cost, not a per-token one, as a
plan build per shape would be (bench/sdpa_shapes.py times the first and second use of a shape).
These passes therefore leave cuDNN attention out (flash, memory-efficient and math remain:
none builds per-shape plans). CPU passes are untouched (no cuDNN there).

`sdpa_kernel` sets process-wide flags for the duration of the pass: the engine's passes all run
on its one worker thread, and the captured decode graphs do not dispatch again.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: SDPA backends for passes at shapes seen once; None: the default order (cuDNN first where torch
#: puts it first; bench/judge.py sets None for a one-stream comparison on the same GPU).
CHANGING_SHAPE_BACKENDS: list[SDPBackend] | None = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
#: Device types whose SDPA dispatcher may pick cuDNN attention (a CPU has none; tests add "cpu"
#: to see the restriction on a CPU).
CUDNN_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def changing_shapes(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context for a forward pass on `device` whose attention shapes are new at almost
    every call: on CUDA, SDPA restricted to `CHANGING_SHAPE_BACKENDS`; elsewhere nothing."""
    backends = CHANGING_SHAPE_BACKENDS
    if device.type not in CUDNN_DEVICE_TYPES or backends is None:
        return contextlib.nullcontext()
    return sdpa_kernel(list(backends))
