"""Chunked GLA in Triton: forward and backward kernels, their autograd.Function, the torch.library ops.

The math is the one of chunk_torch.py (chunks of BT=64 tokens, b = cumsum(gk) inside a chunk, fp32
state), arranged so that every matrix product is a full 64-row tile:

  * intra-chunk scores A_ij = sum_k q_ik k_jk exp(b_ik - b_jk), j <= i. For the blocks below the
    16x16 diagonal, each sub-chunk J gives a reference row r (its last row) and
        A[rows > r, cols in J] = (q * exp(b - b_r))[rows > r] @ ((k * exp(b_r - b))[rows in J])^T,
    with both exponents <= 0; the three products (J = 0, 1, 2) are 64x64 tiles that add up, each
    filling its own column band. The 16x16 diagonal blocks are summed pair by pair (16 steps, one
    column of every block per step), so no exponent is ever positive.
  * h_n, the fp32 state entering chunk n, comes from one sequential pass (_fwd_state_kernel), and
    o = (q * exp(b)) @ h_n + A @ v (_fwd_output_kernel).

Backward: a reverse pass gives dh_n (the gradient of the state leaving chunk n) and dh0; one kernel
per chunk then recomputes A and produces dv, dq, dk and dgk. For the gate, with db_i the gradient of
the in-chunk cumulative gate b_i,  db_i = q_i dq_i - k_i dk_i  (elementwise, q and k as they enter the
products), plus, for b at the chunk's last row, sum_v(h_n dh_n) exp(b_last) + sum_j k_j dk_j(state part);
dgk is the reverse cumulative sum of db inside the chunk plus that last-row term.

Five launches for forward plus backward (two forward, three backward; the backward recomputes h and A
instead of keeping them). The per-chunk states are stored in the input dtype; all accumulation is fp32.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

BT = 64  # chunk
BC = 16  # sub-chunk of the intra-chunk scores


@triton.jit
def _intra_chunk_scores(q, k, g, row0, n_rows, stride, K, scale,
                        BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
    """A [BT, BT] fp32 for the chunk whose first row is `row0`; q, k, g point at the head's column 0."""
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    blk_start = (o_t // BC) * BC
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        offs = (row0 + o_t[:, None]) * stride + o_k[None, :]
        m = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + offs, mask=m, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + offs, mask=m, other=0.0).to(tl.float32)
        b_g = tl.cumsum(tl.load(g + offs, mask=m, other=0.0).to(tl.float32), axis=0)
        for J in tl.static_range(BT // BC - 1):
            r = J * BC + BC - 1
            b_r = tl.sum(tl.where(o_t[:, None] == r, b_g, 0.0), axis=0)
            after = (o_t > r)[:, None]
            in_J = ((o_t >= J * BC) & (o_t <= r))[:, None]
            q_J = tl.where(after, b_q * tl.exp(tl.where(after, b_g - b_r[None, :], 0.0)), 0.0)
            k_J = tl.where(in_J, b_k * tl.exp(tl.where(in_J, b_r[None, :] - b_g, 0.0)), 0.0)
            A += tl.dot(q_J.to(q.dtype.element_ty), tl.trans(k_J.to(q.dtype.element_ty)), input_precision=DOT_PREC)
        # diagonal blocks: E = b_i - b_p for the partner row p = blk_start(i) + jj
        b_start = tl.zeros([BT, BK], dtype=tl.float32)
        for J in tl.static_range(BT // BC):
            row = tl.sum(tl.where(o_t[:, None] == J * BC, b_g, 0.0), axis=0)
            b_start = tl.where((o_t // BC == J)[:, None], row[None, :], b_start)
        E = b_g - b_start
        for jj in range(BC):
            p = blk_start + jj
            m_p = (p < n_rows)[:, None] & m_k[None, :]
            offs_p = (row0 + p[:, None]) * stride + o_k[None, :]
            k_p = tl.load(k + offs_p, mask=m_p, other=0.0).to(tl.float32)
            ok = (o_t >= p)[:, None]
            s = tl.sum(tl.where(ok, b_q * k_p * tl.exp(tl.where(ok, E, 0.0)), 0.0), axis=1)
            A += tl.where(o_t[None, :] == p[:, None], s[:, None], 0.0)
            m_next = ((p + 1 < n_rows) & (jj + 1 < BC))[:, None] & m_k[None, :]
            E -= tl.load(g + offs_p + stride, mask=m_next, other=0.0).to(tl.float32)
    return A


@triton.jit
def _fwd_state_kernel(k, v, g, h, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    """h[chunk n] = the state entering chunk n; ht = the state after the last chunk (fp32)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    NT = tl.cdiv(T, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_offs = o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + i_nh * K * V + state_offs, mask=m_kv, other=0.0).to(tl.float32)
    k += i_h * K
    g += i_h * K
    v += i_h * V
    for i_t in range(NT):
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + state_offs, S.to(h.dtype.element_ty), mask=m_kv)
        rows = bos + i_t * BT + o_t
        m_t = (i_t * BT + o_t) < T
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.cumsum(tl.load(g + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32), axis=0)
        b_v = tl.load(v + rows[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_last = tl.sum(tl.where(o_t[:, None] == BT - 1, b_g, 0.0), axis=0)
        k_end = (b_k * tl.exp(b_last[None, :] - b_g)).to(b_v.dtype)
        S = S * tl.exp(b_last)[:, None] + tl.dot(tl.trans(k_end), b_v, input_precision=DOT_PREC)
    tl.store(ht + i_nh * K * V + state_offs, S, mask=m_kv)


@triton.jit
def _fwd_output_kernel(q, k, v, g, h, o, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    """o = (q * exp(b)) @ h_n + A @ v for one chunk of one head, all value columns."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2)
        i_t = tl.load(chunk_indices + i_c * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        i_tg = i_c.to(tl.int64)
    else:
        i_t = i_c
        bos = (i_b * T).to(tl.int64)
        i_tg = (i_b * tl.cdiv(T, BT) + i_t).to(tl.int64)
    row0 = bos + i_t * BT
    n_rows = T - i_t * BT
    q += i_h * K
    k += i_h * K
    g += i_h * K
    v += i_h * V
    o += i_h * V
    h += (i_tg * H + i_h) * K * V
    A = _intra_chunk_scores(q, k, g, row0, n_rows, H * K, K, scale, BT, BC, BK, DOT_PREC)
    A = A.to(v.dtype.element_ty)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(v + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
        acc = tl.dot(A, b_v, input_precision=DOT_PREC)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            offs = (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
            m_tk = m_t[:, None] & m_k[None, :]
            b_q = tl.load(q + offs, mask=m_tk, other=0.0).to(tl.float32)
            b_g = tl.cumsum(tl.load(g + offs, mask=m_tk, other=0.0).to(tl.float32), axis=0)
            q_dec = (b_q * (tl.exp(b_g) * scale)).to(b_v.dtype)
            b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
            acc += tl.dot(q_dec, b_h.to(b_v.dtype), input_precision=DOT_PREC)
        tl.store(o + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], acc.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def _bwd_state_kernel(q, g, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_DHT: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    """dh[chunk n] = gradient of the state leaving chunk n; dh0 = gradient of the initial state."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    NT = tl.cdiv(T, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_offs = o_k[:, None] * V + o_v[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + i_nh * K * V + state_offs, mask=m_kv, other=0.0).to(tl.float32)
    q += i_h * K
    g += i_h * K
    do += i_h * V
    for i in range(NT):
        i_t = NT - 1 - i
        tl.store(dh + ((boh + i_t) * H + i_h) * K * V + state_offs, dS.to(dh.dtype.element_ty), mask=m_kv)
        rows = bos + i_t * BT + o_t
        m_t = (i_t * BT + o_t) < T
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.cumsum(tl.load(g + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32), axis=0)
        b_do = tl.load(do + rows[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_last = tl.sum(tl.where(o_t[:, None] == BT - 1, b_g, 0.0), axis=0)
        q_dec = (b_q * (tl.exp(b_g) * scale)).to(b_do.dtype)
        dS = dS * tl.exp(b_last)[:, None] + tl.dot(tl.trans(q_dec), b_do, input_precision=DOT_PREC)
    if USE_H0:
        tl.store(dh0 + i_nh * K * V + state_offs, dS, mask=m_kv)


@triton.jit
def _bwd_chunk_kernel(q, k, v, g, h, do, dh, dq, dk, dv, dg, cu_seqlens, chunk_indices, scale, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    """dq, dk, dv, dgk of one chunk of one head, from h_n (state in), dh_n (gradient of state out), do."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2)
        i_t = tl.load(chunk_indices + i_c * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        i_tg = i_c.to(tl.int64)
    else:
        i_t = i_c
        bos = (i_b * T).to(tl.int64)
        i_tg = (i_b * tl.cdiv(T, BT) + i_t).to(tl.int64)
    row0 = bos + i_t * BT
    n_rows = T - i_t * BT
    q += i_h * K
    k += i_h * K
    g += i_h * K
    dq += i_h * K
    dk += i_h * K
    dg += i_h * K
    v += i_h * V
    do += i_h * V
    dv += i_h * V
    h += (i_tg * H + i_h) * K * V
    dh += (i_tg * H + i_h) * K * V
    DT = v.dtype.element_ty

    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    blk_start = (o_t // BC) * BC
    A = _intra_chunk_scores(q, k, g, row0, n_rows, H * K, K, scale, BT, BC, BK, DOT_PREC).to(DT)

    # dv = A^T do + (k * exp(b_last - b)) dh_n;  dA = do v^T
    dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        offs_v = (row0 + o_t[:, None]) * (H * V) + o_v[None, :]
        b_do = tl.load(do + offs_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + offs_v, mask=m_tv, other=0.0)
        dA += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_dv = tl.dot(tl.trans(A), b_do, input_precision=DOT_PREC)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            offs = (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
            m_tk = m_t[:, None] & m_k[None, :]
            b_k = tl.load(k + offs, mask=m_tk, other=0.0).to(tl.float32)
            b_g = tl.cumsum(tl.load(g + offs, mask=m_tk, other=0.0).to(tl.float32), axis=0)
            b_last = tl.sum(tl.where(o_t[:, None] == BT - 1, b_g, 0.0), axis=0)
            k_end = (b_k * tl.exp(b_last[None, :] - b_g)).to(DT)
            b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0).to(DT)
            b_dv += tl.dot(k_end, b_dh, input_precision=DOT_PREC)
        tl.store(dv + offs_v, b_dv.to(dv.dtype.element_ty), mask=m_tv)
    dA = tl.where(o_t[:, None] >= o_t[None, :], dA, 0.0)

    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        offs = (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + offs, mask=m_tk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + offs, mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.cumsum(tl.load(g + offs, mask=m_tk, other=0.0).to(tl.float32), axis=0)
        b_last = tl.sum(tl.where(o_t[:, None] == BT - 1, b_g, 0.0), axis=0)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)  # gradient of the scaled q
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        # blocks below the 16x16 diagonal, through the reference row r of each sub-chunk J
        for J in tl.static_range(BT // BC - 1):
            r = J * BC + BC - 1
            b_r = tl.sum(tl.where(o_t[:, None] == r, b_g, 0.0), axis=0)
            after = (o_t > r)[:, None]
            in_J = ((o_t >= J * BC) & (o_t <= r))[:, None]
            f_q = tl.where(after, tl.exp(tl.where(after, b_g - b_r[None, :], 0.0)), 0.0)
            f_k = tl.where(in_J, tl.exp(tl.where(in_J, b_r[None, :] - b_g, 0.0)), 0.0)
            q_J = (b_q * f_q).to(DT)
            k_J = (b_k * f_k).to(DT)
            dA_c = dA.to(DT)
            b_dq += f_q * tl.dot(dA_c, k_J, input_precision=DOT_PREC)
            b_dk += f_k * tl.dot(tl.trans(dA_c), q_J, input_precision=DOT_PREC)
        # the diagonal blocks, pair by pair; E = b_i - b_p for partner row p = blk_start(i) + jj
        b_start = tl.zeros([BT, BK], dtype=tl.float32)
        for J in tl.static_range(BT // BC):
            row = tl.sum(tl.where(o_t[:, None] == J * BC, b_g, 0.0), axis=0)
            b_start = tl.where((o_t // BC == J)[:, None], row[None, :], b_start)
        E = b_g - b_start
        for jj in range(BC):
            p = blk_start + jj
            m_p = (p < n_rows)[:, None] & m_k[None, :]
            offs_p = (row0 + p[:, None]) * (H * K) + o_k[None, :]
            k_p = tl.load(k + offs_p, mask=m_p, other=0.0).to(tl.float32)
            q_p = tl.load(q + offs_p, mask=m_p, other=0.0).to(tl.float32) * scale
            dA_ip = tl.sum(tl.where(o_t[None, :] == p[:, None], dA, 0.0), axis=1)  # dA[i, p(i)]
            dA_pj = tl.sum(tl.where(o_t[:, None] == p[None, :], dA, 0.0), axis=0)  # dA[p(j), j]
            ok_q = (o_t >= p)[:, None]
            ok_k = (p >= o_t)[:, None]
            b_dq += tl.where(ok_q, dA_ip[:, None] * k_p * tl.exp(tl.where(ok_q, E, 0.0)), 0.0)
            b_dk += tl.where(ok_k, dA_pj[:, None] * q_p * tl.exp(tl.where(ok_k, -E, 0.0)), 0.0)
            m_next = ((p + 1 < n_rows) & (jj + 1 < BC))[:, None] & m_k[None, :]
            E -= tl.load(g + offs_p + H * K, mask=m_next, other=0.0).to(tl.float32)
        # the state parts: do h_n^T and v dh_n^T, and sum_v h_n * dh_n for the last-row gate term
        dq_s = tl.zeros([BT, BK], dtype=tl.float32)
        dk_s = tl.zeros([BT, BK], dtype=tl.float32)
        hdh = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            offs_v = (row0 + o_t[:, None]) * (H * V) + o_v[None, :]
            b_do = tl.load(do + offs_v, mask=m_tv, other=0.0)
            b_v = tl.load(v + offs_v, mask=m_tv, other=0.0)
            b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            dq_s += tl.dot(b_do, tl.trans(b_h.to(DT)), input_precision=DOT_PREC)
            dk_s += tl.dot(b_v, tl.trans(b_dh.to(DT)), input_precision=DOT_PREC)
            hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        dk_s = dk_s * tl.exp(b_last[None, :] - b_g)
        b_dq += dq_s * tl.exp(b_g)
        b_dk += dk_s
        db = b_q * b_dq - b_k * b_dk
        db_last = hdh * tl.exp(b_last) + tl.sum(b_k * dk_s, axis=0)
        b_dg = tl.sum(db, axis=0)[None, :] - tl.cumsum(db, axis=0) + db + db_last[None, :]
        tl.store(dq + offs, (b_dq * scale).to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def _block_sizes(K: int, V: int) -> Tuple[int, int]:
    return min(64, max(16, triton.next_power_of_2(K))), min(64, max(16, triton.next_power_of_2(V)))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs stay exact (no tf32); bf16/fp16 dots run on the tensor cores whatever this says
    return "ieee" if dtype == torch.float32 else "tf32"


def _chunk_layout(cu_seqlens: Optional[torch.Tensor], B: int, T: int):
    """(number of sequences, total chunks, chunk_indices [(seq, chunk in seq)] int32, chunk_offsets int32)."""
    if cu_seqlens is None:
        return B, B * triton.cdiv(T, BT), None, None
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    counts = [triton.cdiv(n, BT) for n in lengths]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    indices = [(n, t) for n, c in enumerate(counts) for t in range(c)]
    device = cu_seqlens.device
    chunk_indices = torch.tensor(indices, dtype=torch.int32, device=device).view(-1)
    chunk_offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    return len(lengths), offsets[-1], chunk_indices, chunk_offsets


def _forward(q, k, v, g, scale, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, NC, chunk_indices, chunk_offsets = _chunk_layout(cu_seqlens, B, T)
    BK, BV = _block_sizes(K, V)
    prec = _dot_precision(q.dtype)
    h = q.new_empty(NC, H, K, V)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32)
    _fwd_state_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), N * H)](
        k, v, g, h, initial_state, ht, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV,
        USE_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None, DOT_PREC=prec, num_warps=4,
    )
    o = torch.empty_like(v)
    grid = (NC, H) if cu_seqlens is not None else (triton.cdiv(T, BT), B * H)
    _fwd_output_kernel[grid](
        q, k, v, g, h, o, cu_seqlens, chunk_indices, scale, T, H, K, V, BT, BC, BK, BV,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=prec, num_warps=4,
    )
    return o, ht, h


def _backward(q, k, v, g, scale, initial_state, cu_seqlens, do, dht):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, NC, chunk_indices, chunk_offsets = _chunk_layout(cu_seqlens, B, T)
    BK, BV = _block_sizes(K, V)
    prec = _dot_precision(q.dtype)
    is_varlen = cu_seqlens is not None
    # the per-chunk states, recomputed rather than kept from the forward pass
    h = q.new_empty(NC, H, K, V)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32)
    state_grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), N * H)
    _fwd_state_kernel[state_grid](
        k, v, g, h, initial_state, ht, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV,
        USE_H0=initial_state is not None, IS_VARLEN=is_varlen, DOT_PREC=prec, num_warps=4,
    )
    dh = q.new_empty(NC, H, K, V)
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    _bwd_state_kernel[state_grid](
        q, g, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H, K, V, BT, BK, BV,
        USE_DHT=dht is not None, USE_H0=initial_state is not None, IS_VARLEN=is_varlen, DOT_PREC=prec, num_warps=4,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = torch.empty_like(g)
    grid = (NC, H) if is_varlen else (triton.cdiv(T, BT), B * H)
    _bwd_chunk_kernel[grid](
        q, k, v, g, h, do, dh, dq, dk, dv, dg, cu_seqlens, chunk_indices, scale, T, H, K, V, BT, BC, BK, BV,
        IS_VARLEN=is_varlen, DOT_PREC=prec, num_warps=4,
    )
    return dq, dk, dv, dg, dh0


# torch.library ops: torch.compile sees them as opaque calls with known output shapes.
@torch.library.custom_op("fabric_lin::chunk_gla_fwd", mutates_args=())
def chunk_gla_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    o, ht, _ = _forward(q, k, v, g, scale, initial_state, cu_seqlens)
    return o, ht


@chunk_gla_fwd_op.register_fake
def _(q, k, v, g, scale, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(B, T, H, v.shape[-1]), q.new_empty(N, H, K, v.shape[-1], dtype=torch.float32)


@torch.library.custom_op("fabric_lin::chunk_gla_bwd", mutates_args=())
def chunk_gla_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
    dht: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dg, dh0 = _backward(q, k, v, g, scale, initial_state, cu_seqlens, do, dht)
    if dh0 is None:
        dh0 = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dg, dh0


@chunk_gla_bwd_op.register_fake
def _(q, k, v, g, scale, initial_state, cu_seqlens, do, dht):
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g), dh0


class ChunkGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
        o, ht = chunk_gla_fwd_op(q, k, v, g, scale, initial_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens)
        ctx.scale = scale
        ctx.output_final_state = output_final_state
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, initial_state, cu_seqlens = ctx.saved_tensors
        dht = dht.contiguous() if ctx.output_final_state and dht is not None else None
        dq, dk, dv, dg, dh0 = chunk_gla_bwd_op(q, k, v, g, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht)
        return dq, dk, dv, dg, None, (dh0 if initial_state is not None else None), None, None


def chunk_gla_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as chunk_gla_torch: q, k, gk [B, T, H, K], v [B, T, H, V], states [B or N, H, K, V] fp32."""
    B, T, H, K = q.shape
    if k.shape != q.shape or gk.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_gla: expected q, k, gk of one shape [B, T, H, K] and v [B, T, H, V], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, gk {tuple(gk.shape)}"
        )
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must have shape {(N, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    o, ht = ChunkGLAFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), scale, initial_state, output_final_state,
        cu_seqlens,
    )
    return o, (ht if output_final_state else None)
