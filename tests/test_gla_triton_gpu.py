"""The Triton GLA kernels on a GPU, bf16 inputs on the real shapes against the fp32 naive recurrence by relative RMS
error: the shipped launch and every setting the launch search can choose, both state pass forms, gates as logits,
strong gates, varlen; also the fused decoding step and the op under torch.compile. Skipped without CUDA. The
interpreter's tests are in test_gla_triton.py, and so is the float16 test, which runs on a GPU too; the inputs, the op
and the references both files use are in conftest.py.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import (  # noqa: E402
    GLA_NAMES, gla_forward_backward, gla_inputs, gpu_of, mixed_spread_gates, naive_from_logits, rel_rms,
    triton_from_logits, triton_gla,
)

from fabric_lin.ops.gla import chunk_gla, fused_recurrent_gla_step, naive_recurrent_gla, recurrent_gla_step  # noqa: E402
from fabric_lin.ops.gla.launch import SHIPPED  # noqa: E402
from fabric_lin.ops.gla.tune import with_settings  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def check_bf16(B, T, H, K, V, cu_seqlens=None, seed=0, strong_logit=None, launch=None):
    """With strong_logit, the second half of each sequence decays fast in the first quarter of the key columns
    (mixed_spread_gates), so that both the single-reference scores and the levels are taken."""
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k, v, gk, h0 = gla_inputs(B, T, H, K, V, N=N, seed=seed, device="cuda", dtype=torch.bfloat16)
    if strong_logit is not None:
        gk = torch.cat([mixed_spread_gates(T, H, K, slice(T // 2, T), slice(0, max(1, K // 4)), seed=seed + b,
                                           strong_logit=strong_logit) for b in range(B)]).cuda()
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
    ref = gla_forward_backward(naive_recurrent_gla, q.float(), k.float(), v.float(), gk, h0, cu)
    out = gla_forward_backward(lambda *a, **kw: triton_gla(*a, launch=launch, **kw), q, k, v, gk, h0, cu)
    errors = {name: rel_rms(a, b) for name, a, b in zip(GLA_NAMES, out, ref)}
    assert out[0].dtype == torch.bfloat16 and out[2].dtype == torch.bfloat16
    bad = {name: e for name, e in errors.items() if not e <= 0.005}
    assert not bad, f"relative RMS error above 0.005: {bad} (all: {errors})"


@needs_cuda
@pytest.mark.parametrize(
    "B,T,H,K,V",
    [(2, 63, 2, 64, 64), (1, 1000, 2, 128, 256), (2, 300, 2, 100, 100), (2, 2048, 8, 128, 128), (1, 2, 1, 256, 32)],
)
def test_gpu_bf16_matches_fp32_naive(B, T, H, K, V):
    check_bf16(B, T, H, K, V)


# settings the launch search (tune.py) or a user (`launch=`) can choose, on the same shapes: the earlier
# state tiles and an 8-warp output kernel, pipelined loads with narrower key tiles, register caps on every
# kernel, the search's 16-warp programs, one key tile per state-pass program, 8-warp single-reference dq/dk
# (output kernels over 32-wide value tiles failed on an H200; the launch keeps them at least 64 wide, so the
# V=32 shapes check that guard)
SEARCHED_SETTINGS = [
    {},
    {"state.BV": 64, "output.BV": 128, "output.warps": 8},
    {"output.stages": 2, "dv.stages": 2, "output.BK": 32, "dqk.BK": 32},
    {"dqk.maxnreg": 128, "dv.maxnreg": 168, "output.maxnreg": 168, "state.maxnreg": 168},
    {"state.warps": 4},
    {"output.warps": 8},
    {"dv.BK": 64},  # the dv kernel looping over key tiles (K > 64) inside each value tile
    {"output.warps": 16, "dqk.warps": 16},
    {"state.BK": 128},  # one key tile per state-pass program (K <= 128)
    {"dqk_single_warps": 8},
]


@needs_cuda
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("settings", SEARCHED_SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "shipped")
@pytest.mark.parametrize(
    "B,T,H,K,V",
    [(2, 63, 2, 64, 64), (1, 1000, 2, 128, 256), (2, 300, 2, 100, 100), (2, 2048, 8, 128, 128), (1, 2, 1, 256, 32),
     (2, 63, 1, 64, 32)],
)
def test_gpu_bf16_searchable_settings_match_fp32_naive(monkeypatch, split, settings, B, T, H, K, V):
    gpu_of(monkeypatch, 10**6 if split else 1)
    check_bf16(B, T, H, K, V, strong_logit=-30.0, launch=with_settings(SHIPPED, settings))  # chunks on both sides of the limit


@needs_cuda
# one chunk at V = 64, where the gate cumsum writes the decayed keys; at V = 32 (32-wide state tiles) every
# kernel forms them itself
@pytest.mark.parametrize("B,T,H,K,V,offsets", [(2, 1000, 4, 128, 256, None), (1, 2000, 4, 128, 128, [0, 15, 100, 300, 1200, 2000]),
                                                (2, 63, 2, 64, 64, None), (1, 2, 1, 256, 32, None), (2, 63, 1, 64, 32, None)])
def test_gpu_bf16_from_logits_matches_fp32_naive(B, T, H, K, V, offsets):
    N = B if offsets is None else len(offsets) - 1
    q, k, v, _, h0 = gla_inputs(B, T, H, K, V, N=N, seed=3, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(B, T, H, K, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device="cuda")
    ref = gla_forward_backward(naive_from_logits, q.float(), k.float(), v.float(), logits.float(), h0, cu)
    out = gla_forward_backward(triton_from_logits, q, k, v, logits, h0, cu)
    errors = {name: rel_rms(a.float(), b) for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dlogits", "dh0"], out, ref)}
    bad = {name: e for name, e in errors.items() if not e <= 0.005}
    assert not bad, f"relative RMS error above 0.005: {bad} (all: {errors})"


@needs_cuda
@pytest.mark.parametrize("strong_logit", [-30.0, -20.0, -3000.0])
def test_gpu_bf16_mixed_gate_spreads_match_fp32_naive(strong_logit):
    # the second half of the sequence decays fast in a quarter of the key columns (the first key tile of its
    # chunks): past the single-reference limit (-30, -3000) or just inside it, factors up to ~exp(40) (-20)
    check_bf16(2, 1000, 2, 128, 256, seed=2, strong_logit=strong_logit)


@needs_cuda
@pytest.mark.parametrize("split", [False, True])
def test_gpu_bf16_varlen_matches_fp32_naive(monkeypatch, split):
    gpu_of(monkeypatch, 10**6 if split else 1)
    check_bf16(1, 2000, 4, 128, 128, cu_seqlens=[0, 15, 100, 300, 1200, 2000])


@needs_cuda
def test_gpu_bf16_scan_state_pass_matches_fp32_naive(monkeypatch):
    gpu_of(monkeypatch, 10**6)
    check_bf16(1, 1000, 2, 128, 256)


@needs_cuda
def test_gpu_fused_recurrent_step():
    B, H, K, V = 3, 4, 128, 256
    q, k, gk = (torch.randn(B, H, K, device="cuda") for _ in range(3))
    v = torch.randn(B, H, V, device="cuda")
    gk = F.logsigmoid(gk) / 16
    state = torch.randn(B, H, K, V, device="cuda")
    o_ref, s_ref = recurrent_gla_step(q, k, v, gk, state)
    o, s = fused_recurrent_gla_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), gk, state)
    assert rel_rms(o, o_ref) < 0.01 and rel_rms(s, s_ref) < 0.01


@needs_cuda
def test_gpu_compiled_model_step_uses_the_op():
    # torch.compile keeps the custom op opaque: the compiled function matches eager, with no graph break
    q, k, v, gk, h0 = gla_inputs(2, 256, 4, 64, 128, device="cuda", dtype=torch.bfloat16)

    def f(q, k, v, gk, h0):
        o, ht = chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
        return o.float().square().mean() + ht.mean()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(q, k, v, gk, h0)
    assert explain.graph_break_count == 0, explain.break_reasons
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gk, h0)]
    loss = torch.compile(f, fullgraph=True)(*leaves)
    loss.backward()
    leaves_ref = [x.clone().requires_grad_(True) for x in (q, k, v, gk, h0)]
    loss_ref = f(*leaves_ref)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=1e-3)
    for a, b in zip(leaves, leaves_ref):
        assert rel_rms(a.grad, b.grad) < 1e-3
