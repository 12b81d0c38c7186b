"""The Triton GLA kernels against the naive fp32 recurrence (float16 inputs against an fp64 one).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
Triton is imported), in fp32 and float16 (its bf16 products are wrong), on small shapes. With CUDA the float16
test also runs at the model's head dims on the compiled kernels; the other GPU tests, bf16 inputs on the real
shapes against the fp32 naive recurrence, are in test_gla_triton_gpu.py. The inputs, the op and its references
that both files use are in conftest.py.
"""
import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import (  # noqa: E402
    GLA_NAMES, compiled_graph_ops, fla_in_interpreter, gated_linear_attention_fp64, gla_forward_backward, gla_inputs,
    gpu_of, mixed_spread_gates, naive_from_logits, rel_rms, triton_from_logits, triton_gla,
)
from helpers import assert_close_scaled  # noqa: E402

from fabric_lin.ops.gla.state_pass import takes_decayed_keys  # noqa: E402
from fabric_lin.ops.gla import (  # noqa: E402
    chunk_gla, chunk_gla_from_logits, fused_recurrent_gla_step, naive_recurrent_gla, recurrent_gla_step,
)
from fabric_lin.ops.gla.launch import SHIPPED  # noqa: E402
from fabric_lin.ops.gla.tune import with_settings  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cpu_only
def test_kernels_run_in_the_interpreter():
    from fabric_lin.ops.gla import chunk_fwd

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(chunk_fwd._fwd_output_kernel).__name__ == "InterpretedFunction", "the kernels were defined before TRITON_INTERPRET was set"


@cpu_only
@pytest.mark.parametrize(
    "B,T,H,K,V,with_h0",
    [(2, 1, 1, 16, 32, True), (1, 63, 2, 32, 16, True), (2, 64, 1, 16, 64, False), (1, 130, 1, 64, 16, True)],
)
def test_triton_matches_naive_fp32(B, T, H, K, V, with_h0):
    q, k, v, gk, h0 = gla_inputs(B, T, H, K, V, seed=T + K)
    h0 = h0 if with_h0 else None
    ref = gla_forward_backward(naive_recurrent_gla, q, k, v, gk, h0, None)
    out = gla_forward_backward(triton_gla, q, k, v, gk, h0, None)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
def test_triton_varlen_matches_naive_fp32():
    offsets = torch.tensor([0, 15, 64, 100, 130, 131], dtype=torch.int32)
    q, k, v, gk, h0 = gla_inputs(1, 131, 2, 16, 32, N=5, seed=7)
    ref = gla_forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = gla_forward_backward(triton_gla, q, k, v, gk, h0, offsets)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert_close_scaled(a, b, name)


NARROW = with_settings(SHIPPED, {
    "state.BK": 16, "state.BV": 16, "output.BK": 32, "output.BV": 32, "dv.BK": 32, "dv.BV": 32, "dqk.BK": 32,
    "dqk.BV": 32, "scan.BK": 16, "scan.BV": 16, "state.maxnreg": 128, "output.maxnreg": 128, "dv.maxnreg": 128,
    "dqk.maxnreg": 128, "cumsum.BK": 32,
})


