"""The gated delta rule's chunked backward pass in Triton.

Per chunk and head, with S = h_n the state entering it, dS' the gradient of the state leaving it, P = q k^T * Gamma
(causal, the diagonal included) and k_end = k exp(b_last - b), the keys as the chunk's end sees them:
    dD = scale P^T do + k_end dS'                                   (the corrections' gradient)
    dS = exp(b_last) dS' + scale (q exp(b))^T do - W^T dD           (carried backwards over the chunks)
    dq = scale (exp(b) do S^T + (do D^T * Gamma) k)
    dk = scale (do D^T * Gamma)^T q + exp(b_last - b) D dS'^T         (the output's and the state's parts)
    dW = -dD S^T,   dU = dD
and from dW and dU through W = (I + A)^-1 X and U = (I + A)^-1 Y on to k, v, beta and the gate (`wy._wy_bwd_kernel`).
The gate (b = cumsum(g) inside the chunk): with db_i the gradient of b_i, db = row sums of dq * q - row sums of
dk * k over P's strictly lower part and q's decay exp(b), plus the WY part, plus exp(b_last) sum(S * dS') at the
chunk's last row (where b_last decays the state); dg is db's reverse cumsum, plus for the keys' decay
exp(b_last - b_i), which moves g_t for t > i only, the sum over i < t of k_i . (exp(b_last - b_i) D dS'^T)_i.
Neither P's diagonal nor the last key's decay (both exp(0) = 1) is taken as a gradient added to one row and taken
away at another: with fast-forgetting gates the true dg is tiny, and the rounding of such O(1) terms would be all
of it.

Launches: W and U recomputed (`wy._wu_kernel`), then
  * `_bwd_dd_local_kernel`: per value tile, chunk and head, scale P^T do,
  * the forward state pass again for h_n and D (`chunk_fwd.forward_state_pass`, no final state), and the reverse
    pass, per value tile, sequence and head: dh_n (= dS' of chunk n), dD, dh0. Neither reads what the other
    writes: where a pass has no more programs than the GPU has multiprocessors, the two run side by side in one
    launch (`_state_passes_kernel`, `launch.pair_state_passes`), else one after the other (`_fwd_state_kernel`,
    `_bwd_state_kernel`),
  * `_bwd_dqkw_kernel`: per key tile, chunk and head, dq, the output's and state's part of dk (fp32), dW, and
    their part of dg (one row of partial sums per key tile),
  * `wy._wy_bwd_kernel`: per chunk and head, the rest of dk, dv, dbeta and dg,
  * (the q/k L2 norm's backward, when the forward normalised them).
Without a gate (b None: the delta rule, where every exp(.) above is 1 and Gamma the causal mask) the kernels are
compiled with USE_GATE off: no gate is read, no part of its gradient computed, and P's diagonal stays in P.
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
from fabric_lin.ops.gdn.chunk_fwd import _causal, _causal_decay, forward_state_pass, state_key_tile, states, wy_factors
from fabric_lin.ops import launch as launch_helpers
from fabric_lin.ops.gdn.launch import GDNLaunch, pair_state_passes, state_pass_launch
from fabric_lin.ops.gdn.wy import _wy_bwd_kernel
from fabric_lin.ops.launch import cdiv, tile_width


@triton.jit
def _bwd_dd_local_kernel(q, k, b, do, dd, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """dd = scale P^T do (P = q k^T * Gamma) for one value tile of one chunk and head, in dd's dtype."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, _ = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    q += i_h * K
    k += i_h * K
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_st = tl.zeros([BT, BT], dtype=tl.float32)  # P^T before the decay: [j, i] = k_j . q_i
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = load_raw(q, row0, o_t, n_rows, H * K, o_k, m_k)
        b_k = load_raw(k, row0, o_t, n_rows, H * K, o_k, m_k)
        b_st += tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
    if USE_GATE:
        b_b = load_head_gate(b + i_h, row0, o_t, n_rows, H)
        b_st = b_st * tl.trans(_causal_decay(b_b, BT)) * scale
    else:  # P^T: on and above the diagonal
        b_st = tl.where(o_t[:, None] <= o_t[None, :], b_st, 0.0) * scale
    b_do = load_raw(do + i_h * V, row0, o_t, n_rows, H * V, o_v, m_v)
    b_dd = tl.dot(b_st.to(DT), b_do.to(DT), input_precision=DOT_PREC)
    m_tv = (o_t < n_rows)[:, None] & m_v[None, :]
    tl.store(dd + i_h * V + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], b_dd.to(dd.dtype.element_ty), mask=m_tv)


