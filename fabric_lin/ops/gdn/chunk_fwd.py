"""The gated delta rule's chunked forward pass in Triton (chunks of BT = 64 rows, the math of chunk_torch.py).

Launches, in order:
  * (q/k L2 norm, `l2norm_triton.py`, when asked)
  * `wy._solve_kernel`: per chunk and head, b = cumsum(g) and (I + A)^-1
  * `wy._wu_kernel`: per chunk and head, W = (I + A)^-1 diag(beta exp(b)) K and U = (I + A)^-1 diag(beta) V
  * `_fwd_state_kernel`: per value tile, sequence and head, the pass over chunks; it stores the state entering
    each chunk, h_n, and the corrections D = U - W h_n, and carries h_{n+1} = exp(b_last) h_n + K^T (exp(b_last - b) D)
    in fp32. The correction needs every key row of the state, so one program holds all of K for its value tile.
  * `_fwd_output_kernel`: per value tile, chunk and head, o = scale (exp(b) q h_n + (q k^T * Gamma) D).
(I + A)^-1 and b are kept for the backward pass, which recomputes W, U, h and D from them.
Without a gate (g None, the delta rule of DeltaNet) every kernel is compiled with USE_GATE off (wy.py says what
that leaves out): b is neither made nor read, and the forward keeps (I + A)^-1 alone.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import (
    chunk_start,
    chunk_state_offset,
    initial_state_tile,
    load_head_gate,
    load_raw,
    seq_start,
    sequence_state_offset,
    state_tile,
)
from fabric_lin.ops.chunked.layout import CHUNK_SIZE, chunk_grid, chunk_layout, dot_precision, state_dtype
from fabric_lin.ops import launch as launch_helpers
from fabric_lin.ops.gdn.launch import GDNLaunch, state_pass_launch
from fabric_lin.ops.gdn.wy import BC, _solve_kernel, _wu_kernel
from fabric_lin.ops.launch import cdiv, next_power_of_2, tile_width


@triton.jit
def _causal_decay(b_b, BT: tl.constexpr):
    """Gamma [BT, BT]: exp(b_i - b_j) for j <= i, zero above the diagonal (whose exponents, positive, are never
    taken)."""
    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]
    return tl.exp(tl.where(causal, b_b[:, None] - b_b[None, :], float("-inf")))


@triton.jit
def _causal(x, BT: tl.constexpr):
    """x [BT, BT] with its entries above the diagonal zeroed: x * Gamma where there is no decay."""
    o_t = tl.arange(0, BT)
    return tl.where(o_t[:, None] >= o_t[None, :], x, 0.0)


@triton.jit
def forward_state_pass(i_v, i_nh, k, w, u, b, h, d, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
                       USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """h[chunk n] = the state entering chunk n (h's dtype), d = the corrections D = U - W h_n (the inputs' dtype),
    and with STORE_FINAL ht = the final state (fp32), for value tile i_v of sequence and head i_nh. BKS >= K: the
    whole key dimension. Without USE_GATE (b None) the state is carried undecayed: h_{n+1} = h_n + K^T D."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = seq_start(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    # key tile 0 of width BKS: all of K, which the correction D = U - W S reads
    o_k, o_v, m_k, m_v, m_kv, state_offs = state_tile(0, i_v, K, V, BKS, BV)
    k += i_h * K
    w += i_h * K
    u += i_h * V
    d += i_h * V
    if USE_GATE:
        b += i_h
    S = initial_state_tile(h0, i_nh, state_offs, m_kv, K, V, BKS, BV, USE_H0)
    for i_t in range(tl.cdiv(T, BT)):
        row0 = bos + i_t * BT
        n_rows = T - i_t * BT
        m_tv = (o_t < n_rows)[:, None] & m_v[None, :]
        tl.store(h + chunk_state_offset(boh + i_t, i_h, H, K, V) + state_offs, S.to(h.dtype.element_ty), mask=m_kv)
        b_w = load_raw(w, row0, o_t, n_rows, H * K, o_k, m_k)
        b_u = load_raw(u, row0, o_t, n_rows, H * V, o_v, m_v).to(tl.float32)
        b_d = b_u - tl.dot(b_w, S.to(DT), input_precision=DOT_PREC)
        tl.store(d + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], b_d.to(d.dtype.element_ty), mask=m_tv)
        b_k = load_raw(k, row0, o_t, n_rows, H * K, o_k, m_k)
        if USE_GATE:
            b_b = load_head_gate(b, row0, o_t, n_rows, H)
            b_last = load_head_gate(b, row0, BT - 1, n_rows, H)
            # K^T diag(exp(b_last - b)) D, the decay on D's BV columns rather than K's K: fewer products per row
            d_end = (b_d * tl.exp(b_last - b_b)[:, None]).to(DT)
            S = S * tl.exp(b_last) + tl.dot(tl.trans(b_k), d_end, input_precision=DOT_PREC)
        else:
            S += tl.dot(tl.trans(b_k), b_d.to(DT), input_precision=DOT_PREC)
    if STORE_FINAL:
        tl.store(ht + sequence_state_offset(i_nh, K, V) + state_offs, S, mask=m_kv)


