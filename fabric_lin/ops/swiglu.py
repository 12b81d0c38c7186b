"""SwiGLU activation, silu(gate) * up, as one elementwise Triton kernel forward and one backward.

The backward recomputes silu from the saved inputs, so nothing but gate and up is kept.
`backend="auto"` runs Triton on CUDA and `swiglu_ref` elsewhere; "triton" / "torch" force one.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@triton.jit
def _swiglu_fwd_kernel(gate, up, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(gate + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y + offs, (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(gate, up, dy, dgate, dup, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(gate + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + offs, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(dup + offs, (d * g * sig).to(dup.dtype.element_ty), mask=m)
    tl.store(dgate + offs, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dgate.dtype.element_ty), mask=m)


@torch.library.custom_op("fabric_lin::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=4)
    return y


@_swiglu_fwd_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("fabric_lin::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dy, dgate, dup, n, BLOCK=BLOCK, num_warps=4)
    return dgate, dup


@_swiglu_bwd_op.register_fake
def _(gate, up, dy):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_bwd_op(gate, up, dy.contiguous())


torch.library.register_autograd("fabric_lin::swiglu_fwd", _backward, setup_context=_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up of one shape and dtype."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'torch'), got {backend!r}")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    if backend == "torch" or (backend == "auto" and not gate.is_cuda):
        return swiglu_ref(gate, up)
    return _swiglu_fwd_op(gate.contiguous(), up.contiguous())
