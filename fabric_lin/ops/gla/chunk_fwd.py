"""GLA's chunked forward pass in Triton: o = (q * exp(b)) @ h_n + A @ v for every chunk n.

Launches: the gate's in-chunk cumsum (`cumsum.py`), the state pass giving h_n, the
state entering chunk n (`state_pass.py`), and the output kernel twice: first for the
chunks whose scores A take one reference row, flagging the others, then for the flagged ones with the levels
of halves (`scores.py`), each launch compiled with only its own path's registers. A is kept for the
backward pass in the inputs' dtype; b (fp32) is kept unless the gate came as logits (then the backward
recomputes it from them).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import chunk_start, chunk_state_offset, load_gate, load_tile
from fabric_lin.ops.chunked.layout import CHUNK_SIZE, chunk_grid, chunk_layout, dot_precision
from fabric_lin.ops.gla.cumsum import gate_cumsum
from fabric_lin.ops.gla.state_pass import states
from fabric_lin.ops.gla.launch import GLALaunch
from fabric_lin.ops.gla.gate import single_reference_limit
from fabric_lin.ops.gla.scores import gate_spread, level_scores, single_reference_scores
from fabric_lin.ops.launch import next_power_of_2


@triton.jit
def _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
                  SINGLE_REFERENCE: tl.constexpr):
    """o of one chunk, pointers at its head; A made with one reference row or by the levels, and stored."""
    DT = v.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    if SINGLE_REFERENCE:
        A = single_reference_scores(q, k, gc, row0, n_rows, H * K, K, scale, BT, BK, DOT_PREC).to(DT)
    else:
        A = level_scores(q, k, gc, row0, n_rows, H * K, K, scale, BT, BK, DOT_PREC).to(DT)
    tl.store(A_ptrs, A, mask=m_t[:, None])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = load_tile(q, row0, o_t, n_rows, H * K, o_k, m_k)
            b_g = load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
            q_dec = (b_q * (tl.exp(b_g) * scale)).to(DT)
            b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
            acc += tl.dot(q_dec, b_h.to(DT), input_precision=DOT_PREC)
        b_v = tl.load(v + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        acc += tl.dot(A, b_v.to(DT), input_precision=DOT_PREC)
        tl.store(o + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], acc.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _fwd_output_kernel(q, k, v, gc, h, o, A_out, flags, cu_seqlens, chunk_indices, scale, limit, T, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, FIRST: tl.constexpr):
    """o = (q * exp(b)) @ h_n + A @ v for one chunk of one head, A kept for the backward pass ([B*T, H, BT],
    input dtype). FIRST: A with one reference row where the chunk's gate spread is at most `limit`, else
    nothing is done here and the program's flag is set; not FIRST: A by the levels where the flag is set,
    nothing elsewhere."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, i_tg = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    q += i_h * K
    k += i_h * K
    gc += i_h * K
    v += i_h * V
    o += i_h * V
    h += chunk_state_offset(i_tg, i_h, H, K, V)
    o_t = tl.arange(0, BT)
    A_ptrs = A_out + (row0 + o_t[:, None]) * (H * BT) + i_h * BT + o_t[None, :]
    flag = flags + i_c * tl.num_programs(1) + i_bh
    if FIRST:
        spread = 0.0
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            spread = tl.maximum(spread, gate_spread(gc, row0, n_rows, H * K, o_k, o_k < K, BT))
        single = spread <= limit
        if single:
            _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H, K, V, BT, BK, BV, DOT_PREC, True)
        tl.store(flag, tl.where(single, 0, 1).to(tl.int8))
    else:
        if tl.load(flag) != 0:
            _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H, K, V, BT, BK, BV, DOT_PREC, False)


def forward(q, k, v, g, scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
            normalizer: Optional[float], launch: GLALaunch):
    """(o, final state, gc = the in-chunk cumulative gate (fp32), A = the intra-chunk scores). g is the log
    gate gk, or with a normalizer the gate's logits (gk = logsigmoid(g) / normalizer)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = chunk_layout(cu_seqlens, B, T, CHUNK_SIZE)
    chunk_indices = layout.chunk_indices
    gc = torch.empty_like(g, dtype=torch.float32)
    if normalizer is not None:
        gate_cumsum(g, gc, cu_seqlens, layout, CHUNK_SIZE, launch.cumsum, normalizer)
        g = None  # the state pass reads gc
    h, ht = states(k, v, g, gc, initial_state, cu_seqlens, layout, CHUNK_SIZE, launch)
    o = torch.empty_like(v, dtype=q.dtype)
    A = q.new_empty(B, T, H, CHUNK_SIZE)
    grid = chunk_grid(cu_seqlens, layout, T, B, H, CHUNK_SIZE)
    BK = min(launch.output.BK, max(16, next_power_of_2(K)))
    # value tiles at least 64 wide (the extra columns masked): narrower ones went wrong on an H200 (Triton
    # 3.6, bf16), outputs 0.12-0.5 off in relative RMS at V=32, and an illegal memory access at K=64, V=32
    BV = min(launch.output.BV, max(64, next_power_of_2(V)))
    flags = torch.empty(grid[0] * grid[1], dtype=torch.int8, device=q.device)  # set by the first launch
    for first in (True, False):
        _fwd_output_kernel[grid](
            q, k, v, gc, h, o, A, flags, cu_seqlens, chunk_indices, scale, single_reference_limit(q.dtype), T,
            H, K, V, CHUNK_SIZE, BK, BV, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(q.dtype), FIRST=first,
            **launch.output.options(),
        )
    return o, ht, gc, A
