"""The chunked PyTorch GLA against the naive fp32 recurrence (the oracle in ops/gla/naive.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import gla_inputs
from fabric_lin.ops.gla import chunk_gla, chunk_gla_torch, naive_recurrent_gla, recurrent_gla_step


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("H,K,V", [(2, 16, 16), (3, 32, 16), (1, 8, 40)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_naive(T, H, K, V, with_state):
    q, k, v, gk, h0 = gla_inputs(2, T, H, K, V, seed=T)
    h0 = h0 if with_state else None
    o_ref, s_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o, s = chunk_gla_torch(q, k, v, gk, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)
    o2, s2 = chunk_gla_torch(q, k, v, gk, initial_state=h0)
    assert s2 is None and torch.equal(o2, o)


def test_custom_scale():
    q, k, v, gk, _ = gla_inputs(1, 70, 2, 16, 16)
    o_ref, _ = naive_recurrent_gla(q, k, v, gk, scale=0.37)
    o, _ = chunk_gla_torch(q, k, v, gk, scale=0.37)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)


def test_strongest_gates_over_2048_steps_stay_finite_and_exact():
    # logsigmoid(-20)/16 per step is about -1.25: the cumulative gate over a 64-token chunk reaches
    # -80, where exp(-b) overflows fp32 if the chunk is not handled stably.
    q, k, v, gk, h0 = gla_inputs(1, 2048, 2, 16, 16, gate_logit=-20.0)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o, s = chunk_gla_torch(q, k, v, gk, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)
    # mixed: strong and weak gates in one chunk
    q, k, v, _, _ = gla_inputs(1, 300, 2, 16, 16, seed=3)
    logits = torch.where(torch.rand(1, 300, 2, 16) < 0.5, torch.tensor(-20.0), torch.tensor(8.0))
    gk = F.logsigmoid(logits) / 16
    torch.testing.assert_close(chunk_gla_torch(q, k, v, gk)[0], naive_recurrent_gla(q, k, v, gk)[0], rtol=1e-4, atol=1e-4)
    # saturated: logsigmoid(-3000)/16 = -187.5 a step, exp(187.5) past fp32 within one step; every factor the
    # chunked form makes must still be exp of a difference <= 0 (a state then reaches only its own token)
    q, k, v, gk, h0 = gla_inputs(1, 64, 1, 16, 16, seed=4, gate_logit=-3000.0)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o, s = chunk_gla_torch(q, k, v, gk, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [1, 63, 130])
def test_gradients_match_naive(T):
    inputs = [t.requires_grad_() for t in gla_inputs(2, T, 2, 16, 24, seed=7)]
    q, k, v, gk, h0 = inputs
    grad_o = torch.randn(2, T, 2, 24)
    grad_s = torch.randn(2, 2, 16, 24)

    def grads(fn):
        o, s = fn(q, k, v, gk, initial_state=h0, output_final_state=True)
        return torch.autograd.grad((o * grad_o).sum() + (s * grad_s).sum(), inputs)

    for name, g, g_ref in zip(["dq", "dk", "dv", "dgk", "dh0"], grads(chunk_gla_torch), grads(naive_recurrent_gla)):
        torch.testing.assert_close(g, g_ref, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name}: {m}")


def test_varlen_equals_documents_run_separately():
    offsets = [0, 15, 100, 101, 230, 300]
    q, k, v, gk, _ = gla_inputs(1, 300, 2, 16, 32, seed=11)
    h0 = torch.randn(len(offsets) - 1, 2, 16, 32)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    o, s = chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, backend="torch")
    for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        o_doc, s_doc = naive_recurrent_gla(
            q[:, start:end], k[:, start:end], v[:, start:end], gk[:, start:end], initial_state=h0[i : i + 1], output_final_state=True
        )
        torch.testing.assert_close(o[:, start:end], o_doc, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s[i : i + 1], s_doc, rtol=1e-4, atol=1e-4)


def test_varlen_gradients_match_naive():
    inputs = [t.requires_grad_() for t in gla_inputs(1, 150, 2, 16, 16, seed=5)]
    q, k, v, gk, _ = inputs
    cu_seqlens = torch.tensor([0, 40, 41, 150])
    w = torch.randn(1, 150, 2, 16)
    g = torch.autograd.grad((chunk_gla_torch(q, k, v, gk, cu_seqlens=cu_seqlens)[0] * w).sum(), (q, k, v, gk))
    g_ref = torch.autograd.grad((naive_recurrent_gla(q, k, v, gk, cu_seqlens=cu_seqlens)[0] * w).sum(), (q, k, v, gk))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_recurrent_step_continues_the_chunked_state():
    q, k, v, gk, h0 = gla_inputs(2, 90, 2, 16, 8)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    _, state = chunk_gla_torch(q[:, :70], k[:, :70], v[:, :70], gk[:, :70], initial_state=h0, output_final_state=True)
    for t in range(70, 90):
        o_t, state = recurrent_gla_step(q[:, t], k[:, t], v[:, t], gk[:, t], state)
        torch.testing.assert_close(o_t, o_ref[:, t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, s_ref, rtol=1e-4, atol=1e-4)


def test_unknown_backend_is_rejected():
    q, k, v, gk, _ = gla_inputs(1, 4, 1, 8, 8)
    with pytest.raises(ValueError, match="backend"):
        chunk_gla(q, k, v, gk, backend="cuda")


def test_the_kernels_on_cpu_tensors_outside_the_interpreter_are_refused_naming_both_ways(monkeypatch):
    """backend='triton', or a model built with fused=True, on CPU tensors without Triton's interpreter: one error that
    says what runs the kernels and what to use instead, where Triton stopped at the launch with '0 active drivers'."""
    from fabric_lin.config import Config
    from fabric_lin.model import GPT

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = (r"^backend='triton' runs the kernels on CUDA tensors, or on the CPU in Triton's interpreter "
               r"\(TRITON_INTERPRET=1 set before fabric_lin is imported\); these are on cpu: use backend='torch' "
               r"\(a model: GPT\(config, fused=False\)\)$")
    q, k, v, gk, _ = gla_inputs(1, 4, 1, 16, 16)
    with pytest.raises(ValueError, match=message):
        chunk_gla(q, k, v, gk, backend="triton")
    model = GPT(Config.from_name("gla-debug", num_layers=1), fused=True)
    with pytest.raises(ValueError, match=message):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("normalizer", [0, -16.0, float("nan")])
def test_from_logits_rejects_a_normalizer_that_is_not_positive(backend, normalizer):
    from fabric_lin.ops.gla import chunk_gla_from_logits

    q, k, v, logits, _ = gla_inputs(1, 4, 1, 8, 8)
    with pytest.raises(ValueError, match="normalizer must be a positive number"):
        chunk_gla_from_logits(q, k, v, logits, normalizer, backend=backend)


def test_log_decay_matches_logsigmoid_and_keeps_the_logits_dtype():
    from fabric_lin.ops.gla.gate import log_decay

    g = torch.Generator().manual_seed(11)
    logits64 = (4 * torch.randn(3, 50, 4, 8, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref64 = logits64.detach().clone().requires_grad_(True)
    out = log_decay(logits64, 16)
    expected = F.logsigmoid(ref64.float()) / 16
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float32 and (out <= 0).all()
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(logits64.grad, ref64.grad)
    # in bf16 the backward keeps the bf16 logits, not an fp32 copy
    saved = []
    logits16 = torch.randn(2, 5, 3, generator=g).to(torch.bfloat16).requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        log_decay(logits16, 16).sum().backward()
    assert saved == [torch.bfloat16] and logits16.grad.dtype == torch.bfloat16


def test_levels_share_against_a_loop_over_chunks():
    # independent: each (sequence, chunk, head) checked row by row, the last row standing in past the end
    from fabric_lin.ops.gla.gate import SINGLE_REFERENCE_LIMIT, levels_share

    def by_loop(gk, bounds, limit=SINGLE_REFERENCE_LIMIT):
        past = total = 0
        for s, e in zip(bounds[:-1], bounds[1:]):
            for c0 in range(s, e, 64):
                rows = gk[0, c0 : min(c0 + 64, e)].double()
                b = rows.cumsum(0)
                ref = b[min(31, len(b) - 1)]
                for h in range(gk.shape[2]):
                    total += 1
                    past += bool((b[:, h] - ref[h]).abs().max() > limit)
        return past / total

    g = torch.Generator().manual_seed(0)
    slow = F.logsigmoid(torch.randn(1, 300, 3, 8, generator=g)) / 16
    fast = F.logsigmoid(torch.randn(1, 300, 3, 8, generator=g) - 30) / 16  # ~1.9 per step: ~60 over half a chunk
    assert levels_share(slow) == 0.0 and levels_share(fast) == 1.0
    mixed = torch.where(torch.arange(300)[None, :, None, None] >= 150, fast, slow)
    mixed[:, :, 1] = slow[:, :, 1]  # one head slow throughout
    for cu in (None, torch.tensor([0, 7, 100, 230, 300])):
        bounds = [0, 300] if cu is None else cu.tolist()
        assert levels_share(mixed, cu) == pytest.approx(by_loop(mixed, bounds))
        assert 0 < levels_share(mixed, cu) < 1
    # float16's limit, log(65504 / 256) = 5.5: gates of ~-0.25 a step (~8 over half a chunk) are past it there only
    middling = F.logsigmoid(torch.randn(1, 300, 3, 8, generator=g) - 4) / 16
    assert levels_share(middling) == 0.0 and levels_share(middling, dtype=torch.float32) == 0.0
    assert levels_share(middling, dtype=torch.float16) == 1.0
    fp16_limit = math.log(65504 / 256)
    assert levels_share(mixed, dtype=torch.float16) == pytest.approx(by_loop(mixed, [0, 300], limit=fp16_limit))
    # the reference is row 31, the last of the first half (as the kernels take it): steps of -30 at rows 1 and 32
    # put b at 0, -30 (rows 1..31) and -60 (rows 32..63), 30 from row 31's either way but 60 from row 32's
    steps = torch.zeros(1, 64, 1, 1)
    steps[0, [1, 32]] = -30.0
    assert levels_share(steps, dtype=torch.float32) == 0.0
