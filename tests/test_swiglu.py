"""The fused SwiGLU ops (silu(gate) * up, and the same fused with the down projection, gate and up side by side in
one tensor) against their PyTorch references, values and gradients. Without CUDA the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set before Triton is imported), in fp32. The checks over every fused op at once
(compiled without graph breaks, the PyTorch paths against float64, bad shapes reported) are in test_norm.py."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import check_against_fp32  # noqa: E402
from helpers import DEVICE, DTYPES, check, grads_of, leaves  # noqa: E402

from fabric_lin.ops.swiglu import swiglu, swiglu_linear, swiglu_ref  # noqa: E402



@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(3, 1500, generator=g).to(DEVICE, dtype) for _ in range(2))  # two blocks, one partial
    ref_in, out_in = leaves(gate, up), leaves(gate, up)
    ref, out = swiglu_ref(*ref_in), swiglu(*out_in, backend="triton")
    check(out, ref, dtype, "y")
    for a, b, name in zip(grads_of(out, out_in), grads_of(ref, ref_in), ["dgate", "dup"]):
        check(a, b, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_linear_matches_reference_and_keeps_no_activation(dtype):
    # gate and up side by side in one [..., 2 I] tensor; I = 1100: a full and a partial column block
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(2, 3, 2200, generator=g).to(DEVICE, dtype)
    weight = (0.05 * torch.randn(24, 1100, generator=g)).to(DEVICE, dtype)
    # the reference in fp32 from the same inputs: two bf16 computations that round the activation
    # differently can put single elements of dweight (a sum over tokens) several bf16 steps apart
    ref_in, out_in = leaves(gate_up.float(), weight.float()), leaves(gate_up, weight)
    ref = F.linear(swiglu_ref(ref_in[0][..., :1100], ref_in[0][..., 1100:]), ref_in[1])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = swiglu_linear(*out_in, backend="triton")
    check_against_fp32(out, ref, dtype, "out")
    for a, b, name in zip(grads_of(out, out_in), grads_of(ref, ref_in), ["dgate_up", "dweight"]):
        check_against_fp32(a, b, dtype, name)
    # kept for backward: gate_up and the weight, not the [2, 3, 1100] activation silu(gate) * up
    assert sorted(saved) == sorted([(2, 3, 2200), (24, 1100)])


def test_swiglu_linear_casts_the_weight_to_the_activations_dtype():
    # bf16-mixed: bf16 activations, an fp32 parameter; the gradient reaches the parameter in fp32
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(5, 32, generator=g).to(DEVICE, torch.float64)
    weight = torch.randn(8, 16, generator=g).to(DEVICE).requires_grad_(True)
    out = swiglu_linear(gate_up, weight, backend="torch")
    assert out.dtype == torch.float64
    out.sum().backward()
    assert weight.grad.dtype == torch.float32
    expected = torch.ones(5, 8, dtype=torch.float64, device=DEVICE).t() @ swiglu_ref(gate_up[:, :16], gate_up[:, 16:])
    torch.testing.assert_close(weight.grad, expected.float())
    with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2 I\] and weight \[out, I\], got gate_up \(5, 32\) and weight \(8, 15\)"):
        swiglu_linear(gate_up, torch.randn(8, 15, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2 I\]"):
        swiglu_linear(gate_up[:, :31], weight, backend="triton")
