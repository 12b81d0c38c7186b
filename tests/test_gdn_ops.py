"""The gated delta rule ops (fabric_lin/ops/gdn) against an fp64 recurrence (conftest.py).

The reference is deliberately independent of the code under test: its own loop, its own
L2 normalisation, fp64 throughout. Errors are measured as max|x - ref| / max|ref| per tensor.
"""
import math

import pytest
import torch
from conftest import gated_delta_rule_fp64 as reference_fp64, gated_delta_rule_inputs
from helpers import leaves, rel_err

from fabric_lin.ops.gdn import (
    chunk_gated_delta_rule,
    l2norm,
    naive_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_step,
)

TOL = 1e-4
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


pytestmark = pytest.mark.usefixtures("one_thread")  # every op here is tiny (conftest.one_thread)


def outputs_and_grads(fn, inputs, with_state, seed=1, **kwargs):
    """Run fn(q, k, v, g, beta, initial_state=..., **kwargs) -> (o, final); return o, final and the
    gradients of sum(o * do) + sum(final * dfinal) for random do, dfinal with respect to every input."""
    q, k, v, g, beta, h0 = inputs
    o, final = fn(q, k, v, g, beta, initial_state=h0 if with_state else None, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * do).sum() + (final.double() * dfinal).sum()
    wrt = [q, k, v, g, beta] + ([h0] if with_state else [])
    return o, final, torch.autograd.grad(loss, wrt)


def chunk_op(q, k, v, g, beta, initial_state=None, **kwargs):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, backend="torch", **kwargs)


def fp64_op(q, k, v, g, beta, initial_state=None, **kwargs):
    return reference_fp64(q, k, v, g, beta, initial_state=initial_state, **kwargs)


def naive_op(q, k, v, g, beta, initial_state=None, **kwargs):
    return naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, **kwargs)


def assert_matches(fn, inputs, with_state, tol=TOL, fn_kwargs=None, ref_kwargs=None):
    o, final, grads = outputs_and_grads(fn, inputs, with_state, **(fn_kwargs or {}))
    o_ref, final_ref, grads_ref = outputs_and_grads(fp64_op, inputs, with_state, **(ref_kwargs or {}))
    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(final, final_ref)}
    errors.update({name: rel_err(x, x_ref) for name, x, x_ref in zip(GRAD_NAMES, grads, grads_ref)})
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"
    return errors


@pytest.mark.parametrize("T", [1, 37, 129, 300])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("gate", ["fast", "slow", "mixed", "forgetting"])
def test_chunk_matches_fp64_recurrence(T, with_state, use_qk_l2norm, gate):
    inputs = leaves(*gated_delta_rule_inputs(2, T, 2, 24, 40, gate=gate, normalized_keys=not use_qk_l2norm, seed=T))
    kwargs = {"use_qk_l2norm": use_qk_l2norm}
    assert_matches(chunk_op, inputs, with_state, fn_kwargs=kwargs, ref_kwargs=kwargs)


# documents of length 1, 1, 1, 37, 0, 1, 129, 1, 129 (an empty one between a 37 and a 1)
VARLEN_OFFSETS = [0, 1, 2, 3, 40, 40, 41, 170, 171, 300]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("gate", ["fast", "slow", "mixed", "forgetting"])
def test_varlen_matches_fp64_recurrence_per_document(with_state, use_qk_l2norm, gate):
    cu_seqlens = torch.tensor(VARLEN_OFFSETS, dtype=torch.int32)
    n_docs = len(VARLEN_OFFSETS) - 1
    inputs = leaves(*gated_delta_rule_inputs(1, 300, 2, 24, 40, gate=gate, normalized_keys=not use_qk_l2norm, n_states=n_docs, seed=5))
    kwargs = {"use_qk_l2norm": use_qk_l2norm, "cu_seqlens": cu_seqlens}
    assert_matches(chunk_op, inputs, with_state, fn_kwargs=kwargs, ref_kwargs=kwargs)


def test_varlen_empty_document_keeps_its_initial_state():
    cu_seqlens = torch.tensor(VARLEN_OFFSETS, dtype=torch.int64)
    q, k, v, g, beta, h0 = gated_delta_rule_inputs(1, 300, 2, 24, 40, n_states=len(VARLEN_OFFSETS) - 1, seed=6)
    _, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    empty = VARLEN_OFFSETS.index(40)  # document 4 spans [40, 40)
    assert torch.equal(final[empty], h0[empty])
    assert not torch.allclose(final[empty - 1], h0[empty - 1])


@pytest.mark.parametrize("T", [1, 37, 129])
@pytest.mark.parametrize("gate", ["fast", "mixed"])
def test_naive_matches_fp64_recurrence(T, gate):
    inputs = leaves(*gated_delta_rule_inputs(2, T, 2, 24, 40, gate=gate, seed=T + 1))
    assert_matches(naive_op, inputs, with_state=True)


def test_naive_varlen_matches_fp64_recurrence():
    cu_seqlens = torch.tensor(VARLEN_OFFSETS)
    inputs = leaves(*gated_delta_rule_inputs(1, 300, 2, 8, 12, n_states=len(VARLEN_OFFSETS) - 1, seed=8))
    kwargs = {"cu_seqlens": cu_seqlens}
    assert_matches(naive_op, inputs, with_state=True, fn_kwargs=kwargs, ref_kwargs=kwargs)


