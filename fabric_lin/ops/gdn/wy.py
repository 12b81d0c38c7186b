"""The chunk-local part of the gated delta rule in Triton: the UT transform (I + A)^-1 and the WY factors W, U
(forward), and the gradients through them (backward). chunk_torch.py's docstring derives the form.

Per chunk of BT = 64 rows and head, with b = the in-chunk cumsum of g, Gamma_ij = exp(b_i - b_j) (j <= i):
    A = strict_lower(diag(beta) K K^T * Gamma),   (I + A)^-1 unit lower triangular,
    W = (I + A)^-1 diag(beta exp(b)) K,           U = (I + A)^-1 diag(beta) V.
(I + A)^-1 is solved on 16 x 16 blocks: forward substitution inside each diagonal block, then the blocks
below the diagonal from those, T_ij = -T_ii sum_{j <= m < i} A_im T_mj. It is kept for the backward pass
in the inputs' dtype, its strictly upper part never written nor read (loads mask it).

The gate's in-chunk cumsum is made here, by the first kernel of the forward pass, which needs it first: a
launch of its own would only read g and write b again. b (fp32, [B, T, H]) is what every later kernel reads.

Every kernel of the chunked path (these, chunk_fwd.py's and chunk_bwd.py's) takes USE_GATE: off, it is the delta rule
of DeltaNet (no decay: b = 0, Gamma the causal mask): the gate and its cumsum are passed as None and never
loaded, stored or exponentiated, and the gate's gradient is not computed. The branches keep the gated code's
operations in their source order, which ptxas's schedule follows, so the gated kernels compile to the same code as
they would without the flag.
"""
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import chunk_start, load_head_gate, load_head_rows, load_raw, load_tile

BC = 16  # rows per block of the triangular solve: a chunk of CHUNK_SIZE = 64 rows is four of them


@triton.jit
def load_lower(A_inv, row0, n_rows, H: tl.constexpr, BT: tl.constexpr):
    """(I + A)^-1 of a chunk, [BT, BT] in its stored dtype, A_inv at the head: the lower triangle with its
    diagonal (the rest is zero and not stored), rows past the sequence's end zero."""
    o_t = tl.arange(0, BT)
    m = (o_t < n_rows)[:, None] & (o_t[None, :] <= o_t[:, None])
    return tl.load(A_inv + (row0 + o_t[:, None]) * (H * BT) + o_t[None, :], mask=m, other=0.0)


# ------------------------------------------------------------------------------------- forward


@triton.jit
def _last(x, o_c, BC: tl.constexpr):
    """The last entry of a [BC] vector (exact: the others are added as zeros)."""
    return tl.sum(tl.where(o_c == BC - 1, x, 0.0), axis=0)


@triton.jit
def _a_block(a, b_rows, b_cols, beta_rows, o_c, DIAGONAL: tl.constexpr, USE_GATE: tl.constexpr):
    """A block of A from its K K^T block: beta_i (k_i . k_j) exp(b_i - b_j). Below the diagonal block every row
    comes after every column, so each exponent is <= 0; in a diagonal block only i > j is kept, the other
    exponents taken as -inf before the exp (never a positive one). Without a gate (b None): beta_i (k_i . k_j)."""
    if USE_GATE:
        diff = b_rows[:, None] - b_cols[None, :]
        if DIAGONAL:
            diff = tl.where(o_c[:, None] > o_c[None, :], diff, float("-inf"))
        a = a * (beta_rows[:, None] * tl.exp(diff))
    else:
        a = a * beta_rows[:, None]
        if DIAGONAL:
            a = tl.where(o_c[:, None] > o_c[None, :], a, 0.0)
    return a


@triton.jit
def _substitute_row(a, t, i, o_c):
    """Forward substitution, row i of t = (I + a)^-1 (a strictly lower, t's rows above i final, row i still e_i):
    t_i = e_i - sum_{j < i} a_ij t_j."""
    a_i = tl.sum(tl.where(o_c[:, None] == i, a, 0.0), axis=0)  # row i of a, indexed by column j
    row = tl.sum(a_i[:, None] * t, axis=0)
    return tl.where(o_c[:, None] == i, t - row[None, :], t)


@triton.jit
def _store_block(A_inv, x, row0, n_rows, i: tl.constexpr, j: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr):
    o_c = tl.arange(0, BC)
    rows = i * BC + o_c
    ptrs = A_inv + (row0 + rows[:, None]) * (H * BT) + (j * BC + o_c)[None, :]
    tl.store(ptrs, x.to(A_inv.dtype.element_ty), mask=(rows < n_rows)[:, None])


