"""GLA's forget gate in log space: logsigmoid(gate_logits) / normalizer, in fp32.

Written as an autograd Function so that the backward pass keeps the gate logits in their own dtype
(bf16 in training), where `F.logsigmoid(x.float())` would keep the fp32 copy: half the bytes.

`levels_share` tells how a model's gates meet the Triton kernels: a chunk whose cumulative gate moves
by more than `single_reference_limit(dtype)` from its middle row takes the slower path (see scores.py).
"""
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from fabric_lin.ops.chunked.layout import CHUNK_SIZE

SINGLE_REFERENCE_LIMIT = 40.0
"""The most the single-reference exponents may reach in any dtype: the pairs the scores mask reach twice that,
exp(80) times q k, in the fp32 accumulator (whose range ends at exp(88.7))."""
QK_HEADROOM = 256.0
"""How large q and k may be (in magnitude) and still stay finite once multiplied by the single-reference
factors in their own dtype."""


@functools.lru_cache(maxsize=None)  # read at every launch: a dict look-up, not a finfo and a log
def single_reference_limit(dtype: torch.dtype) -> float:
    """The gate spread up to which the Triton kernels take one reference row for q, k, v of `dtype`. The factors
    exp(spread) multiply q and k in that dtype: bf16 and fp32 reach 3e38, so SINGLE_REFERENCE_LIMIT binds (40);
    float16 ends at 65504 = exp(11.09), so there the limit is log(65504 / QK_HEADROOM) = 5.55. The limit is a
    kernel argument, not a compile-time constant: each dtype runs the same compiled kernels."""
    return min(SINGLE_REFERENCE_LIMIT, math.log(torch.finfo(dtype).max / QK_HEADROOM))


class _LogDecay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, normalizer: float) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.normalizer = normalizer
        return F.logsigmoid(logits.float()) / normalizer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        # d/dx logsigmoid(x) = sigmoid(-x)
        return (grad * torch.sigmoid(-logits.float()) / ctx.normalizer).to(logits.dtype), None


def log_decay(gate_logits: torch.Tensor, normalizer: float = 16.0) -> torch.Tensor:
    """logsigmoid(gate_logits) / normalizer as fp32 (every value <= 0: the per-step log decay gk)."""
    return _LogDecay.apply(gate_logits, float(normalizer))


def levels_share(gk: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                 dtype: torch.dtype = torch.bfloat16) -> float:
    """The share of (chunk, head) pairs whose intra-chunk scores the Triton kernels make by the levels of
    halves, the slower path, for q, k, v of `dtype`: those where the in-chunk cumulative log gate b moves by
    more than single_reference_limit(dtype) from the chunk's middle row, max |b - b_r| over the chunk's rows
    and key columns (rows past a sequence's end count as its last row), as the output kernel decides. gk:
    [B, T, H, K], the log gate (logsigmoid(logits) / normalizer); with cu_seqlens (B = 1) chunks restart at
    each document."""
    if cu_seqlens is None:
        sequences = [gk[i] for i in range(gk.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        sequences = [gk[0, s:e] for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    limit = single_reference_limit(dtype)
    past, total = 0, 0
    for g in sequences:  # [T, H, K]
        T = g.shape[0]
        pad = (-T) % CHUNK_SIZE
        b = F.pad(g.float(), (0, 0, 0, 0, 0, pad)).unflatten(0, (-1, CHUNK_SIZE)).cumsum(1)  # [chunks, C, H, K]
        # rows past the end add a zero gate, so their cumulative sum is the last row's
        spread = (b - b[:, CHUNK_SIZE // 2 - 1 : CHUNK_SIZE // 2]).abs().amax(dim=(1, 3))  # [chunks, H]
        past += int((spread > limit).sum())
        total += spread.numel()
    return past / max(total, 1)
