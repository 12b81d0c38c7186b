"""The fused norm ops (RMSNorm with a residual, the gated per-head RMSNorm, and either fused with the projections
that follow it) against their PyTorch references, values and gradients, and against float64 at the edges (no rows,
a strided weight, many rows and programs). Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
set before Triton is imported), in fp32. The checks over every fused op at once (compiled without graph breaks, the
PyTorch paths against float64, bad shapes reported, a second derivative refused) are here too."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import check_against_fp32, compiled_graph_ops, rel_rms  # noqa: E402
from helpers import DEVICE, DTYPES, check, grads_of, leaves  # noqa: E402

from fabric_lin.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref  # noqa: E402
from fabric_lin.ops.norm import (  # noqa: E402
    rms_norm,
    rms_norm_gated,
    rms_norm_gated_linear,
    rms_norm_gated_ref,
    rms_norm_linears,
    rms_norm_ref,
)
from fabric_lin.ops.short_conv import causal_conv1d  # noqa: E402
from fabric_lin.ops.swiglu import swiglu, swiglu_linear, swiglu_ref  # noqa: E402



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=g).to(DEVICE, dtype)
    res = torch.randn(3, 5, 48, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    args = [x, w] + ([res] if with_residual else [])
    ref_in, out_in = leaves(*args), leaves(*args)

    def call(fn, t, **kw):
        return fn(t[0], t[1], 1e-6, t[2] if with_residual else None, **kw)

    ref = call(lambda *a: rms_norm_ref(*a), ref_in)
    out = call(lambda *a: rms_norm(*a, backend="triton"), out_in)
    for a, b, name in zip(out if with_residual else (out,), ref if with_residual else (ref,), ["y", "h"]):
        check(a, b, dtype, name)
    for a, b, name in zip(grads_of(out, out_in), grads_of(ref, ref_in), ["dx", "dweight", "dresidual"]):
        check(a, b, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gated_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 4, 40, generator=g).to(DEVICE, dtype)  # [B, T, H, head_v_dim]
    gate = torch.randn(2, 7, 4, 40, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DEVICE, dtype)
    ref_in, out_in = leaves(x, gate, w), leaves(x, gate, w)
    ref = rms_norm_gated_ref(*ref_in, eps=1e-5)
    out = rms_norm_gated(*out_in, eps=1e-5, backend="triton")
    check(out, ref, dtype, "y")
    for a, b, name in zip(grads_of(out, out_in), grads_of(ref, ref_in), ["dx", "dgate", "dweight"]):
        check(a, b, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gated_linear_matches_reference_and_keeps_no_activation(dtype):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 7, 3, 40, generator=g).to(DEVICE, dtype)  # [B, T, H, head_v_dim]
    gate = torch.randn(2, 7, 3, 40, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DEVICE, dtype)
    proj = (0.2 * torch.randn(24, 120, generator=g)).to(DEVICE, dtype)
    ref_in, out_in = leaves(x, gate, w, proj), leaves(x, gate, w, proj)
    ref = F.linear(rms_norm_gated_ref(*ref_in[:3], eps=1e-5).reshape(2, 7, 120), ref_in[3])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = rms_norm_gated_linear(*out_in[:3], 1e-5, out_in[3], backend="triton")
    assert out.shape == (2, 7, 24)
    check(out, ref, dtype, "out")
    for a, b, name in zip(grads_of(out, out_in), grads_of(ref, ref_in), ["dx", "dgate", "dweight", "dproj"]):
        check(a, b, dtype, name)
    # kept for backward: x, gate, the two weights and one rstd per row; not the normed [2, 7, 3, 40] activation
    assert sorted(saved) == sorted([(2, 7, 3, 40), (2, 7, 3, 40), (40,), (42,), (24, 120)])
    with pytest.raises(ValueError, match=r"proj_weight must be \[out, 120\]"):
        rms_norm_gated_linear(x, gate, w, 1e-5, torch.randn(24, 100), backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_linears_matches_reference_and_keeps_no_normed_activation(dtype, with_residual):
    # a pre-norm block's input projections: three weights of different widths, the last output unused
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 7, 48, generator=g).to(DEVICE, dtype)
    residual = torch.randn(2, 7, 48, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    projs = [(0.2 * torch.randn(n, 48, generator=g)).to(DEVICE, dtype) for n in (24, 16, 8)]
    # the reference in fp32 from the same (dtype-rounded) inputs
    ref_in, out_in = leaves(*(t.float() for t in (x, residual, w, *projs))), leaves(x, residual, w, *projs)
    if not with_residual:
        ref_in[1] = out_in[1] = None
    ref_normed = rms_norm_ref(ref_in[0], ref_in[2], 1e-6, ref_in[1])
    ref_y, ref_h = ref_normed if with_residual else (ref_normed, None)
    ref_outs = [F.linear(ref_y, p) for p in ref_in[3:]]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        result = rms_norm_linears(out_in[0], out_in[2], 1e-6, out_in[3:], residual=out_in[1], backend="triton")
    outs, h = result if with_residual else (result, None)
    for a, b, name in zip(outs, ref_outs, ["out0", "out1", "out2"]):
        assert a.is_contiguous() and a.dtype == dtype
        check_against_fp32(a, b, dtype, name)
    # the last output left out of the loss: its weight gets no gradient (zero here, None in the reference)
    used_out = tuple(outs[:2]) + ((h,) if with_residual else ())
    used_ref = tuple(ref_outs[:2]) + ((ref_h,) if with_residual else ())
    out_grads = grads_of(used_out, [t for t in out_in if t is not None], allow_unused=True)
    ref_grads = grads_of(used_ref, [t for t in ref_in if t is not None], allow_unused=True)
    names = ["dx"] + (["dresidual"] if with_residual else []) + ["dweight", "dproj0", "dproj1", "dproj2"]
    for a, b, name in zip(out_grads, ref_grads, names):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        check_against_fp32(a, b, dtype, name)
    # kept for backward: x (or h), the norm weight, one rstd per row and the stacked weights; not the
    # normed [2, 7, 48] activation (one [2, 7, 48] tensor only)
    assert sorted(saved) == sorted([(2, 7, 48), (48,), (14,), (48, 48)])
    with pytest.raises(ValueError, match=r"expected projection weights \[out, 48\]"):
        rms_norm_linears(x, w, 1e-6, [torch.randn(8, 40)], backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rms_norm_linears_runs_the_projections_in_the_compute_dtype(backend):
    # bf16-mixed: an fp32 residual stream and fp32 weights, projections in bf16 as autocast runs a linear
    # layer; the weights' gradients reach them in fp32
    g = torch.Generator().manual_seed(10)
    x, residual = (torch.randn(2, 5, 32, generator=g).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(DEVICE)
    projs = [(0.2 * torch.randn(n, 32, generator=g)).to(DEVICE) for n in (16, 8)]
    ref_in, out_in = leaves(x, residual, w, *projs), leaves(x, residual, w, *projs)
    ref_y, ref_h = rms_norm_ref(ref_in[0], ref_in[2], 1e-6, ref_in[1])
    ref_outs = [F.linear(ref_y.to(torch.bfloat16), p.to(torch.bfloat16)) for p in ref_in[3:]]
    outs, h = rms_norm_linears(out_in[0], out_in[2], 1e-6, out_in[3:], residual=out_in[1], dtype=torch.bfloat16,
                               backend=backend)
    assert [o.dtype for o in outs] == [torch.bfloat16] * 2 and h.dtype == torch.float32
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_of(tuple(outs) + (h,), out_in), grads_of(tuple(ref_outs) + (ref_h,), ref_in)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_rms_norm_gated_linear_casts_the_projection_to_the_activations_dtype():
    # as autocast runs the linear layer: float64 activations and an fp32 projection weight give a float64 output,
    # and the weight's gradient reaches it in fp32 (on the PyTorch path; the kernels take no float64)
    g = torch.Generator().manual_seed(13)
    x, gate = (torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    w = 1 + 0.1 * torch.randn(8, generator=g)
    proj = (0.2 * torch.randn(6, 24, generator=g)).requires_grad_(True)
    out = rms_norm_gated_linear(x, gate, w, 1e-5, proj, backend="torch")
    assert out.dtype == torch.float64
    reference = F.linear(rms_norm_64(x, w, 1e-5).mul(F.silu(gate)).reshape(2, 5, 24), proj.double())
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)  # the norm itself runs in fp32
    out.sum().backward()
    assert proj.grad.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_norms_add_eps_to_the_mean_square_inside_the_root(backend):
    # rows of 1e-3: the mean square is 1e-6, so with eps 1e-6 every entry is 1e-3 / sqrt(2e-6) = 1 / sqrt(2) (times
    # the weight), where eps added outside the root would leave it near 1
    x = torch.full((3, 64), 1e-3, device=DEVICE)
    w = torch.linspace(0.5, 1.5, 64, device=DEVICE)
    gate = torch.full((3, 64), 3.0, device=DEVICE)
    expected = (w / 2**0.5).expand(3, 64)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, backend=backend), expected)
    torch.testing.assert_close(rms_norm_gated(x, gate, w, 1e-6, backend=backend), expected * 3 * torch.sigmoid(gate))


def same_when_rounded(low, full):
    """low is full rounded to low's dtype: exactly on a GPU (round to nearest even, as torch rounds); within
    one unit in the last place in Triton's interpreter, whose bf16 stores round otherwise."""
    if low.is_cuda:
        assert torch.equal(low, full.to(low.dtype))
    else:
        torch.testing.assert_close(low.float(), full, rtol=2 ** -7, atol=0)


