"""The Triton kernels behind short_conv.py's causal_conv1d, their torch.library ops and autograd Function.

    z[t, d] = sum_{j < W} weight[d, j] * x[t - (W - 1) + j, d],   y = silu(z)   (or z without the activation)

Four kernels; the backward pass keeps nothing but x (and the cache), neither z nor y:
* forward: one program per (tile of BD channels, tile of BT rows, sequence) sums the W shifted tiles of x.
* backward, two kernels:
  - dz: one program per (channel tile, block of TILES row tiles, sequence) recomputes z from x, writes
    dz = dy silu'(z) in fp32 and sums its share of dweight. Each program's share goes to its own slot of an
    fp32 buffer that the host sums (a fixed order: the same gradient every run, which atomics would not give).
  - dx: one program per (channel tile, row tile, sequence), dx[s] = sum_j weight[d, j] dz[s + W - 1 - j] from
    W shifted loads of dz. Writing dz and reading it back costs its bytes, but each row's dz is computed once;
    recomputing dz at the W shifted row sets, or moving it up within a tile (tl.gather), timed slower on an
    H100 (benchmarks/short_conv.py). dz stays fp32: in bf16 it would halve those bytes but double dx's error,
    past that of fla's kernel.
  The gradient of a given cache is written by the first row tile of each sequence, only when the cache needs
  one (the training path passes no cache: the model takes one only when decoding).
* decoding step: one token per sequence from the cache, which it also shifts (one launch per token).

Varlen (`cu_seqlens`, B = 1): a program finds each row's document by binary search over the offsets (no
host synchronisation, no per-token index tensor); a tap that would read before the document's first row
reads zero, and a row's dz never reaches dx across a document end.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.custom_op import kernel_op, refuse_second_derivative
from fabric_lin.ops.launch import cdiv, launch_json, next_power_of_2
from fabric_lin.ops.fused_launch import SHIPPED_SHORT_CONV as SHIPPED, ShortConvLaunch


@triton.jit
def _document_bounds(cu_seqlens, rows, N, STEPS):
    """(start, end) of the document holding each row: the largest i with cu_seqlens[i] <= row, by binary
    search over the N + 1 offsets in STEPS = bit_length(N) halvings. An empty document shares its offset
    with the next one; the search lands on the last of equal offsets, the document that holds the row."""
    lo = tl.zeros_like(rows)
    hi = lo + N
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        inside = tl.load(cu_seqlens + mid).to(tl.int32) <= rows
        lo = tl.where(inside, mid, lo)
        hi = tl.where(inside, hi, mid - 1)
    start = tl.load(cu_seqlens + lo).to(tl.int32)
    end = tl.load(cu_seqlens + tl.minimum(lo + 1, N)).to(tl.int32)
    return start, end


@triton.jit
def _row_bounds(cu_seqlens, rows, T, N, STEPS, W: tl.constexpr, HAS_CACHE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row a tap of each row may read, the row after its sequence's last). Rows -(W - 1)..-1 are
    the cache's slots; without a cache they read as zeros."""
    if IS_VARLEN:
        first, end = _document_bounds(cu_seqlens, rows, N, STEPS)
    else:
        end = tl.zeros_like(rows) + T
        if HAS_CACHE:
            first = tl.zeros_like(rows) - (W - 1)
        else:
            first = tl.zeros_like(rows)
    return first, end


@triton.jit
def _load_input(x_seq, x_stride_t, c_seq, rows, first, T, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
                HAS_CACHE: tl.constexpr):
    """The convolution's input at `rows` (a [BT] vector) of one sequence as fp32 [BT, BD]: x at rows in
    [0, T), the cache's slot row + W - 1 at negative rows, zero before each row's `first`."""
    readable = (rows >= first) & (rows < T)
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
def _preactivation(x_seq, x_stride_t, c_seq, weight, rows, first, T, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
                   BT: tl.constexpr, BD: tl.constexpr, HAS_CACHE: tl.constexpr):
    """z at `rows`, fp32 [BT, BD]: tap j reads row - (W - 1 - j)."""
    z = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        b_w = tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        z += b_w[None, :] * _load_input(x_seq, x_stride_t, c_seq, rows - (W - 1 - j), first, T, o_d, m_d, D, W,
                                        HAS_CACHE)
    return z


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
def _preactivation_grad(x_seq, x_stride_t, c_seq, weight, dy_cols, dy_stride, rows, first, end, T, o_d, m_d,
                        D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_CACHE: tl.constexpr,
                        ACTIVATION: tl.constexpr):
    """dz at `rows` (zero outside [0, end)), z recomputed from the input; dy_cols: the tile's columns of the
    sequence's dy (row stride dy_stride)."""
    m = ((rows >= 0) & (rows < end) & (rows < T))[:, None] & m_d[None, :]
    b_dy = tl.load(dy_cols[None, :] + rows.to(tl.int64)[:, None] * dy_stride, mask=m, other=0.0).to(tl.float32)
    if ACTIVATION:
        z = _preactivation(x_seq, x_stride_t, c_seq, weight, rows, first, T, o_d, m_d, D, W, BT, BD, HAS_CACHE)
        sig = tl.sigmoid(z)
        b_dy = b_dy * sig * (1.0 + z * (1.0 - sig))
    return b_dy


