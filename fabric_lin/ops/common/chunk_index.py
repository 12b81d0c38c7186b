"""Where a chunk's rows live, for kernels that cut sequences into chunks of BT tokens.

Tensors are [B, T, H, D], read as [B*T] rows of H*D. With `cu_seqlens` (varlen: B = 1, documents laid end
to end) a chunk never crosses a document boundary: chunks are numbered globally and `chunk_layout` gives
each chunk's (document, chunk within it) and each document's first chunk. Rows past a sequence's end are
masked on load; a cumulative gate read there takes the sequence's last row (no decay past the end).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fabric_lin.ops.launch import cdiv


@triton.jit
def chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row of the chunk in the flattened [B*T] rows, rows left in its sequence, global chunk index)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2)
        i_t = tl.load(chunk_indices + i_c * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        n_rows = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos - i_t * BT).to(tl.int32)
        i_tg = i_c.to(tl.int64)
    else:
        i_b = i_bh // H
        i_t = i_c
        bos = (i_b * T).to(tl.int64)
        n_rows = T - i_t * BT
        i_tg = (i_b * tl.cdiv(T, BT) + i_t).to(tl.int64)
    return bos + i_t * BT, n_rows, i_tg


@triton.jit
def seq_start(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row of sequence i_n, its length, index of its first chunk)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    return bos, T, boh


@triton.jit
def load_raw(ptr, row0, rows, n_rows, stride, o_k, m_k):
    """Rows `rows` (those before n_rows) of a [rows, stride] tensor, columns o_k, in its dtype."""
    m = (rows < n_rows)[:, None] & m_k[None, :]
    return tl.load(ptr + (row0 + rows[:, None]) * stride + o_k[None, :], mask=m, other=0.0)


@triton.jit
def load_tile(ptr, row0, rows, n_rows, stride, o_k, m_k):
    return load_raw(ptr, row0, rows, n_rows, stride, o_k, m_k).to(tl.float32)


@triton.jit
def load_gate(gc, row0, rows, n_rows, stride, o_k, m_k):
    """Cumulative gate at `rows`, rows past the sequence end read as its last row (no decay there)."""
    rows = tl.minimum(rows, n_rows - 1)
    return tl.load(gc + (row0 + rows[:, None]) * stride + o_k[None, :], mask=m_k[None, :], other=0.0)


@triton.jit
def load_gate_row(gc, row0, r, n_rows, stride, o_k, m_k):
    """Cumulative gate at row r (clamped to the sequence), [BK]."""
    r = tl.minimum(r, n_rows - 1)
    return tl.load(gc + (row0 + r) * stride + o_k, mask=m_k, other=0.0)


def chunk_layout(cu_seqlens: Optional[torch.Tensor], B: int, T: int, BT: int):
    """(number of sequences, total chunks, chunk_indices [(seq, chunk in seq)] int32, chunk_offsets int32);
    the last two are None without cu_seqlens."""
    if cu_seqlens is None:
        return B, B * cdiv(T, BT), None, None
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    counts = [cdiv(n, BT) for n in lengths]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    indices = [(n, t) for n, c in enumerate(counts) for t in range(c)]
    device = cu_seqlens.device
    chunk_indices = torch.tensor(indices, dtype=torch.int32, device=device).view(-1)
    chunk_offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    return len(lengths), offsets[-1], chunk_indices, chunk_offsets


def chunk_grid(cu_seqlens: Optional[torch.Tensor], layout, T: int, B: int, H: int, BT: int):
    """The (chunk, batch*head) grid of a chunk-parallel kernel: (chunks, H) for varlen, else
    (chunks per sequence, B * H)."""
    return (layout[1], H) if cu_seqlens is not None else (cdiv(T, BT), B * H)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 inputs stay exact (no tf32); bf16/fp16 dots run on the tensor cores
    whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"