@cpu_only
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("launch", [SHIPPED, NARROW], ids=["shipped", "narrow"])
def test_triton_tiles_and_both_state_pass_forms(monkeypatch, split, launch):
    # narrow: the state passes split K and V into 16-wide tiles, the per-chunk kernels into 32-wide ones (the
    # output kernel's value tiles stay 64 wide); the sequential state pass (forward, then the backward's two
    # passes in one launch) or, on a GPU where it would leave most multiprocessors idle, chunk-parallel
    # updates and a scan; varlen with a sequence of 5 chunks, then 1
    gpu_of(monkeypatch, 132 if split else 1)
    offsets = torch.tensor([0, 300, 330], dtype=torch.int32)
    q, k, v, gk, h0 = gla_inputs(1, 330, 1, 40, 48, N=2, seed=9)
    ref = gla_forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = gla_forward_backward(lambda *a, **kw: triton_gla(*a, launch=launch, **kw), q, k, v, gk, h0, offsets)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("T,offsets,logit_scale,split", [
    (63, None, 3, False), (130, None, 3, True), (330, [0, 1, 64, 200, 330], 3, False),
    (130, None, 40, False),  # logits up to ~+-150: exp(|x|) overflows fp32 unless logsigmoid and sigmoid avoid it
])
def test_triton_from_logits_matches_naive_fp32(monkeypatch, T, offsets, logit_scale, split):
    # the gate formed inside the gate cumsum kernel from its logits; the backward recomputes gk's cumulative
    # sums and the dq/dk kernel writes the logits' gradient; split: chunk-parallel state passes
    gpu_of(monkeypatch, 132 if split else 1)
    N = 1 if offsets is None else len(offsets) - 1
    q, k, v, _, h0 = gla_inputs(1, T, 2, 32, 48, N=N, seed=12)
    logits = logit_scale * torch.randn(1, T, 2, 32, generator=torch.Generator().manual_seed(13))
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    ref = gla_forward_backward(naive_from_logits, q, k, v, logits, h0, cu)
    out = gla_forward_backward(triton_from_logits, q, k, v, logits, h0, cu)
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dlogits", "dh0"], out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_from_logits_divides_by_the_normalizer_given(backend):
    # a normalizer other than fla's 16: the log gate is logsigmoid(logits) / 4, on both paths and in the logits'
    # gradient (the other tests' gates are all / 16)
    q, k, v, _, h0 = gla_inputs(1, 70, 2, 16, 16, seed=21)
    logits = 2 * torch.randn(1, 70, 2, 16, generator=torch.Generator().manual_seed(22))

    def naive(q, k, v, logits, **kwargs):
        return naive_recurrent_gla(q, k, v, F.logsigmoid(logits.float()) / 4, **kwargs)

    def op(q, k, v, logits, **kwargs):
        return chunk_gla_from_logits(q, k, v, logits, 4.0, backend=backend, **kwargs)

    ref = gla_forward_backward(naive, q, k, v, logits, h0, None)
    out = gla_forward_backward(op, q, k, v, logits, h0, None)
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dlogits", "dh0"], out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("V", [32, 48])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("from_logits", [False, True])
def test_triton_decayed_key_forms_match_naive_fp32(monkeypatch, V, split, from_logits):
    # the decayed keys k * exp(b_last - b) of the backward's state recomputation and dv kernel: over state tiles
    # at least 64 wide (V = 48) formed once (by the gate cumsum from logits, else by the sequential state pass)
    # and read by the others; over 32-wide ones (V = 32) and in the split form, formed by each kernel. Varlen
    # with sequences ending inside a chunk, an initial state, K = 40 over 32-wide key tiles
    gpu_of(monkeypatch, 132 if split else 1)
    launch = with_settings(SHIPPED, {"output.BK": 32, "dqk.BK": 32, "state.BK": 32})
    assert takes_decayed_keys(40, V, 4, 2, torch.device("cpu"), launch.state) == (V == 48 and not split)
    offsets = torch.tensor([0, 7, 64, 100, 163], dtype=torch.int32)
    q, k, v, gk, h0 = gla_inputs(1, 163, 2, 40, V, N=4, seed=14)
    if from_logits:
        logits = 3 * torch.randn(1, 163, 2, 40, generator=torch.Generator().manual_seed(15))
        ref = gla_forward_backward(naive_from_logits, q, k, v, logits, h0, offsets)
        out = gla_forward_backward(lambda *a, **kw: triton_from_logits(*a, launch=launch, **kw), q, k, v, logits, h0, offsets)
    else:
        ref = gla_forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
        out = gla_forward_backward(lambda *a, **kw: triton_gla(*a, launch=launch, **kw), q, k, v, gk, h0, offsets)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert_close_scaled(a, b, name)