@triton.jit
def _solve_kernel(k, g, beta, b, A_inv, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                  DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """One chunk of one head: b = cumsum(g) inside the chunk (stored, fp32), A, and (I + A)^-1 (stored in
    A_inv's dtype, [B*T, H, BT]). The chunk is four blocks of BC = 16 rows; A's ten blocks on and below the
    diagonal are accumulated over key tiles. Without USE_GATE, g and b are None."""
    tl.static_assert(BT == 4 * BC)
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, _ = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    k += i_h * K
    beta += i_h
    A_inv += i_h * BT
    o_c = tl.arange(0, BC)
    r0, r1, r2, r3 = o_c, BC + o_c, 2 * BC + o_c, 3 * BC + o_c

    if USE_GATE:
        # the gate's cumsum block by block, each block continuing from the last entry of the one before; rows past
        # the end read g = 0, so b stays at the last row's value there
        g += i_h
        b += i_h
        b0 = tl.cumsum(load_head_rows(g, row0, r0, n_rows, H), axis=0)
        b1 = tl.cumsum(load_head_rows(g, row0, r1, n_rows, H), axis=0) + _last(b0, o_c, BC)
        b2 = tl.cumsum(load_head_rows(g, row0, r2, n_rows, H), axis=0) + _last(b1, o_c, BC)
        b3 = tl.cumsum(load_head_rows(g, row0, r3, n_rows, H), axis=0) + _last(b2, o_c, BC)
        tl.store(b + (row0 + r0) * H, b0, mask=r0 < n_rows)
        tl.store(b + (row0 + r1) * H, b1, mask=r1 < n_rows)
        tl.store(b + (row0 + r2) * H, b2, mask=r2 < n_rows)
        tl.store(b + (row0 + r3) * H, b3, mask=r3 < n_rows)
    else:
        b0, b1, b2, b3 = None, None, None, None

    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a10 = tl.zeros([BC, BC], dtype=tl.float32)
    a11 = tl.zeros([BC, BC], dtype=tl.float32)
    a20 = tl.zeros([BC, BC], dtype=tl.float32)
    a21 = tl.zeros([BC, BC], dtype=tl.float32)
    a22 = tl.zeros([BC, BC], dtype=tl.float32)
    a30 = tl.zeros([BC, BC], dtype=tl.float32)
    a31 = tl.zeros([BC, BC], dtype=tl.float32)
    a32 = tl.zeros([BC, BC], dtype=tl.float32)
    a33 = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        k0 = load_raw(k, row0, r0, n_rows, H * K, o_k, m_k)
        k1 = load_raw(k, row0, r1, n_rows, H * K, o_k, m_k)
        k2 = load_raw(k, row0, r2, n_rows, H * K, o_k, m_k)
        k3 = load_raw(k, row0, r3, n_rows, H * K, o_k, m_k)
        a00 += tl.dot(k0, tl.trans(k0), input_precision=DOT_PREC)
        a10 += tl.dot(k1, tl.trans(k0), input_precision=DOT_PREC)
        a11 += tl.dot(k1, tl.trans(k1), input_precision=DOT_PREC)
        a20 += tl.dot(k2, tl.trans(k0), input_precision=DOT_PREC)
        a21 += tl.dot(k2, tl.trans(k1), input_precision=DOT_PREC)
        a22 += tl.dot(k2, tl.trans(k2), input_precision=DOT_PREC)
        a30 += tl.dot(k3, tl.trans(k0), input_precision=DOT_PREC)
        a31 += tl.dot(k3, tl.trans(k1), input_precision=DOT_PREC)
        a32 += tl.dot(k3, tl.trans(k2), input_precision=DOT_PREC)
        a33 += tl.dot(k3, tl.trans(k3), input_precision=DOT_PREC)

    beta0 = load_head_rows(beta, row0, r0, n_rows, H)
    beta1 = load_head_rows(beta, row0, r1, n_rows, H)
    beta2 = load_head_rows(beta, row0, r2, n_rows, H)
    beta3 = load_head_rows(beta, row0, r3, n_rows, H)
    a00 = _a_block(a00, b0, b0, beta0, o_c, True, USE_GATE)
    a11 = _a_block(a11, b1, b1, beta1, o_c, True, USE_GATE)
    a22 = _a_block(a22, b2, b2, beta2, o_c, True, USE_GATE)
    a33 = _a_block(a33, b3, b3, beta3, o_c, True, USE_GATE)
    a10 = _a_block(a10, b1, b0, beta1, o_c, False, USE_GATE)
    a20 = _a_block(a20, b2, b0, beta2, o_c, False, USE_GATE)
    a21 = _a_block(a21, b2, b1, beta2, o_c, False, USE_GATE)
    a30 = _a_block(a30, b3, b0, beta3, o_c, False, USE_GATE)
    a31 = _a_block(a31, b3, b1, beta3, o_c, False, USE_GATE)
    a32 = _a_block(a32, b3, b2, beta3, o_c, False, USE_GATE)

    # the diagonal blocks' inverses, the four substitutions side by side
    eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    t00, t11, t22, t33 = eye, eye, eye, eye
    for i in range(1, BC):
        t00 = _substitute_row(a00, t00, i, o_c)
        t11 = _substitute_row(a11, t11, i, o_c)
        t22 = _substitute_row(a22, t22, i, o_c)
        t33 = _substitute_row(a33, t33, i, o_c)
    # below the diagonal, from (I + A) T = I: T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=DOT_PREC), input_precision=DOT_PREC)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=DOT_PREC), input_precision=DOT_PREC)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=DOT_PREC), input_precision=DOT_PREC)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=DOT_PREC) + tl.dot(a21, t10, input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=DOT_PREC) + tl.dot(a32, t21, input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=DOT_PREC) + tl.dot(a31, t10, input_precision=DOT_PREC)
                  + tl.dot(a32, t20, input_precision=DOT_PREC), input_precision=DOT_PREC)
    _store_block(A_inv, t00, row0, n_rows, 0, 0, H, BT, BC)
    _store_block(A_inv, t10, row0, n_rows, 1, 0, H, BT, BC)
    _store_block(A_inv, t11, row0, n_rows, 1, 1, H, BT, BC)
    _store_block(A_inv, t20, row0, n_rows, 2, 0, H, BT, BC)
    _store_block(A_inv, t21, row0, n_rows, 2, 1, H, BT, BC)
    _store_block(A_inv, t22, row0, n_rows, 2, 2, H, BT, BC)
    _store_block(A_inv, t30, row0, n_rows, 3, 0, H, BT, BC)
    _store_block(A_inv, t31, row0, n_rows, 3, 1, H, BT, BC)
    _store_block(A_inv, t32, row0, n_rows, 3, 2, H, BT, BC)
    _store_block(A_inv, t33, row0, n_rows, 3, 3, H, BT, BC)


