"""The Triton kernels behind short_conv.py's causal_conv1d, their torch.library ops and autograd Function.

    z[t, d] = sum_{j < W} weight[d, j] * x[t - (W - 1) + j, d],   y = silu(z)   (or z without the activation)

One design, a walk down the rows: each row is read once (x forward, x and dy backward) and dz is made in registers
where it is used, never written in fp32 and read back. The backward pass keeps nothing but x (and the cache),
neither z nor y.

One program per (tile of BD channels, block of ROWS rows, sequence) walks its rows in order, each row a [1, BD]
vector, STEP rows loaded at a time (ShortConvLaunch's channels, rows and rows_per_load); the W - 1 inputs before the
current row (and, backward, the partial sums of the W - 1 rows of dx still open) ride along in registers from row to
row, so no row is shifted across threads and nothing is written but the outputs:
* forward: each input loaded once (the block's W - 1 rows before it, twice), y stored once.
* backward: z recomputed and dz = dy silu'(z) made once per row; dz[t] adds its W parts to the open dx sums of
  rows t - (W - 1) .. t, and row t - (W - 1) is then complete and stored. A block also walks the W - 1 rows after
  it (their dz completes its last rows' dx; their dweight share is the next block's). Per element it reads x and
  dy and writes dx: 6 bytes in bf16, and one sigmoid. Each program's share of dweight goes to its own slot of an
  fp32 buffer that the host sums (a fixed order: the same gradient every run, which atomics would not give).
  The cache's gradient is the open sums of rows -(W - 1) .. -1, completed by the first block of a sequence, and
  written only when the cache needs one (the training path passes no cache: the model takes one only when
  decoding).
* decoding step: one token per sequence from the cache, which it also shifts (one launch per token).

Varlen (`cu_seqlens`, B = 1): a walk finds its first row's document by binary search over the offsets (no host
synchronisation, no per-token index tensor), then steps from document to document as its rows pass their offsets.
A tap that would read before the document's first row reads zero, and a row's dz never reaches dx across a
document end.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.custom_op import kernel_op, refuse_second_derivative
from fabric_lin.ops.launch import cdiv, launch_json
from fabric_lin.ops.fused_launch import SHIPPED_SHORT_CONV as SHIPPED, ShortConvLaunch


@triton.jit
def _document_index(cu_seqlens, row, N, STEPS):
    """The document holding `row`: the largest i with cu_seqlens[i] <= row, by binary search over the N + 1 offsets
    in STEPS = bit_length(N) halvings. An empty document shares its offset with the next one; the search lands on
    the last of equal offsets, the document that holds the row."""
    lo = row * 0
    hi = lo + N
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        inside = tl.load(cu_seqlens + mid).to(tl.int32) <= row
        lo = tl.where(inside, mid, lo)
        hi = tl.where(inside, hi, mid - 1)
    return lo


@triton.jit
def _load_input(x_seq, x_stride_t, c_seq, rows, lowest, T, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
                HAS_CACHE: tl.constexpr):
    """The convolution's input at `rows` (a [1] vector: one row) of one sequence as fp32 [1, BD]: x at rows in
    [0, T), the cache's slot row + W - 1 at negative rows, zero below `lowest` (the first row a load may read)."""
    readable = (rows >= lowest) & (rows < T)
    m_x = (readable & (rows >= 0))[:, None] & m_d[None, :]
    b_x = tl.load(x_seq + rows.to(tl.int64)[:, None] * x_stride_t + o_d[None, :], mask=m_x, other=0.0)
    b_x = b_x.to(tl.float32)
    if HAS_CACHE:
        m_c = (readable & (rows < 0))[:, None] & m_d[None, :]
        b_c = tl.load(c_seq + (rows + W - 1)[:, None] * D + o_d[None, :], mask=m_c, other=0.0)
        # the cache is rounded to x's dtype first, as the reference concatenates it with x
        b_x += b_c.to(x_seq.dtype.element_ty).to(tl.float32)
    return b_x


