"""The causal depthwise short convolution (+ SiLU) that Gated DeltaNet applies to q, k and v.

    y[t, d] = silu( sum_{j < W} weight[d, j] * x[t - (W - 1) + j, d] )

over a window of W (4) tokens ending at t, channel by channel: nn.Conv1d(D, D, W, groups=D, padding=W - 1)
with its first T outputs kept, as flash-linear-attention's ShortConvolution computes it. Inputs before
the sequence are the `cache` (the W - 1 inputs before x, when decoding or continuing a prompt) or zeros;
with `cu_seqlens` (documents packed along T) each document starts from zeros, as a fresh sequence.
`causal_conv1d_ref` is the PyTorch path (differentiable through autograd); `backend` picks it or the
kernels of short_conv_triton.py (imported only when they run) by the rule of fabric_lin/ops/backend.py;
`launch` (a ShortConvLaunch, by default the shipped settings: fabric_lin/ops/fused_launch.py) says how the kernels are launched.
`causal_conv1d_split` convolves channels of several tensors side by side (q, k and v) at once and gives each
its own output: on the kernels, one launch each way instead of one per tensor.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from fabric_lin.ops.backend import resolve_backend
from fabric_lin.ops.fused_launch import ShortConvLaunch

MAX_WIDTH = 8  # the kernels unroll their W taps; GDN uses W = 4
MAX_SPLITS = 3  # outputs of one causal_conv1d_split on the kernels


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, activation: bool = True, backend: str = "auto",
    launch: Optional[ShortConvLaunch] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, D], weight [D, W]; cache [B, W - 1, D] or None; cu_seqlens [N + 1] document offsets (B = 1)
    or None. Returns (y [B, T, D] in x's dtype, computed in fp32; the new cache [B, W - 1, D] in x's dtype:
    the last W - 1 inputs, the cache's included). On the kernels, one token continuing a cache with no
    gradient wanted is one launch (y and the shifted cache)."""
    ys, new_cache = causal_conv1d_split(x, weight, [x.shape[-1]] if x.dim() == 3 else [], cache, cu_seqlens,
                                        activation, backend, launch)
    return ys[0], new_cache


def causal_conv1d_split(
    x: torch.Tensor, weight: torch.Tensor, sizes: Sequence[int], cache: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, activation: bool = True, backend: str = "auto",
    launch: Optional[ShortConvLaunch] = None,
) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """causal_conv1d with its output split along the channels into tensors of `sizes` channels each, [B, T, size]
    (at most MAX_SPLITS on the kernels, each its own contiguous tensor; on the PyTorch path views of one).
    Returns (the outputs, the new cache [B, W - 1, D] of all the channels)."""
    _check_inputs(x, weight, cache, cu_seqlens)
    if sum(sizes) != x.shape[2] or not sizes or min(sizes) < 1:
        raise ValueError(f"causal_conv1d_split: sizes must be positive and add up to x's {x.shape[2]} channels, "
                         f"got {list(sizes)}")
    if resolve_backend(backend, x.device) == "torch":
        y, new_cache = causal_conv1d_ref(x, weight, cache, cu_seqlens, activation)
        return list(y.split(list(sizes), dim=2)), new_cache
    if weight.shape[1] > MAX_WIDTH:
        raise ValueError(f"causal_conv1d: the Triton kernels take weight [D, W] with W <= {MAX_WIDTH}, got W = "
                         f"{weight.shape[1]}; use backend='torch'")
    if len(sizes) > MAX_SPLITS:
        raise ValueError(f"causal_conv1d_split: the Triton kernels split into at most {MAX_SPLITS} outputs, got "
                         f"sizes {list(sizes)}")
    from fabric_lin.ops.short_conv_triton import causal_conv1d_split_triton

    return causal_conv1d_split_triton(x, weight, sizes, cache, cu_seqlens, activation, launch)


def _check_inputs(x, weight, cache, cu_seqlens) -> None:
    """Shapes and dtypes only: nothing here reads a tensor's values (no host synchronisation)."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(
            f"causal_conv1d: x must be a floating-point [B, T, D] tensor, got {x.dtype} of shape {tuple(x.shape)}"
        )
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(
            f"causal_conv1d: weight must be [D, W] with D = {D} (x's channels) and W >= 1, got {tuple(weight.shape)}"
        )
    W = weight.shape[1]
    if cache is not None and (tuple(cache.shape) != (B, W - 1, D)):
        raise ValueError(f"causal_conv1d: cache must be [B, W - 1, D] = {(B, W - 1, D)}, got {tuple(cache.shape)}")
    if cu_seqlens is not None:
        if cache is not None:
            raise ValueError(
                "causal_conv1d: a cache continues one sequence per row; it does not combine with cu_seqlens"
            )
        if B != 1:
            raise ValueError(
                f"causal_conv1d: cu_seqlens needs x with batch size 1 (documents packed along T), got B = {B}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"causal_conv1d: cu_seqlens must be a 1-D integer tensor of N + 1 >= 2 document offsets, "
                f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, activation: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """causal_conv1d in PyTorch, tap by tap (the formula above); the inputs checked by the caller."""
    B, T, D = x.shape
    W = weight.shape[1]
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
