"""Fused RMSNorm kernels: RMSNorm with the residual add folded in, and per-head RMSNorm x swish(gate).

    rms_norm(x, weight, eps, residual=None)  ->  y                       (residual None)
                                             ->  (y, x + residual)      (pre-norm block: the new residual stream)
    rms_norm_gated(x, gate, weight, eps)     ->  rmsnorm(x) * weight * silu(gate)   over the last dim
    rms_norm_gated_linear, rms_norm_linears  ->  the same followed by projections, the normed activation
                                                 recomputed in the backward pass rather than kept

The PyTorch references (`*_ref`) are here; the Triton kernels, in norm_triton.py, normalise each row in fp32
in one program, and their backward recomputes from the saved input and 1/rms. `backend` picks one by the
rule of fabric_lin/ops/backend.py (norm_triton.py is imported only when the kernels run: Triton does not
import on every platform); `launch` (a NormLaunch, by default the shipped settings: fabric_lin/ops/fused_launch.py) says how the kernels are launched.
"""
import itertools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from fabric_lin.ops.backend import resolve_backend
from fabric_lin.ops.fp8_matmul import matmul_nt, matmuls_nt
from fabric_lin.ops.fused_launch import NormLaunch




def rms_norm_ref(x, weight, eps=1e-6, residual=None):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


def rms_norm_gated_ref(x, gate, weight, eps=1e-5):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * F.silu(gate.float())
    return y.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
    backend: str = "auto", launch: Optional[NormLaunch] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm over the last dim. With `residual`, normalises h = x + residual and returns (y, h)."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if resolve_backend(backend, x.device) == "torch":
        return rms_norm_ref(x, weight, eps, residual)
    from fabric_lin.ops.norm_triton import rms_norm_triton

    return rms_norm_triton(x, weight, eps, residual, launch)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, backend: str = "auto",
    launch: Optional[NormLaunch] = None,
) -> torch.Tensor:
    """rmsnorm(x) * weight * silu(gate) over the last dim (GLA's per-head output norm and output gate)."""
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if resolve_backend(backend, x.device) == "torch":
        return rms_norm_gated_ref(x, gate, weight, eps)
    from fabric_lin.ops.norm_triton import rms_norm_gated_triton

    return rms_norm_gated_triton(x, gate, weight, eps, launch)


def rms_norm_gated_linear(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, proj_weight: torch.Tensor,
    backend: str = "auto", launch: Optional[NormLaunch] = None, fp8: bool = False,
) -> torch.Tensor:
    """rms_norm_gated(x, gate, weight) on [..., heads, head_dim], heads flattened, times proj_weight^T;
    keeps x, gate and the weights for the backward pass, not the normed activation. proj_weight is cast
    to x's dtype first (what autocast does for a linear layer under bf16-mixed). fp8: the product and the
    activation's gradient in FP8 (fabric_lin/ops/fp8_matmul.py)."""
    if proj_weight.shape[-1] != x.shape[-2] * x.shape[-1]:
        raise ValueError(
            f"rms_norm_gated_linear: proj_weight must be [out, {x.shape[-2] * x.shape[-1]}] (heads x head_dim of x "
            f"{tuple(x.shape)}), got {tuple(proj_weight.shape)}"
        )
    if gate.shape != x.shape or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm_gated_linear: gate must have the shape of x {tuple(x.shape)} and weight ({x.shape[-1]},), "
            f"got {tuple(gate.shape)} and {tuple(weight.shape)}"
        )
    if resolve_backend(backend, x.device) == "torch":
        y = rms_norm_gated_ref(x, gate, weight, eps)
        return matmul_nt(y.reshape(*x.shape[:-2], -1), proj_weight.to(y.dtype), fp8)
    from fabric_lin.ops.norm_triton import rms_norm_gated_linear_triton

    return rms_norm_gated_linear_triton(x, gate, weight, eps, proj_weight, launch, fp8)


def rms_norm_linears(
    x: torch.Tensor, weight: torch.Tensor, eps: float, proj_weights: Sequence[torch.Tensor],
    residual: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None, backend: str = "auto",
    side_by_side: bool = False, launch: Optional[NormLaunch] = None, fp8: bool = False,
    groups: Optional[Sequence[int]] = None,
) -> Union[List[torch.Tensor], Tuple[List[torch.Tensor], torch.Tensor], torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """[rms_norm(x) @ w.T for w in proj_weights] (a pre-norm block's input projections); with `residual`,
    h = x + residual is normalised and (projections, h) returned. The projections run in `dtype`
    (default x's; under bf16-mixed the autocast dtype, as a linear layer would), the weights cast to it
    (and stacked: one saved copy). Keeps x (or h) and 1/rms for the backward pass, not the normed
    activation. side_by_side: one output, the projections concatenated on the last dim (one product each
    way). groups: how many consecutive projections each output holds side by side (one product each; q, k
    and v for one short convolution), by default one each; in the backward pass each output's gradient
    takes products of its own (the narrowest, a few columns, are added to the input gradient by the norm
    kernel). fp8: the products and the activation's gradient in FP8 (fabric_lin/ops/fp8_matmul.py)."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm_linears: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm_linears: residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    bad = [tuple(w.shape) for w in proj_weights if w.dim() != 2 or w.shape[1] != x.shape[-1]]
    if not proj_weights or bad:
        raise ValueError(f"rms_norm_linears: expected projection weights [out, {x.shape[-1]}], got {bad or 'none'}")
    if groups is not None and (sum(groups) != len(proj_weights) or min(groups) < 1):
        raise ValueError(f"rms_norm_linears: groups must be positive and add up to the {len(proj_weights)} "
                         f"projections, got {list(groups)}")
    dtype = dtype or x.dtype
    if resolve_backend(backend, x.device) == "torch":
        normed = rms_norm_ref(x, weight, eps, residual)
        y, h = normed if residual is not None else (normed, None)
        outs = matmuls_nt(y.to(dtype), [w.to(dtype) for w in proj_weights], fp8)
        if side_by_side:
            outs = torch.cat(outs, dim=-1)
        elif groups is not None:
            ends = list(itertools.accumulate(groups))
            outs = [torch.cat(outs[end - n : end], dim=-1) for n, end in zip(groups, ends)]
        return (outs, h) if residual is not None else outs
    from fabric_lin.ops.norm_triton import rms_norm_linears_triton

    outs, h = rms_norm_linears_triton(x, weight, eps, proj_weights, residual, dtype, side_by_side, launch, fp8, groups)
    return (outs, h) if residual is not None else outs