def test_mixed_dtype_residual_stream_needs_no_casts(monkeypatch):
    # bf16-mixed: the residual stream in fp32, the sublayer's output added to it in bf16. The norm kernel
    # writes the normed activation in the projections' dtype (not fp32 then cast), and the bf16 residual's
    # gradient itself, the fp32 one rounded, where autograd would cast it in a pass of its own
    from fabric_lin.ops import norm_triton as norm

    normed_dtypes, residual_grads = [], []
    fwd, bwd = norm.norm_fwd.fn, norm.norm_bwd.fn  # the kernel ops' functions (eager mode calls them)

    def spy_fwd(*args):
        out = fwd(*args)
        normed_dtypes.append(out[0].dtype)
        return out

    def spy_bwd(*args):
        out = bwd(*args)
        residual_grads.append((out[3].dtype, out[3].numel()))  # empty where no residual gradient of its own
        return out

    monkeypatch.setattr(norm.norm_fwd, "fn", spy_fwd)
    monkeypatch.setattr(norm.norm_bwd, "fn", spy_bwd)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 5, 32, generator=g).to(DEVICE)
    pending = torch.randn(2, 5, 32, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(DEVICE)
    projs = [(0.2 * torch.randn(n, 32, generator=g)).to(DEVICE) for n in (16, 8)]
    out_in, ref_in = leaves(x, pending, w, *projs), leaves(x, pending, w, *projs)
    outs, h = rms_norm_linears(out_in[0], out_in[2], 1e-6, out_in[3:], residual=out_in[1], dtype=torch.bfloat16,
                               backend="triton")
    ref_y, ref_h = rms_norm_ref(ref_in[0], ref_in[2], 1e-6, ref_in[1])
    ref_outs = [F.linear(ref_y.to(torch.bfloat16), p.to(torch.bfloat16)) for p in ref_in[3:]]
    assert h.dtype == torch.float32 and [o.dtype for o in outs] == [torch.bfloat16] * 2
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    grads = grads_of(tuple(outs) + (h,), out_in)
    ref_grads = grads_of(tuple(ref_outs) + (ref_h,), ref_in)
    assert grads[1].dtype == torch.bfloat16
    same_when_rounded(grads[1], grads[0])
    for a, b, name in zip(grads, ref_grads, ["dx", "dpending", "dweight", "dproj0", "dproj1"]):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2, msg=lambda m: f"{name}: {m}")
    assert normed_dtypes == [torch.bfloat16, torch.bfloat16]  # the forward and the backward's recomputation
    assert residual_grads == [(torch.bfloat16, x.numel())]
    # compiled (the Blocks of the real loop are): one graph, the same values and gradients, dtypes included

    def loss(*ins):
        outs, h = rms_norm_linears(ins[0], ins[2], 1e-6, ins[3:], residual=ins[1], dtype=torch.bfloat16, backend="triton")
        return sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs)) + (h * h).sum()

    compiled_in, eager_in = leaves(x, pending, w, *projs), leaves(x, pending, w, *projs)
    out, forward_ops, backward_ops = compiled_graph_ops(loss, *compiled_in)
    assert "fabric_lin.rms_norm_fwd.default" in forward_ops and "fabric_lin.rms_norm_bwd.default" in backward_ops
    eager = loss(*eager_in)
    eager.backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b, name in zip(compiled_in, eager_in, ["dx", "dpending", "dweight", "dproj0", "dproj1"]):
        assert a.grad.dtype == b.grad.dtype, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"compiled {name}: {m}")
    # the plain norm with a residual (the model's final norm): y in x's dtype, the residual's gradient in its own
    out_in = leaves(x, pending, w)
    y, h = rms_norm(out_in[0], out_in[2], 1e-6, residual=out_in[1], backend="triton")
    assert y.dtype == h.dtype == torch.float32
    dx, dpending, _ = grads_of((y, h), out_in)
    assert dpending.dtype == torch.bfloat16
    same_when_rounded(dpending, dx)
    assert residual_grads[-1] == (torch.bfloat16, x.numel())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_linears_side_by_side(dtype):
    # an MLP's gate and up projections as one output: the same values and gradients as two outputs
    g = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(2, 7, 48, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    projs = [(0.2 * torch.randn(40, 48, generator=g)).to(DEVICE, dtype) for _ in range(2)]
    ref_in, out_in = leaves(*(t.float() for t in (x, residual, w, *projs))), leaves(x, residual, w, *projs)
    ref_y, ref_h = rms_norm_ref(ref_in[0], ref_in[2], 1e-6, ref_in[1])
    ref_out = torch.cat([F.linear(ref_y, p) for p in ref_in[3:]], dim=-1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out, h = rms_norm_linears(out_in[0], out_in[2], 1e-6, out_in[3:], residual=out_in[1], backend="triton",
                                  side_by_side=True)
    assert out.shape == (2, 7, 80) and out.is_contiguous()
    check_against_fp32(out, ref_out, dtype, "out")
    check_against_fp32(h, ref_h, dtype, "h")
    names = ["dx", "dresidual", "dweight", "dproj0", "dproj1"]
    for a, b, name in zip(grads_of((out, h), out_in), grads_of((ref_out, ref_h), ref_in), names):
        check_against_fp32(a, b, dtype, name)
    assert sorted(saved) == sorted([(2, 7, 48), (48,), (14,), (80, 48)])
    # the PyTorch path gives the same layout
    torch_out, _ = rms_norm_linears(x, w, 1e-6, projs, residual=residual, backend="torch", side_by_side=True)
    check_against_fp32(torch_out, ref_out, dtype, "torch path")


def test_rms_norm_linears_in_groups():
    # q, k and v as one output beside two outputs of their own: the values and gradients of five separate ones
    g = torch.Generator().manual_seed(12)
    x, residual = (torch.randn(2, 7, 48, generator=g).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE)
    projs = [(0.2 * torch.randn(n, 48, generator=g)).to(DEVICE) for n in (24, 24, 40, 8, 16)]
    ref_in = leaves(x, residual, w, *projs)
    ref_y, ref_h = rms_norm_ref(ref_in[0], ref_in[2], 1e-6, ref_in[1])
    ref_outs = [F.linear(ref_y, p) for p in ref_in[3:]]
    ref_outs = [torch.cat(ref_outs[:3], dim=-1), *ref_outs[3:]]
    names = ["dx", "dresidual", "dweight", "dq", "dk", "dv", "da", "db"]
    ref_grads = grads_of((*ref_outs, ref_h), ref_in)
    for backend in ("triton", "torch"):
        out_in = leaves(x, residual, w, *projs)
        outs, h = rms_norm_linears(out_in[0], out_in[2], 1e-6, out_in[3:], residual=out_in[1], backend=backend,
                                   groups=[3, 1, 1])
        assert [tuple(o.shape) for o in outs] == [(2, 7, 88), (2, 7, 8), (2, 7, 16)], backend
        for a, b, name in zip(outs, ref_outs, ["qkv", "a", "b"]):
            check_against_fp32(a, b, torch.float32, f"{backend} {name}")
        for a, b, name in zip(grads_of((*outs, h), out_in), ref_grads, names):
            check_against_fp32(a, b, torch.float32, f"{backend} {name}")
    with pytest.raises(ValueError, match=r"groups must be positive and add up to the 5 projections, got \[3, 1\]"):
        rms_norm_linears(x, w, 1e-6, projs, groups=[3, 1], backend="triton")


# the layers' input projections at hidden 48 as rms_norm_linears takes them: (widths, groups, side_by_side, the
# outputs' names). Gated DeltaNet: q, k and v side by side, a and b (a column per head: narrow), g; GLA: q, k, v, the
# low-rank gate's first projection (16 wide: narrow), g; one projection alone; the MLP's gate and up as one output;
# narrow outputs apart in the stacked weight, and more narrow columns than the norm kernel takes (the last one wide)
LINEARS = {
    "gdn": ([24, 24, 40, 4, 4, 40], [3, 1, 1, 1], False, ["qkv", "a", "b", "g"]),
    "gla": ([16, 16, 32, 16, 32], None, False, ["q", "k", "v", "low-rank gate", "g"]),
    "one": ([40], None, False, ["out"]),
    "side by side": ([40, 40], None, True, ["gate_up"]),
    "narrow apart": ([4, 40, 16, 16], None, False, ["narrow 4", "wide", "narrow 16", "last 16"]),
}


def linears_inputs(widths, dtype, seed=21):
    """x, residual, the norm weight and the projections' weights: 2 x 37 rows (several tiles and programs of the
    backward kernel at hidden 48, the last one partial)."""
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(2, 37, 48, generator=g) for _ in range(2))
    w = 1 + 0.1 * torch.randn(48, generator=g)
    return [t.to(DEVICE, dtype) for t in (x, residual, w, *(0.2 * torch.randn(n, 48, generator=g) for n in widths))]


def call_linears(case, inputs, backend):
    """The case's projections (a list) and h."""
    _, groups, side_by_side, _ = LINEARS[case]
    outs, h = rms_norm_linears(inputs[0], inputs[2], 1e-6, inputs[3:], residual=inputs[1], backend=backend,
                               groups=groups, side_by_side=side_by_side)
    return ([outs] if side_by_side else outs), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case, unused", [("gdn", None), ("gdn", "g"), ("gdn", "b"), ("gla", None), ("gla", "q"),
                                          ("gla", "low-rank gate"), ("one", None), ("side by side", None),
                                          ("narrow apart", None), ("narrow apart", "narrow 4")])