def test_decayed_keys_stay_out_of_narrow_state_tiles():
    # on an H200 the state passes went wrong writing or reading the decayed keys over 32-wide value tiles:
    # they are written once only where the state pass's value tiles are at least 64 wide
    state = SHIPPED.state
    assert not takes_decayed_keys(16, 32, 1, 2, torch.device("cpu"), state)
    assert takes_decayed_keys(16, 48, 1, 2, torch.device("cpu"), state)
    narrow = with_settings(SHIPPED, {"state.BV": 32}).state  # 32-wide state tiles at any V
    assert not takes_decayed_keys(16, 128, 1, 2, torch.device("cpu"), narrow)


def test_state_pass_warps_follow_the_launch_programs(monkeypatch):
    # 8 warps where a launch has no more programs than multiprocessors; the backward's fused pair counts both
    # passes' programs (at 8K tokens, 16 heads, K = V = 128: 128 a pass on 132 multiprocessors, 256 both)
    from fabric_lin.ops.gla.state_pass import sequential_programs, split_states, state_warps

    gpu_of(monkeypatch, 132)
    device, state = torch.device("cuda"), SHIPPED.state
    assert sequential_programs(128, 128, 4, 16, state) == 128
    assert state_warps(128, 128, 4, 16, device, state) == 8
    assert state_warps(128, 128, 4, 16, device, state, passes=2) == 4
    assert state_warps(128, 128, 1, 16, device, state, passes=2) == 8  # 64 programs both
    assert state_warps(128, 128, 4, 16, device, with_settings(SHIPPED, {"state.warps": 8}).state, passes=2) == 8
    # the split form where the sequential one would have fewer programs than half the multiprocessors
    assert split_states(128, 128, 1, 8, device, state) and not split_states(128, 128, 4, 16, device, state)


@cpu_only
def test_triton_head_dims_not_powers_of_two_and_custom_scale():
    # K=40 and V=72 leave partly masked tiles; V spans two value tiles of 64
    q, k, v, gk, _ = gla_inputs(1, 70, 1, 40, 72, seed=3)
    ref = gla_forward_backward(lambda *a, **kw: naive_recurrent_gla(*a, scale=0.3, **kw), q, k, v, gk, None, None)
    out = gla_forward_backward(lambda *a, **kw: triton_gla(*a, scale=0.3, **kw), q, k, v, gk, None, None)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("decay", [-20.0, -3000.0])
def test_triton_strong_gates_stay_finite(decay):
    # half the channels decay by logsigmoid(-20)/16 ~ -1.25 per step: -80 over one chunk, where a chunked form
    # that divides by exp(b) overflows fp32; -3000 decays by ~190 per step, a gate spread of thousands over a
    # chunk, where any factor with a positive exponent of one step or more overflows: only the levels of
    # halves (every exponent <= 0) give finite scores there, so this also shows they are the path taken
    q, k, v, _, h0 = gla_inputs(1, 130, 1, 16, 16, seed=5)
    logits = torch.where(torch.rand(1, 130, 1, 16, generator=torch.Generator().manual_seed(0)) < 0.5, decay, 8.0)
    gk = F.logsigmoid(logits) / 16
    ref = gla_forward_backward(naive_recurrent_gla, q, k, v, gk, h0, None)
    out = gla_forward_backward(triton_gla, q, k, v, gk, h0, None)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("strong_logit", [-30.0, -3000.0])