@triton.jit
def _wu_kernel(k, v, beta, b, A_inv, w, u, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
               DOT_PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """W = (I + A)^-1 diag(beta exp(b)) K and U = (I + A)^-1 diag(beta) V for one chunk of one head, in the
    inputs' dtype (without USE_GATE, b is None and W = (I + A)^-1 diag(beta) K)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, _ = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    t = load_lower(A_inv + i_h * BT, row0, n_rows, H, BT).to(DT)
    b_beta = load_head_rows(beta + i_h, row0, o_t, n_rows, H)
    if USE_GATE:
        b_kscale = b_beta * tl.exp(load_head_gate(b + i_h, row0, o_t, n_rows, H))
    else:
        b_kscale = b_beta
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v = load_tile(v + i_h * V, row0, o_t, n_rows, H * V, o_v, m_v)
        b_u = tl.dot(t, (b_v * b_beta[:, None]).to(DT), input_precision=DOT_PREC)
        offs = i_h * V + (row0 + o_t[:, None]) * (H * V) + o_v[None, :]
        tl.store(u + offs, b_u.to(u.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k = load_tile(k + i_h * K, row0, o_t, n_rows, H * K, o_k, m_k)
        b_w = tl.dot(t, (b_k * b_kscale[:, None]).to(DT), input_precision=DOT_PREC)
        offs = i_h * K + (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
        tl.store(w + offs, b_w.to(w.dtype.element_ty), mask=m_t[:, None] & m_k[None, :])


# ------------------------------------------------------------------------------------- backward


@triton.jit
def _wy_bwd_kernel(k, v, beta, b, A_inv, dw, dd, dk_part, dg_part, dk, dv, dbeta, dg, cu_seqlens, chunk_indices,
                   T, NK_PART, part_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                   USE_GATE: tl.constexpr):
    """One chunk of one head, from dW and dU = dD (the corrections' gradient), with T = (I + A)^-1:
        dT = dW X^T + dU Y^T           (X = diag(beta exp(b)) K, Y = diag(beta) V; W = T X, U = T Y)
        dX = T^T dW, dY = T^T dU       -> dk += diag(beta exp(b)) dX, dv = diag(beta) dY, dbeta, db
        dA = strict_lower(-T^T dT T^T) -> to k, beta and b through A = strict_lower(diag(beta) K K^T * Gamma)
    dk = dk_part (the output's and state's part, fp32) plus these. The gate's gradient is db's reverse cumsum inside
    the chunk (b = cumsum(g)) plus the output's and state's part, dg_part's NK_PART key tiles ([NK_PART, B*T, H],
    part_stride = B*T*H apart; `_bwd_dqkw_kernel` says why that part is not a db). Without USE_GATE (exp(b) = 1,
    Gamma = 1 below the diagonal) b, dg_part and dg are None and no gate gradient is made."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    row0, n_rows, _ = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    k += i_h * K
    dw += i_h * K
    dk_part += i_h * K
    dk += i_h * K
    v += i_h * V
    dd += i_h * V
    dv += i_h * V
    t = load_lower(A_inv + i_h * BT, row0, n_rows, H, BT).to(DT)
    b_beta = load_head_rows(beta + i_h, row0, o_t, n_rows, H)
    if USE_GATE:
        b_b = load_head_gate(b + i_h, row0, o_t, n_rows, H)
        b_eb = tl.exp(b_b)
        b_kscale = b_beta * b_eb
    else:
        b_kscale = b_beta

    d_t = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k = load_tile(k, row0, o_t, n_rows, H * K, o_k, m_k)
        b_x = b_k * b_kscale[:, None]
        b_dw = load_raw(dw, row0, o_t, n_rows, H * K, o_k, m_k).to(DT)
        d_t += tl.dot(b_dw, tl.trans(b_x.to(DT)), input_precision=DOT_PREC)
        b_dx = tl.dot(tl.trans(t), b_dw, input_precision=DOT_PREC)
        if USE_GATE:
            b_dbeta += tl.sum(b_dx * b_k, axis=1) * b_eb
            b_db += tl.sum(b_dx * b_x, axis=1)
        else:
            b_dbeta += tl.sum(b_dx * b_k, axis=1)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v = load_tile(v, row0, o_t, n_rows, H * V, o_v, m_v)
        b_du = load_raw(dd, row0, o_t, n_rows, H * V, o_v, m_v).to(DT)
        d_t += tl.dot(b_du, tl.trans((b_v * b_beta[:, None]).to(DT)), input_precision=DOT_PREC)
        b_dy = tl.dot(tl.trans(t), b_du, input_precision=DOT_PREC)
        b_dbeta += tl.sum(b_dy * b_v, axis=1)
        offs = (row0 + o_t[:, None]) * (H * V) + o_v[None, :]
        tl.store(dv + offs, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

    # T is lower triangular, so only dT's strictly lower part reaches dA's: its upper part is dropped
    strict = o_t[:, None] > o_t[None, :]
    d_t = tl.where(strict, d_t, 0.0)
    d_a = -tl.dot(tl.trans(t), tl.dot(d_t.to(DT), tl.trans(t), input_precision=DOT_PREC).to(DT),
                  input_precision=DOT_PREC)
    # G = dA * Gamma (strictly lower). A_ij = beta_i (k_i . k_j) Gamma_ij gives dk = diag(beta) G K + G^T diag(beta) K,
    # dbeta_i = k_i . (G K)_i, and db = row sums - column sums of diag(beta) G * K K^T, which are
    # beta_i k_i . (G K)_i and k_j . (G^T diag(beta) K)_j: no K K^T needed
    if USE_GATE:
        b_dag = tl.where(strict, d_a * tl.exp(tl.where(strict, b_b[:, None] - b_b[None, :], float("-inf"))), 0.0).to(DT)
    else:
        b_dag = tl.where(strict, d_a, 0.0).to(DT)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = load_tile(k, row0, o_t, n_rows, H * K, o_k, m_k)
        b_dw = load_raw(dw, row0, o_t, n_rows, H * K, o_k, m_k).to(DT)
        b_dx = tl.dot(tl.trans(t), b_dw, input_precision=DOT_PREC)  # again: cheaper than keeping it across loops
        b_gk = tl.dot(b_dag, b_k.to(DT), input_precision=DOT_PREC)
        b_gtk = tl.dot(tl.trans(b_dag), (b_k * b_beta[:, None]).to(DT), input_precision=DOT_PREC)
        b_kgk = tl.sum(b_k * b_gk, axis=1)
        b_dbeta += b_kgk
        if USE_GATE:
            b_db += b_beta * b_kgk - tl.sum(b_k * b_gtk, axis=1)
        offs = (row0 + o_t[:, None]) * (H * K) + o_k[None, :]
        b_dk = tl.load(dk_part + offs, mask=m_tk, other=0.0)
        b_dk += b_dx * b_kscale[:, None] + b_gk * b_beta[:, None] + b_gtk
        tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    if USE_GATE:
        b_dg = tl.cumsum(tl.where(m_t, b_db, 0.0), axis=0, reverse=True)
        for i_p in range(NK_PART):  # i_p * part_stride fits int32 (`chunk_bwd._bwd_dqkw_kernel` says why)
            b_dg += tl.load(dg_part + i_p * part_stride + (row0 + o_t) * H + i_h, mask=m_t, other=0.0)
        tl.store(dg + (row0 + o_t) * H + i_h, b_dg, mask=m_t)
    tl.store(dbeta + (row0 + o_t) * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
