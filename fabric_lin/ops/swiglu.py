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


# SwiGLU followed by the down projection, with the activation recomputed in the backward pass: an MLP
# then keeps gate, up and the weight for its backward, not also the [tokens, intermediate] activation
# that a separate linear layer would save (a third of an MLP's saved activations).
@torch.library.custom_op("fabric_lin::swiglu_linear_fwd", mutates_args=())
def _swiglu_linear_fwd_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.matmul(_swiglu_fwd_op(gate, up), weight.t())


@_swiglu_linear_fwd_op.register_fake
def _(gate, up, weight):
    return gate.new_empty(*gate.shape[:-1], weight.shape[0])


def _swiglu_linear_backward(ctx, d_out):
    gate, up, weight = ctx.saved_tensors
    d_out = d_out.contiguous()
    y = _swiglu_fwd_op(gate, up)  # recomputed: one elementwise pass instead of keeping it
    d_weight = torch.matmul(d_out.reshape(-1, d_out.shape[-1]).t(), y.reshape(-1, y.shape[-1]))
    d_gate, d_up = _swiglu_bwd_op(gate, up, torch.matmul(d_out, weight).contiguous())
    return d_gate, d_up, d_weight


torch.library.register_autograd("fabric_lin::swiglu_linear_fwd", _swiglu_linear_backward, setup_context=_setup)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """(silu(gate) * up) @ weight^T, keeping only gate, up and weight for the backward pass. The weight is
    cast to gate's dtype first (what autocast does for a linear layer under bf16-mixed)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'torch'), got {backend!r}")
    if gate.shape != up.shape or gate.dtype != up.dtype or weight.shape[-1] != gate.shape[-1]:
        raise ValueError(
            f"swiglu_linear: gate and up must match and weight be [out, {gate.shape[-1]}], got gate "
            f"{tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}, weight {tuple(weight.shape)}"
        )
    if backend == "torch" or (backend == "auto" and not gate.is_cuda):
        return F.linear(swiglu_ref(gate, up), weight.to(gate.dtype))
    return _swiglu_linear_fwd_op(gate.contiguous(), up.contiguous(), weight.to(gate.dtype))
