"""Chunked GLA in Triton: forward and backward kernels, their autograd.Function, the torch.library ops.

The math is the one of chunk_torch.py (chunks of BT=64 tokens, b = cumsum(gk) inside a chunk, fp32
state), arranged so that every matrix product is a full 64-row tile:

  * intra-chunk scores A_ij = sum_k q_ik k_jk exp(b_ik - b_jk), j <= i, in six levels of halves and the
    diagonal. Level P (P = 64, 32, ..., 2) cuts every block of P rows in two halves and references both to
    r, the last row of the first half:
        A[second half, first half] = (q * exp(b - b_r))[second half] @ ((k * exp(b_r - b))[first half])^T,
    both exponents <= 0 (b falls down the rows), so one exponential, exp(-|b - b_r|), gives both factors.
    Each level is one 64x64 product masked to pairs inside the same block of P rows; every pair i > j is
    made at exactly one level (the one whose halves first separate i from j), and the diagonal is
    sum_k q_ik k_ik. No exponent is ever positive, whatever the gates. The levels inside blocks of 16 rows
    (and the diagonal) need no 64x64 product: they run as [16, 16] pieces batched over the chunk's four
    blocks (_scores_fine_levels, LAUNCH["output_fine_rows"]), placed on A's diagonal blocks after.
  * or, where the gates allow, with one reference row for the whole chunk (r its middle row):
        A = tril((q * exp(b - b_r)) @ (k * exp(b_r - b))^T),
    one product per key tile instead of six levels. Its exponents reach the gate's spread max |b - b_r|
    (positive above r), so it is taken only where that is at most LAUNCH["single_reference_limit"]: a first
    launch does these chunks and flags the others, a second launch runs the levels for the flagged ones
    (LAUNCH["single_reference"] "split"; "off": the levels everywhere). dq/dk is split the same way.
  * gc = b (fp32, [B, T, H, K]) is written once (by _gate_cumsum_kernel, or inside the state pass:
    LAUNCH["separate_cumsum"]) and read by the other kernels;
    reference rows are plain loads of gc, and rows past a sequence's end read its last row.
  * h_n, the state entering chunk n, comes from a state pass, and o = (q * exp(b)) @ h_n + A @ v
    (_fwd_output_kernel, which computes A itself or reads it from _fwd_scores_kernel, a kernel of its
    own with one 16-row strip of A per program and a simpler split of the chunk, referenced to each
    strip's first row: LAUNCH["separate_scores"]). The state pass is either one sequential loop per
    (sequence, head, tile) with the products inside (_fwd_state_kernel), or, for long sequences with few
    heads, chunk-parallel products (_chunk_update_kernel) followed by an elementwise scan over the chunks
    (_state_scan_kernel, the sum carried in fp32); LAUNCH["state_split"] picks. Either way h_n is kept in
    the input dtype or in fp32 (LAUNCH["state_dtype"]).

Backward: the states h_n are recomputed, a reverse pass gives dh_n (the gradient of the state leaving
chunk n) and dh0; per chunk, one kernel gives dv = (k exp(b_last - b)) dh_n + A^T do and
dA = tril(do v^T) (A is kept from the forward pass; both go through memory in the input dtype, the one
the products use). The decayed keys k exp(b_last - b), which the state recomputation and the dv kernel
both use, are written once (by the backward's gate cumsum, else by the state recomputation) and read by
the other, rather than formed by each from k and the fp32 gc (LAUNCH["decayed_keys"]). One kernel per
chunk and key tile gives dq, dk and dgk, level by level as A was made, its four finest levels inside
blocks of 16 rows as [16, 16] pieces of dA batched over the four blocks (_dqk_fine_levels;
LAUNCH["dqk_fine_rows"] 0: as 64x64 products masked to the blocks). For the gate, with db_i the gradient
of the in-chunk cumulative gate b_i, db_i = q_i dq_i - k_i dk_i (elementwise, q and k as they enter the
products), plus, for b at the chunk's last row, sum_v(h_n dh_n) exp(b_last) + sum_j k_j dk_j(state part);
dgk is the reverse cumulative sum of db inside the chunk plus that term.

The backward's two sequential passes (states recomputed forwards, their gradients backwards) share
one launch (LAUNCH["fused_bwd_states"]): eight launches for forward plus backward with the sequential
state pass (gate cumsum, states, output twice; both state passes, dv, dq/dk twice). All accumulation is
fp32.

chunk_gla_from_logits_triton takes the forget gate as logits (gk = logsigmoid(logits) / normalizer, formed
in the gate cumsum kernel) and keeps only those for the backward pass, recomputing gc there; the dq/dk
kernel then writes the logits' gradient (nine launches, no elementwise pass over the gate besides).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.launch import cdiv, multiprocessors, next_power_of_2, op_or_fn

BT = 64  # chunk
BC = 16  # rows of A per program of the separate score kernel


@triton.jit
def _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
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
def _seq_start(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
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
def _load_raw(ptr, row0, rows, n_rows, stride, o_k, m_k):
    """Rows `rows` (those before n_rows) of a [rows, stride] tensor, columns o_k, in its dtype."""
    m = (rows < n_rows)[:, None] & m_k[None, :]
    return tl.load(ptr + (row0 + rows[:, None]) * stride + o_k[None, :], mask=m, other=0.0)


@triton.jit
def _load_tile(ptr, row0, rows, n_rows, stride, o_k, m_k):
    return _load_raw(ptr, row0, rows, n_rows, stride, o_k, m_k).to(tl.float32)


@triton.jit
def _load_gate(gc, row0, rows, n_rows, stride, o_k, m_k):
    """Cumulative gate at `rows`, rows past the sequence end read as its last row (no decay there)."""
    rows = tl.minimum(rows, n_rows - 1)
    return tl.load(gc + (row0 + rows[:, None]) * stride + o_k[None, :], mask=m_k[None, :], other=0.0)


@triton.jit
def _load_gate_row(gc, row0, r, n_rows, stride, o_k, m_k):
    """Cumulative gate at row r (clamped to the sequence), [BK]."""
    r = tl.minimum(r, n_rows - 1)
    return tl.load(gc + (row0 + r) * stride + o_k, mask=m_k, other=0.0)


@triton.jit
def _ref_gate(gc, row0, o_t, n_rows, stride, o_k, m_k, P: tl.constexpr, r, BT: tl.constexpr):
    """b at row r of each row's block of P rows: [1, BK] when one block is the whole chunk, else [BT, BK]."""
    if P == BT:
        return _load_gate_row(gc, row0, r, n_rows, stride, o_k, m_k)[None, :]
    else:
        return _load_gate(gc, row0, (o_t // P) * P + r, n_rows, stride, o_k, m_k)


@triton.jit
def _half_factor(b_g, gc, row0, o_t, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr):
    """Level P of the split into halves: every block of P rows is cut in two and referenced to r, the last
    row of its first half. Returns (first, f): first masks the first half's rows (the keys' side); f is
    exp(b_r - b) on those rows and exp(b - b_r) on the second half's (the queries' side). b falls down the
    rows, so one exponential, exp(-|b - b_r|), gives both with exponents <= 0."""
    first = ((o_t % P) < P // 2)[:, None]
    f = tl.exp(-tl.abs(b_g - _ref_gate(gc, row0, o_t, n_rows, stride, o_k, m_k, P, P // 2 - 1, BT)))
    return first, f


@triton.jit
def _scores_halves(A, q, b_q, b_k, b_g, gc, row0, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """A + the scores between the two halves of every block of P rows: one product, second-half queries
    against first-half keys, both referenced to the last row of the first half."""
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    first, f = _half_factor(b_g, gc, row0, o_t, n_rows, stride, o_k, m_k, P, BT)
    q_f = tl.where(first, 0.0, b_q * f).to(DT)
    k_f = tl.where(first, b_k * f, 0.0).to(DT)
    scores = tl.dot(q_f, tl.trans(k_f), input_precision=DOT_PREC)
    if P < BT:  # only pairs inside the same block of P rows
        scores = tl.where((o_t[:, None] // P) == (o_t[None, :] // P), scores, 0.0)
    return A + scores


@triton.jit
def _scores_tile(q, k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, DOT_PREC: tl.constexpr,
                 FINE_ROWS: tl.constexpr):
    """The part of A [BT, BT] / scale that columns o_k of q, k contribute (see the module docstring). q and k
    stay in their dtype until used (half the registers of fp32 tiles: the output kernel holds them).
    FINE_ROWS > 0: only the levels of blocks larger than FINE_ROWS rows; the pairs inside those blocks and
    the diagonal are _scores_fine_levels' (zeros here)."""
    o_t = tl.arange(0, BT)
    b_q = _load_raw(q, row0, o_t, n_rows, stride, o_k, m_k)
    b_k = _load_raw(k, row0, o_t, n_rows, stride, o_k, m_k)
    b_g = _load_gate(gc, row0, o_t, n_rows, stride, o_k, m_k)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    # six levels of halves, blocks of 64, 32, ..., 2 rows (BT = 64)
    for level in tl.static_range(6):
        if (BT >> level) > FINE_ROWS:
            A = _scores_halves(A, q, b_q, b_k, b_g, gc, row0, n_rows, stride, o_k, m_k, BT >> level, BT, DOT_PREC)
    if FINE_ROWS == 0:  # the diagonal: exp(b_i - b_i) = 1
        diagonal = tl.sum(b_q.to(tl.float32) * b_k.to(tl.float32), axis=1)
        A += tl.where(o_t[:, None] == o_t[None, :], diagonal[:, None], 0.0)
    return A


@triton.jit
def _block_tiles(q, k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, BS: tl.constexpr):
    """q, k (their dtype) and b (fp32) of the chunk as [BT/BS, BS, BK] tiles, block by block of BS rows."""
    NB: tl.constexpr = BT // BS
    rows = tl.arange(0, NB)[:, None, None] * BS + tl.arange(0, BS)[None, :, None]
    m3 = (rows < n_rows) & m_k[None, None, :]
    offs = (row0 + rows) * stride + o_k[None, None, :]
    b_q = tl.load(q + offs, mask=m3, other=0.0)
    b_k = tl.load(k + offs, mask=m3, other=0.0)
    b_g = tl.load(gc + (row0 + tl.minimum(rows, n_rows - 1)) * stride + o_k[None, None, :], mask=m_k[None, None, :],
                  other=0.0)
    return b_q, b_k, b_g


@triton.jit
def _block_level_factor(b_g, gc, row0, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr,
                        BS: tl.constexpr):
    """_half_factor's (first, f) of level P on [BT/BS, BS, BK] tiles: every block of P rows inside each block of
    BS rows cut in two and referenced to the last row of its first half."""
    NB: tl.constexpr = BT // BS
    t = tl.arange(0, BS)
    first = ((t % P) < P // 2)[None, :, None]
    ref = tl.arange(0, NB)[:, None, None] * BS + ((t // P) * P + P // 2 - 1)[None, :, None]
    b_r = tl.load(gc + (row0 + tl.minimum(ref, n_rows - 1)) * stride + o_k[None, None, :], mask=m_k[None, None, :],
                  other=0.0)
    return first, tl.exp(-tl.abs(b_g - b_r))


@triton.jit
def _scores_fine_levels(q, k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, BK: tl.constexpr,
                        BS: tl.constexpr, DOT_PREC: tl.constexpr):
    """The scores inside the chunk's blocks of BS rows (levels P = BS, BS/2, ..., 2 and the diagonal) as
    [BT/BS, BS, BS] pieces, each from [BS, BK] factor tiles, batched over the blocks: the same exponentials
    as the 64x64 levels, a BT/BS-th of their products and masks. Columns o_k's part, / scale."""
    NB: tl.constexpr = BT // BS
    DT = q.dtype.element_ty
    t = tl.arange(0, BS)
    b_q, b_k, b_g = _block_tiles(q, k, gc, row0, n_rows, stride, o_k, m_k, BT, BS)
    A = tl.zeros([NB, BS, BS], dtype=tl.float32)
    for level in tl.static_range(6):
        P = BS >> level  # BS, BS/2, ..., 2
        if P >= 2:
            first, f = _block_level_factor(b_g, gc, row0, n_rows, stride, o_k, m_k, P, BT, BS)
            q_f = tl.where(first, 0.0, b_q * f).to(DT)
            k_f = tl.where(first, b_k * f, 0.0).to(DT)
            scores = tl.dot(q_f, tl.permute(k_f, (0, 2, 1)), input_precision=DOT_PREC)
            if P < BS:  # only pairs inside the same block of P rows
                scores = tl.where(((t[:, None] // P) == (t[None, :] // P))[None, :, :], scores, 0.0)
            A += scores
    diagonal = tl.sum(b_q.to(tl.float32) * b_k.to(tl.float32), axis=2)  # [NB, BS]
    return A + tl.where((t[:, None] == t[None, :])[None, :, :], diagonal[:, :, None], 0.0)


@triton.jit
def _block_diagonal(A_b, BT: tl.constexpr, BS: tl.constexpr):
    """[BT/BS, BS, BS] blocks -> the [BT, BT] tile holding them on its diagonal, zeros elsewhere."""
    NB: tl.constexpr = BT // BS
    blocks = tl.arange(0, NB)
    A4 = tl.where((blocks[:, None, None, None] == blocks[None, None, :, None]), A_b[:, :, None, :], 0.0)
    return tl.reshape(A4, [BT, BT])


@triton.jit
def _intra_chunk_scores(q, k, gc, row0, n_rows, stride, K, scale, BT: tl.constexpr, BK: tl.constexpr,
                        DOT_PREC: tl.constexpr, FINE_ROWS: tl.constexpr):
    """A [BT, BT], fp32. FINE_ROWS > 0: the pairs inside blocks of FINE_ROWS rows by _scores_fine_levels."""
    A = tl.zeros([BT, BT], dtype=tl.float32)
    if FINE_ROWS > 0:
        A_fine = tl.zeros([BT // FINE_ROWS, FINE_ROWS, FINE_ROWS], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        A += _scores_tile(q, k, gc, row0, n_rows, stride, o_k, m_k, BT, DOT_PREC, FINE_ROWS)
        if FINE_ROWS > 0:
            A_fine += _scores_fine_levels(q, k, gc, row0, n_rows, stride, o_k, m_k, BT, BK, FINE_ROWS, DOT_PREC)
    if FINE_ROWS > 0:
        A += _block_diagonal(A_fine, BT, FINE_ROWS)
    return A * scale


@triton.jit
def _log_decay(x, normalizer):
    """logsigmoid(x) / normalizer in fp32, written so that exp never overflows."""
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
    row0, n_rows, _ = _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_g = _load_tile(g + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
    if FROM_LOGITS:  # rows past the end become nonzero here, but they come after every stored row
        b_g = _log_decay(b_g, normalizer)
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


@triton.jit
def _step_inputs(x, gate, y, i_t, bos, T, o_t, o_k, m_k, o_v, m_v, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, RAW_GATE: tl.constexpr, LAST_ONLY: tl.constexpr):
    """Chunk i_t's tiles for one step of a state pass, as loaded: x [BT, BK] and y [BT, BV] in their dtype, the
    gate [BT, BK] (gc, or with RAW_GATE the per-row log gate g) and gc's last row [BK] (zeros with RAW_GATE).
    LAST_ONLY: gc's last row alone is read (x holds the decayed keys), the gate tile returned is zeros."""
    row0 = bos + i_t * BT
    n_rows = T - i_t * BT
    m_x = (o_t < n_rows)[:, None] & m_k[None, :]
    b_x = tl.load(x + (row0 + o_t[:, None]) * (H * K) + o_k[None, :], mask=m_x, other=0.0)
    if RAW_GATE:
        b_gate = tl.load(gate + (row0 + o_t[:, None]) * (H * K) + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_last = tl.zeros_like(o_k).to(tl.float32)
    elif LAST_ONLY:
        b_gate = tl.zeros_like(b_x).to(tl.float32)
        b_last = _load_gate_row(gate, row0, BT - 1, n_rows, H * K, o_k, m_k)
    else:
        b_gate = _load_gate(gate, row0, o_t, n_rows, H * K, o_k, m_k)
        b_last = _load_gate_row(gate, row0, BT - 1, n_rows, H * K, o_k, m_k)
    b_y = tl.load(y + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], mask=(o_t < n_rows)[:, None] & m_v[None, :], other=0.0)
    return b_x, b_gate, b_last, b_y


@triton.jit
def _state_pass(i_k, i_v, i_nh, k, v, g, gc, kd, h, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                USE_H0: tl.constexpr, STORE_GC: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
                DOT_PREC: tl.constexpr, PREFETCH: tl.constexpr, KD_MODE: tl.constexpr):
    """h[chunk n] = the state entering chunk n; ht = the state after the last chunk (fp32).
    With STORE_GC, the in-chunk cumulative gate gc is computed from g and written (by the programs of
    the first value tile); without, gc is read. The decayed keys k * exp(b_last - b) ([B*T, H, K], k's dtype):
    KD_MODE 0 forms them from k and gc, 1 forms them and writes them to kd (first value tile's programs),
    2 reads them from kd (and of gc only each chunk's last row)."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = _seq_start(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
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
    gc += i_h * K
    v += i_h * V
    if STORE_GC:
        gate = g + i_h * K
    else:
        gate = gc
    if KD_MODE == 2:
        keys = kd + i_h * K
    else:
        keys = k
    LAST_ONLY: tl.constexpr = KD_MODE == 2
    if PREFETCH:  # the loads of chunk i_t + 1 are issued before chunk i_t's products, so they overlap them
        n_k, n_gate, n_last, n_v = _step_inputs(keys, gate, v, 0, bos, T, o_t, o_k, m_k, o_v, m_v, H, K, V, BT, STORE_GC,
                                                LAST_ONLY)
    for i_t in range(NT):
        if PREFETCH:
            b_k, b_gate, b_last, b_v = n_k, n_gate, n_last, n_v
            n_k, n_gate, n_last, n_v = _step_inputs(keys, gate, v, tl.minimum(i_t + 1, NT - 1), bos, T, o_t, o_k, m_k,
                                                    o_v, m_v, H, K, V, BT, STORE_GC, LAST_ONLY)
        else:
            b_k, b_gate, b_last, b_v = _step_inputs(keys, gate, v, i_t, bos, T, o_t, o_k, m_k, o_v, m_v, H, K, V, BT,
                                                    STORE_GC, LAST_ONLY)
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + state_offs, S.to(h.dtype.element_ty), mask=m_kv)
        if STORE_GC:
            b_g = tl.cumsum(b_gate, axis=0)
            b_last = tl.sum(b_gate, axis=0)
            if i_v == 0:
                row0 = bos + i_t * BT
                tl.store(gc + (row0 + o_t[:, None]) * (H * K) + o_k[None, :], b_g,
                         mask=(o_t < T - i_t * BT)[:, None] & m_k[None, :])
        else:
            b_g = b_gate
        if KD_MODE == 2:
            k_end = b_k.to(b_v.dtype)
        else:
            k_end = (b_k.to(tl.float32) * tl.exp(tl.minimum(b_last[None, :] - b_g, 0.0))).to(b_v.dtype)
            if KD_MODE == 1:
                if i_v == 0:
                    kd_offs = i_h * K + (bos + i_t * BT + o_t[:, None]) * (H * K) + o_k[None, :]
                    tl.store(kd + kd_offs, k_end.to(kd.dtype.element_ty), mask=(o_t < T - i_t * BT)[:, None] & m_k[None, :])
        S = S * tl.exp(b_last)[:, None] + tl.dot(tl.trans(k_end), b_v, input_precision=DOT_PREC)
    if STORE_HT:
        tl.store(ht + i_nh * K * V + state_offs, S, mask=m_kv)


@triton.jit
def _fwd_state_kernel(k, v, g, gc, kd, h, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_H0: tl.constexpr, STORE_GC: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                      PREFETCH: tl.constexpr, KD_MODE: tl.constexpr):
    _state_pass(tl.program_id(0), tl.program_id(1), tl.program_id(2), k, v, g, gc, kd, h, h0, ht, cu_seqlens,
                chunk_offsets, T, H, K, V, BT, BK, BV, USE_H0, STORE_GC, True, IS_VARLEN, DOT_PREC, PREFETCH, KD_MODE)


@triton.jit
def _chunk_update_kernel(x, y, g, gc, u, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         REVERSE: tl.constexpr, STORE_GC: tl.constexpr, IS_VARLEN: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    """One chunk's own term of the state recurrence (fp32 products, stored in u's dtype) into u[chunk]:
    forward (x=k, y=v):  (k * exp(b_last - b))^T v;   reverse (x=q, y=do):  (q * scale * exp(b))^T do.
    With STORE_GC, gc is computed from g here (by the programs of the first value tile)."""
    i_kv, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_h = i_bh % H
    row0, n_rows, i_tg = _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    x += i_h * K
    gc += i_h * K
    y += i_h * V
    b_x = _load_tile(x, row0, o_t, n_rows, H * K, o_k, m_k)
    if STORE_GC:
        g += i_h * K
        b_graw = _load_tile(g, row0, o_t, n_rows, H * K, o_k, m_k)
        b_g = tl.cumsum(b_graw, axis=0)
        b_last = tl.sum(b_graw, axis=0)
        if i_v == 0:
            tl.store(gc + (row0 + o_t[:, None]) * (H * K) + o_k[None, :], b_g, mask=(o_t < n_rows)[:, None] & m_k[None, :])
    else:
        b_g = _load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
        b_last = _load_gate_row(gc, row0, BT - 1, n_rows, H * K, o_k, m_k)
    b_y = tl.load(y + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], mask=(o_t < n_rows)[:, None] & m_v[None, :], other=0.0)
    if REVERSE:
        b_x = b_x * (tl.exp(b_g) * scale)
    else:
        b_x = b_x * tl.exp(tl.minimum(b_last[None, :] - b_g, 0.0))
    b_u = tl.dot(tl.trans(b_x.to(b_y.dtype)), b_y, input_precision=DOT_PREC)
    tl.store(u + (i_tg * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty),
             mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _scan_load(hu, gc, idx, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Step idx of the scan: (u of its chunk, b_last of its chunk, offsets into hu, whether idx < NT)."""
    ok = idx < NT
    if REVERSE:
        i_t = NT - 1 - idx
    else:
        i_t = idx
    offs = ((boh + i_t) * H) * K * V + state_offs
    b_u = tl.load(hu + offs, mask=m_kv & ok, other=0.0).to(tl.float32)
    last_row = bos + i_t * BT + tl.minimum(BT, T - i_t * BT) - 1
    b_last = tl.load(gc + last_row * (H * K) + o_k, mask=m_k & ok, other=0.0)
    return b_u, b_last, offs, ok


@triton.jit
def _scan_load4(hu, gc, i0, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr):
    """_scan_load of steps i0 .. i0 + 3, their loads issued together."""
    u0, d0, offs0, ok0 = _scan_load(hu, gc, i0, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    u1, d1, offs1, ok1 = _scan_load(hu, gc, i0 + 1, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    u2, d2, offs2, ok2 = _scan_load(hu, gc, i0 + 2, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    u3, d3, offs3, ok3 = _scan_load(hu, gc, i0 + 3, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    return u0, d0, offs0, ok0, u1, d1, offs1, ok1, u2, d2, offs2, ok2, u3, d3, offs3, ok3


@triton.jit
def _state_scan_kernel(hu, gc, s0, s_final, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr,
                       USE_S0: tl.constexpr, STORE_FINAL: tl.constexpr, REVERSE: tl.constexpr,
                       IS_VARLEN: tl.constexpr):
    """In place over hu [chunks, H, K, V] (fp32, or the inputs' dtype: the state is carried in fp32 either
    way): reads chunk n's own term u_n, writes the state S that chunk n sees, S <- exp(b_last,n) * S + u_n.
    Forward S starts at s0 (h0) and runs over the chunks in order; REVERSE starts at dht and runs backwards
    (then hu[n] is the gradient of the state after chunk n). s_final gets the last S (final state, or dh0)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = _seq_start(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    o_k = i_k * SK + tl.arange(0, SK)
    o_v = i_v * SV + tl.arange(0, SV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    state_offs = o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([SK, SV], dtype=tl.float32)
    if USE_S0:
        S += tl.load(s0 + i_nh * K * V + state_offs, mask=m_kv, other=0.0).to(tl.float32)
    gc += i_h * K
    hu += i_h * K * V
    # four chunks per step, whose loads are issued together and one step ahead: before the stores of the
    # step in hand, which write the same buffer and would otherwise keep each load waiting for them (eight
    # loads in flight); past the end they read as zero
    (n_u0, n_d0, n_offs0, n_ok0, n_u1, n_d1, n_offs1, n_ok1, n_u2, n_d2, n_offs2, n_ok2,
     n_u3, n_d3, n_offs3, n_ok3) = _scan_load4(hu, gc, 0, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    for i0 in range(0, NT, 4):
        u0, d0, offs0, ok0 = n_u0, n_d0, n_offs0, n_ok0
        u1, d1, offs1, ok1 = n_u1, n_d1, n_offs1, n_ok1
        u2, d2, offs2, ok2 = n_u2, n_d2, n_offs2, n_ok2
        u3, d3, offs3, ok3 = n_u3, n_d3, n_offs3, n_ok3
        (n_u0, n_d0, n_offs0, n_ok0, n_u1, n_d1, n_offs1, n_ok1, n_u2, n_d2, n_offs2, n_ok2,
         n_u3, n_d3, n_offs3, n_ok3) = _scan_load4(hu, gc, i0 + 4, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V,
                                                   BT, REVERSE)
        tl.store(hu + offs0, S.to(hu.dtype.element_ty), mask=m_kv & ok0)
        S = S * tl.exp(d0)[:, None] + u0
        tl.store(hu + offs1, S.to(hu.dtype.element_ty), mask=m_kv & ok1)
        S = S * tl.exp(d1)[:, None] + u1
        tl.store(hu + offs2, S.to(hu.dtype.element_ty), mask=m_kv & ok2)
        S = S * tl.exp(d2)[:, None] + u2
        tl.store(hu + offs3, S.to(hu.dtype.element_ty), mask=m_kv & ok3)
        S = S * tl.exp(d3)[:, None] + u3
    if STORE_FINAL:
        tl.store(s_final + i_nh * K * V + state_offs, S, mask=m_kv)


@triton.jit
def _fwd_scores_kernel(q, k, gc, A_out, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DOT_PREC: tl.constexpr):
    """Rows [BC * i_s, BC * i_s + BC) of A, the intra-chunk scores of one chunk of one head ([B*T, H, BT],
    input dtype), for the output kernel to read (LAUNCH["separate_scores"]) and the backward pass.
    One strip of BC rows per program, so a chunk's scores take BT // BC programs.

    Columns before the strip: one product whose reference is the strip's first row r,
        A[strip, j < r] = (q * exp(b - b_r))[strip] @ ((k * exp(b_r - b))[j < r])^T,
    both exponents <= 0. Columns inside the strip (the diagonal block): one column per step, each an
    elementwise product with exponent b_i - b_j <= 0 (i >= j)."""
    i_s, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, _ = _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    q += i_h * K
    k += i_h * K
    gc += i_h * K
    r = i_s * BC  # the strip's first row
    o_t = tl.arange(0, BT)  # all rows (columns of A)
    o_i = r + tl.arange(0, BC)  # the strip's rows
    before = (o_t < r)[:, None]
    A = tl.zeros([BC, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = _load_tile(q, row0, o_i, n_rows, H * K, o_k, m_k) * scale
        b_gq = _load_gate(gc, row0, o_i, n_rows, H * K, o_k, m_k)
        b_r = _load_gate_row(gc, row0, r, n_rows, H * K, o_k, m_k)[None, :]
        if i_s > 0:
            b_k = _load_tile(k, row0, o_t, n_rows, H * K, o_k, m_k)
            b_gk = _load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
            k_r = tl.where(before, b_k * tl.exp(tl.where(before, b_r - b_gk, 0.0)), 0.0)
            q_r = b_q * tl.exp(b_gq - b_r)
            A += tl.dot(q_r.to(DT), tl.trans(k_r.to(DT)), input_precision=DOT_PREC)
        for jj in range(BC):
            c = r + jj
            k_c = tl.load(k + (row0 + c) * (H * K) + o_k, mask=m_k & (c < n_rows), other=0.0).to(tl.float32)[None, :]
            g_c = _load_gate_row(gc, row0, c, n_rows, H * K, o_k, m_k)[None, :]
            ok = (o_i >= c)[:, None]
            s = tl.sum(tl.where(ok, b_q * k_c * tl.exp(tl.where(ok, b_gq - g_c, 0.0)), 0.0), axis=1)
            A += tl.where(o_t[None, :] == c, s[:, None], 0.0)
    tl.store(A_out + (row0 + o_i[:, None]) * (H * BT) + i_h * BT + o_t[None, :], A.to(A_out.dtype.element_ty),
             mask=(o_i < n_rows)[:, None])


@triton.jit
def _gate_spread(gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr):
    """max |b - b_r| over the chunk's rows and the key columns o_k, b_r the chunk's middle row: how far from 1
    the single-reference factors exp(+-(b - b_r)) of _single_reference_scores reach (log scale)."""
    e = _load_gate(gc, row0, tl.arange(0, BT), n_rows, stride, o_k, m_k) - \
        _load_gate_row(gc, row0, BT // 2 - 1, n_rows, stride, o_k, m_k)[None, :]
    return tl.max(tl.max(tl.abs(e), axis=1), axis=0)


@triton.jit
def _single_reference_scores(q, k, gc, row0, n_rows, stride, K, scale, BT: tl.constexpr, BK: tl.constexpr,
                             DOT_PREC: tl.constexpr):
    """A [BT, BT], fp32, with every row referenced to the chunk's middle row r: one product per key tile,
        A = tril((q * exp(b - b_r)) @ (k * exp(b_r - b))^T),
    the same algebra as the levels without their splits. Its factors reach exp(spread) (_gate_spread), so
    it is taken only where the spread is below LAUNCH["single_reference_limit"]; above it, the levels."""
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        e = _load_gate(gc, row0, o_t, n_rows, stride, o_k, m_k) - \
            _load_gate_row(gc, row0, BT // 2 - 1, n_rows, stride, o_k, m_k)[None, :]
        q_f = (_load_tile(q, row0, o_t, n_rows, stride, o_k, m_k) * tl.exp(e)).to(DT)
        k_f = (_load_tile(k, row0, o_t, n_rows, stride, o_k, m_k) * tl.exp(-e)).to(DT)
        A += tl.dot(q_f, tl.trans(k_f), input_precision=DOT_PREC)
    # the pairs j > i, masked here, may reach exp(2 spread) or overflow; a select leaves no trace of them
    return tl.where(o_t[:, None] >= o_t[None, :], A, 0.0) * scale


@triton.jit
def _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
                  SCORES: tl.constexpr, FINE_ROWS: tl.constexpr):
    """o of one chunk, pointers at its head. SCORES: 0 A by the levels, 1 A read from A_ptrs, 2 A with one
    reference row (_single_reference_scores); A is stored at A_ptrs where it is computed here."""
    DT = v.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    if SCORES == 1:
        A = tl.load(A_ptrs, mask=m_t[:, None], other=0.0).to(DT)
    else:
        if SCORES == 2:
            A = _single_reference_scores(q, k, gc, row0, n_rows, H * K, K, scale, BT, BK, DOT_PREC).to(DT)
        else:
            A = _intra_chunk_scores(q, k, gc, row0, n_rows, H * K, K, scale, BT, BK, DOT_PREC, FINE_ROWS).to(DT)
        tl.store(A_ptrs, A, mask=m_t[:, None])
    for i_v in range(tl.program_id(2), tl.cdiv(V, BV), tl.num_programs(2)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = _load_tile(q, row0, o_t, n_rows, H * K, o_k, m_k)
            b_g = _load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
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
                       IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, LOAD_SCORES: tl.constexpr,
                       FINE_ROWS: tl.constexpr, SINGLE: tl.constexpr):
    """o = (q * exp(b)) @ h_n + A @ v for one chunk of one head. A is computed here and kept for the
    backward pass ([B*T, H, BT], input dtype), or, with LOAD_SCORES, read from there (written by
    _fwd_scores_kernel). Program (i_c, i_bh, i_v0) covers value tiles i_v0, i_v0 + the grid's third
    size, ...: all of them when that size is 1 (as it must be when A is computed here).
    SINGLE (where A is computed here): 0 A by the levels; 1 A with one reference row where the chunk's gate
    spread is at most `limit`, else nothing is done here and the program's flag is set; 2 A by the levels
    where the flag is set, nothing elsewhere (the launch after a SINGLE = 1 one)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, i_tg = _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    q += i_h * K
    k += i_h * K
    gc += i_h * K
    v += i_h * V
    o += i_h * V
    h += (i_tg * H + i_h) * K * V
    o_t = tl.arange(0, BT)
    A_ptrs = A_out + (row0 + o_t[:, None]) * (H * BT) + i_h * BT + o_t[None, :]
    flag = flags + i_c * tl.num_programs(1) + i_bh
    if LOAD_SCORES:
        _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H, K, V, BT, BK, BV, DOT_PREC, 1, FINE_ROWS)
    elif SINGLE == 0:
        _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H, K, V, BT, BK, BV, DOT_PREC, 0, FINE_ROWS)
    elif SINGLE == 1:
        spread = 0.0
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            spread = tl.maximum(spread, _gate_spread(gc, row0, n_rows, H * K, o_k, o_k < K, BT))
        single = spread <= limit
        if single:
            _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H, K, V, BT, BK, BV, DOT_PREC, 2, FINE_ROWS)
        tl.store(flag, tl.where(single, 0, 1).to(tl.int8))
    else:  # SINGLE == 2
        if tl.load(flag) != 0:
            _output_chunk(q, k, v, gc, h, o, A_ptrs, row0, n_rows, scale, H, K, V, BT, BK, BV, DOT_PREC, 0, FINE_ROWS)


@triton.jit
def _dstate_pass(i_k, i_v, i_nh, q, gc, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 USE_DHT: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """dh[chunk n] = gradient of the state leaving chunk n; dh0 = gradient of the initial state."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = _seq_start(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
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
    gc += i_h * K
    do += i_h * V
    if PREFETCH:  # as in _state_pass, chunk i_t - 1's loads overlap chunk i_t's products
        n_q, n_g, n_last, n_do = _step_inputs(q, gc, do, NT - 1, bos, T, o_t, o_k, m_k, o_v, m_v, H, K, V, BT, False,
                                              False)
    for i in range(NT):
        i_t = NT - 1 - i
        if PREFETCH:
            b_q, b_g, b_last, b_do = n_q, n_g, n_last, n_do
            n_q, n_g, n_last, n_do = _step_inputs(q, gc, do, tl.maximum(i_t - 1, 0), bos, T, o_t, o_k, m_k, o_v, m_v,
                                                  H, K, V, BT, False, False)
        else:
            b_q, b_g, b_last, b_do = _step_inputs(q, gc, do, i_t, bos, T, o_t, o_k, m_k, o_v, m_v, H, K, V, BT, False,
                                                  False)
        tl.store(dh + ((boh + i_t) * H + i_h) * K * V + state_offs, dS.to(dh.dtype.element_ty), mask=m_kv)
        q_dec = (b_q.to(tl.float32) * (tl.exp(b_g) * scale)).to(b_do.dtype)
        dS = dS * tl.exp(b_last)[:, None] + tl.dot(tl.trans(q_dec), b_do, input_precision=DOT_PREC)
    if USE_H0:
        tl.store(dh0 + i_nh * K * V + state_offs, dS, mask=m_kv)


@triton.jit
def _bwd_state_kernel(q, gc, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_DHT: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                      PREFETCH: tl.constexpr):
    _dstate_pass(tl.program_id(0), tl.program_id(1), tl.program_id(2), q, gc, do, dh, dht, dh0, cu_seqlens,
                 chunk_offsets, scale, T, H, K, V, BT, BK, BV, USE_DHT, USE_H0, IS_VARLEN, DOT_PREC, PREFETCH)


@triton.jit
def _bwd_both_states_kernel(q, k, v, gc, kd, do, h, dh, h0, dht, dh0, cu_seqlens, chunk_offsets, scale, T, NH,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
                            DOT_PREC: tl.constexpr, PREFETCH: tl.constexpr, KD_MODE: tl.constexpr):
    """The backward pass's two sequential passes in one launch: programs i_p < NH recompute the states h
    (forward over the chunks; the decayed keys as KD_MODE says, see _state_pass), the others the state
    gradients dh (backward over the chunks). They are independent, so each fills the multiprocessors while
    the other waits on its loads."""
    i_k, i_v, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_p < NH:
        _state_pass(i_k, i_v, i_p, k, v, gc, gc, kd, h, h0, h0, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV,
                    USE_H0, False, False, IS_VARLEN, DOT_PREC, PREFETCH, KD_MODE)
    else:
        _dstate_pass(i_k, i_v, i_p - NH, q, gc, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H, K, V,
                     BT, BK, BV, USE_DHT, USE_H0, IS_VARLEN, DOT_PREC, PREFETCH)


@triton.jit
def _decayed_keys(k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, DT: tl.constexpr, STORED: tl.constexpr):
    """k * exp(b_last - b), columns o_k, in DT: the keys as the state leaving the chunk sees them (STORED: k
    holds them already)."""
    o_t = tl.arange(0, BT)
    if STORED:
        k_end = _load_raw(k, row0, o_t, n_rows, stride, o_k, m_k).to(DT)
    else:
        b_k = _load_tile(k, row0, o_t, n_rows, stride, o_k, m_k)
        b_g = _load_gate(gc, row0, o_t, n_rows, stride, o_k, m_k)
        b_last = _load_gate_row(gc, row0, BT - 1, n_rows, stride, o_k, m_k)
        k_end = (b_k * tl.exp(b_last[None, :] - b_g)).to(DT)
    return k_end


@triton.jit
def _bwd_dv_kernel(k, v, gc, kd, A, do, dh, dv, dA, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                   DOT_PREC: tl.constexpr, READ_KD: tl.constexpr):
    """dv = (k * exp(b_last - b)) dh_n + A^T do, and dA = tril(do v^T) ([B*T, H, BT], input dtype) for one chunk.
    READ_KD: the decayed keys k * exp(b_last - b) are read from kd (written by the state pass or the gate
    cumsum), not formed from k and gc."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, i_tg = _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    if READ_KD:
        k = kd  # the keys read below are the decayed ones
    k += i_h * K
    gc += i_h * K
    v += i_h * V
    do += i_h * V
    dv += i_h * V
    dh += (i_tg * H + i_h) * K * V
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
    """Level P of the backward's halves, as _scores_halves made the scores: (dA kept to the pairs inside one
    block of P rows (the others were not made by this level's product), the keys' factor exp(b_r - b) on
    the first halves' rows and 0 on the others, the queries' factor exp(b - b_r) on the second halves'
    rows and 0 on the others)."""
    o_t = tl.arange(0, BT)
    if P < BT:
        dA_c = tl.where((o_t[:, None] // P) == (o_t[None, :] // P), dA_c, 0.0).to(dA_c.dtype)
    first, f = _half_factor(b_g, gc, row0, o_t, n_rows, stride, o_k, m_k, P, BT)
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
    diagonal blocks. Returns their part of (dq, dk), [BT, BK]; their tiles are loaded here and dead after."""
    NB: tl.constexpr = BT // BS
    DT = q.dtype.element_ty
    t = tl.arange(0, BS)
    # the tiles _block_tiles loads, loaded here: through it Triton 3.8 compiles this kernel to other spills (44
    # against 48 registers at the gla-340M layer), and the timed form is this one
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
            first, f = _block_level_factor(b_g, gc, row0, n_rows, stride, o_k, m_k, P, BT, BS)
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
               BV: tl.constexpr, DOT_PREC: tl.constexpr, PREFETCH: tl.constexpr):
    """The state parts of dq and dk before their gate factors, do h_n^T and v dh_n^T ([BT, BK] each), and
    sum_v h_n * dh_n ([BK]) for the last-row gate term. PREFETCH: value tile i_v + 1's loads are issued
    before tile i_v's products (as in the state passes), else each tile is loaded when its step starts."""
    DT = v.dtype.element_ty
    dq_s = tl.zeros([BT, BK], dtype=tl.float32)
    dk_s = tl.zeros([BT, BK], dtype=tl.float32)
    hdh = tl.zeros([BK], dtype=tl.float32)
    if PREFETCH:
        n_do, n_v, n_h, n_dh = _dqk_state_tiles(v, h, do, dh, row0, m_t, o_k, m_k, 0, H, V, BT, BV)
    for i_v in range(tl.cdiv(V, BV)):
        if PREFETCH:
            b_do, b_v, b_h, b_dh = n_do, n_v, n_h, n_dh
            n_do, n_v, n_h, n_dh = _dqk_state_tiles(v, h, do, dh, row0, m_t, o_k, m_k, i_v + 1, H, V, BT, BV)
        else:
            b_do, b_v, b_h, b_dh = _dqk_state_tiles(v, h, do, dh, row0, m_t, o_k, m_k, i_v, H, V, BT, BV)
        dq_s += tl.dot(b_do.to(DT), tl.trans(b_h.to(DT)), input_precision=DOT_PREC)
        dk_s += tl.dot(b_v.to(DT), tl.trans(b_dh.to(DT)), input_precision=DOT_PREC)
        hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    return dq_s, dk_s, hdh


@triton.jit
def _dqk_chunk_tiles(q, k, gc, dA, row0, n_rows, m_t, o_k, m_k, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """The chunk's tiles for dq/dk's intra-chunk part: b, b at the last row, q, k (their dtype), dA."""
    o_t = tl.arange(0, BT)
    b_g = _load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
    b_last = _load_gate_row(gc, row0, BT - 1, n_rows, H * K, o_k, m_k)
    b_q = _load_raw(q, row0, o_t, n_rows, H * K, o_k, m_k)
    b_k = _load_raw(k, row0, o_t, n_rows, H * K, o_k, m_k)
    dA_c = tl.load(dA + (row0 + o_t[:, None]) * (H * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
    return b_g, b_last, b_q, b_k, dA_c


@triton.jit
def _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, DOT_PREC: tl.constexpr, FROM_LOGITS: tl.constexpr, PREFETCH: tl.constexpr,
               EARLY_LOADS: tl.constexpr, FINE_ROWS: tl.constexpr, SINGLE_REFERENCE: tl.constexpr):
    """dq, dk, dgk of one chunk and key tile, pointers at its head. SINGLE_REFERENCE: the intra-chunk part as
    the gradient of _single_reference_scores' one product, else level by level."""
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    offs = (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
    DT = q.dtype.element_ty

    if EARLY_LOADS:  # the chunk's q, k, gate and dA in flight while the state part runs
        b_g, b_last, b_q, b_k, dA_c = _dqk_chunk_tiles(q, k, gc, dA, row0, n_rows, m_t, o_k, m_k, H, K, BT)
    if FINE_ROWS > 0 and not SINGLE_REFERENCE:
        # the levels inside blocks of FINE_ROWS rows first, their tiles dead before the state part's
        fine_dq, fine_dk = _dqk_fine_levels(q, k, gc, dA, row0, n_rows, H * K, o_k, m_k, scale, H, BT, BK, FINE_ROWS,
                                            DOT_PREC)
    dq_s, dk_s, hdh = _dqk_state(v, h, do, dh, row0, m_t, o_k, m_k, H, V, BT, BK, BV, DOT_PREC, PREFETCH)
    if not EARLY_LOADS:
        b_g, b_last, b_q, b_k, dA_c = _dqk_chunk_tiles(q, k, gc, dA, row0, n_rows, m_t, o_k, m_k, H, K, BT)
    b_dq = dq_s * tl.exp(b_g)  # the gradient of the scaled q
    b_dk = dk_s * tl.exp(b_last[None, :] - b_g)
    db_last = hdh * tl.exp(b_last) + tl.sum(b_k.to(tl.float32) * b_dk, axis=0)
    if SINGLE_REFERENCE:
        # dA is lower-triangular with its diagonal (the dv kernel's mask), so one product per side gives every
        # pair j <= i: dq_i = exp(b_i - b_r) sum_j dA_ij k_j exp(b_r - b_j), dk alike
        e = b_g - _load_gate_row(gc, row0, BT // 2 - 1, n_rows, H * K, o_k, m_k)[None, :]
        f_q = tl.exp(e)
        f_k = tl.exp(-e)
        b_dq += f_q * tl.dot(dA_c, (b_k.to(tl.float32) * f_k).to(DT), input_precision=DOT_PREC)
        b_dk += f_k * tl.dot(tl.trans(dA_c), (b_q.to(tl.float32) * (f_q * scale)).to(DT), input_precision=DOT_PREC)
        b_q = b_q.to(tl.float32) * scale
        b_k = b_k.to(tl.float32)
    else:
        if FINE_ROWS > 0:
            b_dq += fine_dq
            b_dk += fine_dk
        # the intra-chunk part, level by level as the forward made the scores (those of blocks larger than
        # FINE_ROWS rows), then the diagonal (dA[i, i])
        for level in tl.static_range(6):
            if (BT >> level) > FINE_ROWS:
                b_dq, b_dk = _dqk_level(b_dq, b_dk, dA_c, b_q, b_k, b_g, gc, row0, n_rows, H * K, o_k, m_k, scale,
                                        BT >> level, BT, DOT_PREC)
        dA_diag = tl.load(dA + (row0 + o_t) * (H * BT) + o_t, mask=m_t, other=0.0).to(tl.float32)[:, None]
        b_q = b_q.to(tl.float32) * scale
        b_k = b_k.to(tl.float32)
        b_dq += dA_diag * b_k
        b_dk += dA_diag * b_q
    # the gate: db_i = (q_i scale) dq_i - k_i dk_i, summed from the chunk's end, plus the last row's term. One
    # reverse scan: a sum and a forward scan left 54 spilled registers at the gla-340M layer, this 26, same
    # time; the sums as a product with triangular ones on the tensor cores spilled 176, 12-15% slower (run AA3)
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
                    FROM_LOGITS: tl.constexpr, PREFETCH: tl.constexpr, EARLY_LOADS: tl.constexpr,
                    FINE_ROWS: tl.constexpr, SINGLE: tl.constexpr):
    """dq, dk, dgk of one chunk, one head, one tile of key columns; FROM_LOGITS: dg gets the gradient of
    the gate's logits instead, dgk * d logsigmoid(x) / dx / normalizer = dgk * sigmoid(-x) / normalizer.
    The state part comes first, so that its tiles are dead by the time the intra-chunk part's are live
    (the other order spilled: 400 spilled registers, 2.44 against 1.53 ms forward+backward at the gla-340M
    layer on an H200). q and k stay in their dtype until used. SINGLE as in _fwd_output_kernel, the spread
    taken over this program's key tile."""
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    row0, n_rows, i_tg = _chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
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
    h += (i_tg * H + i_h) * K * V
    dh += (i_tg * H + i_h) * K * V
    flag = flags + (i_k * tl.num_programs(1) + i_c) * tl.num_programs(2) + i_bh
    if SINGLE == 0:
        _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer, H, K, V, BT,
                   BK, BV, DOT_PREC, FROM_LOGITS, PREFETCH, EARLY_LOADS, FINE_ROWS, False)
    elif SINGLE == 1:
        o_k = i_k * BK + tl.arange(0, BK)
        single = _gate_spread(gc, row0, n_rows, H * K, o_k, o_k < K, BT) <= limit
        if single:
            _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer, H, K, V,
                       BT, BK, BV, DOT_PREC, FROM_LOGITS, PREFETCH, EARLY_LOADS, FINE_ROWS, True)
        tl.store(flag, tl.where(single, 0, 1).to(tl.int8))
    else:  # SINGLE == 2
        if tl.load(flag) != 0:
            _dqk_chunk(q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, row0, n_rows, i_k, scale, normalizer, H, K, V,
                       BT, BK, BV, DOT_PREC, FROM_LOGITS, PREFETCH, EARLY_LOADS, FINE_ROWS, False)


# The launch table: tile widths, warps and pipeline depth, fixed (no autotuning, so no start-up search and
# nothing re-tuned when the batch size or sequence length changes). Module-level so that the opt-in search
# (tune.py: `kernel_autotune` in pretrain, `benchmarks/gla_kernel.py --sweep`) can replace it. Measured on
# an H200 (bf16, tutorials/performance.md): 128-wide value tiles for the sequential state passes, a 4-warp
# output kernel over 256-wide value tiles (at least 64 wide: see _forward), 4 warps for the dv kernel, 8
# for dq/dk; at the gla-340M layer 1.84 ms forward+backward against 2.06 for the earlier 64-wide state
# tiles and 8-warp, 128-wide output kernel (1.81 with the dv kernel's register cap, below; 1.69 with the
# state passes' prefetch and scores in three levels of quarters; 1.53-1.57 with the scores in halves and
# dq/dk's state part first, against 1.70-1.72 for the quarters in the same runs; 1.38 with dq/dk's state
# part prefetching and the dv kernel's keys decayed once, against 1.57 for the table before them, run Z5).
# The split state pass when the sequential one would have fewer programs than half the multiprocessors
# (32K tokens, one sequence, 8 heads: 16 programs; 3.56 against 5.82 ms), not at 128 or 256 programs,
# where the sequential pass won.
LAUNCH = {"BK": 64, "BV": 64, "BV_out": 256, "state_BK": 64, "state_BV": 128, "state_stages": 1,
          # the sequential state passes issue chunk n+1's loads before chunk n's products (True) or load each
          # chunk when its step starts (False); their warps: 4, 8, or "auto" = 8 when a pass has no more
          # programs than the GPU has multiprocessors, else 4. On an H200 (run V, tutorials/performance.md):
          # 1.70 against 1.79 ms at the gla-340M layer (256 programs a pass, 4 warps), 5.35 against 5.82 at
          # 8K tokens (128 programs, 8 warps; 5.45 with 4)
          "state_prefetch": True, "state_warps": "auto",
          "output_warps": 4, "dv_warps": 4,
          "dqk_warps": 8, "stages": 1, "dqk_stages": 1,
          # dq/dk's state part issues value tile n+1's loads before tile n's products (True), or loads each
          # tile when its step starts (False): on an H200 (runs Z3, Z4) 1.47 against 1.50 ms at the gla-340M
          # layer, 4.46 against 4.51 at 8K. dq/dk's own tiles (q, k, gate, dA) loaded before its state part
          # (True), after it (False), or "auto" = before when V <= 128: 4.25 against 4.34 ms at 8K and 2.51
          # against 2.57 at 32K (V = 128), but 1.57 against 1.46 at the gla-340M layer, whose four value
          # tiles keep them waiting longer (run Z4). With the fine blocks below, after it at every V (run AC1)
          "dqk_prefetch": True, "dqk_early_loads": False,
          # dq/dk's levels inside blocks of dqk_fine_rows rows (16: the four finest; 32: five) as products batched
          # over the blocks ([16, 16] pieces of dA, _dqk_fine_levels), or 0: every level as a 64x64 product masked
          # to its blocks. Run AC1 (H200, forward+backward, 16 against 0): 1.355-1.363 against 1.374-1.376 ms at
          # the gla-340M layer; at 8K and 32K 4.178 and 2.487 against 4.195 and 2.503 with dqk_early_loads False,
          # but 4.258 and 2.522 with "auto" (loads early at V = 128). Triton 3.6 spills 42 registers at 8K (54
          # before) and 46 at the gla-340M layer (26): fewer tiles live at once, for more spilled ones.
          # 32 spilled 290 registers (Triton 3.8). output_fine_rows: the same split for the forward's scores
          # (_scores_fine_levels; 0: six 64x64 levels). Run AF1, 16 against 0: forward 1.348 against 1.374 ms at
          # 8K (forward+backward 4.148 against 4.184), 2.471 against 2.484 at 32K, 1.354 against 1.360 at the
          # gla-340M layer; Triton 3.8 spills 48 registers at 8K against 82 (32: 86, not timed)
          "dqk_fine_rows": 16, "output_fine_rows": 16,
          # the intra-chunk scores (output kernel) and their gradients (dq/dk) with every row referenced to
          # the chunk's middle row r: one product where the levels take six, but factors exp(+-(b - b_r))
          # that grow with the gate's spread over the chunk, max |b - b_r|. "split": a launch that takes the
          # one product where the spread is at most single_reference_limit and flags the other programs, then
          # a launch of the levels for the flagged ones (each compiled with only its own path's registers);
          # "off": the levels everywhere. The limit keeps the factors within exp(40) ~ 2e17 (bf16 and fp32
          # reach 3e38): the products of pairs j <= i stay at most 1 in their exponent, the masked pairs
          # j > i at most exp(80). Run AM3 (H200, forward+backward ms, gla-340M layer / 8K / 32K): 0.961 /
          # 2.744 / 1.789 against 1.340 / 4.107 / 2.470 for "off"; with every chunk past the limit (the levels
          # after a launch that only measures the spread) 1.416 / 4.430 / 2.638. A form with both paths in
          # one kernel behind a branch took 1.309 / 2.889 / 1.864 (run AM1). single_dqk_warps: the warps of
          # the first dq/dk launch (4: 0.961 / 2.744 against 1.015 / 2.915 ms for 8 at the gla-340M layer and
          # 8K, run AM3); the first output launch keeps output_warps (8: 1.096 at the gla-340M layer, AM1)
          "single_reference": "split", "single_reference_limit": 40.0, "single_dqk_warps": 4,
          # key tile width of the dv kernel: one tile covering K (K <= dv_BK) forms the decayed keys once for
          # all value tiles, where 64-wide tiles formed them again for each value tile (run Z3: 1.38 against
          # 1.47 ms at the gla-340M layer, 4.28 against 4.46 at 8K, 2.53 against 2.62 at 32K)
          "dv_BK": 128,
          # the forward's intra-chunk scores by their own kernel, read by the output kernel (True), or computed
          # inside the output kernel (False: one launch, but the output kernel's programs hold both)
          "separate_scores": False, "scores_warps": 4,
          # the backward pass's state recomputation and state-gradient pass in one launch
          "fused_bwd_states": True,
          # warps of that launch: 4, 8, "auto" (state_warps' rule applied to the launch's programs, twice a
          # pass's, where state_warps is "auto", else state_warps), or 0 (as one pass: state_warps). At 8K
          # (256 programs, 128 a pass) "auto" gives 4 where the per-pass rule gave 8: 4.109 against 4.129 ms
          # (run AG2; 4.200 against 4.221 in run AA4); the gla-340M layer (512 programs) had 4 either way, and
          # 32K takes the split passes
          "both_states_warps": "auto",
          # the forward's in-chunk cumulative gate by its own kernel (True) or inside the sequential state pass:
          # 1.370 / 4.193 against 1.434 / 4.268 ms at the gla-340M layer and 8K (run AA2; with each chunk's scan
          # after the previous chunk's product instead, 1.373 / 4.221 against 1.415 / 4.310, run AA4)
          "separate_cumsum": True,
          # its key tile and warps. Run AN4 (H200, the gla-340M training shape 16 x 2048, 4 heads of 128, bf16
          # logits; us per call): from the logits 45.3 at 128-wide tiles and 4 warps, 38.7 at 16 and 2 (torch's
          # copy of the same bytes: 50.6); with the decayed keys (the backward's) 128.5 against 76.0 (32 and 4:
          # 82.7). In the training step 5.1 -> 3.1 ms (AN1 -> AN4)
          "cumsum_BK": 16, "cumsum_warps": 2,
          # state passes as chunk-parallel updates + an elementwise scan (True), as one sequential pass with
          # the matrix products inside (False), or the scan when the sequential pass would have fewer
          # programs than half the multiprocessors ("auto": long sequences, few heads)
          "state_split": "auto", "scan_SK": 16, "scan_SV": 64, "scan_stages": 3,
          # the decayed keys k * exp(b_last - b), which the backward's state recomputation and the dv kernel
          # both use: "recompute" (each forms them from k and gc), "backward" (formed once in the backward pass,
          # by the gate cumsum where the gate comes as logits, else by the sequential state pass, and read by
          # the others: at 8K ~0.27 GB of fp32 gate reads fewer for 0.13 GB written), or "saved" (chunk_gla with
          # gk given: written by the forward's state pass and kept for the backward, one more [B, T, H, K]
          # tensor in the inputs' dtype kept; the recomputation reads no gate tile at all). Run AF2 (H200,
          # forward+backward): "backward" 4.138 against 4.157 ms at 8K and 1.341 against 1.354 at the gla-340M
          # layer; "saved" 4.097 and 1.320, keeping 448 MiB for the backward at 8K against 320 (fla: 384) and
          # 112 against 80 (fla: 96) at the gla-340M layer. Only where the state passes' value tiles are at
          # least 64 wide (_state_pass_takes_decayed_keys); the split state passes form their own
          "decayed_keys": "backward",
          # dtype of the per-chunk states h and dh (both state passes): "input" (bf16 for bf16 inputs,
          # half the traffic), "fp32", or "auto" = fp32 when a state crosses the op's boundary (initial
          # state given, final-state gradient flowing), where rounding them costs most relative accuracy
          "state_dtype": "auto",
          # registers per thread a kernel may use (0: the compiler's choice). Nsight Compute on an H200 found
          # every kernel latency-bound at 12.5% occupancy, limited by registers (214-255 per thread: one
          # 8-warp or two 4-warp programs per multiprocessor); a cap trades spills for more programs per SM
          # and shipped where it paid: dv at 168 (220 before, no spills, 3 programs per SM): 1.805 against
          # 1.830 ms at the gla-340M layer, 1% at 8K and 32K (with one key tile it needs 160, run Z5; uncapped,
          # 1.54 against 1.38 at the gla-340M layer, run Z3); caps on dq/dk and the output kernel spilled and lost
          "state_maxnreg": 0, "output_maxnreg": 0, "dv_maxnreg": 168, "dqk_maxnreg": 0}


def _single_reference_modes(programs: int, device: torch.device) -> Tuple[Tuple[int, ...], torch.Tensor]:
    """The SINGLE values to launch the output and dq/dk kernels with, in order (LAUNCH["single_reference"]), and
    the programs' flags the split launches pass between them (one int8 per program; one element where unused)."""
    mode = LAUNCH["single_reference"]
    if mode not in ("off", "split"):
        raise ValueError(f"LAUNCH['single_reference'] = {mode!r}; expected 'off' or 'split'")
    if mode == "off":
        return (0,), _reference_flags(1, device)
    return (1, 2), _reference_flags(programs, device)


def _dqk_warps(mode: int, BK: int) -> int:
    """Warps of the dq/dk launch with SINGLE = mode (single_dqk_warps for the single-reference launch, else
    dqk_warps), at least 8 over key tiles narrower than 64: with BK = 32 either launch at 4 warps gave wrong
    dq, dk or dgk on an H200 with Triton 3.6 (relative RMS error 0.07 to 97 against the fp32 recurrence) or
    an illegal memory access, where at 8 warps both matched it (runs AM1-AM4)."""
    warps = LAUNCH["single_dqk_warps" if mode == 1 else "dqk_warps"]
    return warps if BK >= 64 else max(warps, 8)


def _reference_flags(programs: int, device: torch.device) -> torch.Tensor:
    """Per-program flags of the split launches: set by the first for the programs the second must do."""
    return torch.empty(programs, dtype=torch.int8, device=device)


def _dqk_early_loads(V: int) -> bool:
    """Whether dq/dk loads its own tiles before its state part (LAUNCH["dqk_early_loads"]; "auto": V <= 128)."""
    mode = LAUNCH["dqk_early_loads"]
    return V <= 128 if mode == "auto" else bool(mode)


def _register_cap(kernel: str) -> dict:
    """Launch option {"maxnreg": n} where LAUNCH caps the kernel's registers per thread."""
    cap = LAUNCH[kernel + "_maxnreg"]
    return {"maxnreg": cap} if cap else {}


def _state_dtype(x: torch.Tensor, boundary_state: bool) -> torch.dtype:
    mode = LAUNCH["state_dtype"]
    return torch.float32 if mode == "fp32" or (mode == "auto" and boundary_state) else x.dtype


def _block_sizes(K: int, V: int, kind: str = "") -> Tuple[int, int]:
    """Key and value tile widths; kind "state_" for the sequential state passes (their programs are
    (key tile, value tile, sequence, head), so narrower tiles give long single sequences more programs)."""
    BK = min(LAUNCH[kind + "BK"], max(16, next_power_of_2(K)))
    BV = min(LAUNCH[kind + "BV"], max(16, next_power_of_2(V)))
    return BK, BV


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs stay exact (no tf32); bf16/fp16 dots run on the tensor cores whatever this says
    return "ieee" if dtype == torch.float32 else "tf32"


def _chunk_layout(cu_seqlens: Optional[torch.Tensor], B: int, T: int):
    """(number of sequences, total chunks, chunk_indices [(seq, chunk in seq)] int32, chunk_offsets int32)."""
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


def _state_programs(K: int, V: int, N: int, H: int) -> int:
    """Programs of one sequential state pass: one per (key tile, value tile, sequence, head)."""
    SK, SV = _block_sizes(K, V, "state_")
    return cdiv(K, SK) * cdiv(V, SV) * N * H


def _multiprocessors(device: torch.device) -> int:
    return multiprocessors(device) if device.type == "cuda" else 1


def _split_states(K: int, V: int, N: int, H: int, device: torch.device) -> bool:
    mode = LAUNCH["state_split"]
    if mode != "auto":
        return bool(mode)
    return 2 * _state_programs(K, V, N, H) < _multiprocessors(device)  # never on the CPU (1 multiprocessor)


def _state_warps(K: int, V: int, N: int, H: int, device: torch.device, passes: int = 1) -> int:
    """Warps of the sequential state passes; "auto": 8 when the launch (`passes` passes' programs) has no more
    programs than the GPU has multiprocessors (one program per SM: twice the threads to keep its loads and
    products going), else 4 (two programs per SM)."""
    warps = LAUNCH["state_warps"]
    if warps != "auto":
        return warps
    return 8 if passes * _state_programs(K, V, N, H) <= _multiprocessors(device) else 4


def _both_states_warps(K: int, V: int, N: int, H: int, device: torch.device) -> int:
    """Warps of the backward's two state passes as one launch (LAUNCH["both_states_warps"])."""
    warps = LAUNCH["both_states_warps"]
    if warps == "auto":
        return _state_warps(K, V, N, H, device, passes=2)
    if warps == 0:  # as one pass
        return _state_warps(K, V, N, H, device)
    return warps


def _scan(hu, gc, s0, s_final, cu_seqlens, layout, T, reverse):
    N, chunk_offsets = layout[0], layout[3]
    H, K, V = hu.shape[1:]
    SK = min(LAUNCH["scan_SK"], max(16, next_power_of_2(K)))
    SV = min(LAUNCH["scan_SV"], max(16, next_power_of_2(V)))
    _state_scan_kernel[(cdiv(K, SK), cdiv(V, SV), N * H)](
        hu, gc, s0, s_final, cu_seqlens, chunk_offsets, T, H, K, V, BT, SK, SV,
        USE_S0=s0 is not None, STORE_FINAL=s_final is not None, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None, num_warps=4,
        num_stages=LAUNCH["scan_stages"],
    )


def _chunk_updates(x, y, g, gc, scale, cu_seqlens, layout, reverse, dtype):
    """[chunks, H, K, V] in `dtype`: each chunk's own term of the (reverse) state recurrence."""
    B, T, H, K = x.shape
    V = y.shape[-1]
    NC, chunk_indices = layout[1], layout[2]
    BK, BV = _block_sizes(K, V, "state_")
    u = x.new_empty(NC, H, K, V, dtype=dtype)
    grid = (cdiv(K, BK) * cdiv(V, BV),) + ((NC, H) if cu_seqlens is not None else (cdiv(T, BT), B * H))
    _chunk_update_kernel[grid](
        x, y, g, gc, u, cu_seqlens, chunk_indices, scale, T, H, K, V, BT, BK, BV,
        REVERSE=reverse, STORE_GC=g is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=_dot_precision(x.dtype), num_warps=4, num_stages=1,
    )
    return u


def _gate_cumsum(g, gc, cu_seqlens, layout, normalizer=None, k=None, kd=None):
    """gc <- the cumulative sum of g inside each chunk (fp32); with a normalizer, g holds the gate's logits
    and the sum is over logsigmoid(g) / normalizer. With k and kd: kd <- the decayed keys k * exp(b_last - b)."""
    B, T, H, K = g.shape
    BKc = min(LAUNCH["cumsum_BK"], max(16, next_power_of_2(K)))
    grid = (cdiv(K, BKc),) + ((layout[1], H) if cu_seqlens is not None else (cdiv(T, BT), B * H))
    _gate_cumsum_kernel[grid](g, gc, k, kd, cu_seqlens, layout[2], normalizer or 1.0, T, H, K, BT, BKc,
                              IS_VARLEN=cu_seqlens is not None, FROM_LOGITS=normalizer is not None,
                              STORE_KD=kd is not None, num_warps=LAUNCH["cumsum_warps"])


# how the decayed keys k * exp(b_last - b), which the state pass and the dv kernel both use, reach them
# (LAUNCH["decayed_keys"]): 0 formed from k and gc by each, 1 formed and written by the state pass, 2 read
KD_FORM, KD_WRITE, KD_READ = 0, 1, 2


def _states(k, v, g, gc, initial_state, cu_seqlens, layout, kd=None, kd_mode=KD_FORM):
    """Per-chunk states h (the state each chunk sees) and the final state (fp32); fills gc from g when g
    is given. kd, kd_mode: the decayed keys written or read by the sequential pass (the split one forms
    them itself and writes none: the caller checks _state_pass_takes_decayed_keys)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N, NC, _, chunk_offsets = layout
    ht = k.new_empty(N, H, K, V, dtype=torch.float32)
    if _split_states(K, V, N, H, k.device):
        h = _chunk_updates(k, v, g, gc, 1.0, cu_seqlens, layout, False, _state_dtype(k, initial_state is not None))
        _scan(h, gc, initial_state, ht, cu_seqlens, layout, T, reverse=False)
        return h, ht
    if g is not None and LAUNCH["separate_cumsum"]:
        # the cumulative gate by its own fully parallel kernel: inside the sequential pass it would add
        # its latency to every one of the pass's steps
        _gate_cumsum(g, gc, cu_seqlens, layout)
        g = None
    BK, BV = _block_sizes(K, V, "state_")
    h = k.new_empty(NC, H, K, V, dtype=_state_dtype(k, initial_state is not None))
    _fwd_state_kernel[(cdiv(K, BK), cdiv(V, BV), N * H)](
        k, v, g, gc, kd, h, initial_state, ht, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV,
        USE_H0=initial_state is not None, STORE_GC=g is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=_dot_precision(k.dtype), PREFETCH=LAUNCH["state_prefetch"], KD_MODE=kd_mode,
        num_warps=_state_warps(K, V, N, H, k.device), num_stages=LAUNCH["state_stages"],
        **_register_cap("state"),
    )
    return h, ht


def _state_grads(q, gc, do, dht, initial_state, scale, cu_seqlens, layout):
    """dh [chunks, H, K, V] (gradient of the state leaving each chunk) and dh0 (or None)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    N, NC, _, chunk_offsets = layout
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    if _split_states(K, V, N, H, q.device):
        dh = _chunk_updates(q, do, None, gc, scale, cu_seqlens, layout, True,
                            _state_dtype(q, initial_state is not None or dht is not None))
        _scan(dh, gc, dht, dh0, cu_seqlens, layout, T, reverse=True)
        return dh, dh0
    SK, SV = _block_sizes(K, V, "state_")
    dh = q.new_empty(NC, H, K, V, dtype=_state_dtype(q, initial_state is not None or dht is not None))
    _bwd_state_kernel[(cdiv(K, SK), cdiv(V, SV), N * H)](
        q, gc, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H, K, V, BT, SK, SV,
        USE_DHT=dht is not None, USE_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=_dot_precision(q.dtype), PREFETCH=LAUNCH["state_prefetch"],
        num_warps=_state_warps(K, V, N, H, q.device), num_stages=LAUNCH["state_stages"],
        **_register_cap("state"),
    )
    return dh, dh0


def _states_and_grads(q, k, v, gc, do, dht, initial_state, scale, cu_seqlens, layout, kd=None, kd_mode=KD_FORM):
    """_states (without the final state) and _state_grads, as one launch of the two sequential passes."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, NC, _, chunk_offsets = layout
    BK, BV = _block_sizes(K, V, "state_")
    h = k.new_empty(NC, H, K, V, dtype=_state_dtype(k, initial_state is not None))
    dh = q.new_empty(NC, H, K, V, dtype=_state_dtype(q, initial_state is not None or dht is not None))
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    _bwd_both_states_kernel[(cdiv(K, BK), cdiv(V, BV), 2 * N * H)](
        q, k, v, gc, kd, do, h, dh, initial_state, dht, dh0, cu_seqlens, chunk_offsets, scale, T, N * H, H, K, V, BT,
        BK, BV, USE_H0=initial_state is not None, USE_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=_dot_precision(q.dtype), PREFETCH=LAUNCH["state_prefetch"], KD_MODE=kd_mode,
        num_warps=_both_states_warps(K, V, N, H, q.device), num_stages=LAUNCH["state_stages"],
        **_register_cap("state"),
    )
    return h, dh, dh0


def _state_pass_takes_decayed_keys(K: int, V: int, N: int, H: int, device: torch.device) -> bool:
    """Whether the decayed keys are written once and read (by the state passes and the dv kernel): only for the
    sequential state pass over value tiles at least 64 wide. With 32-wide ones (V = 32), state passes that
    wrote or read them gave inf gradients or an illegal memory access on an H200 (Triton 3.6, bf16; runs AF2,
    AF4), and so did the gate cumsum writing them for the dv kernel to read (run AG1), where each kernel
    forming them from k and gc is right. The dv kernel read them in all three failing forms (it writes dA,
    which dq/dk reads: the infinite gradients were dq, dk, dgk); which kernel faults was not isolated."""
    return _block_sizes(K, V, "state_")[1] >= 64 and not _split_states(K, V, N, H, device)


def _keeps_decayed_keys(K: int, V: int, N: int, H: int, device: torch.device, normalizer) -> bool:
    """Whether the forward pass's state pass writes the decayed keys for the backward pass to keep
    (LAUNCH["decayed_keys"] "saved"; the gate given as gk, not as logits)."""
    return (LAUNCH["decayed_keys"] == "saved" and normalizer is None
            and _state_pass_takes_decayed_keys(K, V, N, H, device))


def _forward(q, k, v, g, scale, initial_state, cu_seqlens, normalizer=None):
    """(o, final state, and for the backward pass: gc = in-chunk cumulative gate, A = intra-chunk scores,
    kd = the decayed keys, or an empty tensor where they are not kept). With a normalizer, g holds the
    gate's logits (log gate = logsigmoid(g) / normalizer)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = _chunk_layout(cu_seqlens, B, T)
    NC, chunk_indices = layout[1], layout[2]
    BK, BV = _block_sizes(K, V)
    gc = torch.empty_like(g, dtype=torch.float32)
    if normalizer is not None:
        _gate_cumsum(g, gc, cu_seqlens, layout, normalizer)
        g = None  # the state pass reads gc
    if _keeps_decayed_keys(K, V, layout[0], H, q.device, normalizer):
        kd = torch.empty_like(k)
        h, ht = _states(k, v, g, gc, initial_state, cu_seqlens, layout, kd, KD_WRITE)
    else:
        kd = k.new_empty(0)
        h, ht = _states(k, v, g, gc, initial_state, cu_seqlens, layout)
    o = torch.empty_like(v, dtype=q.dtype)
    A = q.new_empty(B, T, H, BT)
    grid = (NC, H) if cu_seqlens is not None else (cdiv(T, BT), B * H)
    # value tiles at least 64 wide (the extra columns masked): narrower ones went wrong on an H200 (Triton
    # 3.6, bf16), outputs 0.12-0.5 off in relative RMS at V=32, and an illegal memory access at K=64, V=32
    BV_out = min(LAUNCH["BV_out"], max(64, next_power_of_2(V)))
    separate = LAUNCH["separate_scores"]
    if separate:
        _fwd_scores_kernel[(BT // BC,) + grid](
            q, k, gc, A, cu_seqlens, chunk_indices, scale, T, H, K, BT, BC, BK,
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=_dot_precision(q.dtype),
            num_warps=LAUNCH["scores_warps"], num_stages=LAUNCH["stages"],
        )
    # with the scores read from memory, the value tiles of a chunk are programs of their own
    value_programs = cdiv(V, BV_out) if separate else 1
    modes, flags = _single_reference_modes(grid[0] * grid[1], q.device)
    if separate:  # the scores come from _fwd_scores_kernel: one launch reads them
        modes = (0,)
    for mode in modes:
        _fwd_output_kernel[grid + (value_programs,)](
            q, k, v, gc, h, o, A, flags, cu_seqlens, chunk_indices, scale, LAUNCH["single_reference_limit"], T,
            H, K, V, BT, BK, BV_out, IS_VARLEN=cu_seqlens is not None, DOT_PREC=_dot_precision(q.dtype),
            LOAD_SCORES=separate, FINE_ROWS=LAUNCH["output_fine_rows"], SINGLE=mode,
            num_warps=LAUNCH["output_warps"], num_stages=LAUNCH["stages"], **_register_cap("output"),
        )
    return o, ht, gc, A, kd


def _backward(q, k, v, gate, A, kd, scale, initial_state, cu_seqlens, do, dht, normalizer=None):
    """(dq, dk, dv, dgate, dh0). gate is gc, the in-chunk cumulative log gate (dgate: the log gate's gradient,
    fp32), or, with a normalizer, the gate's logits (gc is recomputed from them; dgate: the logits' gradient,
    in their dtype). kd: the decayed keys kept from the forward pass, or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = _chunk_layout(cu_seqlens, B, T)
    N, NC, chunk_indices, chunk_offsets = layout
    split = _split_states(K, V, N, H, q.device)
    # the decayed keys k * exp(b_last - b), read by the state recomputation and the dv kernel: formed once
    # here (by the gate cumsum, else by the sequential state pass) unless kept or LAUNCH says "recompute",
    # and never over narrow state tiles (kd is kept only where they are not)
    takes_kd = _state_pass_takes_decayed_keys(K, V, N, H, q.device)
    form_once = kd is None and LAUNCH["decayed_keys"] != "recompute" and takes_kd
    logits = gate if normalizer is not None else None
    if logits is not None:
        gc = torch.empty_like(logits, dtype=torch.float32)
        if form_once:  # by the gate cumsum (then kd is set, and the state recomputation reads it)
            kd = torch.empty_like(k)
            _gate_cumsum(logits, gc, cu_seqlens, layout, normalizer, k, kd)
        else:
            _gate_cumsum(logits, gc, cu_seqlens, layout, normalizer)
    else:
        gc = gate
    if kd is not None:
        kd_mode = KD_READ
    elif form_once:
        kd, kd_mode = torch.empty_like(k), KD_WRITE
    else:
        kd_mode = KD_FORM
    BK, BV = _block_sizes(K, V)
    prec = _dot_precision(q.dtype)
    is_varlen = cu_seqlens is not None
    # the per-chunk states, recomputed rather than kept from the forward pass, and their gradients
    if LAUNCH["fused_bwd_states"] and not split:
        h, dh, dh0 = _states_and_grads(q, k, v, gc, do, dht, initial_state, scale, cu_seqlens, layout, kd, kd_mode)
    else:
        h, _ = _states(k, v, None, gc, initial_state, cu_seqlens, layout, kd, kd_mode)
        dh, dh0 = _state_grads(q, gc, do, dht, initial_state, scale, cu_seqlens, layout)
    dv = torch.empty_like(v)
    dA = torch.empty(B, T, H, BT, device=q.device, dtype=q.dtype)  # the products read it in this dtype
    grid = (NC, H) if is_varlen else (cdiv(T, BT), B * H)
    dv_BK = min(LAUNCH["dv_BK"], max(16, next_power_of_2(K)))
    _bwd_dv_kernel[grid](
        k, v, gc, kd, A, do, dh, dv, dA, cu_seqlens, chunk_indices, T, H, K, V, BT, dv_BK, BV,
        IS_VARLEN=is_varlen, DOT_PREC=prec, READ_KD=kd is not None, num_warps=LAUNCH["dv_warps"], num_stages=LAUNCH["stages"],
        **_register_cap("dv"),
    )
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(gate)
    dqk_grid = (cdiv(K, BK),) + grid
    modes, flags = _single_reference_modes(dqk_grid[0] * dqk_grid[1] * dqk_grid[2], q.device)
    for mode in modes:
        _bwd_dqk_kernel[dqk_grid](
            q, k, v, gc, h, do, dh, dA, dq, dk, dg, logits, flags, cu_seqlens, chunk_indices, scale,
            normalizer or 1.0, LAUNCH["single_reference_limit"], T, H, K, V, BT, BK, BV, IS_VARLEN=is_varlen,
            DOT_PREC=prec, FROM_LOGITS=logits is not None, PREFETCH=LAUNCH["dqk_prefetch"],
            EARLY_LOADS=_dqk_early_loads(V), FINE_ROWS=LAUNCH["dqk_fine_rows"], SINGLE=mode,
            num_warps=_dqk_warps(mode, BK), num_stages=LAUNCH["dqk_stages"], **_register_cap("dqk"),
        )
    return dq, dk, dv, dg, dh0


# torch.library ops of _gla_fwd and _gla_bwd: torch.compile sees them as opaque calls with known output
# shapes. The autograd Functions call them through op_or_fn (the registered op only while torch.compile
# traces; the functions themselves in eager mode, without the dispatcher's cost).
def _gla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], normalizer: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, g, scale, initial_state, cu_seqlens, normalizer)


chunk_gla_fwd_op = torch.library.custom_op("fabric_lin::chunk_gla_fwd", mutates_args=())(_gla_fwd)


@chunk_gla_fwd_op.register_fake
def _(q, k, v, g, scale, initial_state, cu_seqlens, normalizer=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    kd = torch.empty_like(k) if _keeps_decayed_keys(K, V, N, H, q.device, normalizer) else k.new_empty(0)
    return (q.new_empty(B, T, H, V), q.new_empty(N, H, K, V, dtype=torch.float32),
            torch.empty_like(g, dtype=torch.float32), q.new_empty(B, T, H, BT), kd)


def _gla_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, A: torch.Tensor, kd: Optional[torch.Tensor],
    scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
    dht: Optional[torch.Tensor], normalizer: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kd = kd if kd is not None and kd.numel() > 0 else None  # empty: not kept by the forward pass
    dq, dk, dv, dg, dh0 = _backward(q, k, v, gate, A, kd, scale, initial_state, cu_seqlens, do, dht, normalizer)
    if dh0 is None:
        dh0 = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dg, dh0


chunk_gla_bwd_op = torch.library.custom_op("fabric_lin::chunk_gla_bwd", mutates_args=())(_gla_bwd)


@chunk_gla_bwd_op.register_fake
def _(q, k, v, gate, A, kd, scale, initial_state, cu_seqlens, do, dht, normalizer=None):
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gate), dh0


class ChunkGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
        o, ht, gc, A, kd = op_or_fn(chunk_gla_fwd_op, _gla_fwd)(q, k, v, g, scale, initial_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, gc, A, kd, initial_state, cu_seqlens)
        ctx.scale = scale
        ctx.output_final_state = output_final_state
        ctx.g_dtype = g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, A, kd, initial_state, cu_seqlens = ctx.saved_tensors
        dht = dht.contiguous() if ctx.output_final_state and dht is not None else None
        dq, dk, dv, dg, dh0 = op_or_fn(chunk_gla_bwd_op, _gla_bwd)(
            q, k, v, gc, A, kd, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht
        )
        return dq, dk, dv, dg.to(ctx.g_dtype), None, (dh0 if initial_state is not None else None), None, None


def _checked_inputs(q, k, v, gate, gate_name, scale, initial_state, cu_seqlens):
    """(scale, initial_state, cu_seqlens) ready for the kernels; errors name the argument and the shape expected."""
    B, T, H, K = q.shape
    if k.shape != q.shape or gate.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_gla: expected q, k, {gate_name} of one shape [B, T, H, K] and v [B, T, H, V], got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, {gate_name} {tuple(gate.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"chunk_gla: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
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
    return scale, initial_state, cu_seqlens


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
    scale, initial_state, cu_seqlens = _checked_inputs(q, k, v, gk, "gk", scale, initial_state, cu_seqlens)
    o, ht = ChunkGLAFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), scale, initial_state, output_final_state,
        cu_seqlens,
    )
    return o, (ht if output_final_state else None)


# The gate from its logits: gk = logsigmoid(gate_logits) / normalizer is formed inside the gate cumsum
# kernel, and the backward pass recomputes gk's in-chunk cumulative sums from the logits (one launch) and
# writes the logits' gradient from the dq/dk kernel: the layer keeps 2 bytes per gate entry (bf16 logits)
# where it would keep 8 (fp32 gc, and the fp32 logsigmoid input), and no elementwise pass over the gate
# runs outside the kernels.
class ChunkGLAFromLogitsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate_logits, normalizer, scale, initial_state, output_final_state, cu_seqlens):
        o, ht, _, A, _ = op_or_fn(chunk_gla_fwd_op, _gla_fwd)(q, k, v, gate_logits, scale, initial_state, cu_seqlens, normalizer)
        ctx.save_for_backward(q, k, v, gate_logits, A, initial_state, cu_seqlens)
        ctx.scale, ctx.normalizer, ctx.output_final_state = scale, normalizer, output_final_state
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gate_logits, A, initial_state, cu_seqlens = ctx.saved_tensors
        dht = dht.contiguous() if ctx.output_final_state and dht is not None else None
        dq, dk, dv, d_logits, dh0 = op_or_fn(chunk_gla_bwd_op, _gla_bwd)(
            q, k, v, gate_logits, A, None, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht, ctx.normalizer
        )
        return (dq, dk, dv, d_logits, None, None, (dh0 if initial_state is not None else None), None, None)


def chunk_gla_from_logits_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    normalizer: float,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """chunk_gla_triton with gk = logsigmoid(gate_logits) / normalizer (gate_logits [B, T, H, K], any float dtype)."""
    scale, initial_state, cu_seqlens = _checked_inputs(q, k, v, gate_logits, "gate_logits", scale, initial_state, cu_seqlens)
    o, ht = ChunkGLAFromLogitsFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), gate_logits.contiguous(), float(normalizer), scale,
        initial_state, output_final_state, cu_seqlens,
    )
    return o, (ht if output_final_state else None)