def test_rms_norm_linears_gradients_match_the_torch_path_in_float64(case, unused, dtype):
    # every gradient (x, the residual, the norm weight, each projection's weight) against the PyTorch path in float64
    # from the same inputs; `unused`: an output left out of the loss (its gradient None), wide or narrow, whose
    # weights' gradients are zeros (None on the PyTorch path)
    inputs = linears_inputs(LINEARS[case][0], dtype)
    out_in, ref_in = leaves(*inputs), leaves(*(t.double() for t in inputs))
    outs, h = call_linears(case, out_in, "triton")
    ref_outs, ref_h = call_linears(case, ref_in, "torch")
    keep = [i for i, name in enumerate(LINEARS[case][3]) if name != unused]
    out_grads = grads_of((*(outs[i] for i in keep), h), out_in, allow_unused=True)
    ref_grads = grads_of((*(ref_outs[i] for i in keep), ref_h), ref_in, allow_unused=True)
    grad_names = ["dx", "dresidual", "dweight"] + [f"dproj{i}" for i in range(len(inputs) - 3)]
    for a, b, name in zip(out_grads, ref_grads, grad_names):
        if b is None:  # the unused output's weights
            assert unused is not None and a is not None and not a.any(), name
            continue
        assert a.dtype == dtype, name
        if dtype == torch.float32:
            check(a, b, dtype, name)
        else:
            assert rel_rms(a, b) < 2e-3, f"{name}: relative RMS error {rel_rms(a, b):.2e} against float64"
    assert sum(b is None for b in ref_grads) == (unused is not None)


