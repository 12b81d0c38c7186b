"""The FP8 products of the fused ops (fabric_lin/ops/fp8_matmul.py): the row-by-row cast against its definition, the
products against float64 with rows of very different magnitudes (each row keeps its own precision: a scale per
tensor would not), and every fused op with fp8 against its float64 reference, keeping no more for the backward pass
than without. The Triton cast runs on CUDA only: Triton's interpreter rounds float8 wrongly (-127.75 to -64)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import rel_rms  # noqa: E402
from helpers import DEVICE, grads_of, leaves  # noqa: E402

from fabric_lin.ops.fp8_matmul import FP8, FP8_MAX, matmul_nn, matmul_nt, rowwise_fp8, rowwise_fp8_ref  # noqa: E402
from fabric_lin.ops.norm import rms_norm_gated_linear, rms_norm_gated_ref, rms_norm_linears, rms_norm_ref  # noqa: E402
from fabric_lin.ops.swiglu import swiglu_linear, swiglu_ref  # noqa: E402

# the compute dtype of the fused products: bf16 on a GPU (FP8 products with row scales write bf16 there), fp32 on the CPU
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def spread_rows(rows, cols, seed):
    """A [rows, cols] fp32 matrix whose rows' magnitudes run from 1e-4 to 1e4, and one row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, rows)[torch.randperm(rows, generator=g)][:, None]
    x[rows // 2] = 0
    return x


def test_rowwise_cast_scales_each_row_to_the_fp8_range():
    x = spread_rows(9, 64, 0)
    q, scale = rowwise_fp8_ref(x)
    assert q.dtype == FP8 and scale.shape == (9, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(1, keepdim=True)
    nonzero = amax[:, 0] > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / FP8_MAX, rtol=1e-6, atol=0)
    assert scale[~nonzero].eq(1).all() and q[~nonzero].float().eq(0).all()
    # each row's largest element lands on e4m3's largest; the others within half an e4m3 step (3 mantissa bits)
    assert q.float().abs().amax(1)[nonzero].eq(FP8_MAX).all()
    normal = x.abs() >= amax * 2.0**-6  # above e4m3's subnormals
    assert ((q.float() * scale - x).abs() <= x.abs() * 2.0**-4 + 1e-30)[normal].all()
    # a bf16 row is cast from its value, in fp32 (as the Triton kernel does): the same bytes and fp32 scales
    q16, scale16 = rowwise_fp8_ref(x.bfloat16())
    q32, scale32 = rowwise_fp8_ref(x.bfloat16().float())
    assert scale16.dtype == torch.float32 and torch.equal(scale16, scale32)
    assert torch.equal(q16.view(torch.uint8), q32.view(torch.uint8))


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's interpreter rounds float8 wrongly; the kernel is checked on a GPU")
def test_rowwise_cast_kernel_matches_the_reference_bit_for_bit():
    x = spread_rows(300, 1000, 1).to("cuda", torch.bfloat16)
    q, scale = rowwise_fp8(x)
    q_ref, scale_ref = rowwise_fp8_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_products_keep_each_rows_precision():
    a, b = spread_rows(32, 64, 2), spread_rows(48, 64, 3)
    exact = a.double() @ b.double().t()
    out = matmul_nt(a.to(DEVICE, DTYPE), b.to(DEVICE, DTYPE), fp8=True).double().cpu()
    # each element against the size of its row and column: e4m3's half step, 2^-4, over a 64-term sum
    bound = 0.08 * a.double().norm(dim=1, keepdim=True) * b.double().norm(dim=1)[None, :]
    assert ((out - exact).abs() <= bound).all()
    assert out[16].eq(0).all() and out[:, 24].eq(0).all()  # the zero rows give zeros, not NaN
    assert matmul_nt(a.to(DEVICE, torch.bfloat16), b.to(DEVICE, torch.bfloat16), fp8=True).dtype == torch.bfloat16
    # the input gradient form: a @ w for w [N, K], the scales along its K columns
    d, w = spread_rows(32, 48, 4), spread_rows(64, 48, 5).t().contiguous()  # w [48, 64]
    exact = d.double() @ w.double()
    out = matmul_nn(d.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), fp8=True).double().cpu()
    bound = 0.08 * d.double().norm(dim=1, keepdim=True) * w.double().norm(dim=0)[None, :]
    assert ((out - exact).abs() <= bound).all()


def test_narrow_products_stay_in_the_compute_dtype():
    # FP8 products need widths in multiples of 16: a 4-wide gate projection (GDN's a, b) is computed as without fp8
    a, b = torch.randn(8, 64).to(DEVICE, DTYPE), torch.randn(4, 64).to(DEVICE, DTYPE)
    assert torch.equal(matmul_nt(a, b, fp8=True), matmul_nt(a, b, fp8=False))
    d = torch.randn(8, 4).to(DEVICE, DTYPE)
    assert torch.equal(matmul_nn(d, b, fp8=True), d @ b)
    # an input gradient through wide projections stacked with a narrow one: the narrow rows' part is exact
    d, w = spread_rows(32, 52, 8), spread_rows(52, 64, 9)
    d[:, :48] = 0  # only the narrow rows (48..51) contribute
    torch.testing.assert_close(matmul_nn(d.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), fp8=True).float().cpu(),
                               (d.to(DTYPE) @ w.to(DTYPE)).float(), rtol=1e-2, atol=1e-2)


