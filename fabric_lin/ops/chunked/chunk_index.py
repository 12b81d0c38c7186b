"""Where a chunk's rows live, inside the kernels that cut sequences into chunks of BT rows (`layout.py` lays the
chunks out on the host).

Tensors are [B, T, H, D], read as [B*T] rows of H*D. Two kinds of program find their rows here:
* chunk-parallel (one chunk of one head per program): `chunk_start`;
* a sequential state pass (one sequence of one head per program, looping over its chunks): `seq_start` (its
  sequence), `state_tile` (its tile of the [K, V] state), `initial_state_tile` (the state it starts from), or
  `state_pass_start` for the three at once. The delta rule's passes call the three apart, between steps of their
  own: ptxas schedules by the source's order, so the order a pass sets up in is part of its compiled code.
Rows past a sequence's end are masked on load; a cumulative gate read there takes the sequence's last row (no
decay past the end). Gates come per key column ([B*T, H, K], GLA's) or per head ([B*T, H], the delta rule's).

Offsets into whole tensors are int64, those inside one tile int32. A batch's elements pass 2^31 at sizes trained at
(131,072 tokens x 32 heads x 128 x 256 per-chunk states; 1M tokens x 4096 channels of q), while program ids, loaded
indices and row counts are int32 (B*T < 2^31 rows). So the first rows that `chunk_start` and `seq_start` give are
int64, and every row offset made from them (row * stride) with them; states are reached by `chunk_state_offset` and
`sequence_state_offset`, int64; a position inside one [K, V] state (`state_tile`, K * V <= 2^18) or one row stays
int32, the cheaper arithmetic in the kernels' loops.
"""
import triton
import triton.language as tl


@triton.jit
def chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row of the chunk in the flattened [B*T] rows, rows left in its sequence, global chunk index); the first
    row and the chunk index int64."""
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
    """(first row of sequence i_n, its length, index of its first chunk); the first row and the chunk index int64."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    return bos, T, boh


@triton.jit
def state_tile(i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Key tile i_k and value tile i_v of a [K, V] state: (key columns, value columns, their masks, the tile's mask
    and its offsets in the state)."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_offs = o_k[:, None] * V + o_v[None, :]
    return o_k, o_v, m_k, m_v, m_kv, state_offs


@triton.jit
def chunk_state_offset(i_chunk, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Where head i_h's state of chunk i_chunk (numbered over the batch) starts in per-chunk states [chunks, H, K, V],
    in int64: past 2048 chunks (131,072 tokens) of 32 heads of 128 x 256 states the product passes 2^31."""
    return (i_chunk.to(tl.int64) * H + i_h) * K * V


@triton.jit
def sequence_state_offset(i_nh, K: tl.constexpr, V: tl.constexpr):
    """Where the state of (sequence, head) i_nh starts in states [N, H, K, V] (initial and final states, their
    gradients, a decoding step's), in int64: past 2048 packed documents of 32 heads of 128 x 256 states (or a decoding
    batch as large) the product passes 2^31."""
    return i_nh.to(tl.int64) * K * V


@triton.jit
def initial_state_tile(s0, i_nh, state_offs, m_kv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, USE_S0: tl.constexpr):
    """The state a pass starts from, one tile of it, fp32: s0's ([N * H, K, V], i_nh its sequence and head) where
    USE_S0, else zeros."""
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S0:
        S += tl.load(s0 + sequence_state_offset(i_nh, K, V) + state_offs, mask=m_kv, other=0.0).to(tl.float32)
    return S


@triton.jit
def state_pass_start(i_k, i_v, i_nh, s0, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_S0: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    """What the program of a sequential state pass starts from, for key tile i_k, value tile i_v and (sequence,
    head) i_nh: (head, the sequence's first row, its length, its first chunk, its chunk count, `state_tile`'s six,
    and `initial_state_tile`)."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = seq_start(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    o_k, o_v, m_k, m_v, m_kv, state_offs = state_tile(i_k, i_v, K, V, BK, BV)
    S = initial_state_tile(s0, i_nh, state_offs, m_kv, K, V, BK, BV, USE_S0)
    return i_h, bos, T, boh, NT, o_k, o_v, m_k, m_v, m_kv, state_offs, S


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


@triton.jit
def load_head_rows(ptr, row0, rows, n_rows, H: tl.constexpr):
    """A per-head scalar ([B*T, H], ptr at the head) at `rows` of a chunk, fp32; 0 past the sequence's end."""
    return tl.load(ptr + (row0 + rows) * H, mask=rows < n_rows, other=0.0).to(tl.float32)


@triton.jit
def load_head_gate(b, row0, rows, n_rows, H: tl.constexpr):
    """A per-head cumulative gate ([B*T, H] fp32, b at the head) at `rows`, rows past the sequence's end reading
    its last row (no decay there, so exponents of differences stay <= 0)."""
    return tl.load(b + (row0 + tl.minimum(rows, n_rows - 1)) * H)
