"""The q/k L2 norm of the gated delta rule's Triton path (l2norm.py's formula, fla's eps inside the square root):
    y = x * r,  r = 1 / sqrt(sum(x^2) + eps);      dx = r (dy - y sum(dy * y))
over the last dim, one block of whole rows per program. The forward pass keeps y (x's dtype) and r (fp32) for
the backward one."""
import torch
import triton
import triton.language as tl

from fabric_lin.ops.launch import KernelLaunch, cdiv, next_power_of_2

EPS = 1e-6


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, n_rows, eps, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    b_x = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + offs, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, b_r, mask=rows < n_rows)


@triton.jit
def _l2norm_bwd_kernel(y, rstd, dy, dx, n_rows, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    b_y = tl.load(y + offs, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32)
    b_r = tl.load(rstd + rows, mask=rows < n_rows, other=0.0)
    b_dx = (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None]) * b_r[:, None]
    tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)


def l2norm_fwd(x: torch.Tensor, launch: KernelLaunch):
    """(y = x / sqrt(sum(x^2) + eps) in x's dtype, r = 1 / sqrt(...) fp32 of shape x.shape[:-1]); x contiguous."""
    D = x.shape[-1]
    n_rows = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    BR = launch.BK
    _l2norm_fwd_kernel[(cdiv(n_rows, BR),)](x, y, rstd, n_rows, EPS, D, BR, max(16, next_power_of_2(D)),
                                           **launch.options())
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, launch: KernelLaunch):
    """The gradient of x (in `dtype`) from y, r (l2norm_fwd's) and the gradient of y."""
    D = y.shape[-1]
    n_rows = y.numel() // D
    dx = torch.empty_like(y, dtype=dtype)
    BR = launch.BK
    _l2norm_bwd_kernel[(cdiv(n_rows, BR),)](y, rstd, dy, dx, n_rows, D, BR, max(16, next_power_of_2(D)),
                                           **launch.options())
    return dx