@triton.jit
def _output_tile(i_d, i_b, T, D0, D1, out0, out1, out2, D: tl.constexpr, BD: tl.constexpr,
                 SEGMENTS: tl.constexpr):
    """Where channel tile i_d lies: (its D channels' indices o_d [BD] and mask m_d, the pointers to its columns of
    sequence i_b of the output (or output gradient) tensor it belongs to [BD], that tensor's row stride).
    SEGMENTS = 1: one output [B, T, D]; 3: the channels split into D0, D1 and D - D0 - D1, each its own
    output [B, T, width] (q, k and v convolved in one launch, each output the tensor the next op takes)."""
    zero = tl.zeros_like(i_d)  # start and width as tensors in every branch (a width of 1 is a constant)
    out, start, width, tile = out0, zero, zero + D, i_d
    if SEGMENTS > 1:
        n0, n1 = tl.cdiv(D0, BD), tl.cdiv(D1, BD)
        width = zero + D0
        if i_d >= n0 + n1:
            out, start, width, tile = out2, zero + D0 + D1, zero + (D - D0 - D1), i_d - n0 - n1
        elif i_d >= n0:
            out, start, width, tile = out1, zero + D0, zero + D1, i_d - n0
    o_l = tile * BD + tl.arange(0, BD)
    return start + o_l, o_l < width, out + i_b * T * width + o_l, width