@triton.jit
def reverse_state_pass(i_v, i_nh, q, k, w, b, do, dd_local, dh, dd, dht, dh0, cu_seqlens, chunk_offsets, scale, T,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
                       BV: tl.constexpr, USE_DHT: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """The reverse pass over one sequence's chunks for value tile i_v and sequence and head i_nh: dh[chunk n] = dS',
    the gradient of the state leaving chunk n (dh's dtype); dd = dd_local + k_end dS' (the corrections' whole
    gradient, dd's dtype); dh0 = the initial state's gradient (fp32). BKS >= K: the whole key dimension. Without
    USE_GATE (b None) k_end = k, q enters undecayed and dS' passes back unscaled."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = seq_start(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    # key tile 0 of width BKS: all of K, which the correction D = U - W S reads
    o_k, o_v, m_k, m_v, m_kv, state_offs = state_tile(0, i_v, K, V, BKS, BV)
    q += i_h * K
    k += i_h * K
    w += i_h * K
    if USE_GATE:
        b += i_h
    do += i_h * V
    dd_local += i_h * V
    dd += i_h * V
    dS = initial_state_tile(dht, i_nh, state_offs, m_kv, K, V, BKS, BV, USE_DHT)
    for i_r in range(tl.cdiv(T, BT)):
        i_t = tl.cdiv(T, BT) - 1 - i_r
        row0 = bos + i_t * BT
        n_rows = T - i_t * BT
        m_tv = (o_t < n_rows)[:, None] & m_v[None, :]
        tl.store(dh + chunk_state_offset(boh + i_t, i_h, H, K, V) + state_offs, dS.to(dh.dtype.element_ty), mask=m_kv)
        # the decays k_end = diag(exp(b_last - b)) K and q_start = diag(exp(b) scale) Q are taken on the BV columns
        # of the products they enter (k dS', and dO) rather than on K's K columns: fewer products per row
        b_k = load_raw(k, row0, o_t, n_rows, H * K, o_k, m_k)
        k_dS = tl.dot(b_k, dS.to(DT), input_precision=DOT_PREC)
        b_do = load_raw(do, row0, o_t, n_rows, H * V, o_v, m_v).to(tl.float32)
        if USE_GATE:
            b_b = load_head_gate(b, row0, o_t, n_rows, H)
            b_last = load_head_gate(b, row0, BT - 1, n_rows, H)
            k_dS = k_dS * tl.exp(b_last - b_b)[:, None]
            do_start = (b_do * (tl.exp(b_b) * scale)[:, None]).to(DT)
        else:
            do_start = (b_do * scale).to(DT)
        b_dd = load_raw(dd_local, row0, o_t, n_rows, H * V, o_v, m_v).to(tl.float32) + k_dS
        tl.store(dd + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], b_dd.to(dd.dtype.element_ty), mask=m_tv)
        b_q = load_raw(q, row0, o_t, n_rows, H * K, o_k, m_k)
        b_w = load_raw(w, row0, o_t, n_rows, H * K, o_k, m_k)
        if USE_GATE:
            dS = dS * tl.exp(b_last)
        dS = (dS + tl.dot(tl.trans(b_q), do_start, input_precision=DOT_PREC)
              - tl.dot(tl.trans(b_w), b_dd.to(DT), input_precision=DOT_PREC))
    if USE_H0:
        tl.store(dh0 + sequence_state_offset(i_nh, K, V) + state_offs, dS, mask=m_kv)


@triton.jit
def _bwd_state_kernel(q, k, w, b, do, dd_local, dh, dd, dht, dh0, cu_seqlens, chunk_offsets, scale, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
                      BV: tl.constexpr, USE_DHT: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
                      DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """`reverse_state_pass` for one value tile (program 0) of one sequence and head (program 1)."""
    reverse_state_pass(tl.program_id(0), tl.program_id(1), q, k, w, b, do, dd_local, dh, dd, dht, dh0, cu_seqlens,
                       chunk_offsets, scale, T, H, K, V, BT, BKS, BV, USE_DHT, USE_H0, IS_VARLEN, DOT_PREC, USE_GATE)


@triton.jit
def _state_passes_kernel(q, k, w, u, b, do, dd_local, h, d, dh, dd, h0, dht, dh0, cu_seqlens, chunk_offsets, scale, T,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
                         DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """Both passes over the chunks of one value tile (program 0) of one sequence and head (program 1): program 2 = 0
    runs the forward pass again for h and D (no final state), 1 the reverse pass."""
    if tl.program_id(2) == 0:
        forward_state_pass(tl.program_id(0), tl.program_id(1), k, w, u, b, h, d, h0, None, cu_seqlens, chunk_offsets, T,
                           H, K, V, BT, BKS, BV, USE_H0, False, IS_VARLEN, DOT_PREC, USE_GATE)
    else:
        reverse_state_pass(tl.program_id(0), tl.program_id(1), q, k, w, b, do, dd_local, dh, dd, dht, dh0, cu_seqlens,
                           chunk_offsets, scale, T, H, K, V, BT, BKS, BV, USE_DHT, USE_H0, IS_VARLEN, DOT_PREC, USE_GATE)


@triton.jit
def _bwd_dqkw_kernel(q, k, d, b, h, dh, do, dd, dq, dk_part, dw, dg_part, cu_seqlens, chunk_indices, scale, T,
                     part_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                     USE_GATE: tl.constexpr):
    """For one key tile of one chunk and head: dq (dq's dtype), the output's and state's part of dk (fp32),
    dW = -dD S^T (dw's dtype), and their part of the gate's gradient dg (fp32, the key tile's own row of dg_part;
    without USE_GATE, b and dg_part are None and there is none)."""
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, i_tg = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    d += i_h * V
    do += i_h * V
    dd += i_h * V
    h += chunk_state_offset(i_tg, i_h, H, K, V)
    dh += chunk_state_offset(i_tg, i_h, H, K, V)
    dq_state = tl.zeros([BT, BK], dtype=tl.float32)  # do S^T
    dk_state = tl.zeros([BT, BK], dtype=tl.float32)  # D dS'^T
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dD S^T
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)  # do D^T
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # sum over values of S * dS'
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        b_do = load_raw(do, row0, o_t, n_rows, H * V, o_v, m_v).to(DT)
        b_d = load_raw(d, row0, o_t, n_rows, H * V, o_v, m_v).to(DT)
        b_dd = load_raw(dd, row0, o_t, n_rows, H * V, o_v, m_v).to(DT)
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        dq_state += tl.dot(b_do, tl.trans(b_h.to(DT)), input_precision=DOT_PREC)
        dk_state += tl.dot(b_d, tl.trans(b_dh.to(DT)), input_precision=DOT_PREC)
        b_dw += tl.dot(b_dd, tl.trans(b_h.to(DT)), input_precision=DOT_PREC)
        b_ds += tl.dot(b_do, tl.trans(b_d), input_precision=DOT_PREC)
        if USE_GATE:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    m_tk = m_t[:, None] & m_k[None, :]
    offs = i_h * K + (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
    tl.store(dw + offs, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)  # stored first: its registers are needed below
    if USE_GATE:
        b_b = load_head_gate(b + i_h, row0, o_t, n_rows, H)
        b_last = load_head_gate(b + i_h, row0, BT - 1, n_rows, H)
        b_q = load_raw(q + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
        b_k = load_raw(k + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
        # P's diagonal (exp(0) = 1 whatever the gate) moves no b: it enters db_i once through q_i and once, negated,
        # through k_i. Summed into dq . q and dk . k it would leave the rounding of those O(1) terms in db, which is
        # all there is of a fast gate's tiny true gradient; so it is kept out of db, and added to dq and dk apart
        b_ds = b_ds * _causal_decay(b_b, BT) * scale
        diagonal = o_t[:, None] == o_t[None, :]
        ds_diag = tl.sum(tl.where(diagonal, b_ds, 0.0), axis=1)
        b_ds = tl.where(diagonal, 0.0, b_ds).to(DT)
        b_dq = dq_state * (tl.exp(b_b) * scale)[:, None] + tl.dot(b_ds, b_k, input_precision=DOT_PREC)
        b_db = tl.sum(b_dq * b_q.to(tl.float32), axis=1)
        b_dq += ds_diag[:, None] * b_k.to(tl.float32)
        tl.store(dq + offs, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        b_dk = tl.dot(tl.trans(b_ds), b_q, input_precision=DOT_PREC)
        b_db -= tl.sum(b_dk * b_k.to(tl.float32), axis=1)
        dk_state = dk_state * tl.exp(b_last - b_b)[:, None]
        # The keys' exp(b_last - b_i) = exp(g_{i+1} + ... + g_last) moves g_t for t > i only, by c_i = k_i . dk_state_i:
        # g_t's gradient gets the sum of c_i over the rows i < t. Taken as b_last's gradient minus b_i's, the last row's
        # c (of a key no decay reaches, O(1)) would be added at the last row and taken away again in the reverse cumsum
        c = tl.sum(dk_state * b_k.to(tl.float32), axis=1)
        b_dk += dk_state + ds_diag[:, None] * b_q.to(tl.float32)
        tl.store(dk_part + offs, b_dk, mask=m_tk)
        # exp(b_last) decays the state: its gradient lands on the chunk's last row, so db's reverse cumsum gives it
        # to every row's g
        b_db += tl.where(o_t == tl.minimum(n_rows, BT) - 1, tl.sum(b_hdh, axis=0) * tl.exp(b_last), 0.0)
        dg_keys = tl.sum(tl.where(o_t[:, None] > o_t[None, :], c[None, :], 0.0), axis=1)
        b_dg = tl.cumsum(tl.where(m_t, b_db, 0.0), axis=0, reverse=True) + dg_keys
        # i_k * part_stride fits int32: dg_part's cdiv(K, BK) * B*T*H elements, at most (K*H / 16) x 1M tokens, pass
        # 2^31 only past K*H = 32K (64 heads of K = 512 in 16-wide key tiles fill it exactly)
        tl.store(dg_part + i_k * part_stride + (row0 + o_t) * H + i_h, b_dg, mask=m_t)
    else:
        b_q = load_raw(q + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
        b_k = load_raw(k + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
        # no gate, so no db to keep P's diagonal out of: P is q k^T on and below the diagonal
        b_ds = _causal(b_ds * scale, BT).to(DT)
        b_dq = dq_state * scale + tl.dot(b_ds, b_k, input_precision=DOT_PREC)
        tl.store(dq + offs, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        b_dk = tl.dot(tl.trans(b_ds), b_q, input_precision=DOT_PREC) + dk_state
        tl.store(dk_part + offs, b_dk, mask=m_tk)


# ------------------------------------------------------------------------------------------ host side


def backward(q, k, v, b, beta, A_inv, scale: float, initial_state: Optional[torch.Tensor],
             cu_seqlens: Optional[torch.Tensor], do, dht: Optional[torch.Tensor], launch: GDNLaunch,
             dqk_dtype: Optional[torch.dtype] = None):
    """(dq, dk, dv, dg fp32, dbeta in beta's dtype, dh0 fp32 or None) for q, k as the recurrence read them; b None
    (no gate): dg None. dqk_dtype: dq's and dk's dtype (default q's; fp32 where the L2 norm's backward follows)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = chunk_layout(cu_seqlens, B, T, CHUNK_SIZE)
    N, NC, chunk_indices, chunk_offsets = layout
    is_varlen = cu_seqlens is not None
    prec = dot_precision(q.dtype)
    gated = b is not None
    grid = chunk_grid(cu_seqlens, layout, T, B, H, CHUNK_SIZE)

    w, u = wy_factors(k, v, beta, b, A_inv, cu_seqlens, layout, launch)

    dd_local = torch.empty_like(v)
    BV = tile_width(launch.dd_local.BV, V)
    _bwd_dd_local_kernel[(cdiv(V, BV),) + grid](
        q, k, b, do, dd_local, cu_seqlens, chunk_indices, scale, T, H, K, V, CHUNK_SIZE, tile_width(launch.dd_local.BK, K),
        BV, IS_VARLEN=is_varlen, DOT_PREC=prec, USE_GATE=gated, **launch.dd_local.options(),
    )

    dh = q.new_empty(NC, H, K, V, dtype=state_dtype(q, initial_state is not None or dht is not None))
    dd = torch.empty_like(v)
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    multiprocessors = launch_helpers.multiprocessors(q.device)
    dstate = state_pass_launch(launch.dstate, launch.narrow_dstate, V, N, H, multiprocessors)
    BV = tile_width(dstate.BV, V)
    pass_grid = (cdiv(V, BV), N * H)
    if pair_state_passes(pass_grid[0] * pass_grid[1], multiprocessors):
        h = q.new_empty(NC, H, K, V, dtype=state_dtype(q, initial_state is not None))
        d = torch.empty_like(v)
        _state_passes_kernel[pass_grid + (2,)](
            q, k, w, u, b, do, dd_local, h, d, dh, dd, initial_state, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H,
            K, V, CHUNK_SIZE, state_key_tile(K), BV, USE_H0=initial_state is not None, USE_DHT=dht is not None,
            IS_VARLEN=is_varlen, DOT_PREC=prec, USE_GATE=gated, **dstate.options(),
        )
    else:
        h, d, _ = states(k, w, u, b, initial_state, cu_seqlens, layout, launch)
        _bwd_state_kernel[pass_grid](
            q, k, w, b, do, dd_local, dh, dd, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H, K, V, CHUNK_SIZE,
            state_key_tile(K), BV, USE_DHT=dht is not None, USE_H0=initial_state is not None, IS_VARLEN=is_varlen,
            DOT_PREC=prec, USE_GATE=gated, **dstate.options(),
        )

    dqk_dtype = dqk_dtype or q.dtype
    dq = torch.empty_like(q, dtype=dqk_dtype)
    dk_part = torch.empty_like(k, dtype=torch.float32)
    dw = torch.empty_like(k)
    BK = tile_width(launch.dqkw.BK, K)
    NK = cdiv(K, BK)
    dg_part = torch.empty(NK, B, T, H, device=q.device, dtype=torch.float32) if gated else None
    _bwd_dqkw_kernel[(NK,) + grid](
        q, k, d, b, h, dh, do, dd, dq, dk_part, dw, dg_part, cu_seqlens, chunk_indices, scale, T, B * T * H,
        H, K, V, CHUNK_SIZE, BK, tile_width(launch.dqkw.BV, V), IS_VARLEN=is_varlen, DOT_PREC=prec, USE_GATE=gated,
        **launch.dqkw.options(),
    )

    dk = torch.empty_like(k, dtype=dqk_dtype)
    dv = torch.empty_like(v)
    dg = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if gated else None
    dbeta = torch.empty_like(beta)
    _wy_bwd_kernel[grid](
        k, v, beta, b, A_inv, dw, dd, dk_part, dg_part, dk, dv, dbeta, dg, cu_seqlens, chunk_indices, T, NK,
        B * T * H, H, K, V, CHUNK_SIZE, tile_width(launch.wy_bwd.BK, K), tile_width(launch.wy_bwd.BV, V),
        IS_VARLEN=is_varlen, DOT_PREC=prec, USE_GATE=gated, **launch.wy_bwd.options(),
    )
    return dq, dk, dv, dg, dbeta, dh0