def test_triton_single_reference_and_levels_in_one_call_match_naive_fp32(strong_logit):
    # the scores and their gradients with one reference row where the gate's spread allows it, the levels
    # where it does not, in one call: varlen, an initial state, 32-wide key tiles over K = 40; the sequence from
    # row 100 decays fast in columns 0-7 (its chunk's first key tile past the limit, the second not; at -3000
    # one reference row would overflow there)
    launch = with_settings(SHIPPED, {"output.BK": 32, "dqk.BK": 32})
    offsets = torch.tensor([0, 7, 64, 100, 163], dtype=torch.int32)
    q, k, v, _, h0 = gla_inputs(1, 163, 2, 40, 48, N=4, seed=11)
    gk = mixed_spread_gates(163, 2, 40, slice(100, 163), slice(0, 8), strong_logit=strong_logit)
    ref = gla_forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = gla_forward_backward(lambda *a, **kw: triton_gla(*a, launch=launch, **kw), q, k, v, gk, h0, offsets)
    for name, a, b in zip(GLA_NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert_close_scaled(a, b, name)


@cpu_only
def test_triton_without_final_state_returns_none_and_same_output():
    q, k, v, gk, _ = gla_inputs(1, 20, 1, 16, 16)
    o, ht = triton_gla(q, k, v, gk)
    o_ref, _ = naive_recurrent_gla(q, k, v, gk)
    assert ht is None
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)


@cpu_only
@pytest.mark.parametrize("K,V", [(32, 48), (40, 130)])  # 130: three value tiles, the last one partial
def test_fused_recurrent_step_matches_reference(K, V):
    B, H = 2, 3
    g = torch.Generator().manual_seed(0)
    q, k, gk = (torch.randn(B, H, K, generator=g) for _ in range(3))
    v = torch.randn(B, H, V, generator=g)
    gk = F.logsigmoid(gk) / 16
    state = torch.randn(B, H, K, V, generator=g)
    for s in (state, None):
        o_ref, s_ref = recurrent_gla_step(q, k, v, gk, s)
        o, s_new = fused_recurrent_gla_step(q, k, v, gk, s, backend="triton")
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_new, s_ref, rtol=1e-5, atol=1e-5)
    # one step of the recurrence is the naive recurrence on a sequence of length 1
    o_seq, s_seq = naive_recurrent_gla(q[:, None], k[:, None], v[:, None], gk[:, None], initial_state=state, output_final_state=True)
    o, s_new = fused_recurrent_gla_step(q, k, v, gk, state, backend="triton")
    torch.testing.assert_close(o, o_seq[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_new, s_seq, rtol=1e-5, atol=1e-5)


@cpu_only
@pytest.mark.parametrize("from_logits", [False, True])
def test_torch_compile_captures_the_op_without_graph_breaks(from_logits):
    # the Triton op is a torch.library custom op: dynamo keeps it as one opaque node, forward and backward
    q, k, v, gk, h0 = gla_inputs(1, 70, 2, 16, 32, seed=11)
    if from_logits:  # the same gate, given as logits: gk = logsigmoid(logits) / 16
        gk = torch.logit(torch.exp(16 * gk).clamp(1e-6, 1 - 1e-6))

    def f(q, k, v, gk, h0):
        if from_logits:
            o, ht = chunk_gla_from_logits(q, k, v, gk, 16, initial_state=h0, output_final_state=True, backend="triton")
        else:
            o, ht = chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True, backend="triton")
        return o.square().mean() + ht.mean()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(q, k, v, gk, h0)
    assert explain.graph_break_count == 0, explain.break_reasons
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gk, h0)]
    loss, forward_ops, backward_ops = compiled_graph_ops(f, *leaves)
    # the op is one node of each graph (in eager mode its function runs without the op)
    assert "fabric_lin.chunk_gla_fwd.default" in forward_ops, forward_ops
    assert "fabric_lin.chunk_gla_bwd.default" in backward_ops, backward_ops
    leaves_ref = [x.clone().requires_grad_(True) for x in (q, k, v, gk, h0)]
    reference = naive_from_logits if from_logits else naive_recurrent_gla
    loss_ref = reference(*leaves_ref[:4], initial_state=leaves_ref[4], output_final_state=True)
    loss_ref = loss_ref[0].square().mean() + loss_ref[1].mean()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-5)
    for name, a, b in zip(["dq", "dk", "dv", "dgk", "dh0"], leaves, leaves_ref):
        assert_close_scaled(a.grad, b.grad, name)


