"""The Triton kernels behind norm.py's ops: RMSNorm with the residual add folded in, and per-head RMSNorm x
swish(gate), forward and backward, their torch.library ops and autograd Functions, and the fused forms that
recompute the normed activation in the backward pass instead of keeping it for the projections after it."""
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.custom_op import kernel_op, refuse_second_derivative
from fabric_lin.ops.fp8_matmul import matmul_nn, matmul_nt, matmuls_nt
from fabric_lin.ops.launch import cdiv, launch_json, multiprocessors, next_power_of_2
from fabric_lin.ops.fused_launch import SHIPPED_NORM as SHIPPED, NormLaunch


def _rows(D: int, launch: NormLaunch) -> Tuple[int, int, int]:
    """(block width, rows per tile, warps) for rows of D elements."""
    BD = next_power_of_2(D)
    R = max(1, launch.tile_elements // BD)
    return BD, R, min(16, max(1, R * BD // (32 * launch.elements_per_thread)))


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _norm_fwd_kernel(x, r, g, w, y, h, rstd, n_rows, D, eps, BD: tl.constexpr, R: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr):
    """Rows [pid * R, pid * R + R)."""
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    cols = tl.arange(0, BD)
    m_row = rows < n_rows
    m = m_row[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    b_x = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        b_x += tl.load(r + offs, mask=m, other=0.0).to(tl.float32)
        b_x = b_x.to(h.dtype.element_ty).to(tl.float32)  # the residual stream is kept in the input dtype
        tl.store(h + offs, b_x.to(h.dtype.element_ty), mask=m)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    tl.store(rstd + rows, b_rstd, mask=m_row)
    b_y = b_x * b_rstd[:, None] * tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        b_g = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
        b_y = b_y * b_g * tl.sigmoid(b_g)
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def _bwd_tile(h, g, rstd, dh_extra, rows, row_end, cols, D, HAS_DH_EXTRA: tl.constexpr, HAS_GATE: tl.constexpr):
    """The backward pass's inputs at rows (those from row_end on left out): (h, gate, 1/rms, extra residual
    gradient), fp32; the ones a kernel does not have are zeros that the caller never reads."""
    m_row = rows < row_end
    m = m_row[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    b_h = tl.load(h + offs, mask=m, other=0.0).to(tl.float32)
    b_rstd = tl.load(rstd + rows, mask=m_row, other=0.0)
    b_g = tl.zeros_like(b_h)
    b_e = tl.zeros_like(b_h)
    if HAS_GATE:
        b_g = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_DH_EXTRA:
        b_e = tl.load(dh_extra + offs, mask=m, other=0.0).to(tl.float32)
    return b_h, b_g, b_rstd, b_e


@triton.jit
def _dy_tile(dys, d_narrow, w_narrow, rows, row_end, cols, D, R: tl.constexpr, BD: tl.constexpr,
             N_NARROW: tl.constexpr):
    """The normed activation's gradient at rows, fp32: the sum of the parts dys ([rows, D] each, as the products
    that made them rounded them; summed here unrounded) plus d_narrow [rows, N_NARROW] @ w_narrow [N_NARROW, D],
    the narrow projections' share, a multiply-add over the row per column (a product of its own would write and
    read a whole [rows, D] part for a few columns)."""
    m_row = rows < row_end
    m_col = cols < D
    offs = rows[:, None] * D + cols[None, :]
    b_dy = tl.zeros([R, BD], dtype=tl.float32)
    for p in tl.static_range(len(dys)):
        b_dy += tl.load(dys[p] + offs, mask=m_row[:, None] & m_col[None, :], other=0.0).to(tl.float32)
    for j in tl.static_range(N_NARROW):
        b_d = tl.load(d_narrow + rows * N_NARROW + j, mask=m_row, other=0.0).to(tl.float32)
        b_w = tl.load(w_narrow + j * D + cols, mask=m_col, other=0.0).to(tl.float32)
        b_dy += b_d[:, None] * b_w[None, :]
    return b_dy


@triton.jit
def _norm_bwd_kernel(h, g, w, rstd, dys, d_narrow, w_narrow, dh_extra, dx, dres, dg, dw_part, n_rows, D,
                     rows_per_program, BD: tl.constexpr, R: tl.constexpr, N_NARROW: tl.constexpr,
                     HAS_DH_EXTRA: tl.constexpr, HAS_GATE: tl.constexpr, HAS_DRES: tl.constexpr):
    """dx for rows [pid * rows_per_program, ...) (a multiple of R), R rows at a time, and this program's
    partial sum of dweight, dy formed as _dy_tile forms it; with HAS_DRES also dx in the residual's dtype (dres)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    m_col = cols < D
    b_w = tl.load(w + cols, mask=m_col, other=0.0).to(tl.float32)[None, :]
    b_dw = tl.zeros([R, BD], dtype=tl.float32)  # summed over its rows once, at the end
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)  # past the program's rows nothing is loaded
    for i in range(0, rows_per_program, R):
        rows = row_start + i + tl.arange(0, R)
        m = (rows < row_end)[:, None] & m_col[None, :]
        offs = rows[:, None] * D + cols[None, :]
        b_h, b_g, b_rstd, b_e = _bwd_tile(h, g, rstd, dh_extra, rows, row_end, cols, D, HAS_DH_EXTRA, HAS_GATE)
        b_dy = _dy_tile(dys, d_narrow, w_narrow, rows, row_end, cols, D, R, BD, N_NARROW)
        xhat = b_h * b_rstd[:, None]
        if HAS_GATE:
            sig = tl.sigmoid(b_g)
            tl.store(dg + offs, (b_dy * xhat * b_w * sig * (1.0 + b_g * (1.0 - sig))).to(dg.dtype.element_ty), mask=m)
            b_dy = b_dy * b_g * sig
        b_dw += b_dy * xhat
        dxhat = b_dy * b_w
        b_dx = b_rstd[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=1) / D)[:, None])
        if HAS_DH_EXTRA:
            b_dx += b_e
        tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)
        if HAS_DRES:
            tl.store(dres + offs, b_dx.to(dres.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * D + cols, tl.sum(b_dw, axis=0), mask=m_col)


# ------------------------------------------------------------------------------------ torch.library ops
# the kernel ops; the autograd Functions below call them


@kernel_op("rms_norm_fwd")
def norm_fwd(
    x: torch.Tensor, residual: Optional[torch.Tensor], gate: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
    y_dtype: Optional[torch.dtype], launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in y_dtype (None: x's), h = x + residual (an empty tensor without residual), 1/rms per row)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    n = x2.shape[0]
    weight = weight.contiguous()  # the kernels index it as dense
    y = torch.empty_like(x2, dtype=y_dtype or x.dtype)
    h = torch.empty_like(x2) if residual is not None else x2
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    settings = NormLaunch.from_json(launch)
    BD, R, warps = _rows(D, settings)
    r2 = residual.reshape(-1, D) if residual is not None else None
    g2 = gate.reshape(-1, D) if gate is not None else None
    if n > 0:
        _norm_fwd_kernel[(cdiv(n, R),)](x2, r2, g2, weight, y, h, rstd, n, D, eps, BD=BD, R=R,
                                        HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
                                        num_warps=warps)
    return y.view_as(x), (h.view_as(x) if residual is not None else x.new_empty(0)), rstd


@kernel_op("rms_norm_bwd")
def norm_bwd(
    h: torch.Tensor, gate: Optional[torch.Tensor], weight: torch.Tensor, rstd: torch.Tensor, dys: List[torch.Tensor],
    d_narrow: Optional[torch.Tensor], w_narrow: Optional[torch.Tensor], dh_extra: Optional[torch.Tensor],
    residual_dtype: Optional[torch.dtype], launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate (an empty tensor without gate), dweight, dx in residual_dtype where that is given and
    differs from h's (else an empty tensor): the residual's gradient, which autograd would otherwise cast
    from dx in a pass of its own). The output's gradient dy is sum(dys) + d_narrow @ w_narrow, formed in
    fp32 in the kernel: dys of h's shape, d_narrow [rows, n] and w_narrow [n, D] (n at most NARROW_COLUMNS,
    or both None)."""
    D = h.shape[-1]
    h2 = h.reshape(-1, D)
    n = h2.shape[0]
    weight = weight.contiguous()
    dx = torch.empty_like(h2)
    dres = torch.empty_like(h2, dtype=residual_dtype) if _casts_residual_grad(h, residual_dtype) else None
    dg = torch.empty_like(gate.reshape(-1, D)) if gate is not None else None
    settings = NormLaunch.from_json(launch)
    BD, R, warps = _rows(D, settings)
    sms = multiprocessors(h.device) if h.is_cuda else 2
    # programs that each loop over several tiles, summing their rows' part of dweight (fewer partial sums
    # than one program per tile), but enough of them that the last wave leaves little of the GPU idle
    programs = max(1, min(cdiv(n, R), settings.bwd_programs_per_sm * sms))
    rows_per_program = cdiv(cdiv(max(n, 1), programs), R) * R
    programs = cdiv(max(n, 1), rows_per_program)  # the rounding up may have left programs with no rows
    # every launched program writes its whole row; with no rows nothing is launched and the sum is zero
    dw_part = (torch.empty if n > 0 else torch.zeros)(programs, D, device=h.device, dtype=torch.float32)
    n_narrow = d_narrow.shape[-1] if d_narrow is not None else 0
    if n > 0:
        _norm_bwd_kernel[(programs,)](
            h2, gate.reshape(-1, D) if gate is not None else None, weight, rstd,
            tuple(dy.reshape(-1, D).contiguous() for dy in dys),
            d_narrow.reshape(-1, n_narrow).contiguous() if n_narrow else None,
            w_narrow.contiguous() if n_narrow else None,
            dh_extra.reshape(-1, D).contiguous() if dh_extra is not None else None, dx, dres, dg, dw_part, n, D,
            rows_per_program, BD=BD, R=R, N_NARROW=n_narrow, HAS_DH_EXTRA=dh_extra is not None,
            HAS_GATE=gate is not None, HAS_DRES=dres is not None, num_warps=warps,
        )
    dw = dw_part.sum(0).to(weight.dtype)
    return (dx.view_as(h), (dg.view_as(gate) if gate is not None else h.new_empty(0)), dw,
            dres.view_as(h) if dres is not None else h.new_empty(0))


def _casts_residual_grad(h: torch.Tensor, residual_dtype: Optional[torch.dtype]) -> bool:
    """Whether the backward writes the residual's gradient in a dtype of its own (bf16-mixed: the residual
    stream in fp32, the sublayer output added to it in bf16)."""
    return residual_dtype is not None and residual_dtype != h.dtype


@norm_fwd.register_fake
def _(x, residual, gate, weight, eps, y_dtype, launch):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return torch.empty_like(x, dtype=y_dtype or x.dtype), h, x.new_empty(rows, dtype=torch.float32)


@norm_bwd.register_fake
def _(h, gate, weight, rstd, dys, d_narrow, w_narrow, dh_extra, residual_dtype, launch):
    dres = torch.empty_like(h, dtype=residual_dtype) if _casts_residual_grad(h, residual_dtype) else h.new_empty(0)
    return (torch.empty_like(h), (torch.empty_like(gate) if gate is not None else h.new_empty(0)), torch.empty_like(weight),
            dres)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gate, weight, eps, launch):
        y, h, rstd = norm_fwd(x, residual, gate, weight, eps, None, launch)
        ctx.save_for_backward(h if residual is not None else x, gate, weight, rstd)
        ctx.residual_dtype = residual.dtype if residual is not None else None  # None: no residual
        ctx.launch = launch
        return y, h

    @staticmethod
    def backward(ctx, dy, dh_out):
        h, gate, weight, rstd = ctx.saved_tensors
        refuse_second_derivative("rms_norm" if gate is None else "rms_norm_gated")
        dh_extra = dh_out.contiguous() if ctx.residual_dtype is not None and dh_out is not None else None
        dx, dg, dw, dres = norm_bwd(h, gate, weight, rstd, [dy], None, None, dh_extra, ctx.residual_dtype, ctx.launch)
        return dx, _residual_grad(ctx, h, dx, dres), (dg if gate is not None else None), dw, None, None


def _residual_grad(ctx, h, dx, dres):
    """The residual's gradient: dx, or the copy of it in the residual's own dtype that the backward wrote."""
    if ctx.residual_dtype is None:  # no residual
        return None
    return dres if _casts_residual_grad(h, ctx.residual_dtype) else dx


NARROW_WIDTH = 16
"""An output this narrow (Gated DeltaNet's a and b, one column per head; GLA's low-rank gate) adds its share of the
input gradient inside the norm's backward kernel, not by a product of its own, which would write and read a whole
[tokens, hidden] part for a few columns."""
NARROW_COLUMNS = 32
"""At most this many such columns in all (the kernel's multiply-adds per row grow with them); the rest are wide."""
MOST_WIDE_APART = 2
"""With more wide outputs than this, their gradients are put side by side for one product each way instead. Apart,
each wide output adds an input-gradient part of [tokens, hidden] that is written and read once more; side by side,
every gradient is copied once. On an H100 (torch 2.11) the gdn-340M step, two wide outputs (q|k|v and the output
gate, 3072 columns at hidden 1024), was 1-2% faster apart; the gla-340M step, four (q, k, v, the output gate: about
as many bytes either way, and products of narrower outputs), 1.7% slower
(benchmarks/results/2026-12-07-session11-h100.md)."""


@kernel_op("columns_side_by_side")
def columns_side_by_side(pieces: List[torch.Tensor]) -> torch.Tensor:
    """torch.cat(pieces, dim=-1) of [rows, n_i] tensors of one dtype, as one opaque op. Compiled as a node of its own,
    it is a copy at the memory's speed; left to Inductor, the copy is fused with the elementwise backward of whatever
    made the pieces, into one kernel several times slower than the copy (profile_step.py on gdn-340M)."""
    return torch.cat(pieces, dim=-1)


@columns_side_by_side.register_fake
def _(pieces):
    return pieces[0].new_empty(pieces[0].shape[0], sum(piece.shape[-1] for piece in pieces))


class _Pieces(NamedTuple):
    """How rms_norm_linears' backward takes its outputs apart."""

    rows: Tuple[Tuple[int, int], ...]
    """Each output's first and end row of the stacked weight."""
    wide: Tuple[int, ...]
    """The outputs whose input gradient is a product of its own."""
    narrow: Tuple[int, ...]
    """The outputs whose share of the input gradient the norm kernel adds."""
    narrow_rows: Optional[Tuple[int, int]]
    """The narrow outputs' rows where they are one slice of the stacked weight, else None."""
    side_by_side: bool
    """Whether all gradients are put side by side instead (more than MOST_WIDE_APART wide outputs)."""


def _pieces(sizes: Sequence[int]) -> _Pieces:
    """The outputs of widths `sizes` (in the stacked weight's order), wide and narrow."""
    rows, wide, narrow, start, narrow_columns = [], [], [], 0, 0
    for i, n in enumerate(sizes):
        rows.append((start, start + n))
        start += n
        if n <= NARROW_WIDTH and narrow_columns + n <= NARROW_COLUMNS:
            narrow.append(i)
            narrow_columns += n
        else:
            wide.append(i)
    adjacent = all(rows[i][1] == rows[j][0] for i, j in zip(narrow, narrow[1:]))
    narrow_rows = (rows[narrow[0]][0], rows[narrow[-1]][1]) if narrow and adjacent else None
    return _Pieces(tuple(rows), tuple(wide), tuple(narrow), narrow_rows, len(wide) > MOST_WIDE_APART)


class _RMSNormGatedLinearFunction(torch.autograd.Function):
    """rms_norm_gated over the heads, then the output projection; the normed, gated activation is
    recomputed in the backward pass instead of being kept for the projection's weight gradient."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, proj_weight, launch, fp8):
        y, _, rstd = norm_fwd(x, None, gate, weight, eps, None, launch)
        ctx.save_for_backward(x, gate, weight, rstd, proj_weight)
        ctx.eps, ctx.launch, ctx.fp8 = eps, launch, fp8
        return matmul_nt(y.reshape(*x.shape[:-2], -1), proj_weight, fp8)

    @staticmethod
    def backward(ctx, d_out):
        refuse_second_derivative("rms_norm_gated_linear")
        x, gate, weight, rstd, proj_weight = ctx.saved_tensors
        y, _, _ = norm_fwd(x, None, gate, weight, ctx.eps, None, ctx.launch)
        d_out = d_out.contiguous()
        d_proj = torch.matmul(d_out.reshape(-1, d_out.shape[-1]).t(), y.reshape(-1, proj_weight.shape[1]))
        dy = matmul_nn(d_out, proj_weight, ctx.fp8).view_as(x)
        dx, dg, dw, _ = norm_bwd(x, gate, weight, rstd, [dy], None, None, None, None, ctx.launch)
        return dx, dg, dw, None, d_proj, None, None


class _RMSNormLinearsFunction(torch.autograd.Function):
    """RMSNorm (with the residual add folded in, when given), then projections of the normed activation
    by row blocks of one stacked weight (each output its own contiguous tensor; with sizes None, one
    product and one output, the projections side by side); the normed activation is recomputed in the
    backward pass instead of being kept for the weight gradients. The norm kernel writes the normed
    activation in the projections' dtype (under bf16-mixed: bf16 from the fp32 residual stream, no cast of
    its own) and, in the backward pass, the residual's gradient in the residual's dtype. In the backward pass
    each output's gradient takes products of its own (the narrow ones': one for all of them, and their share of
    the input gradient added by the norm kernel): no wide gradient is copied beside the others."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, stacked, sizes, launch, fp8):
        y, h, rstd = norm_fwd(x, residual, None, weight, eps, stacked.dtype, launch)
        source = h if residual is not None else x
        ctx.save_for_backward(source, weight, rstd, stacked)
        ctx.eps, ctx.launch, ctx.fp8 = eps, launch, fp8
        ctx.pieces = _pieces(sizes if sizes is not None else [stacked.shape[0]])
        ctx.residual_dtype = residual.dtype if residual is not None else None  # None: no residual
        if sizes is None:
            return h, matmul_nt(y, stacked, fp8)
        return (h, *matmuls_nt(y, stacked.split(sizes), fp8))

    @staticmethod
    def backward(ctx, dh_out, *d_outs):
        refuse_second_derivative("rms_norm_linears")
        source, weight, rstd, stacked = ctx.saved_tensors
        dh_extra = dh_out.contiguous() if ctx.residual_dtype is not None and dh_out is not None else None
        tokens, D = source.numel() // source.shape[-1], source.shape[-1]
        rows, wide, narrow, narrow_rows, side_by_side = ctx.pieces
        grads = [d.reshape(tokens, e - s) if d is not None else None for d, (s, e) in zip(d_outs, rows)]
        if side_by_side:  # taken as one wide output: one product each way, the input's summed inside it, rounded once
            grads = [columns_side_by_side([d if d is not None else stacked.new_zeros(tokens, e - s)
                                           for d, (s, e) in zip(grads, rows)])]
            rows, wide, narrow, narrow_rows = ((0, stacked.shape[0]),), (0,), (), None
        # the narrow outputs' gradients side by side (a few columns: a small copy) and their weights' rows, for one
        # weight-gradient product and the norm kernel's share of the input gradient
        d_narrow = w_narrow = None
        if any(grads[i] is not None for i in narrow):
            d_narrow = grads[narrow[0]] if len(narrow) == 1 else torch.cat([
                grads[i] if grads[i] is not None else stacked.new_zeros(tokens, rows[i][1] - rows[i][0]) for i in narrow
            ], dim=-1)
            w_narrow = (stacked[narrow_rows[0]:narrow_rows[1]] if narrow_rows is not None
                        else torch.cat([stacked[rows[i][0]:rows[i][1]] for i in narrow]))
        # the normed activation recomputed where it is needed, and the weight gradients (its last use) before the
        # input gradient: it is held only while those products run (compiled, Inductor frees a buffer after its
        # last use). Each wide output's product writes its own rows of the stacked weight's gradient: the wide
        # gradients are never put side by side
        y = norm_fwd(source, None, None, weight, ctx.eps, stacked.dtype, ctx.launch)[0].reshape(tokens, D)
        d_stacked = torch.empty_like(stacked)
        for i in wide:
            s, e = rows[i]
            if grads[i] is None:
                d_stacked[s:e].zero_()
            else:
                torch.mm(grads[i].t(), y, out=d_stacked[s:e])
        if d_narrow is None:
            for i in narrow:
                d_stacked[rows[i][0]:rows[i][1]].zero_()
        elif narrow_rows is not None:
            torch.mm(d_narrow.t(), y, out=d_stacked[narrow_rows[0]:narrow_rows[1]])
        else:
            d_rows = torch.mm(d_narrow.t(), y).split([rows[i][1] - rows[i][0] for i in narrow])
            for i, d in zip(narrow, d_rows):
                d_stacked[rows[i][0]:rows[i][1]] = d
        del y
        # the input gradient: a product for each wide output, rounded to its dtype, the parts summed in fp32 by the
        # norm kernel with the narrow share (independent parts' roundings add up to about one rounding of their
        # sum). FP8 needs no outputs side by side either: each product casts its own gradient, with its own row scales
        dys = [matmul_nn(grads[i], stacked[rows[i][0]:rows[i][1]], ctx.fp8) for i in wide if grads[i] is not None]
        dx, _, dw, dres = norm_bwd(source, None, weight, rstd, dys, d_narrow, w_narrow, dh_extra, ctx.residual_dtype,
                                   ctx.launch)
        return dx, _residual_grad(ctx, source, dx, dres), dw, None, d_stacked, None, None, None


# the entry points of norm.py's ops; launch: a NormLaunch (None: SHIPPED)


def rms_norm_triton(x, weight, eps, residual=None, launch: Optional[NormLaunch] = None):
    y, h = _RMSNormFunction.apply(x.contiguous(), residual.contiguous() if residual is not None else None, None,
                                  weight, float(eps), launch_json(launch, SHIPPED))
    return y if residual is None else (y, h)


def rms_norm_gated_triton(x, gate, weight, eps, launch: Optional[NormLaunch] = None):
    y, _ = _RMSNormFunction.apply(x.contiguous(), None, gate.contiguous(), weight, float(eps), launch_json(launch, SHIPPED))
    return y


def rms_norm_gated_linear_triton(x, gate, weight, eps, proj_weight, launch: Optional[NormLaunch] = None, fp8: bool = False):
    return _RMSNormGatedLinearFunction.apply(x.contiguous(), gate.contiguous(), weight, float(eps), proj_weight.to(x.dtype),
                                             launch_json(launch, SHIPPED), fp8)


def rms_norm_linears_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, proj_weights: Sequence[torch.Tensor],
                            residual: Optional[torch.Tensor], dtype: torch.dtype, side_by_side: bool,
                            launch: Optional[NormLaunch] = None, fp8: bool = False,
                            groups: Optional[Sequence[int]] = None):
    """(projections: a list, one per group of projections side by side (default one each), or one tensor side by
    side; h = x + residual or None)."""
    stacked = torch.cat([w.to(dtype) for w in proj_weights]) if len(proj_weights) > 1 else proj_weights[0].to(dtype)
    widths = iter(w.shape[0] for w in proj_weights)
    sizes = None if side_by_side else [sum(next(widths) for _ in range(n)) for n in groups or [1] * len(proj_weights)]
    h, *outs = _RMSNormLinearsFunction.apply(x.contiguous(), residual.contiguous() if residual is not None else None,
                                             weight, float(eps), stacked, sizes, launch_json(launch, SHIPPED), fp8)
    return (outs[0] if side_by_side else outs), (h if residual is not None else None)