@triton.jit
def _fwd_state_kernel(k, w, u, b, h, d, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                      IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """`forward_state_pass` for one value tile (program 0) of one sequence and head (program 1), the final state
    stored."""
    forward_state_pass(tl.program_id(0), tl.program_id(1), k, w, u, b, h, d, h0, ht, cu_seqlens, chunk_offsets, T, H,
                       K, V, BT, BKS, BV, USE_H0, True, IS_VARLEN, DOT_PREC, USE_GATE)


@triton.jit
def _fwd_output_kernel(q, k, d, b, h, o, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """o = scale (exp(b) q h_n + (q k^T * Gamma) D) for one value tile of one chunk and head; without USE_GATE
    (b None), o = scale (q h_n + causal(q k^T) D)."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, i_tg = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    q += i_h * K
    k += i_h * K
    h += chunk_state_offset(i_tg, i_h, H, K, V)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = load_raw(q, row0, o_t, n_rows, H * K, o_k, m_k)
        b_k = load_raw(k, row0, o_t, n_rows, H * K, o_k, m_k)
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_q, b_h.to(DT), input_precision=DOT_PREC)
        b_s += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    if USE_GATE:
        b_b = load_head_gate(b + i_h, row0, o_t, n_rows, H)
        b_s = b_s * _causal_decay(b_b, BT)
    else:
        b_s = _causal(b_s, BT)
    b_d = load_raw(d + i_h * V, row0, o_t, n_rows, H * V, o_v, m_v)
    if USE_GATE:  # after D's load is issued: ptxas follows the source's order, and the gated schedule has it here
        b_o = b_o * tl.exp(b_b)[:, None]
    b_o += tl.dot(b_s.to(DT), b_d.to(DT), input_precision=DOT_PREC)
    m_tv = (o_t < n_rows)[:, None] & m_v[None, :]
    tl.store(o + i_h * V + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=m_tv)


# ------------------------------------------------------------------------------------------ host side


def state_key_tile(K: int) -> int:
    """The state passes' key tile: all of K (a power of two, at least 16)."""
    return max(16, next_power_of_2(K))


def solve(k, g, beta, cu_seqlens, layout, launch: GDNLaunch):
    """(b, the in-chunk cumsum of g [B, T, H] fp32, None without a gate; (I + A)^-1 [B, T, H, CHUNK_SIZE] in k's
    dtype)."""
    B, T, H, K = k.shape
    b = torch.empty_like(g, dtype=torch.float32) if g is not None else None
    A_inv = k.new_empty(B, T, H, CHUNK_SIZE)
    _solve_kernel[chunk_grid(cu_seqlens, layout, T, B, H, CHUNK_SIZE)](
        k, g, beta, b, A_inv, cu_seqlens, layout.chunk_indices, T, H, K, CHUNK_SIZE, BC, tile_width(launch.solve.BK, K),
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype), USE_GATE=g is not None,
        **launch.solve.options(),
    )
    return b, A_inv


def wy_factors(k, v, beta, b, A_inv, cu_seqlens, layout, launch: GDNLaunch):
    """(W [B, T, H, K], U [B, T, H, V]) in the inputs' dtype; b None: no gate."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    w, u = torch.empty_like(k), torch.empty_like(v)
    _wu_kernel[chunk_grid(cu_seqlens, layout, T, B, H, CHUNK_SIZE)](
        k, v, beta, b, A_inv, w, u, cu_seqlens, layout.chunk_indices, T, H, K, V, CHUNK_SIZE, tile_width(launch.wu.BK, K),
        tile_width(launch.wu.BV, V), IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype),
        USE_GATE=b is not None, **launch.wu.options(),
    )
    return w, u


def states(k, w, u, b, initial_state, cu_seqlens, layout, launch: GDNLaunch):
    """(h [chunks, H, K, V], the state entering each chunk; D [B, T, H, V] the corrections, in the inputs'
    dtype; the final state [N, H, K, V] fp32); b None: no gate."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    N, NC, _, chunk_offsets = layout
    state = state_pass_launch(launch.state, launch.narrow_state, V, N, H, launch_helpers.multiprocessors(k.device))
    BV = tile_width(state.BV, V)
    h = k.new_empty(NC, H, K, V, dtype=state_dtype(k, initial_state is not None))
    d = torch.empty_like(u)
    ht = k.new_empty(N, H, K, V, dtype=torch.float32)
    _fwd_state_kernel[(cdiv(V, BV), N * H)](
        k, w, u, b, h, d, initial_state, ht, cu_seqlens, chunk_offsets, T, H, K, V, CHUNK_SIZE, state_key_tile(K), BV,
        USE_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype),
        USE_GATE=b is not None, **state.options(),
    )
    return h, d, ht


def forward(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
            cu_seqlens: Optional[torch.Tensor], launch: GDNLaunch):
    """(o, final state fp32, b = the in-chunk cumsum of g (fp32; None where g is None, no decay), (I + A)^-1 per
    chunk) for q, k as the recurrence reads them (already normalised where asked)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = chunk_layout(cu_seqlens, B, T, CHUNK_SIZE)
    b, A_inv = solve(k, g, beta, cu_seqlens, layout, launch)
    w, u = wy_factors(k, v, beta, b, A_inv, cu_seqlens, layout, launch)
    h, d, ht = states(k, w, u, b, initial_state, cu_seqlens, layout, launch)
    o = torch.empty_like(v)
    BV = tile_width(launch.output.BV, V)
    _fwd_output_kernel[(cdiv(V, BV),) + chunk_grid(cu_seqlens, layout, T, B, H, CHUNK_SIZE)](
        q, k, d, b, h, o, cu_seqlens, layout.chunk_indices, scale, T, H, K, V, CHUNK_SIZE, tile_width(launch.output.BK, K), BV,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(q.dtype), USE_GATE=b is not None,
        **launch.output.options(),
    )
    return o, ht, b, A_inv