# ---------------------------------------------------------------- float16 against the fp64 recurrence

# fla's own tests (tests/ops/test_gla.py) accept a chunk_gla result whose relative RMS error, against its
# recurrent op in the same dtype, is below these; here the reference is the fp64 recurrence
FLA_TOLERANCE = {"o": 0.004, "ht": 0.005, "dq": 0.005, "dk": 0.005, "dv": 0.005, "dgk": 0.005, "dh0": 0.005}


# one head per gate strength, each gate logsigmoid(u) / normalizer with u uniform in [0, 1) as fla's tests draw
# it: -6.9 to -3.1 per step at 0.1; -0.69 to -0.31 at 1 (fla's tests without a normalizer), where half a
# chunk moves by ~16 and exp(16) overflows float16; -0.23 to -0.10 at 3, about float16's single-reference limit
# (5.5) over half a chunk, so chunks on both paths; -0.07 to -0.03 at 10
NORMALIZERS = (0.1, 1.0, 3.0, 10.0)


def float16_inputs(T, K, V, N, seed=0):
    """fla's test inputs in float16, head h gated at NORMALIZERS[h]: q, k, v uniform in [0, 1), the log gate gk
    (float16, as fla's tests pass it), h0 uniform in fp32 ([N, H, K, V])."""
    g = torch.Generator().manual_seed(seed)
    H = len(NORMALIZERS)
    q, k = (torch.rand(1, T, H, K, generator=g).half() for _ in range(2))
    v = torch.rand(1, T, H, V, generator=g).half()
    u = torch.rand(1, T, H, K, generator=g)
    gk = (F.logsigmoid(u) / torch.tensor(NORMALIZERS)[:, None]).half()
    return q, k, v, gk, torch.rand(N, H, K, V, generator=g)


def as_logits(gk, normalizer=16.0):
    """float16 logits x with logsigmoid(x) / normalizer = gk: the same gates given as the model gives them."""
    return (-torch.log(torch.expm1(-normalizer * gk.double()))).half()


def per_head_errors(out, ref, names):
    """{name: relative RMS error of each head}; the head is dim 1 of the states [N, H, K, V], dim 2 of the rest."""
    errors = {}
    for name, a, r in zip(names, out, ref):
        dim = 1 if name in ("ht", "dh0") else 2
        errors[name] = [rel_rms(a.select(dim, h), r.select(dim, h)) for h in range(len(NORMALIZERS))]
    return errors


def float16_case(with_h0, offsets, from_logits, T=150, K=32, V=32, device="cpu"):
    """(inputs, cu_seqlens, outputs and gradients of the Triton op, those of the fp64 recurrence, their names).
    from_logits: the gates given as the model gives them, float16 logits with normalizer 16."""
    N = 1 if offsets is None else len(offsets) - 1
    q, k, v, gk, h0 = (x.to(device) for x in float16_inputs(T, K, V, N))
    h0 = h0 if with_h0 else None
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=device)
    gate = as_logits(gk) if from_logits else gk

    def ours(q, k, v, gate, **kwargs):
        if from_logits:
            return chunk_gla_from_logits(q, k, v, gate, 16.0, backend="triton", **kwargs)
        return triton_gla(q, k, v, gate, **kwargs)

    def reference(q, k, v, gate, initial_state=None, output_final_state=True, cu_seqlens=None):
        gk = F.logsigmoid(gate) / 16.0 if from_logits else gate
        return gated_linear_attention_fp64(q, k, v, gk, initial_state=initial_state, cu_seqlens=cu_seqlens)

    inputs = (q, k, v, gate, h0)
    out = gla_forward_backward(ours, *inputs, cu)
    ref = gla_forward_backward(reference, *(None if x is None else x.double() for x in inputs), cu)
    names = GLA_NAMES if with_h0 else GLA_NAMES[:-1]
    if from_logits:
        names = [("dlogits" if n == "dgk" else n) for n in names]
    return inputs, cu, out, ref, names