@triton.jit
def _output_grad(dy_cols, dy_stride, rows, T, m_d):
    """dy at `rows` (one row, never negative) as fp32 [1, BD], zero from row T; dy_cols: the tile's columns of the
    sequence's dy."""
    m = (rows < T)[:, None] & m_d[None, :]
    return tl.load(dy_cols[None, :] + rows.to(tl.int64)[:, None] * dy_stride, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _silu_grad(dy, z):
    """dz from dy = d silu(z): silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))."""
    sig = tl.sigmoid(z)
    return dy * sig * (1.0 + z * (1.0 - sig))


@triton.jit
def _walk_start(x_seq, x_stride_t, c_seq, weight, cu_seqlens, r0, T, N, STEPS, o_d, m_d, D: tl.constexpr,
                W: tl.constexpr, HAS_CACHE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What a walk down rows r0, r0 + 1, ... starts from: (the taps, W rows [1, BD] in fp32; the W - 1 inputs
    before row r0, nearest first; the lowest row a load may read; the document state of _advance_document, at row
    r0's document with cu_seqlens, else (0, that lowest row, T))."""
    taps = ()
    for j in tl.static_range(W):
        taps = taps + (tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)[None, :],)
    if HAS_CACHE:
        lowest = 1 - W  # the cache's slots are rows -(W - 1) .. -1
    else:
        lowest = 0
    history = ()
    for k in tl.static_range(1, W):
        history = history + (_load_input(x_seq, x_stride_t, c_seq, r0 - k + tl.arange(0, 1), lowest, T, o_d, m_d, D,
                                         W, HAS_CACHE),)
    i_n, start, after = r0 * 0, r0 * 0 + lowest, r0 * 0 + T
    if IS_VARLEN:
        i_n = _document_index(cu_seqlens, r0, N, STEPS)
        start = tl.load(cu_seqlens + i_n).to(tl.int32)
        after = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    return taps, history, lowest, i_n, start, after


@triton.jit
def _advance_document(cu_seqlens, t, i_n, start, after, N):
    """(the document holding row t, its first row, the row after its last) from those of an earlier row: rows are
    visited in order, so the offsets passed are few (several at once only over empty documents)."""
    while (after <= t) & (i_n + 1 < N):
        i_n += 1
        start = after
        after = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    return i_n, start, after


@triton.jit
def _walked_preactivation(window, t, start, taps, W: tl.constexpr, IS_VARLEN: tl.constexpr):
    """z at row t, [1, BD] fp32, from `window` (the inputs at rows t, t - 1, .., t - (W - 1)). Returns (z, the
    inputs as the taps read them, whether each window row is in row t's document): with IS_VARLEN a row before
    `start` (the first row of row t's document) reads zero."""
    same_document = ()
    if IS_VARLEN:
        for k in tl.static_range(W):
            same_document = same_document + (t - k >= start,)
        read = ()
        for k in tl.static_range(W):
            read = read + (tl.where(same_document[k], window[k], 0.0),)
    else:
        read = window
    z = taps[W - 1] * read[0]
    for k in tl.static_range(1, W):
        z += taps[W - 1 - k] * read[k]
    return z, read, same_document


@triton.jit
def _next_history(window, W: tl.constexpr):
    """The W - 1 inputs before the next row, nearest first: the window less its oldest row."""
    history = ()
    for k in tl.static_range(W - 1):
        history = history + (window[k],)
    return history


@triton.jit
def _conv_fwd_kernel(x, weight, cache, cu_seqlens, y0, y1, y2, T, x_stride_b, x_stride_t, N, STEPS, D0, D1,
                     D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr,
                     SEGMENTS: tl.constexpr, HAS_CACHE: tl.constexpr, IS_VARLEN: tl.constexpr,
                     ACTIVATION: tl.constexpr):
    """The forward of ROWS rows of one sequence (its i_s-th such block) and a tile of BD channels: the rows
    walked in order, STEP rows of x loaded at a time, each input read once."""
    i_d, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d, m_d, y_cols, y_stride = _output_tile(i_d, i_b, T, D0, D1, y0, y1, y2, D, BD, SEGMENTS)
    x_seq, c_seq = x + i_b * x_stride_b, cache + i_b * (W - 1) * D
    r0 = i_s * ROWS
    taps, history, lowest, i_n, start, after = _walk_start(x_seq, x_stride_t, c_seq, weight, cu_seqlens, r0, T, N,
                                                           STEPS, o_d, m_d, D, W, HAS_CACHE, IS_VARLEN)
    for t0 in range(r0, tl.minimum(r0 + ROWS, T), STEP):
        inputs = ()  # the step's loads first, all in flight before its rows' arithmetic
        for i in tl.static_range(STEP):
            inputs = inputs + (_load_input(x_seq, x_stride_t, c_seq, t0 + i + tl.arange(0, 1), lowest, T, o_d, m_d,
                                           D, W, HAS_CACHE),)
        for i in tl.static_range(STEP):
            t = t0 + i
            if IS_VARLEN:
                i_n, start, after = _advance_document(cu_seqlens, t, i_n, start, after, N)
            window = (inputs[i],) + history
            z, _, _ = _walked_preactivation(window, t, start, taps, W, IS_VARLEN)
            if ACTIVATION:
                z = z * tl.sigmoid(z)
            rows = t + tl.arange(0, 1)
            tl.store(y_cols[None, :] + rows.to(tl.int64)[:, None] * y_stride, z.to(y0.dtype.element_ty),
                     mask=(rows < T)[:, None] & m_d[None, :])
            history = _next_history(window, W)


@triton.jit
def _walk_row(x_row, dy_row, t, start, history, pending, dw, taps, W: tl.constexpr, OWNED: tl.constexpr,
              IS_VARLEN: tl.constexpr, ACTIVATION: tl.constexpr):
    """Row t of the backward walk, each value one row [1, BD] in fp32: z[t] from x_row (the input at row t)
    and `history` (the W - 1 inputs before it, nearest first); dz[t] from dy_row; dz[t]'s part of dx at rows
    t - (W - 1) .. t, added to `pending` (rows t - (W - 1) .. t - 1's sums so far). Row t - (W - 1) then has every
    part: returns (the history and pending sums for row t + 1, dw with dz[t]'s part if this program OWNED row t,
    dx at row t - (W - 1)). With IS_VARLEN dz[t] reaches no row before `start`, the first row of its document."""
    window = (x_row,) + history
    z, read, same_document = _walked_preactivation(window, t, start, taps, W, IS_VARLEN)
    if ACTIVATION:
        grad = _silu_grad(dy_row, z)
    else:
        grad = dy_row
    if OWNED:
        owned_dw = ()
        for j in tl.static_range(W):
            owned_dw = owned_dw + (dw[j] + grad * read[W - 1 - j],)
        dw = owned_dw
    before = pending + (tl.zeros_like(grad),)  # rows t - (W - 1) .. t; row t - (W - 1) + i takes tap i's part
    sums = ()
    for i in tl.static_range(W):
        part = taps[i] * grad
        if IS_VARLEN:
            part = tl.where(same_document[W - 1 - i], part, 0.0)
        sums = sums + (before[i] + part,)
    next_pending = ()
    for i in tl.static_range(1, W):
        next_pending = next_pending + (sums[i],)
    return _next_history(window, W), next_pending, dw, sums[0]


@triton.jit
def _store_walked_grad(dx_cols, dc_cols, grad, row, r0, T, m_d, D: tl.constexpr, W: tl.constexpr,
                       WANT_DCACHE: tl.constexpr, FIRST_ROWS):
    """A row's complete input gradient: to dx if the walk owns the row (r0 <= row < T), to the cache's slot
    row + W - 1 if the row is before the sequence and the walk starts it (FIRST_ROWS) and the cache needs one."""
    rows = row + tl.arange(0, 1)
    m = ((rows >= r0) & (rows < T))[:, None] & m_d[None, :]
    tl.store(dx_cols[None, :] + rows.to(tl.int64)[:, None] * D, grad.to(dx_cols.dtype.element_ty), mask=m)
    if WANT_DCACHE:
        m_c = ((rows < 0) & FIRST_ROWS)[:, None] & m_d[None, :]
        tl.store(dc_cols[None, :] + (rows + W - 1)[:, None] * D, grad.to(dc_cols.dtype.element_ty), mask=m_c)


@triton.jit
def _conv_bwd_kernel(x, weight, cache, cu_seqlens, dy0, dy1, dy2, dx, dcache, dw_part, T, x_stride_b, x_stride_t, N,
                     STEPS, D0, D1, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                     STEP: tl.constexpr, SEGMENTS: tl.constexpr, HAS_CACHE: tl.constexpr, IS_VARLEN: tl.constexpr,
                     ACTIVATION: tl.constexpr, WANT_DCACHE: tl.constexpr):
    """The backward of ROWS rows of one sequence (its i_s-th such block) and a tile of BD channels: the
    rows walked in order, STEP rows' x and dy loaded at a time, then the W - 1 rows after the block (whose dz
    the block's last rows' dx needs; their dz is not this program's share of dweight)."""
    i_d, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d, m_d, dy_cols, dy_stride = _output_tile(i_d, i_b, T, D0, D1, dy0, dy1, dy2, D, BD, SEGMENTS)
    x_seq, c_seq = x + i_b * x_stride_b, cache + i_b * (W - 1) * D
    dx_cols, dc_cols = dx + i_b * T * D + o_d, dcache + i_b * (W - 1) * D + o_d
    r0 = i_s * ROWS
    taps, history, lowest, i_n, start, after = _walk_start(x_seq, x_stride_t, c_seq, weight, cu_seqlens, r0, T, N,
                                                           STEPS, o_d, m_d, D, W, HAS_CACHE, IS_VARLEN)
    zero = tl.zeros([1, BD], dtype=tl.float32)
    pending = ()
    for _ in tl.static_range(1, W):
        pending = pending + (zero,)
    dw = ()
    for _ in tl.static_range(W):
        dw = dw + (zero,)
    end = r0 + tl.cdiv(tl.minimum(ROWS, T - r0), STEP) * STEP  # past T only in a sequence's last block
    for t0 in range(r0, end, STEP):
        inputs = ()  # the step's loads first, all in flight before its rows' arithmetic
        grads = ()
        for i in tl.static_range(STEP):
            rows = t0 + i + tl.arange(0, 1)
            inputs = inputs + (_load_input(x_seq, x_stride_t, c_seq, rows, lowest, T, o_d, m_d, D, W, HAS_CACHE),)
            grads = grads + (_output_grad(dy_cols, dy_stride, rows, T, m_d),)
        for i in tl.static_range(STEP):
            t = t0 + i
            if IS_VARLEN:
                i_n, start, after = _advance_document(cu_seqlens, t, i_n, start, after, N)
            history, pending, dw, done = _walk_row(inputs[i], grads[i], t, start, history, pending, dw, taps, W,
                                                   True, IS_VARLEN, ACTIVATION)
            _store_walked_grad(dx_cols, dc_cols, done, t - (W - 1), r0, T, m_d, D, W, WANT_DCACHE, i_s == 0)
    for k in tl.static_range(W - 1):
        t = end + k
        rows = t + tl.arange(0, 1)
        if IS_VARLEN:
            i_n, start, after = _advance_document(cu_seqlens, t, i_n, start, after, N)
        history, pending, dw, done = _walk_row(
            _load_input(x_seq, x_stride_t, c_seq, rows, lowest, T, o_d, m_d, D, W, HAS_CACHE),
            _output_grad(dy_cols, dy_stride, rows, T, m_d), t, start, history, pending, dw, taps, W, False, IS_VARLEN,
            ACTIVATION)
        _store_walked_grad(dx_cols, dc_cols, done, t - (W - 1), r0, T, m_d, D, W, WANT_DCACHE, i_s == 0)
    # the block's share of dweight in its slot of dw_part [slots, W, D]: each tap's channels contiguous, one vector
    # store per tap under the loads' channel mask (W-strided, each channel's store kept its own mask through the
    # walk, which ptxas spilled at 512 channels on sm_90)
    p_dw = dw_part + (i_b * tl.num_programs(1) + i_s) * W * D + o_d[None, :]
    for j in tl.static_range(W):
        tl.store(p_dw + j * D, dw[j], mask=m_d[None, :])


@triton.jit
def _conv_step_kernel(x, weight, cache, y, new_cache, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
                      ACTIVATION: tl.constexpr):
    """One token per sequence: y from the W - 1 cached inputs and x; the cache shifted by one, x appended."""
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    z = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        b_c = tl.load(cache + (i_b * (W - 1) + j) * D + o_d, mask=m_d, other=0.0).to(new_cache.dtype.element_ty)
        z += tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32) * b_c.to(tl.float32)
        if j > 0:
            tl.store(new_cache + (i_b * (W - 1) + j - 1) * D + o_d, b_c, mask=m_d)
    b_x = tl.load(x + i_b * D + o_d, mask=m_d, other=0.0)
    z += tl.load(weight + o_d * W + W - 1, mask=m_d, other=0.0).to(tl.float32) * b_x.to(tl.float32)
    if W > 1:
        tl.store(new_cache + (i_b * (W - 1) + W - 2) * D + o_d, b_x, mask=m_d)
    if ACTIVATION:
        z = z * tl.sigmoid(z)
    tl.store(y + i_b * D + o_d, z.to(y.dtype.element_ty), mask=m_d)


def _varlen_args(cu_seqlens: Optional[torch.Tensor]) -> Tuple[int, int]:
    """(N documents, binary-search steps), from the offsets' shape alone (no host synchronisation)."""
    if cu_seqlens is None:
        return 0, 0
    N = cu_seqlens.numel() - 1
    return N, N.bit_length()


def _segments(outs: List[torch.Tensor]) -> Tuple[int, int, int, List[torch.Tensor]]:
    """The kernels' (SEGMENTS, D0, D1, out0, out1, out2) for one output [B, T, D], or two or three side by side
    (of two, the third is empty: D - D0 - D1 = 0)."""
    if len(outs) == 1:
        return 1, outs[0].shape[2], 0, outs * 3
    return 3, outs[0].shape[2], outs[1].shape[2], outs + outs[-1:] * (3 - len(outs))


@kernel_op("causal_conv1d_fwd")
def conv_fwd(x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             activation: bool, sizes: List[int], launch: str) -> List[torch.Tensor]:
    """The outputs, x's channels split into `sizes` (each its own tensor [B, T, size])."""
    B, T, D = x.shape
    W = weight.shape[1]
    ys = [x.new_empty(B, T, size) for size in sizes]
    if B * T * D:
        settings = ShortConvLaunch.from_json(launch)
        N, steps = _varlen_args(cu_seqlens)
        segments, D0, D1, outs = _segments(ys)
        BD = settings.channels
        # without a cache the kernel is given x as its (never read) cache pointer
        _conv_fwd_kernel[(sum(cdiv(size, BD) for size in sizes), cdiv(T, settings.rows), B)](
            x, weight, x if cache is None else cache, cu_seqlens, *outs, T, x.stride(0), x.stride(1), N, steps, D0, D1,
            D, W, BD, settings.rows, settings.rows_per_load, segments, HAS_CACHE=cache is not None,
            IS_VARLEN=cu_seqlens is not None, ACTIVATION=activation, num_warps=settings.warps,
        )
    return ys


@kernel_op("causal_conv1d_bwd")
def conv_bwd(x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             dys: List[torch.Tensor], activation: bool, want_dcache: bool,
             launch: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dcache; dcache is empty unless want_dcache) from the gradients of conv_fwd's outputs."""
    B, T, D = x.shape
    W = weight.shape[1]
    dx = x.new_empty(B, T, D)
    want_dcache = want_dcache and cache is not None
    # zeros where no input reaches the cache's slots (T = 0); no launch writes an empty one (W = 1)
    if want_dcache:
        dcache = cache.new_zeros(cache.shape) if T == 0 else cache.new_empty(cache.shape)
    else:
        dcache = x.new_empty(0)
    if T == 0:
        return dx, weight.new_zeros(weight.shape), dcache
    settings = ShortConvLaunch.from_json(launch)
    N, steps = _varlen_args(cu_seqlens)
    segments, D0, D1, dy = _segments(dys)
    BD = settings.channels
    blocks = cdiv(T, settings.rows)
    dw_part = x.new_empty(B * blocks, W, D, dtype=torch.float32)  # each program's share of dweight, transposed
    # without a cache the kernel is given x as its (never read) cache pointer
    _conv_bwd_kernel[(sum(cdiv(g.shape[2], BD) for g in dys), blocks, B)](
        x, weight, x if cache is None else cache, cu_seqlens, *dy, dx, dcache, dw_part, T, x.stride(0), x.stride(1), N,
        steps, D0, D1, D, W, BD, settings.rows, settings.rows_per_load, segments, HAS_CACHE=cache is not None,
        IS_VARLEN=cu_seqlens is not None, ACTIVATION=activation, WANT_DCACHE=want_dcache and W > 1,
        num_warps=settings.warps,
    )
    return dx, dw_part.sum(0).t().contiguous().to(weight.dtype), dcache


@kernel_op("causal_conv1d_step")
def conv_step(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, activation: bool,
              launch: str) -> Tuple[torch.Tensor, torch.Tensor]:
    B, D = x.shape
    W = weight.shape[1]
    y, new_cache = x.new_empty(B, D), x.new_empty(B, W - 1, D)
    if y.numel():
        settings = ShortConvLaunch.from_json(launch)
        BD = settings.step_channels
        _conv_step_kernel[(cdiv(D, BD), B)](x, weight, cache, y, new_cache, D, W, BD, ACTIVATION=activation,
                                            num_warps=settings.warps)
    return y, new_cache


@conv_fwd.register_fake
def _(x, weight, cache, cu_seqlens, activation, sizes, launch):
    return [x.new_empty(x.shape[0], x.shape[1], size) for size in sizes]


@conv_bwd.register_fake
def _(x, weight, cache, cu_seqlens, dys, activation, want_dcache, launch):
    want_dcache = want_dcache and cache is not None
    dcache = cache.new_empty(cache.shape) if want_dcache else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), dcache


