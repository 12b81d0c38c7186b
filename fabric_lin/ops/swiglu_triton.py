"""The Triton kernels behind swiglu.py's ops, their torch.library ops and autograd Functions."""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.custom_op import kernel_op, refuse_second_derivative
from fabric_lin.ops.fp8_matmul import matmul_nn, matmul_nt
from fabric_lin.ops.launch import cdiv, launch_json
from fabric_lin.ops.fused_launch import SHIPPED_SWIGLU as SHIPPED, SwiGLULaunch


# One program per (row, block of BLOCK columns, SwiGLULaunch.block). gate and up are read at row * stride_in + column: two
# tensors of rows of I (stride_in = I), or the two halves of one [rows, 2 I] tensor (stride_in = 2 I, up
# starting I elements after gate), the layout of an MLP's gate and up projections computed side by side.
@triton.jit
def _swiglu_fwd_kernel(gate, up, y, I, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gate + row * stride_in + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_in + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * I + cols, (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(gate, up, dy, dgate, dup, I, stride_in, BLOCK: tl.constexpr):
    """dgate and dup in the layout of gate and up."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gate + row * stride_in + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_in + cols, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dy + row * I + cols, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(dup + row * stride_in + cols, (d * g * sig).to(dup.dtype.element_ty), mask=m)
    tl.store(dgate + row * stride_in + cols, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dgate.dtype.element_ty), mask=m)


def _launch(kernel, rows: int, I: int, launch: str, *args):
    """kernel over `rows` rows of I columns, as `launch` (a SwiGLULaunch's JSON) says."""
    settings = SwiGLULaunch.from_json(launch)
    kernel[(rows, cdiv(I, settings.block))](*args, BLOCK=settings.block, num_warps=settings.warps)


@kernel_op("swiglu_fwd")
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, launch: str) -> torch.Tensor:
    y = torch.empty_like(gate)
    I = gate.shape[-1]
    if y.numel():
        _launch(_swiglu_fwd_kernel, y.numel() // I, I, launch, gate, up, y, I, I)
    return y


@kernel_op("swiglu_bwd")
def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, launch: str) -> Tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    I = gate.shape[-1]
    if gate.numel():
        _launch(_swiglu_bwd_kernel, gate.numel() // I, I, launch, gate, up, dy, dgate, dup, I, I)
    return dgate, dup


@swiglu_fwd.register_fake
def _(gate, up, launch):
    return torch.empty_like(gate)


@swiglu_bwd.register_fake
def _(gate, up, dy, launch):
    return torch.empty_like(gate), torch.empty_like(up)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, launch):
        ctx.save_for_backward(gate, up)
        ctx.launch = launch
        return swiglu_fwd(gate, up, launch)

    @staticmethod
    def backward(ctx, dy):
        refuse_second_derivative("swiglu")
        gate, up = ctx.saved_tensors
        return (*swiglu_bwd(gate, up, dy.contiguous(), ctx.launch), None)


def _packed_fwd(gate_up: torch.Tensor, launch: str) -> torch.Tensor:
    """silu(gate) * up of a contiguous [..., 2 I] gate_up (gate first)."""
    I = gate_up.shape[-1] // 2
    y = gate_up.new_empty(*gate_up.shape[:-1], I)
    if y.numel():
        _launch(_swiglu_fwd_kernel, y.numel() // I, I, launch, gate_up, gate_up[..., I:], y, I, 2 * I)
    return y


def _packed_bwd(gate_up: torch.Tensor, dy: torch.Tensor, launch: str) -> torch.Tensor:
    """The gradient of gate_up, in its [..., 2 I] layout: one tensor, so the projections that made
    gate_up take it as it is (no concatenation of two gradients)."""
    I = gate_up.shape[-1] // 2
    d_gate_up = torch.empty_like(gate_up)
    if d_gate_up.numel():
        _launch(_swiglu_bwd_kernel, dy.numel() // I, I, launch, gate_up, gate_up[..., I:], dy, d_gate_up,
                d_gate_up[..., I:], I, 2 * I)
    return d_gate_up


# SwiGLU followed by the down projection, with the activation recomputed in the backward pass: an MLP
# then keeps gate_up and the weight for its backward, not also the [tokens, intermediate] activation
# that a separate linear layer would save (a third of an MLP's saved activations).
@kernel_op("swiglu_linear_fwd")
def swiglu_linear_fwd(gate_up: torch.Tensor, weight: torch.Tensor, fp8: bool, launch: str) -> torch.Tensor:
    return matmul_nt(_packed_fwd(gate_up, launch), weight, fp8)


@kernel_op("swiglu_linear_bwd")
def swiglu_linear_bwd(gate_up: torch.Tensor, weight: torch.Tensor, d_out: torch.Tensor,
                      fp8: bool, launch: str) -> Tuple[torch.Tensor, torch.Tensor]:
    y = _packed_fwd(gate_up, launch)  # recomputed: one elementwise pass instead of keeping it
    d_weight = torch.matmul(d_out.reshape(-1, d_out.shape[-1]).t(), y.reshape(-1, y.shape[-1]))
    del y  # freed before the input gradient is made
    return _packed_bwd(gate_up, matmul_nn(d_out, weight, fp8), launch), d_weight


@swiglu_linear_fwd.register_fake
def _(gate_up, weight, fp8, launch):
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])


@swiglu_linear_bwd.register_fake
def _(gate_up, weight, d_out, fp8, launch):
    return torch.empty_like(gate_up), weight.new_empty(weight.shape)


class _SwiGLULinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, weight, launch, fp8):
        ctx.save_for_backward(gate_up, weight)
        ctx.launch, ctx.fp8 = launch, fp8
        return swiglu_linear_fwd(gate_up, weight, fp8, launch)

    @staticmethod
    def backward(ctx, d_out):
        refuse_second_derivative("swiglu_linear")
        gate_up, weight = ctx.saved_tensors
        return (*swiglu_linear_bwd(gate_up, weight, d_out.contiguous(), ctx.fp8, ctx.launch), None, None)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, launch: Optional[SwiGLULaunch] = None) -> torch.Tensor:
    return _SwiGLUFunction.apply(gate.contiguous(), up.contiguous(), launch_json(launch, SHIPPED))


def swiglu_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor, launch: Optional[SwiGLULaunch] = None,
                         fp8: bool = False) -> torch.Tensor:
    return _SwiGLULinearFunction.apply(gate_up.contiguous(), weight.to(gate_up.dtype), launch_json(launch, SHIPPED), fp8)