FLOAT16_CASES = [  # (initial state, cu_seqlens, gates as logits)
    (True, None, False), (False, None, True), (True, [0, 15, 100, 150], True), (False, [0, 70, 150], False),
]


@cpu_only
@pytest.mark.parametrize("with_h0,offsets,from_logits", FLOAT16_CASES)
def test_triton_float16_within_fla_tolerance_of_fp64(with_h0, offsets, from_logits):
    # every output and gradient finite, and within fla's tolerance of the fp64 recurrence at every gate strength:
    # the single-reference factors, exp(+-(b - b_r)), stay inside float16's range (65504 = exp(11.09))
    assert_float16_within_fla_tolerance(*float16_case(with_h0, offsets, from_logits)[2:])


@needs_cuda
@pytest.mark.parametrize("with_h0,offsets,from_logits",
                         [(True, None, False), (False, [0, 15, 100, 300, 1200, 2000], True)])
def test_gpu_float16_within_fla_tolerance_of_fp64(with_h0, offsets, from_logits):
    # the interpreter's float16 test at the model's head dims, on the compiled kernels
    assert_float16_within_fla_tolerance(*float16_case(with_h0, offsets, from_logits, T=2000, K=128, V=128,
                                                      device="cuda")[2:])


def assert_float16_within_fla_tolerance(out, ref, names):
    assert out[0].dtype == torch.float16 and out[2].dtype == torch.float16 and out[5].dtype == torch.float16
    bad = [name for name, a in zip(names, out) if not torch.isfinite(a).all()]
    assert not bad, f"not finite: {bad}"
    errors = per_head_errors(out, ref, names)
    over = {f"{name} at normalizer {NORMALIZERS[h]}": f"{e:.2e}" for name, errs in errors.items()
            for h, e in enumerate(errs) if not e < FLA_TOLERANCE[name.replace("dlogits", "dgk")]}
    assert not over, f"relative RMS error against fp64 above fla's tolerance: {over}"


def fla_chunk_gla(q, k, v, gate, from_logits, initial_state=None, output_final_state=True, cu_seqlens=None):
    """fla's chunk_gla with float16_case's arguments (from_logits: the gate as logits, normalizer 16)."""
    from fla.ops.gla import chunk_gla as fla_op

    gk = F.logsigmoid(gate.float()) / 16.0 if from_logits else gate
    return fla_op(q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)


def fla_forward_backward(inputs, cu_seqlens, from_logits):
    """gla_forward_backward of fla's chunk_gla on the same inputs, its kernels in the interpreter as
    conftest.fla_in_interpreter runs them. Skips where fla's chunk_gla does not import."""
    pytest.importorskip("fla.ops.gla")
    with fla_in_interpreter():
        return gla_forward_backward(functools.partial(fla_chunk_gla, from_logits=from_logits), *inputs, cu_seqlens)


# our float16 error against fp64 over fla's on the same inputs, at most: fla keeps the scores A, their gradient dA
# and the products of dq, dk and dv on them in fp32 (in the interpreter even its tf32 products are exact),
# and makes the pairs within 16 rows one by one, where ours take float16 factors; dgk, the reverse cumulative sum
# of q dq - k dk, keeps what those roundings leave where the two terms cancel (most with fast gates)
FLA_RATIO = {"o": 1.1, "ht": 1.1, "dq": 1.3, "dk": 1.3, "dv": 1.3, "dlogits": 2.5, "dh0": 1.1}


