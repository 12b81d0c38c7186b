"""SwiGLU activation, silu(gate) * up, as one elementwise Triton kernel forward and one backward.

The backward recomputes silu from the saved inputs, so nothing but gate and up is kept. `backend` picks the
kernels (swiglu_triton.py, imported only when they run) or `swiglu_ref` by the rule of fabric_lin/ops/backend.py;
`launch` (a SwiGLULaunch, by default the shipped settings: fabric_lin/ops/fused_launch.py) says how the kernels are launched.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from fabric_lin.ops.backend import resolve_backend
from fabric_lin.ops.fp8_matmul import matmul_nt
from fabric_lin.ops.fused_launch import SwiGLULaunch




def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto",
           launch: Optional[SwiGLULaunch] = None) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up of one shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    if resolve_backend(backend, gate.device) == "torch":
        return swiglu_ref(gate, up)
    from fabric_lin.ops.swiglu_triton import swiglu_triton

    return swiglu_triton(gate, up, launch)


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, backend: str = "auto",
                  launch: Optional[SwiGLULaunch] = None, fp8: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T for gate_up = [..., 2 I], gate its first half and up its second (an
    MLP's two input projections computed side by side), keeping only gate_up and weight for the backward
    pass, whose gradient of gate_up is one tensor in the same layout. The weight is cast to gate_up's
    dtype first (what autocast does for a linear layer under bf16-mixed). fp8: the product and the activation's
    gradient in FP8 (fabric_lin/ops/fp8_matmul.py)."""
    I = gate_up.shape[-1] // 2
    if gate_up.shape[-1] % 2 or weight.dim() != 2 or weight.shape[-1] != I:
        raise ValueError(
            f"swiglu_linear: gate_up must be [..., 2 I] and weight [out, I], got gate_up {tuple(gate_up.shape)}"
            f" and weight {tuple(weight.shape)}"
        )
    if resolve_backend(backend, gate_up.device) == "torch":
        gate, up = gate_up.chunk(2, dim=-1)
        return matmul_nt(swiglu_ref(gate, up), weight.to(gate_up.dtype), fp8)
    from fabric_lin.ops.swiglu_triton import swiglu_linear_triton

    return swiglu_linear_triton(gate_up, weight, launch, fp8)
