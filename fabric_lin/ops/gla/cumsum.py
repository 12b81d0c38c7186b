"""The gate's cumulative sum inside each chunk, b = cumsum(g) over a chunk's rows, in fp32: the quantity every
chunked kernel reads (decays between two rows of a chunk are exp(b_i - b_j)). Fully parallel, one chunk of
one head and key tile per program, so that the sequential state pass does not add its latency to every step.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import chunk_start, load_tile
from fabric_lin.ops.chunked.layout import chunk_grid
from fabric_lin.ops.launch import KernelLaunch, cdiv, tile_width


@triton.jit
def log_decay_of_logits(x, normalizer):
    """logsigmoid(x) / normalizer in fp32 (GLA's forget gate from its logits), written so that exp never
    overflows."""
    return (tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))) / normalizer


@triton.jit
def _gate_cumsum_kernel(g, gc, k, kd, cu_seqlens, chunk_indices, normalizer, T, H: tl.constexpr, K: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, FROM_LOGITS: tl.constexpr,
                        STORE_KD: tl.constexpr):
    """gc = cumulative sum of g inside each chunk (fp32), one chunk of one head and key tile per program.
    FROM_LOGITS: g holds the gate's logits, and the log gate logsigmoid(g) / normalizer is summed.
    STORE_KD: also the decayed keys kd = k * exp(b_last - b) (k's dtype), for the backward's state pass and
    dv kernel to read instead of k and gc."""
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, _ = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_g = load_tile(g + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
    if FROM_LOGITS:  # rows past the end become nonzero here, but they come after every stored row
        b_g = log_decay_of_logits(b_g, normalizer)
    b_g = tl.cumsum(b_g, axis=0)
    m_tk = (o_t < n_rows)[:, None] & m_k[None, :]
    offs = i_h * K + (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
    tl.store(gc + offs, b_g, mask=m_tk)
    if STORE_KD:
        last = tl.minimum(n_rows, BT) - 1
        b_last = tl.sum(tl.where((o_t == last)[:, None], b_g, 0.0), axis=0)
        b_k = tl.load(k + offs, mask=m_tk, other=0.0).to(tl.float32)
        k_end = b_k * tl.exp(tl.minimum(b_last[None, :] - b_g, 0.0))
        tl.store(kd + offs, k_end.to(kd.dtype.element_ty), mask=m_tk)


def gate_cumsum(g: torch.Tensor, gc: torch.Tensor, cu_seqlens: Optional[torch.Tensor], layout, BT: int,
                launch: KernelLaunch, normalizer: Optional[float] = None, k: Optional[torch.Tensor] = None,
                kd: Optional[torch.Tensor] = None) -> None:
    """gc [B, T, H, K] fp32 <- the cumulative sum of g inside each chunk of BT rows; with a normalizer, g holds
    the gate's logits and the sum is over logsigmoid(g) / normalizer. With k and kd: kd <- the decayed keys
    k * exp(b_last - b). launch.BK: the key tile; launch.warps."""
    B, T, H, K = g.shape
    BK = tile_width(launch.BK, K)
    grid = (cdiv(K, BK),) + chunk_grid(cu_seqlens, layout, T, B, H, BT)
    _gate_cumsum_kernel[grid](g, gc, k, kd, cu_seqlens, layout.chunk_indices, normalizer or 1.0, T, H, K, BT, BK,
                              IS_VARLEN=cu_seqlens is not None, FROM_LOGITS=normalizer is not None,
                              STORE_KD=kd is not None, num_warps=launch.warps)