@cpu_only
def test_triton_float16_error_against_fla():
    # one call, the model's (gates as logits), varlen with initial states; fla's op in the interpreter is slow
    inputs, cu, out, ref, names = float16_case(True, [0, 15, 100, 150], True)
    theirs = fla_forward_backward(inputs, cu, True)
    assert [None if t is None else t.shape for t in theirs] == [None if t is None else t.shape for t in out]
    ours_err, fla_err = per_head_errors(out, ref, names), per_head_errors(theirs, ref, names)
    over = {f"{name} at normalizer {NORMALIZERS[h]}": f"ours {a:.2e}, fla {b:.2e}" for name in names
            for h, (a, b) in enumerate(zip(ours_err[name], fla_err[name])) if not a <= FLA_RATIO[name] * b}
    assert not over, f"float16 error against fp64 above {FLA_RATIO} times fla's: {over}"


NEAR_CANCEL_CASES = [  # (device, dtype, bound): the interpreter's float16, the compiled kernels' bf16 (8x coarser)
    pytest.param("cpu", torch.float16, 2e-3, marks=cpu_only),
    pytest.param("cuda", torch.bfloat16, 1.2e-2, marks=needs_cuda),
]


@pytest.mark.parametrize("device,dtype,bound", NEAR_CANCEL_CASES)
def test_a_token_whose_query_and_key_nearly_cancel_gets_its_own_score_and_dv_to_input_precision(device, dtype, bound):
    # the single-reference scores take q and k through rounded factors exp(+-(b - b_r)); where q_0 . k_0 is small
    # against |q_0| |k_0|, a diagonal score made from them is several percent off, and so is dv_0 wherever token
    # 0's own output gradient dominates (in a model: a sequence's first token). The diagonal is made from q and k.
    torch.manual_seed(0)
    K, V = 64, 64
    q, k = torch.randn(1, 64, 1, K), torch.randn(1, 64, 1, K)
    q0, k0 = q[0, 0, 0], k[0, 0, 0]
    k[0, 0, 0] = k0 - (k0 @ q0) / (q0 @ q0) * q0 + 0.0005 * q0  # q_0 . k_0 = 0.0005 |q_0|^2, 0.05% of |q_0| |k_0|
    q, k, v = (x.to(device, dtype) for x in (q, k, torch.randn(1, 64, 1, V)))
    gk = torch.full((1, 64, 1, K), -0.05, device=device)  # a slow gate: one reference row for the whole chunk
    do = torch.zeros(1, 64, 1, V, device=device)
    do[0, 0] = 1.0  # only token 0's output is asked for: dv_0 = A_00 do_0
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = chunk_gla(*leaves, gk, backend="triton")
    (o.float() * do).sum().backward()
    reference = [x.float().clone().requires_grad_() for x in (q, k, v)]
    o32, _ = naive_recurrent_gla(*reference, gk)
    (o32 * do).sum().backward()
    assert rel_rms(o[0, 0], o32[0, 0]) < bound
    assert rel_rms(leaves[2].grad[0, 0], reference[2].grad[0, 0]) < bound


@cpu_only
def test_a_tokens_own_score_gives_its_gate_no_gradient():
    # o_0 = (q_0 . k_0) v_0 does not depend on the gate (the first token's own score has no decay): with only o_0
    # asked for, the gate's gradient is zero. Through rounded factors exp(+-(b - b_r)), q dq - k dk left float16
    # rounding of q_0 k_0 dA_00 in it, one part in a few thousand of each term.
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 64, 1, 64).half() for _ in range(3))
    gk = torch.full((1, 64, 1, 64), -0.05, requires_grad=True)  # slow: one reference row, exp(+-1.55) at row 0
    do = torch.zeros(1, 64, 1, 64)
    do[0, 0] = 1.0
    o, _ = chunk_gla(q, k, v, gk, backend="triton")
    (o.float() * do).sum().backward()
    scale = (q[0, 0, 0].float() * k[0, 0, 0].float() * (v[0, 0, 0].float() @ do[0, 0, 0])).abs().max() / 8
    assert gk.grad.abs().max() <= 1e-6 * scale, gk.grad.abs().max() / scale
