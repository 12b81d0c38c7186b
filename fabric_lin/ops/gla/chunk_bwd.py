"""GLA's chunked backward pass in Triton.

The per-chunk states h_n are recomputed rather than kept; one launch runs that forward pass and the reverse
pass giving dh_n (the gradient of the state leaving chunk n) and dh0 (`state_pass.py`).
Then, per chunk:
  * dv = (k exp(b_last - b)) dh_n + A^T do and dA = tril(do v^T) (A kept from the forward pass; both go
    through memory in the inputs' dtype, the one the products use). The decayed keys k exp(b_last - b), which
    the state recomputation and this kernel both use, are written once (by the gate cumsum where the gate
    came as logits, else by the state recomputation) and read by the other.
  * dq, dk and the gate's gradient per key tile, the intra-chunk part differentiated as the forward made the
    scores (`scores.py`): one reference row where the gate's spread allows, else the levels of halves (the two
    launches as in the forward). With db_i the gradient of the in-chunk cumulative gate b_i,
    db_i = q_i dq_i - k_i dk_i (q and k as they enter the products), plus, for b at the chunk's last row,
    sum_v(h_n dh_n) exp(b_last) + sum_j k_j dk_j(state part); the gate's gradient is the reverse cumulative
    sum of db inside the chunk plus that term. From logits, it is multiplied by d logsigmoid(x)/dx / normalizer.
All accumulation is fp32.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import (
    chunk_start,
    chunk_state_offset,
    load_gate,
    load_gate_row,
    load_raw,
    load_tile,
)
from fabric_lin.ops.chunked.layout import CHUNK_SIZE, chunk_grid, chunk_layout, dot_precision
from fabric_lin.ops.gla.cumsum import gate_cumsum
from fabric_lin.ops.gla.state_pass import (
    KD_FORM,
    KD_READ,
    KD_WRITE,
    sequential_states_and_grads,
    split_state_grads,
    split_states,
    states,
    takes_decayed_keys,
)
from fabric_lin.ops.gla.launch import GLALaunch
from fabric_lin.ops.gla.gate import single_reference_limit
from fabric_lin.ops.gla.scores import FINE_ROWS, block_level_factor, gate_spread, half_factor
from fabric_lin.ops.launch import cdiv, tile_width


@triton.jit
def _decayed_keys(k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, DT: tl.constexpr, STORED: tl.constexpr):
    """k * exp(b_last - b), columns o_k, in DT: the keys as the state leaving the chunk sees them (STORED: k
    holds them already)."""
    o_t = tl.arange(0, BT)
    if STORED:
        k_end = load_raw(k, row0, o_t, n_rows, stride, o_k, m_k).to(DT)
    else:
        b_k = load_tile(k, row0, o_t, n_rows, stride, o_k, m_k)
        b_g = load_gate(gc, row0, o_t, n_rows, stride, o_k, m_k)
        b_last = load_gate_row(gc, row0, BT - 1, n_rows, stride, o_k, m_k)
        k_end = (b_k * tl.exp(b_last[None, :] - b_g)).to(DT)
    return k_end


@triton.jit
def _bwd_dv_kernel(k, v, gc, kd, A, do, dh, dv, dA, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                   DOT_PREC: tl.constexpr, READ_KD: tl.constexpr):
    """dv = (k * exp(b_last - b)) dh_n + A^T do, and dA = tril(do v^T) ([B*T, H, BT], input dtype) for one chunk.
    READ_KD: the decayed keys k * exp(b_last - b) are read from kd, not formed from k and gc."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, i_tg = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    if READ_KD:
        k = kd  # the keys read below are the decayed ones
    k += i_h * K
    gc += i_h * K
    v += i_h * V
    do += i_h * V
    dv += i_h * V
    dh += chunk_state_offset(i_tg, i_h, H, K, V)
    DT = v.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    offs_A = (row0 + o_t[:, None]) * (H * BT) + i_h * BT + o_t[None, :]
    b_A = tl.load(A + offs_A, mask=m_t[:, None], other=0.0).to(DT)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    if BK >= K:  # one key tile: its decayed keys are formed once for all value tiles
        k_end_all = _decayed_keys(k, gc, row0, n_rows, H * K, tl.arange(0, BK), tl.arange(0, BK) < K, BT, DT, READ_KD)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        offs_v = (row0 + o_t[:, None]) * (H * V) + o_v[None, :]
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            if BK >= K:
                k_end = k_end_all
            else:
                k_end = _decayed_keys(k, gc, row0, n_rows, H * K, o_k, m_k, BT, DT, READ_KD)
            b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0).to(DT)
            b_dv += tl.dot(k_end, b_dh, input_precision=DOT_PREC)
        b_do = tl.load(do + offs_v, mask=m_tv, other=0.0).to(DT)
        b_v = tl.load(v + offs_v, mask=m_tv, other=0.0).to(DT)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_dv += tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
        tl.store(dv + offs_v, b_dv.to(dv.dtype.element_ty), mask=m_tv)
    b_dA = tl.where(o_t[:, None] >= o_t[None, :], b_dA, 0.0)
    tl.store(dA + offs_A, b_dA.to(dA.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _level_factors(dA_c, b_g, gc, row0, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr):
    """Level P of the backward's halves, as the forward made the scores: (dA kept to the pairs inside one
    block of P rows (the others were not made by this level's product), the keys' factor exp(b_r - b) on
    the first halves' rows and 0 on the others, the queries' factor exp(b - b_r) on the second halves'
    rows and 0 on the others)."""
    o_t = tl.arange(0, BT)
    if P < BT:
        dA_c = tl.where((o_t[:, None] // P) == (o_t[None, :] // P), dA_c, 0.0).to(dA_c.dtype)
    first, f = half_factor(b_g, gc, row0, o_t, n_rows, stride, o_k, m_k, P, BT)
    return dA_c, tl.where(first, f, 0.0), tl.where(first, 0.0, f)


@triton.jit
def _dqk_level(b_dq, b_dk, dA_c, b_q, b_k, b_g, gc, row0, n_rows, stride, o_k, m_k, scale, P: tl.constexpr,
               BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """The gradients of level P's product: dq += f_q (dA @ (k f_k)), dk += f_k (dA^T @ (q scale f_q)), b_dq being
    the gradient of the scaled q."""
    DT = dA_c.dtype
    dA_c, f_k, f_q = _level_factors(dA_c, b_g, gc, row0, n_rows, stride, o_k, m_k, P, BT)
    k_f = (b_k.to(tl.float32) * f_k).to(DT)
    q_f = (b_q.to(tl.float32) * (f_q * scale)).to(DT)
    b_dq += f_q * tl.dot(dA_c, k_f, input_precision=DOT_PREC)
    b_dk += f_k * tl.dot(tl.trans(dA_c), q_f, input_precision=DOT_PREC)
    return b_dq, b_dk


@triton.jit
def _dqk_fine_levels(q, k, gc, dA, row0, n_rows, stride, o_k, m_k, scale, H: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr):
    """The levels inside the chunk's blocks of BS rows (P = BS, BS/2, ..., 2), as _dqk_level makes
    them but on [BT/BS, BS, BK] tiles: per block, a [BS, BS] piece of dA against [BS, BK] factor tiles,
    batched over the blocks, where a level of 64x64 products would multiply zeros everywhere but on its
    diagonal blocks. Returns their part of (dq, dk), [BT, BK]; their tiles are loaded here (not through
    scores.py's block loader, with which this kernel compiles to more spills) and dead after."""
    NB: tl.constexpr = BT // BS
    DT = q.dtype.element_ty
    t = tl.arange(0, BS)
    rows = tl.arange(0, NB)[:, None, None] * BS + t[None, :, None]  # [NB, BS, 1], rows of the chunk
    m3 = (rows < n_rows) & m_k[None, None, :]
    offs = (row0 + rows) * stride + o_k[None, None, :]
    b_q = tl.load(q + offs, mask=m3, other=0.0)
    b_k = tl.load(k + offs, mask=m3, other=0.0)
    b_g = tl.load(gc + (row0 + tl.minimum(rows, n_rows - 1)) * stride + o_k[None, None, :], mask=m_k[None, None, :],
                  other=0.0)
    cols = tl.arange(0, NB)[:, None, None] * BS + t[None, None, :]  # [NB, 1, BS]: dA's columns of each block
    dA_b = tl.load(dA + (row0 + rows) * (H * BT) + cols, mask=rows < n_rows, other=0.0)  # [NB, BS, BS]
    dA_bt = tl.permute(dA_b, (0, 2, 1))
    dq = tl.zeros([NB, BS, BK], dtype=tl.float32)
    dk = tl.zeros([NB, BS, BK], dtype=tl.float32)
    for level in tl.static_range(6):
        P = BS >> level  # BS, BS/2, ..., 2
        if P >= 2:
            same_block = ((t[:, None] // P) == (t[None, :] // P))[None, :, :]
            dA_p = tl.where(same_block, dA_b, 0.0).to(dA_b.dtype)
            dA_pt = tl.where(same_block, dA_bt, 0.0).to(dA_b.dtype)  # same_block is symmetric
            first, f = block_level_factor(b_g, gc, row0, n_rows, stride, o_k, m_k, P, BT, BS)
            f_k = tl.where(first, f, 0.0)
            f_q = tl.where(first, 0.0, f)
            dq += f_q * tl.dot(dA_p, (b_k.to(tl.float32) * f_k).to(DT), input_precision=DOT_PREC)
            dk += f_k * tl.dot(dA_pt, (b_q.to(tl.float32) * (f_q * scale)).to(DT), input_precision=DOT_PREC)
    return tl.reshape(dq, [BT, BK]), tl.reshape(dk, [BT, BK])


@triton.jit
def _dqk_state_tiles(v, h, do, dh, row0, m_t, o_k, m_k, i_v, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BV: tl.constexpr):
    """do, v ([BT, BV]) and h_n, dh_n ([BK, BV]) at value tile i_v; past the last tile, all masked (no traffic)."""
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    offs_v = (row0 + o_t[:, None]) * (H * V) + o_v[None, :]
    b_do = tl.load(do + offs_v, mask=m_tv, other=0.0)
    b_v = tl.load(v + offs_v, mask=m_tv, other=0.0)
    b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    return b_do, b_v, b_h, b_dh


@triton.jit
def _dqk_state(v, h, do, dh, row0, m_t, o_k, m_k, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """The state parts of dq and dk before their gate factors, do h_n^T and v dh_n^T ([BT, BK] each), and
    sum_v h_n * dh_n ([BK]) for the last-row gate term. Value tile i_v + 1's loads are issued before tile
    i_v's products (as in the state passes)."""
    DT = v.dtype.element_ty
    dq_s = tl.zeros([BT, BK], dtype=tl.float32)
    dk_s = tl.zeros([BT, BK], dtype=tl.float32)
    hdh = tl.zeros([BK], dtype=tl.float32)
    n_do, n_v, n_h, n_dh = _dqk_state_tiles(v, h, do, dh, row0, m_t, o_k, m_k, 0, H, V, BT, BV)
    for i_v in range(tl.cdiv(V, BV)):
        b_do, b_v, b_h, b_dh = n_do, n_v, n_h, n_dh
        n_do, n_v, n_h, n_dh = _dqk_state_tiles(v, h, do, dh, row0, m_t, o_k, m_k, i_v + 1, H, V, BT, BV)
        dq_s += tl.dot(b_do.to(DT), tl.trans(b_h.to(DT)), input_precision=DOT_PREC)
        dk_s += tl.dot(b_v.to(DT), tl.trans(b_dh.to(DT)), input_precision=DOT_PREC)
        hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    return dq_s, dk_s, hdh


@triton.jit
def _dqk_chunk_tiles(q, k, gc, dA, row0, n_rows, m_t, o_k, m_k, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """The chunk's tiles for dq/dk's intra-chunk part: b, b at the last row, q, k (their dtype), dA."""
    o_t = tl.arange(0, BT)
    b_g = load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
    b_last = load_gate_row(gc, row0, BT - 1, n_rows, H * K, o_k, m_k)
    b_q = load_raw(q, row0, o_t, n_rows, H * K, o_k, m_k)
    b_k = load_raw(k, row0, o_t, n_rows, H * K, o_k, m_k)
    dA_c = tl.load(dA + (row0 + o_t[:, None]) * (H * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
    return b_g, b_last, b_q, b_k, dA_c


@triton.jit
def _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, DOT_PREC: tl.constexpr, FROM_LOGITS: tl.constexpr, SINGLE_REFERENCE: tl.constexpr):
    """dq, dk, dgk of one chunk and key tile, pointers at its head. SINGLE_REFERENCE: the intra-chunk part as
    the gradient of one reference row's product, else level by level. The state part comes before the chunk's
    own tiles are loaded, so that its tiles are dead by the time theirs are live (the other order spills)."""
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    offs = (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
    DT = q.dtype.element_ty

    if not SINGLE_REFERENCE:
        # the levels inside blocks of FINE_ROWS rows first, their tiles dead before the state part's
        fine_dq, fine_dk = _dqk_fine_levels(q, k, gc, dA, row0, n_rows, H * K, o_k, m_k, scale, H, BT, BK, FINE_ROWS,
                                            DOT_PREC)
    dq_s, dk_s, hdh = _dqk_state(v, h, do, dh, row0, m_t, o_k, m_k, H, V, BT, BK, BV, DOT_PREC)
    b_g, b_last, b_q, b_k, dA_c = _dqk_chunk_tiles(q, k, gc, dA, row0, n_rows, m_t, o_k, m_k, H, K, BT)
    b_dq = dq_s * tl.exp(b_g)  # the gradient of the scaled q
    b_dk = dk_s * tl.exp(b_last[None, :] - b_g)
    db_last = hdh * tl.exp(b_last) + tl.sum(b_k.to(tl.float32) * b_dk, axis=0)
    if SINGLE_REFERENCE:
        # one product per side gives every pair j < i: dq_i = exp(b_i - b_r) sum_j dA_ij k_j exp(b_r - b_j), dk
        # alike; the diagonal, made from q and k in the forward pass, is differentiated from them below
        e = b_g - load_gate_row(gc, row0, BT // 2 - 1, n_rows, H * K, o_k, m_k)[None, :]
        f_q = tl.exp(e)
        f_k = tl.exp(-e)
        dA_below = tl.where(o_t[:, None] > o_t[None, :], dA_c, 0.0).to(dA_c.dtype)
        b_dq += f_q * tl.dot(dA_below, (b_k.to(tl.float32) * f_k).to(DT), input_precision=DOT_PREC)
        b_dk += f_k * tl.dot(tl.trans(dA_below), (b_q.to(tl.float32) * (f_q * scale)).to(DT), input_precision=DOT_PREC)
    else:
        b_dq += fine_dq
        b_dk += fine_dk
        # the coarse levels (blocks larger than FINE_ROWS rows), as the forward made the scores, then the
        # diagonal (dA[i, i])
        for level in tl.static_range(6):
            if (BT >> level) > FINE_ROWS:
                b_dq, b_dk = _dqk_level(b_dq, b_dk, dA_c, b_q, b_k, b_g, gc, row0, n_rows, H * K, o_k, m_k, scale,
                                        BT >> level, BT, DOT_PREC)
    # the diagonal, dA[i, i] (q_i . k_i): in fp32, so that its parts of q dq and k dk below cancel in the gate's
    # gradient as they do exactly
    dA_diag = tl.load(dA + (row0 + o_t) * (H * BT) + o_t, mask=m_t, other=0.0).to(tl.float32)[:, None]
    b_q = b_q.to(tl.float32) * scale
    b_k = b_k.to(tl.float32)
    b_dq += dA_diag * b_k
    b_dk += dA_diag * b_q
    # the gate: db_i = (q_i scale) dq_i - k_i dk_i, summed from the chunk's end, plus the last row's term, in one
    # reverse scan (a sum and a forward scan, or the sums as a product with triangular ones, spill more)
    db = b_q * b_dq - b_k * b_dk
    b_dg = tl.cumsum(db, axis=0, reverse=True) + db_last[None, :]
    if FROM_LOGITS:
        x = tl.load(logits + offs, mask=m_tk, other=0.0).to(tl.float32)
        sigmoid_neg_x = tl.exp(tl.minimum(-x, 0.0)) / (1.0 + tl.exp(-tl.abs(x)))  # no exp of a positive number
        b_dg = b_dg * sigmoid_neg_x / normalizer
    tl.store(dq + offs, (b_dq * scale).to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=m_tk)


@triton.jit
def _bwd_dqk_kernel(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, flags, cu_seqlens, chunk_indices, scale,
                    normalizer, limit, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                    FROM_LOGITS: tl.constexpr, FIRST: tl.constexpr):
    """dq, dk, dgk of one chunk, one head, one tile of key columns; FROM_LOGITS: dg gets the gradient of
    the gate's logits instead, dgk * d logsigmoid(x) / dx / normalizer = dgk * sigmoid(-x) / normalizer.
    FIRST as in the forward's output kernel, the spread taken over this program's key tile."""
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, i_tg = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    q += i_h * K
    k += i_h * K
    gc += i_h * K
    dq += i_h * K
    dk += i_h * K
    dg += i_h * K
    if FROM_LOGITS:
        logits += i_h * K
    v += i_h * V
    do += i_h * V
    dA += i_h * BT
    # chunk_state_offset's int64 product written out (i_tg is int64, from chunk_start): through the call, ptxas
    # spills more in the levels' launch of this kernel (sm_90, Triton 3.8: 48 words of local memory against 42)
    h += (i_tg * H + i_h) * K * V
    dh += (i_tg * H + i_h) * K * V
    flag = flags + (i_k * tl.num_programs(1) + i_c) * tl.num_programs(2) + i_bh
    if FIRST:
        o_k = i_k * BK + tl.arange(0, BK)
        single = gate_spread(gc, row0, n_rows, H * K, o_k, o_k < K, BT) <= limit
        if single:
            _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer, H, K, V,
                       BT, BK, BV, DOT_PREC, FROM_LOGITS, True)
        tl.store(flag, tl.where(single, 0, 1).to(tl.int8))
    else:
        if tl.load(flag) != 0:
            _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer, H, K, V,
                       BT, BK, BV, DOT_PREC, FROM_LOGITS, False)


def dqk_warps(launch: GLALaunch, first: bool, BK: int) -> int:
    """Warps of a dq/dk launch, at least 8 over key tiles narrower than 64: with BK = 32 either launch at 4 warps
    gave wrong dq, dk or dgk on an H200 with Triton 3.6 (relative RMS error 0.07 to 97 against the fp32
    recurrence) or an illegal memory access, where at 8 warps both matched it."""
    warps = launch.dqk_single_warps if first else launch.dqk.warps
    return warps if BK >= 64 else max(warps, 8)


def backward(q, k, v, gate, A, scale: float, initial_state: Optional[torch.Tensor],
             cu_seqlens: Optional[torch.Tensor], do, dht: Optional[torch.Tensor], normalizer: Optional[float],
             launch: GLALaunch):
    """(dq, dk, dv, dgate, dh0). gate is gc, the in-chunk cumulative log gate (dgate: the log gate's gradient,
    fp32), or, with a normalizer, the gate's logits (gc is recomputed from them; dgate: the logits' gradient,
    in their dtype)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = chunk_layout(cu_seqlens, B, T, CHUNK_SIZE)
    N, NC, chunk_indices, chunk_offsets = layout
    split = split_states(K, V, N, H, q.device, launch.state)
    # the decayed keys k * exp(b_last - b), read by the state recomputation and the dv kernel: formed once (by
    # the gate cumsum where the gate comes as logits, else by the sequential state pass), never over narrow
    # state tiles
    form_once = takes_decayed_keys(K, V, N, H, q.device, launch.state)
    kd = torch.empty_like(k) if form_once else None
    logits = gate if normalizer is not None else None
    if logits is not None:
        gc = torch.empty_like(logits, dtype=torch.float32)
        gate_cumsum(logits, gc, cu_seqlens, layout, CHUNK_SIZE, launch.cumsum, normalizer, k if form_once else None, kd)
        kd_mode = KD_READ if form_once else KD_FORM
    else:
        gc = gate
        kd_mode = KD_WRITE if form_once else KD_FORM
    if split:
        h, _ = states(k, v, None, gc, initial_state, cu_seqlens, layout, CHUNK_SIZE, launch)
        dh, dh0 = split_state_grads(q, gc, do, dht, initial_state, scale, cu_seqlens, layout, CHUNK_SIZE, launch)
    else:
        h, dh, dh0 = sequential_states_and_grads(q, k, v, gc, do, dht, initial_state, scale, cu_seqlens, layout, CHUNK_SIZE,
                                                 launch.state, kd, kd_mode)
    prec = dot_precision(q.dtype)
    is_varlen = cu_seqlens is not None
    grid = chunk_grid(cu_seqlens, layout, T, B, H, CHUNK_SIZE)
    dv = torch.empty_like(v)
    dA = torch.empty(B, T, H, CHUNK_SIZE, device=q.device, dtype=q.dtype)  # the products read it in this dtype
    _bwd_dv_kernel[grid](
        k, v, gc, kd, A, do, dh, dv, dA, cu_seqlens, chunk_indices, T, H, K, V, CHUNK_SIZE,
        tile_width(launch.dv.BK, K), tile_width(launch.dv.BV, V),
        IS_VARLEN=is_varlen, DOT_PREC=prec, READ_KD=kd is not None, **launch.dv.options(),
    )
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(gate)
    BK, BV = tile_width(launch.dqk.BK, K), tile_width(launch.dqk.BV, V)
    dqk_grid = (cdiv(K, BK),) + grid
    flags = torch.empty(dqk_grid[0] * dqk_grid[1] * dqk_grid[2], dtype=torch.int8, device=q.device)
    for first in (True, False):
        _bwd_dqk_kernel[dqk_grid](
            q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, flags, cu_seqlens, chunk_indices, scale,
            normalizer or 1.0, single_reference_limit(q.dtype), T, H, K, V, CHUNK_SIZE, BK, BV, IS_VARLEN=is_varlen,
            DOT_PREC=prec, FROM_LOGITS=logits is not None, FIRST=first,
            **launch.dqk.options(dqk_warps(launch, first, BK)),
        )
    return dq, dk, dv, dg, dh0