@triton.jit
def _conv_fwd_kernel(x, weight, cache, cu_seqlens, y0, y1, y2, T, x_stride_b, x_stride_t, N, STEPS, D0, D1,
                     D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SEGMENTS: tl.constexpr,
                     HAS_CACHE: tl.constexpr, IS_VARLEN: tl.constexpr, ACTIVATION: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d, m_d, y_cols, y_stride = _output_tile(i_d, i_b, T, D0, D1, y0, y1, y2, D, BD, SEGMENTS)
    rows = i_t * BT + tl.arange(0, BT)
    first, _ = _row_bounds(cu_seqlens, rows, T, N, STEPS, W, HAS_CACHE, IS_VARLEN)
    x_seq, c_seq = x + i_b * x_stride_b, cache + i_b * (W - 1) * D
    z = _preactivation(x_seq, x_stride_t, c_seq, weight, rows, first, T, o_d, m_d, D, W, BT, BD, HAS_CACHE)
    if ACTIVATION:
        z = z * tl.sigmoid(z)
    p_y = y_cols[None, :] + rows.to(tl.int64)[:, None] * y_stride
    tl.store(p_y, z.to(y0.dtype.element_ty), mask=(rows < T)[:, None] & m_d[None, :])


@triton.jit
def _conv_dz_kernel(x, weight, cache, cu_seqlens, dy0, dy1, dy2, dz, dw_part, T, x_stride_b, x_stride_t, N, STEPS,
                    TILES, D0, D1, D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, SEGMENTS: tl.constexpr, HAS_CACHE: tl.constexpr, IS_VARLEN: tl.constexpr,
                    ACTIVATION: tl.constexpr):
    """The backward's first kernel: dz for TILES tiles of BT rows, written to dz [B, T, D] in fp32, and this
    block's share of dweight ([D, W] at slot (sequence, block) of dw_part)."""
    i_d, i_blk, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d, m_d, dy_cols, dy_stride = _output_tile(i_d, i_b, T, D0, D1, dy0, dy1, dy2, D, BD, SEGMENTS)
    o_w = tl.arange(0, BW)
    x_seq, c_seq = x + i_b * x_stride_b, cache + i_b * (W - 1) * D
    dz_seq = dz + i_b * T * D
    b_dw = tl.zeros([BW, BD], dtype=tl.float32)
    for i_s in range(TILES):
        rows = (i_blk * TILES + i_s) * BT + tl.arange(0, BT)
        first, end = _row_bounds(cu_seqlens, rows, T, N, STEPS, W, HAS_CACHE, IS_VARLEN)
        b_dz = _preactivation_grad(x_seq, x_stride_t, c_seq, weight, dy_cols, dy_stride, rows, first, end, T, o_d,
                                   m_d, D, W, BT, BD, HAS_CACHE, ACTIVATION)
        for j in tl.static_range(W):
            b_in = _load_input(x_seq, x_stride_t, c_seq, rows - (W - 1 - j), first, T, o_d, m_d, D, W, HAS_CACHE)
            b_dw += tl.where(o_w[:, None] == j, tl.sum(b_dz * b_in, 0)[None, :], 0.0)
        p_dz = dz_seq + rows.to(tl.int64)[:, None] * D + o_d[None, :]
        tl.store(p_dz, b_dz, mask=(rows < T)[:, None] & m_d[None, :])
    p_dw = dw_part + (i_b * tl.num_programs(1) + i_blk) * D * W + o_d[None, :] * W + o_w[:, None]
    tl.store(p_dw, b_dw, mask=(o_w < W)[:, None] & m_d[None, :])


@triton.jit
def _input_grad(dz_seq, weight, rows, end, T, o_d, m_d, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr):
    """The input's gradient at `rows` from the written dz: the input at row s reaches z[s + back] through tap
    W - 1 - back; dz is read only below each row's `end`, so no gradient crosses a document end (rows below 0
    are the cache's slots)."""
    grad = tl.zeros([BT, BD], dtype=tl.float32)
    for back in tl.static_range(W):
        later = rows + back
        m = ((later >= 0) & (later < end) & (later < T))[:, None] & m_d[None, :]
        b_dz = tl.load(dz_seq + later.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0)
        b_w = tl.load(weight + o_d * W + (W - 1 - back), mask=m_d, other=0.0).to(tl.float32)
        grad += b_w[None, :] * b_dz
    return grad


@triton.jit
def _conv_dx_kernel(dz, weight, cu_seqlens, dx, dcache, T, N, STEPS, D: tl.constexpr, W: tl.constexpr,
                    BC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, WANT_DCACHE: tl.constexpr,
                    IS_VARLEN: tl.constexpr):
    """The backward's second kernel: dx on a tile of BT rows from W shifted loads of dz; the cache's gradient
    from a sequence's first tile."""
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    dz_seq, dx_seq = dz + i_b * T * D, dx + i_b * T * D
    rows = i_t * BT + tl.arange(0, BT)
    _, end = _row_bounds(cu_seqlens, rows, T, N, STEPS, W, False, IS_VARLEN)
    b_dx = _input_grad(dz_seq, weight, rows, end, T, o_d, m_d, D, W, BT, BD)
    p_dx = dx_seq + rows.to(tl.int64)[:, None] * D + o_d[None, :]
    tl.store(p_dx, b_dx.to(dx.dtype.element_ty), mask=(rows < T)[:, None] & m_d[None, :])
    if WANT_DCACHE:
        if i_t == 0:
            slots = tl.arange(0, BC)
            b_dc = _input_grad(dz_seq, weight, slots - (W - 1), tl.zeros_like(slots) + T, T, o_d, m_d, D, W, BC, BD)
            p_dc = dcache + i_b * (W - 1) * D + slots[:, None] * D + o_d[None, :]
            tl.store(p_dc, b_dc.to(dcache.dtype.element_ty), mask=(slots < W - 1)[:, None] & m_d[None, :])


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
        BD, BT = settings.fwd_channels, settings.fwd_rows
        N, steps = _varlen_args(cu_seqlens)
        segments, D0, D1, outs = _segments(ys)
        # without a cache the kernel is given x as its (never read) cache pointer
        _conv_fwd_kernel[(sum(cdiv(size, BD) for size in sizes), cdiv(T, BT), B)](
            x, weight, x if cache is None else cache, cu_seqlens, *outs, T, x.stride(0), x.stride(1), N, steps, D0, D1,
            D, W, BT, BD, segments, HAS_CACHE=cache is not None, IS_VARLEN=cu_seqlens is not None,
            ACTIVATION=activation, num_warps=settings.warps,
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
    BD, BT = settings.bwd_channels, settings.bwd_rows
    tiles = min(settings.bwd_row_tiles, cdiv(T, BT))
    blocks = cdiv(T, BT * tiles)
    dw_part = x.new_empty(B * blocks, D, W, dtype=torch.float32)
    N, steps = _varlen_args(cu_seqlens)
    BW, BC = next_power_of_2(W), max(2, next_power_of_2(W - 1))
    segments, D0, D1, dy = _segments(dys)
    dz = x.new_empty(B, T, D, dtype=torch.float32)
    # without a cache the kernel is given x as its (never read) cache pointer
    _conv_dz_kernel[(sum(cdiv(g.shape[2], BD) for g in dys), blocks, B)](
        x, weight, x if cache is None else cache, cu_seqlens, *dy, dz, dw_part, T, x.stride(0), x.stride(1), N, steps,
        tiles, D0, D1, D, W, BW, BT, BD, segments, HAS_CACHE=cache is not None, IS_VARLEN=cu_seqlens is not None,
        ACTIVATION=activation, num_warps=settings.warps,
    )
    _conv_dx_kernel[(cdiv(D, BD), cdiv(T, BT), B)](
        dz, weight, cu_seqlens, dx, dcache, T, N, steps, D, W, BC, BT, BD, WANT_DCACHE=want_dcache and W > 1,
        IS_VARLEN=cu_seqlens is not None, num_warps=settings.warps,
    )
    return dx, dw_part.sum(0).to(weight.dtype), dcache


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