def test_rms_norm_linears_backward_puts_no_wide_gradient_side_by_side(monkeypatch):
    # Gated DeltaNet's outputs (qkv, a, b, g): the input gradient's products are one per wide output (qkv, g), the
    # norm kernel summing them with a's and b's share (d [rows, 8] @ their weights' rows), and only those 8
    # columns are put side by side; compiled too (as the Blocks are in training), with eager's gradients
    from fabric_lin.ops import norm_triton

    inputs = linears_inputs(LINEARS["gdn"][0], torch.float32)
    eager_in = leaves(*inputs)
    outs, h = call_linears("gdn", eager_in, "triton")
    kernel_calls, concatenated = [], []
    norm_bwd, cat = norm_triton.norm_bwd.fn, torch.cat
    monkeypatch.setattr(norm_triton.norm_bwd, "fn", lambda *args: kernel_calls.append(args) or norm_bwd(*args))
    monkeypatch.setattr(torch, "cat", lambda *args, **kw: concatenated.append(tuple(cat(*args, **kw).shape))
                        or cat(*args, **kw))
    eager_grads = grads_of((*outs, h), eager_in)
    monkeypatch.undo()
    assert concatenated == [(74, 8)]
    ((_, _, _, _, dys, d_narrow, w_narrow, *_),) = kernel_calls
    assert [tuple(dy.shape) for dy in dys] == [(74, 48), (74, 48)]
    assert tuple(d_narrow.shape) == (74, 8)
    assert torch.equal(w_narrow, torch.cat(inputs[6:8]))  # a's and b's weights

    g = torch.Generator().manual_seed(1)  # the output gradients grads_of gave
    d_outs = [torch.randn(o.shape, generator=g).to(DEVICE) for o in (*outs, h)]

    def loss(*ins):
        outs, h = call_linears("gdn", ins, "triton")
        return sum((o.float() * d).sum() for o, d in zip((*outs, h), d_outs))

    compiled_in, graphs = leaves(*inputs), {}
    compiled_graph_ops(loss, *compiled_in, graphs=graphs)
    widths = [node.meta["val"].shape[-1] for gm in graphs["backward"] for node in gm.graph.nodes
              if node.target is torch.ops.aten.cat.default]
    assert widths == [8], widths
    for a, b, name in zip((t.grad for t in compiled_in), eager_grads,
                          ["dx", "dresidual", "dweight", "dq", "dk", "dv", "da", "db", "dg"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"compiled {name}: {m}")


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7), backend="triton")
    with pytest.raises(ValueError, match="gate and up must match"):
        swiglu(torch.randn(2, 8), torch.randn(2, 9), backend="triton")
    with pytest.raises(ValueError, match="expected hidden"):
        linear_cross_entropy(torch.randn(2, 8), torch.randn(5, 7), torch.zeros(2, dtype=torch.long), backend="triton")