@pytest.mark.parametrize("gate", ["slow", "mixed"])
def test_long_sequence_is_accurate_to_fp32(gate):
    # 32 chunks: the state crosses 31 chunk boundaries in fp32; slow gates let errors accumulate
    inputs = leaves(*gated_delta_rule_inputs(1, 2048, 2, 16, 16, gate=gate, normalized_keys=False, seed=9))
    kwargs = {"use_qk_l2norm": True}
    assert_matches(chunk_op, inputs, with_state=True, fn_kwargs=kwargs, ref_kwargs=kwargs)


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_decoding_steps_continue_the_chunked_op(use_qk_l2norm):
    B, T, H, K, V = 2, 129, 3, 24, 40
    q, k, v, g, beta, h0 = gated_delta_rule_inputs(B, T, H, K, V, normalized_keys=not use_qk_l2norm, seed=10)
    o, final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=use_qk_l2norm
    )
    state, steps = h0, []
    for t in range(T):
        o_t, state = recurrent_gated_delta_rule_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, use_qk_l2norm=use_qk_l2norm
        )
        steps.append(o_t)
    assert rel_err(torch.stack(steps, dim=1), o) <= 1e-5
    assert rel_err(state, final) <= 1e-5
    # a prefill of the first 100 tokens, then steps, is the same sequence
    _, prefill_state = chunk_gated_delta_rule(
        q[:, :100], k[:, :100], v[:, :100], g[:, :100], beta[:, :100], initial_state=h0,
        output_final_state=True, use_qk_l2norm=use_qk_l2norm,
    )
    o_100, _ = recurrent_gated_delta_rule_step(
        q[:, 100], k[:, 100], v[:, 100], g[:, 100], beta[:, 100], prefill_state, use_qk_l2norm=use_qk_l2norm
    )
    assert rel_err(o_100, o[:, 100]) <= 1e-5


def test_decoding_step_from_zero_state_matches_fp64():
    q, k, v, g, beta, _ = gated_delta_rule_inputs(2, 1, 2, 24, 40, seed=11)
    o, state = recurrent_gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], None)
    o_ref, state_ref = reference_fp64(q, k, v, g, beta)
    assert rel_err(o, o_ref[:, 0]) <= TOL and rel_err(state, state_ref) <= TOL


def test_l2norm_puts_eps_inside_the_square_root():
    # fla's l2norm: x / sqrt(sum(x^2) + 1e-6). For |x| = 1e-3 that is 1/sqrt(2) of x / |x|, where
    # F.normalize (eps as a floor on the norm) would give the unit vector.
    x = torch.tensor([[1e-3, 0.0], [3.0, 4.0]])
    y = l2norm(x)
    torch.testing.assert_close(y[0], torch.tensor([1e-3 / math.sqrt(2e-6), 0.0]))
    torch.testing.assert_close(y[1], torch.tensor([0.6, 0.8]))


def test_custom_scale_and_no_final_state():
    q, k, v, g, beta, _ = gated_delta_rule_inputs(1, 70, 2, 24, 40, seed=12)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.37)
    o_ref, _ = reference_fp64(q, k, v, g, beta, scale=0.37)
    assert final is None
    assert rel_err(o, o_ref) <= TOL


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    q, k, v, g, beta, h0 = gated_delta_rule_inputs(1, 100, 2, 24, 40, normalized_keys=False, seed=13)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    o_ref, final_ref = reference_fp64(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-2  # bf16 rounding of the output
    assert rel_err(final, final_ref) <= 1e-4  # the arithmetic and the state are fp32


def valid_inputs(B=2, T=10, H=2, K=8, V=6):
    return dict(
        q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
        g=-torch.rand(B, T, H), beta=torch.rand(B, T, H),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.randn(2, 10, 16)), r"q must be \[B, T, H, K\]"),
        (dict(k=torch.randn(2, 10, 2, 9)), r"k must be \[B, T, H, K\] = \(2, 10, 2, 8\)"),
        (dict(v=torch.randn(2, 11, 2, 6)), r"v must be \[B, T, H, V\]"),
        (dict(g=-torch.rand(2, 10, 2, 8)), r"g must be \[B, T, H\] = \(2, 10, 2\)"),
        (dict(beta=torch.rand(2, 10)), r"beta must be \[B, T, H\] = \(2, 10, 2\)"),
        (dict(g=-torch.rand(2, 10, 2).bfloat16()), r"g must be float32"),
        (dict(v=torch.randn(2, 10, 2, 6).double()), r"q, k and v must share a dtype"),
        (dict(initial_state=torch.zeros(2, 2, 6, 8)), r"initial_state must be \[N, H, K, V\] = \(2, 2, 8, 6\)"),
        (dict(initial_state=torch.zeros(2, 2, 8, 6).bfloat16()), r"initial_state must be float32"),
        (dict(cu_seqlens=torch.tensor([0, 4, 10])), r"cu_seqlens needs batch size 1.*B = 2"),
        (dict(backend="cuda"), r"backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    ],
)
def test_bad_inputs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(**{**valid_inputs(), **change})


@pytest.mark.parametrize(
    "cu_seqlens, message",
    [
        (torch.tensor([0, 4, 9]), r"rise from 0 to T = 10"),
        (torch.tensor([0, 6, 4, 10]), r"rise from 0 to T = 10"),
        (torch.tensor([0.0, 10.0]), r"1-D integer tensor"),
        (torch.tensor([0]), r"1-D integer tensor"),
    ],
)
def test_bad_cu_seqlens_are_named(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(**valid_inputs(B=1), cu_seqlens=cu_seqlens)


def test_varlen_initial_state_counts_documents():
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \(3, 2, 8, 6\).*documents"):
        chunk_gated_delta_rule(
            **valid_inputs(B=1), cu_seqlens=torch.tensor([0, 2, 5, 10]), initial_state=torch.zeros(1, 2, 8, 6)
        )
