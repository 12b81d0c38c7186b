"""The causal depthwise short convolution (+ SiLU) that Gated DeltaNet applies to q, k and v.

    y[t, d] = silu( sum_{j < W} weight[d, j] * x[t - (W - 1) + j, d] )

over a window of W (4) tokens ending at t, channel by channel: nn.Conv1d(D, D, W, groups=D, padding=W - 1)
with its first T outputs kept, as flash-linear-attention's ShortConvolution computes it. Inputs before
the sequence are the `cache` (the W - 1 inputs before x, when decoding or continuing a prompt) or zeros;
with `cu_seqlens` (documents packed along T) each document starts from zeros, as a fresh sequence.
This is the PyTorch path; it is differentiable through autograd.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, activation: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, D], weight [D, W]; cache [B, W - 1, D] or None. Returns (y [B, T, D] in x's dtype, computed
    in fp32; the new cache [B, W - 1, D]: the last W - 1 inputs, the cache's included)."""
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"causal_conv1d: weight must be [D, W] with D = {D} (x's channels), got {tuple(weight.shape)}")
    W = weight.shape[1]
    if cache is not None and (tuple(cache.shape) != (B, W - 1, D)):
        raise ValueError(f"causal_conv1d: cache must be [B, W - 1, D] = {(B, W - 1, D)}, got {tuple(cache.shape)}")
    if cache is not None and cu_seqlens is not None:
        raise ValueError("causal_conv1d: a cache continues one sequence per row; it does not combine with cu_seqlens")
    history = cache.to(x.dtype) if cache is not None else x.new_zeros(B, W - 1, D)
    padded = torch.cat([history, x], dim=1)  # [B, W - 1 + T, D]
    w = weight.float()
    if cu_seqlens is not None:
        # how far back each position may look inside its own document
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
        position = torch.arange(T, device=x.device) - starts.to(x.device)  # [T]
    y = x.new_zeros(B, T, D, dtype=torch.float32)
    for j in range(W):
        back = W - 1 - j  # tap j reads x[t - back]
        tap = padded[:, j : j + T].float() * w[:, j]
        if cu_seqlens is not None and back > 0:
            tap = tap * (position >= back).to(tap.dtype)[None, :, None]
        y = y + tap
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), padded[:, T:]