@conv_step.register_fake
def _(x, weight, cache, activation, launch):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], weight.shape[1] - 1, x.shape[1])


class _CausalConv1dFunction(torch.autograd.Function):
    """The convolution of x's channels, split into outputs of `sizes` channels each (one output: [D])."""

    @staticmethod
    def forward(ctx, x, weight, cache, cu_seqlens, activation, sizes, launch):
        ctx.save_for_backward(x, weight, cache, cu_seqlens)
        ctx.activation, ctx.sizes, ctx.launch = activation, sizes, launch
        return tuple(conv_fwd(x, weight, cache, cu_seqlens, activation, sizes, launch))

    @staticmethod
    def backward(ctx, *dys):
        refuse_second_derivative("causal_conv1d")
        x, weight, cache, cu_seqlens = ctx.saved_tensors
        want_dcache = cache is not None and ctx.needs_input_grad[2]
        B, T, _ = x.shape
        dys = [x.new_zeros(B, T, size) if dy is None else dy.contiguous() for dy, size in zip(dys, ctx.sizes)]
        dx, dweight, dcache = conv_bwd(x, weight, cache, cu_seqlens, dys, ctx.activation, want_dcache, ctx.launch)
        return dx, dweight, dcache if want_dcache else None, None, None, None, None


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] with its channels contiguous; the rows may be strided (a view of projections side by side)."""
    return x if x.stride(2) == 1 or x.shape[2] <= 1 else x.contiguous()


def causal_conv1d_step_triton(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, activation: bool = True,
                              launch: Optional[ShortConvLaunch] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: x [B, D] (one token), weight [D, W], cache [B, W - 1, D] -> (y [B, D] in x's dtype,
    the new cache [B, W - 1, D] in x's dtype: the cache's last W - 2 inputs, then x). Not differentiable."""
    return conv_step(x.contiguous(), weight.contiguous(), cache.contiguous(), activation, launch_json(launch, SHIPPED))


