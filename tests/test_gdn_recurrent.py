"""The fused Gated DeltaNet decoding step (fabric_lin/ops/gdn/fused_recurrent.py: one token of the gated delta rule
in one Triton launch) against a token loop in fp64 (conftest.gdn_step_reference), chained over a sequence against
the naive recurrence, and its argument errors on either backend. On a machine without CUDA the kernel runs in
Triton's interpreter (TRITON_INTERPRET=1), in fp32; with CUDA, bf16 inputs are compared with the fp32 step of
recurrent.py. Compiled as an opaque op and for sm_90, it is checked with the convolution's step in
test_short_conv.py.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from conftest import gdn_inputs, gdn_step_reference  # noqa: E402
from helpers import GDN_STEP_SHAPE, assert_close  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cpu_only
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("gate", ["slow", "fast"])
@pytest.mark.parametrize("K,V", [(48, 96), (128, 40)])  # 96: two value tiles, the second partial
def test_gdn_step_matches_an_fp64_step(use_qk_l2norm, gate, K, V):
    from fabric_lin.ops.gdn.fused_recurrent import fused_recurrent_gated_delta_rule_step_triton

    q, k, v, g, beta, state = gdn_inputs(2, 3, K, V, seed=K + V, gate=gate)
    if not use_qk_l2norm:  # keep ||k|| about 1, as the model's normalised keys, so the state stays bounded
        q, k = q / K**0.5, k / K**0.5
    else:  # a short q and k (squared norms ~ 5e-7), where the eps inside the square root matters
        q[0, 0], k[0, 1] = q[0, 0] * 1e-4, k[0, 1] * 1e-4
    for s in (state, None):
        for scale in (None, 0.3):
            o, s_new = fused_recurrent_gated_delta_rule_step_triton(q, k, v, g, beta, s, scale, use_qk_l2norm)
            o_ref, s_ref = gdn_step_reference(q, k, v, g, beta, s, K**-0.5 if scale is None else scale, use_qk_l2norm)
            assert o.dtype == torch.float32 and s_new.dtype == torch.float32 and s_new.shape == (2, 3, K, V)
            assert_close(o, o_ref, f"o (state {'given' if s is not None else 'None'}, scale {scale})")
            assert_close(s_new, s_ref, "state")
    # the state is not changed in place
    torch.testing.assert_close(state, gdn_inputs(2, 3, K, V, seed=K + V, gate=gate)[5], rtol=0, atol=0)


@cpu_only
@pytest.mark.parametrize("gate", ["slow", "fast"])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_gdn_steps_chained_equal_the_naive_recurrence(gate, use_qk_l2norm):
    from fabric_lin.ops.gdn.fused_recurrent import fused_recurrent_gated_delta_rule_step_triton
    from fabric_lin.ops.gdn.l2norm import l2norm
    from fabric_lin.ops.gdn.naive import naive_recurrent_gated_delta_rule

    B, T, H, K, V = 2, 24, 2, 48, 96
    q, k, v, g, beta, h0 = gdn_inputs(B, H, K, V, seed=1, gate=gate, T=T)
    if not use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    for initial in (h0, None):
        state, outs = initial, []
        for t in range(T):
            o, state = fused_recurrent_gated_delta_rule_step_triton(
                q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, use_qk_l2norm=use_qk_l2norm
            )
            outs.append(o)
        qn, kn = (l2norm(q), l2norm(k)) if use_qk_l2norm else (q, k)
        o_ref, s_ref = naive_recurrent_gated_delta_rule(qn, kn, v, g, beta, initial_state=initial,
                                                        output_final_state=True)
        assert_close(torch.stack(outs, dim=1), o_ref, "chained o", tol=1e-5)
        assert_close(state, s_ref, "final state", tol=1e-5)


@cpu_only
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gdn_step_errors_name_the_argument(backend):
    from fabric_lin.ops.gdn import fused_recurrent_gated_delta_rule_step as step

    q, k, v, g, beta, state = gdn_inputs(2, 3, 16, 32)
    cases = [
        ((q[0], k, v, g, beta, state), r"q must be \[B, H, K\], got shape \(3, 16\)"),
        ((q, k[:, :, :8], v, g, beta, state), r"k must be \[B, H, K\] = \(2, 3, 16\) like q, got shape \(2, 3, 8\)"),
        ((q, k, v[:1], g, beta, state), r"v must be \[B, H, V\]"),
        ((q, k, v, g[:, :, None], beta, state), r"g must be \[B, H\] = \(2, 3\)"),
        ((q, k, v, g, beta[:1], state), r"beta must be \[B, H\] = \(2, 3\)"),
        ((q, k, v, g, beta, state[..., :16]), r"state must be \[B, H, K, V\] = \(2, 3, 16, 32\), got shape \(2, 3, 16, 16\)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule_step: " + message):
            step(*args, backend=backend)


# ---------------------------------------------------------------- GPU: bf16 against fp32 references


@needs_cuda
@pytest.mark.parametrize("gate", ["slow", "fast"])
def test_gpu_gdn_step_bf16_matches_fp32(gate):
    from conftest import rel_rms

    from fabric_lin.ops.gdn.fused_recurrent import fused_recurrent_gated_delta_rule_step_triton
    from fabric_lin.ops.gdn.recurrent import recurrent_gated_delta_rule_step

    q, k, v, g, beta, state = (t.cuda() for t in gdn_inputs(*GDN_STEP_SHAPE, gate=gate))
    o_ref, s_ref = recurrent_gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm=True)
    o, s = fused_recurrent_gated_delta_rule_step_triton(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, state,
                                                        use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, o_ref) < 0.01 and rel_rms(s, s_ref) < 0.01
