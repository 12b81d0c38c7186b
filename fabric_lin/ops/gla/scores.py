"""GLA's intra-chunk scores, A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) for j <= i inside a chunk of BT = 64
rows (b = the in-chunk cumulative log gate, falling down the rows), made so that no exponent is ever large:

* **levels of halves** (any gate). Level P (P = 64, 32, ..., 2) cuts every block of P rows in two halves
  and references both to r, the last row of the first half:
      A[second half, first half] = (q * exp(b - b_r))[second half] @ ((k * exp(b_r - b))[first half])^T,
  both exponents <= 0, so one exponential, exp(-|b - b_r|), gives both factors. Every pair i > j is made at
  exactly one level (the one whose halves first separate i from j); the diagonal is sum_k q_ik k_ik. The
  two coarsest levels are 64x64 products masked to their blocks; the levels inside blocks of FINE_ROWS = 16
  rows, and the diagonal, run as [16, 16] pieces batched over the chunk's four blocks (a quarter of the
  products and masks), placed on A's diagonal blocks after.
* **one reference row** (where the gate allows), r the chunk's middle row:
      A = tril((q * exp(b - b_r)) @ (k * exp(b_r - b))^T),
  one product per key tile instead of six levels. Its exponents reach the gate's spread max |b - b_r|
  (positive above r), so it is taken only where the spread is at most single_reference_limit(dtype) (gate.py):
  40 for bf16 and fp32, factors up to exp(40) ~ 2e17 (both reach 3e38); 5.5 for float16, whose range ends at
  65504, factors up to 256. The kept pairs j <= i are at most 1 in their exponent, the masked pairs j > i at
  most exp(80) (in the fp32 accumulator).

The backward pass (`chunk_bwd.py`) differentiates the same products, so it uses these factors too.
"""
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import load_gate, load_gate_row, load_raw, load_tile

FINE_ROWS = tl.constexpr(16)