def causal_conv1d_split_triton(
    x: torch.Tensor, weight: torch.Tensor, sizes: Sequence[int], cache: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, activation: bool = True, launch: Optional[ShortConvLaunch] = None,
) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """short_conv.causal_conv1d_split on the kernels (one to three outputs, the shapes checked by the caller): one
    launch each way for all the outputs. A single token continuing a cache with no gradient wanted takes the
    decoding step (one launch for y and the new cache)."""
    B, T, D = x.shape
    W = weight.shape[1]
    weight = weight.contiguous()
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (cache is not None and cache.requires_grad)
    )
    if T == 1 and cache is not None and W > 1 and not wants_grad:
        y, new_cache = causal_conv1d_step_triton(x[:, 0], weight, cache, activation, launch)
        return list(y.unsqueeze(1).split(list(sizes), dim=2)), new_cache
    x = _rows_contiguous(x)
    if cache is not None:
        cache = cache.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    ys = _CausalConv1dFunction.apply(x, weight, cache, cu_seqlens, activation, list(sizes), launch_json(launch, SHIPPED))
    # the last W - 1 inputs, outside the Function: autograd differentiates the slice itself
    if cache is None and T >= W - 1:
        new_cache = x[:, T - (W - 1):]
    else:
        history = cache.to(x.dtype) if cache is not None else x.new_zeros(B, W - 1, D)
        new_cache = torch.cat([history, x], dim=1)[:, T:]
    return list(ys), new_cache