FP8_BOUND = 0.06  # relative RMS error of an FP8 product over 64-128 terms against float64: ~0.02-0.03


def fused_cases():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 24, 64, generator=g)
    residual = torch.randn(2, 24, 64, generator=g)
    norm_w = 1 + 0.1 * torch.randn(64, generator=g)
    projs = [0.1 * torch.randn(n, 64, generator=g) for n in (32, 16, 4)]
    heads, gate = torch.randn(2, 24, 4, 32, generator=g), torch.randn(2, 24, 4, 32, generator=g)
    head_w, o_w = 1 + 0.1 * torch.randn(32, generator=g), 0.1 * torch.randn(64, 128, generator=g)
    gate_up, down = torch.randn(2, 24, 96, generator=g), 0.1 * torch.randn(64, 48, generator=g)

    def linears(t, fp8, fused):
        if fused:
            outs, h = rms_norm_linears(t[0], t[2], 1e-6, t[3:], residual=t[1], backend="triton", fp8=fp8)
            return (*outs, h)
        y, h = rms_norm_ref(t[0], t[2], 1e-6, t[1])
        return (*(F.linear(y, p) for p in t[3:]), h)

    def side_by_side(t, fp8, fused):
        if fused:
            out, h = rms_norm_linears(t[0], t[2], 1e-6, t[3:], residual=t[1], backend="triton", side_by_side=True,
                                      fp8=fp8)
            return out, h
        y, h = rms_norm_ref(t[0], t[2], 1e-6, t[1])
        return torch.cat([F.linear(y, p) for p in t[3:]], -1), h

    def gated(t, fp8, fused):
        if fused:
            return rms_norm_gated_linear(t[0], t[1], t[2], 1e-5, t[3], backend="triton", fp8=fp8)
        return F.linear(rms_norm_gated_ref(t[0], t[1], t[2], 1e-5).flatten(-2), t[3])

    def mlp(t, fp8, fused):
        if fused:
            return swiglu_linear(t[0], t[1], backend="triton", fp8=fp8)
        return F.linear(swiglu_ref(*t[0].chunk(2, -1)), t[1])

    return {
        "rms_norm_linears": (linears, [x, residual, norm_w, *projs]),
        "rms_norm_linears side by side": (side_by_side, [x, residual, norm_w, *projs[:2]]),
        "rms_norm_gated_linear": (gated, [heads, gate, head_w, o_w]),
        "swiglu_linear": (mlp, [gate_up, down]),
    }


@pytest.mark.parametrize("case", list(fused_cases()))
def test_fused_ops_in_fp8_match_float64_and_keep_what_bf16_keeps(case):
    fn, inputs = fused_cases()[case]
    ref_in = leaves(*(t.double() for t in inputs))
    ref = fn(ref_in, False, False)
    ref = ref if isinstance(ref, tuple) else (ref,)
    saved, first_output, first_grad = {}, {}, {}
    for fp8 in (False, True):
        out_in = leaves(*(t.to(DEVICE, DTYPE) for t in inputs))
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
            out = fn(out_in, fp8, True)
        saved[fp8] = sorted(shapes, key=str)
        out = out if isinstance(out, tuple) else (out,)
        first_output[fp8] = out[0].detach().cpu()
        grads = grads_of(out, out_in)
        first_grad[fp8] = grads[0].cpu()
        if not fp8:
            continue
        for i, (a, b) in enumerate(zip(out, ref)):
            assert rel_rms(a.cpu(), b) <= FP8_BOUND, f"{case}: output {i}"
        for i, (a, b) in enumerate(zip(grads, grads_of(ref, ref_in))):
            assert rel_rms(a.cpu(), b) <= FP8_BOUND, f"{case}: gradient of input {i}"
    # both products that fp8 moves to FP8 did move: the forward one and the input gradient's
    assert rel_rms(first_output[True], first_output[False]) > 3e-3, f"{case}: fp8=True computed without FP8"
    assert rel_rms(first_grad[True], first_grad[False]) > 3e-3, f"{case}: the input gradient computed without FP8"
    assert saved[True] == saved[False]


def test_fp8_fused_ops_compile_whole_and_match_eager():
    # the Blocks are compiled in training: the FP8 products must trace without graph breaks, to the same numbers
    from conftest import compiled_graph_ops

    g = torch.Generator().manual_seed(7)
    x, res = (torch.randn(2, 8, 32, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    w = torch.ones(32, device=DEVICE, dtype=DTYPE)
    gate_up_w, down_w = (0.2 * torch.randn(n, k, generator=g).to(DEVICE, DTYPE) for n, k in ((64, 32), (32, 32)))

    def f(x, res, w, gate_up_w, down_w):
        gate_up, h = rms_norm_linears(x, w, 1e-6, [gate_up_w], residual=res, backend="triton", side_by_side=True,
                                      fp8=True)
        return (swiglu_linear(gate_up, down_w, backend="triton", fp8=True).float() * h.float()).sum()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(x, res, w, gate_up_w, down_w)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled_in, eager_in = leaves(x, res, w, gate_up_w, down_w), leaves(x, res, w, gate_up_w, down_w)
    out, _, _ = compiled_graph_ops(f, *compiled_in)
    eager = f(*eager_in)
    eager.backward()
    torch.testing.assert_close(out, eager)
    for a, b in zip(compiled_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)