@triton.jit
def ref_gate(gc, row0, o_t, n_rows, stride, o_k, m_k, P: tl.constexpr, r, BT: tl.constexpr):
    """b at row r of each row's block of P rows: [1, BK] when one block is the whole chunk, else [BT, BK]."""
    if P == BT:
        return load_gate_row(gc, row0, r, n_rows, stride, o_k, m_k)[None, :]
    else:
        return load_gate(gc, row0, (o_t // P) * P + r, n_rows, stride, o_k, m_k)


@triton.jit
def half_factor(b_g, gc, row0, o_t, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr):
    """Level P of the split into halves: every block of P rows is cut in two and referenced to r, the last
    row of its first half. Returns (first, f): first masks the first half's rows (the keys' side); f is
    exp(b_r - b) on those rows and exp(b - b_r) on the second half's (the queries' side). b falls down the
    rows, so one exponential, exp(-|b - b_r|), gives both with exponents <= 0."""
    first = ((o_t % P) < P // 2)[:, None]
    f = tl.exp(-tl.abs(b_g - ref_gate(gc, row0, o_t, n_rows, stride, o_k, m_k, P, P // 2 - 1, BT)))
    return first, f


@triton.jit
def _scores_halves(A, q, b_q, b_k, b_g, gc, row0, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """A + the scores between the two halves of every block of P rows: one product, second-half queries
    against first-half keys, both referenced to the last row of the first half."""
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    first, f = half_factor(b_g, gc, row0, o_t, n_rows, stride, o_k, m_k, P, BT)
    q_f = tl.where(first, 0.0, b_q * f).to(DT)
    k_f = tl.where(first, b_k * f, 0.0).to(DT)
    scores = tl.dot(q_f, tl.trans(k_f), input_precision=DOT_PREC)
    if P < BT:  # only pairs inside the same block of P rows
        scores = tl.where((o_t[:, None] // P) == (o_t[None, :] // P), scores, 0.0)
    return A + scores


@triton.jit
def _coarse_levels(q, k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, DOT_PREC: tl.constexpr,
                   BS: tl.constexpr):
    """The part of A [BT, BT] / scale that columns o_k of q, k contribute through the levels of blocks larger
    than BS rows (the pairs inside those blocks and the diagonal are _fine_levels'). q and k stay in their
    dtype until used (half the registers of fp32 tiles: the output kernel holds them)."""
    o_t = tl.arange(0, BT)
    b_q = load_raw(q, row0, o_t, n_rows, stride, o_k, m_k)
    b_k = load_raw(k, row0, o_t, n_rows, stride, o_k, m_k)
    b_g = load_gate(gc, row0, o_t, n_rows, stride, o_k, m_k)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for level in tl.static_range(6):  # blocks of 64, 32, ..., 2 rows (BT = 64)
        if (BT >> level) > BS:
            A = _scores_halves(A, q, b_q, b_k, b_g, gc, row0, n_rows, stride, o_k, m_k, BT >> level, BT, DOT_PREC)
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
def block_level_factor(b_g, gc, row0, n_rows, stride, o_k, m_k, P: tl.constexpr, BT: tl.constexpr,
                       BS: tl.constexpr):
    """half_factor's (first, f) of level P on [BT/BS, BS, BK] tiles: every block of P rows inside each block of
    BS rows cut in two and referenced to the last row of its first half."""
    NB: tl.constexpr = BT // BS
    t = tl.arange(0, BS)
    first = ((t % P) < P // 2)[None, :, None]
    ref = tl.arange(0, NB)[:, None, None] * BS + ((t // P) * P + P // 2 - 1)[None, :, None]
    b_r = tl.load(gc + (row0 + tl.minimum(ref, n_rows - 1)) * stride + o_k[None, None, :], mask=m_k[None, None, :],
                  other=0.0)
    return first, tl.exp(-tl.abs(b_g - b_r))


@triton.jit
def _fine_levels(q, k, gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr, BK: tl.constexpr,
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
            first, f = block_level_factor(b_g, gc, row0, n_rows, stride, o_k, m_k, P, BT, BS)
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
def level_scores(q, k, gc, row0, n_rows, stride, K, scale, BT: tl.constexpr, BK: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """A [BT, BT], fp32, by the levels of halves (any gate)."""
    A = tl.zeros([BT, BT], dtype=tl.float32)
    A_fine = tl.zeros([BT // FINE_ROWS, FINE_ROWS, FINE_ROWS], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        A += _coarse_levels(q, k, gc, row0, n_rows, stride, o_k, m_k, BT, DOT_PREC, FINE_ROWS)
        A_fine += _fine_levels(q, k, gc, row0, n_rows, stride, o_k, m_k, BT, BK, FINE_ROWS, DOT_PREC)
    A += _block_diagonal(A_fine, BT, FINE_ROWS)
    return A * scale


@triton.jit
def gate_spread(gc, row0, n_rows, stride, o_k, m_k, BT: tl.constexpr):
    """max |b - b_r| over the chunk's rows and the key columns o_k, b_r the chunk's middle row: how far from 1
    the single-reference factors exp(+-(b - b_r)) reach (log scale)."""
    e = load_gate(gc, row0, tl.arange(0, BT), n_rows, stride, o_k, m_k) - \
        load_gate_row(gc, row0, BT // 2 - 1, n_rows, stride, o_k, m_k)[None, :]
    return tl.max(tl.max(tl.abs(e), axis=1), axis=0)


@triton.jit
def single_reference_scores(q, k, gc, row0, n_rows, stride, K, scale, BT: tl.constexpr, BK: tl.constexpr,
                            DOT_PREC: tl.constexpr):
    """A [BT, BT], fp32, with every row referenced to the chunk's middle row r: one product per key tile,
        A = tril((q * exp(b - b_r)) @ (k * exp(b_r - b))^T),
    the same algebra as the levels without their splits, for chunks whose gate spread is at most
    SINGLE_REFERENCE_LIMIT."""
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    diagonal = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        e = load_gate(gc, row0, o_t, n_rows, stride, o_k, m_k) - \
            load_gate_row(gc, row0, BT // 2 - 1, n_rows, stride, o_k, m_k)[None, :]
        b_q = load_tile(q, row0, o_t, n_rows, stride, o_k, m_k)
        b_k = load_tile(k, row0, o_t, n_rows, stride, o_k, m_k)
        A += tl.dot((b_q * tl.exp(e)).to(DT), tl.trans((b_k * tl.exp(-e)).to(DT)), input_precision=DOT_PREC)
        diagonal += tl.sum(b_q * b_k, axis=1)
    # the diagonal sum_k q_ik k_ik from the inputs in fp32, as the levels make it: through the rounded factors,
    # a token whose q and k nearly cancel got a score several percent off, and its dv that much off wherever
    # its own output gradient dominates (a sequence's first token). The pairs j > i, masked here, may reach
    # exp(2 spread) or overflow; a select leaves no trace of them.
    A = tl.where(o_t[:, None] > o_t[None, :], A, 0.0)
    return tl.where(o_t[:, None] == o_t[None, :], diagonal[:, None], A) * scale