def test_ops_compile_without_graph_breaks():
    # each fused op is a torch.library custom op: dynamo captures it whole, and the gradients still flow
    g = torch.Generator().manual_seed(5)
    x, res, gate = (torch.randn(4, 32, generator=g).to(DEVICE) for _ in range(3))
    w = torch.ones(32, device=DEVICE)
    weight = torch.randn(40, 32, generator=g).to(DEVICE)
    targets = torch.randint(0, 40, (4,), generator=g).to(DEVICE)

    proj = torch.randn(32, 32, generator=g).to(DEVICE) / 8

    def f(x, res, gate, w, weight):
        y, h = rms_norm(x, w, residual=res, backend="triton")
        y = rms_norm_gated(swiglu(y, gate, backend="triton"), h, w, backend="triton")
        y = swiglu_linear(torch.cat([y, h], dim=-1), proj, backend="triton")
        y = rms_norm_gated_linear(y.view(4, 2, 16), gate.view(4, 2, 16), w[:16], 1e-5, proj, backend="triton")
        return linear_cross_entropy(y, weight, targets, backend="triton")

    def f_ref(x, res, gate, w, weight):
        y, h = rms_norm_ref(x, w, residual=res)
        y = rms_norm_gated_ref(swiglu_ref(y, gate), h, w)
        y = F.linear(swiglu_ref(y, h), proj)
        y = F.linear(rms_norm_gated_ref(y.view(4, 2, 16), gate.view(4, 2, 16), w[:16]).view(4, 32), proj)
        return linear_cross_entropy_ref(y, weight, targets)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(x, res, gate, w, weight)
    assert explain.graph_break_count == 0, explain.break_reasons
    ins, ins_ref = leaves(x, res, gate, w, weight), leaves(x, res, gate, w, weight)
    out, forward_ops, backward_ops = compiled_graph_ops(f, *ins)
    # each kernel wrapper is one node of the graphs (in eager mode the same functions run without the op)
    assert {"fabric_lin.rms_norm_fwd.default", "fabric_lin.swiglu_fwd.default", "fabric_lin.swiglu_linear_fwd.default",
            "fabric_lin.linear_cross_entropy_fwd.default"} <= forward_ops, forward_ops
    assert {"fabric_lin.rms_norm_bwd.default", "fabric_lin.swiglu_bwd.default",
            "fabric_lin.swiglu_linear_bwd.default"} <= backward_ops, backward_ops
    ref = f_ref(*ins_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ref.backward()
    for a, b, name in zip(ins, ins_ref, ["dx", "dres", "dgate", "dw", "dweight"]):
        check(a.grad, b.grad, torch.float32, name)


SECOND_DERIVATIVE_CASES = {  # each fused op's Triton path as a function of one input x [4, 32]
    "rms_norm": lambda x, w: rms_norm(x, w, residual=x.flip(0), backend="triton")[0],
    "rms_norm_gated": lambda x, w: rms_norm_gated(x, x.flip(0), w, backend="triton"),
    "rms_norm_gated_linear": lambda x, w: rms_norm_gated_linear(x.view(4, 2, 16), x.view(4, 2, 16), w[:16], 1e-5,
                                                                x[:8], backend="triton"),
    "rms_norm_linears": lambda x, w: rms_norm_linears(x, w, 1e-6, [x[:8]], backend="triton")[0],
    "swiglu": lambda x, w: swiglu(x, x.flip(0), backend="triton"),
    "swiglu_linear": lambda x, w: swiglu_linear(x, x[:8, :16], backend="triton"),
    "linear_cross_entropy": lambda x, w: linear_cross_entropy(x, x[:8], torch.arange(4, device=x.device), backend="triton"),
    "causal_conv1d": lambda x, w: causal_conv1d(x[None], x.t(), backend="triton")[0],
}


@pytest.mark.parametrize("op", SECOND_DERIVATIVE_CASES)
def test_a_second_derivative_through_a_kernel_is_refused(op):
    """The kernels' backward passes are no autograd graph: a gradient asked to be differentiable (create_graph=True: a
    gradient penalty, a Hessian-vector product) is refused naming the op, where its second derivative lacked the op's
    own part, silently."""
    x = torch.randn(4, 32, device=DEVICE, requires_grad=True)
    out = SECOND_DERIVATIVE_CASES[op](x, torch.ones(32, device=DEVICE))
    with pytest.raises(RuntimeError, match=f"^{op}: the Triton kernels have no second derivative .* backend='torch'"):
        torch.autograd.grad(out.float().sin().sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(out.float().sin().sum(), x)  # a first derivative as before
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def rms_norm_64(x, weight, eps):
    """RMSNorm in float64, the independent reference of the edge-case tests below."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_norm_ops_give_a_zero_weight_gradient_for_zero_rows():
    # an empty batch: no row contributes to the weight's gradient, which must be zeros, not whatever
    # memory the partial sums were given (deterministic mode fills uninitialised memory with NaN)
    x = torch.randn(0, 48, device=DEVICE)
    deterministic, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: cuBLAS would refuse its default workspace
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        calls = {
            "rms_norm": lambda x, w: rms_norm(x, w, backend="triton"),
            "rms_norm residual": lambda x, w: rms_norm(x, w, residual=torch.zeros_like(x), backend="triton")[0],
            "rms_norm_gated": lambda x, w: rms_norm_gated(x, torch.ones_like(x), w, backend="triton"),
            "rms_norm_linears": lambda x, w: rms_norm_linears(x, w, 1e-6, [torch.ones(8, 48, device=DEVICE)],
                                                              backend="triton")[0],
        }
        for name, call in calls.items():
            x_in, w = leaves(x, torch.ones(48, device=DEVICE))
            call(x_in, w).sum().backward()
            assert x_in.grad.shape == (0, 48), name
            assert torch.equal(w.grad, torch.zeros(48, device=DEVICE)), f"{name}: dweight {w.grad[:4].tolist()}..."
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_norm_ops_read_a_strided_weight():
    # a norm weight that is a strided view (a column of a [D, 2] tensor): the kernels index it as dense
    g = torch.Generator().manual_seed(12)
    x, gate = (torch.randn(3, 2, 40, generator=g).to(DEVICE) for _ in range(2))
    proj = (0.2 * torch.randn(8, 80, generator=g)).to(DEVICE)
    w_base = (1 + 0.1 * torch.randn(40, 2, generator=g)).to(DEVICE)
    calls = {
        "rms_norm": (lambda w: rms_norm(x, w, 1e-6, backend="triton"), lambda w: rms_norm_64(x, w, 1e-6)),
        "rms_norm_gated": (lambda w: rms_norm_gated(x, gate, w, 1e-5, backend="triton"),
                           lambda w: rms_norm_64(x, w, 1e-5) * F.silu(gate.double())),
        "rms_norm_gated_linear": (lambda w: rms_norm_gated_linear(x, gate, w, 1e-5, proj, backend="triton"),
                                  lambda w: (rms_norm_64(x, w, 1e-5) * F.silu(gate.double())).reshape(3, 80)
                                  @ proj.double().t()),
        "rms_norm_linears": (lambda w: rms_norm_linears(x, w, 1e-6, [proj[:, :40]], backend="triton")[0],
                             lambda w: rms_norm_64(x, w, 1e-6) @ proj[:, :40].double().t()),
    }
    for name, (call, ref_call) in calls.items():
        w = w_base.clone().requires_grad_(True)
        w_64 = w_base.double().requires_grad_(True)
        out, ref = call(w[:, 0]), ref_call(w_64[:, 0])
        check(out, ref, torch.float32, name)
        check(grads_of(out, [w])[0], grads_of(ref, [w_64])[0], torch.float32, f"{name} dweight")


@pytest.mark.parametrize("D", [1000, 256, 24])
def test_norm_ops_over_many_rows_and_programs(D):
    # enough rows that the kernels tile several rows at a time (D = 256: 4 rows a tile, 24: 32) and the
    # backward's programs loop over many tiles, the last one partly past the end (n not a multiple of the
    # rows per tile or per program); against float64, with a residual and with a gate
    g = torch.Generator().manual_seed(15)
    n = 1603 if D < 1000 else 303
    x, res, gate = (torch.randn(n, D, generator=g).to(DEVICE) for _ in range(3))
    w_base = 1 + 0.1 * torch.randn(D, generator=g).to(DEVICE)
    for name in ("residual", "gate"):
        inputs = leaves(x, res if name == "residual" else gate, w_base)
        inputs_64 = [t.detach().double().requires_grad_(True) for t in inputs]
        if name == "residual":
            out = rms_norm(inputs[0], inputs[2], 1e-6, residual=inputs[1], backend="triton")
            h_64 = inputs_64[0] + inputs_64[1]
            ref = (rms_norm_64(h_64, inputs_64[2], 1e-6), h_64)
        else:
            out = rms_norm_gated(*inputs, 1e-5, backend="triton")
            ref = rms_norm_64(inputs_64[0], inputs_64[2], 1e-5) * F.silu(inputs_64[1])
        for a, b, part in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,),
                              ["y", "h"]):
            check(a, b, torch.float32, f"{name} {part}")
        for a, b, part in zip(grads_of(out, inputs), grads_of(ref, inputs_64), ["dx", "d" + name, "dweight"]):
            check(a, b, torch.float32, f"{name} {part}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_paths_match_float64(dtype):
    # the PyTorch references themselves (the CPU path, and what the kernels are compared with), odd sizes
    g = torch.Generator().manual_seed(16)
    x, r, gate = (torch.randn(3, 100, generator=g).to(DEVICE, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(100, generator=g)).to(DEVICE, dtype)
    lm_head = (0.1 * torch.randn(7, 100, generator=g)).to(DEVICE, dtype)
    targets = torch.tensor([5, -100, 6], device=DEVICE)
    y, h = rms_norm(x, w, 1e-6, residual=r, backend="torch")
    h_64 = x.double() + r.double()
    pairs = [
        (y, rms_norm_64(h_64, w, 1e-6), "rms_norm"), (h, h_64, "h"),
        (rms_norm_gated(x, gate, w, 1e-5, backend="torch"), rms_norm_64(x, w, 1e-5) * F.silu(gate.double()),
         "rms_norm_gated"),
        (swiglu(x, gate, backend="torch"), F.silu(x.double()) * gate.double(), "swiglu"),
        (linear_cross_entropy(x, lm_head, targets, backend="torch"),
         F.cross_entropy(x.double() @ lm_head.double().t(), targets), "linear_cross_entropy"),
    ]
    for a, b, name in pairs:
        assert a.dtype == (torch.float32 if name == "linear_cross_entropy" else dtype), name
        check_against_fp32(a, b, dtype, name)


def test_projection_gradients_are_put_side_by_side_only_past_two_wide_outputs():
    # gdn-340M's attention inputs (q|k|v, a, b, g): two wide outputs, their gradients apart; gla-340M's (q, k, v, the
    # low-rank gate, g): four, side by side (apart, that step was slower on an H100)
    from fabric_lin.ops import norm_triton

    gdn, gla = norm_triton._pieces([2048, 4, 4, 1024]), norm_triton._pieces([512, 512, 1024, 16, 1024])
    assert (gdn.wide, gdn.narrow, gdn.side_by_side) == ((0, 3), (1, 2), False)
    assert (gla.wide, gla.narrow, gla.side_by_side) == ((0, 1, 2, 4), (3,), True)
