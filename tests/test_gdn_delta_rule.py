"""DeltaNet's delta rule: the gated delta rule's ops called with g=None (fabric_lin/ops/gdn), against an fp64
recurrence written from the rule's definition (conftest.delta_rule_fp64), which has no decay in it at all.

The chunked op on both paths (PyTorch; Triton in its interpreter, fp32, on CPU-only machines), the naive oracle and
the decoding step: every output and gradient (o, the final state, dq, dk, dv, dbeta, dh0), with and without an
initial state, varlen. And what the decay's absence must mean for the code: every Triton launch compiled with
USE_GATE off, with None where the gate, its cumsum and their gradients would go (a spy on the launches), and None, not
zeros, reaching the PyTorch paths.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined, as the other kernel tests set it

import pytest  # noqa: E402
from conftest import compiled_graph_ops, delta_rule_fp64, fla_in_interpreter, gated_delta_rule_inputs  # noqa: E402
from conftest import rel_rms  # noqa: E402
from helpers import rel_err  # noqa: E402

from fabric_lin.ops.gdn import (  # noqa: E402
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_step,
    naive_recurrent_gated_delta_rule,
)

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")

pytestmark = pytest.mark.usefixtures("one_thread")  # every op here is tiny (conftest.one_thread)

TOL = 1e-4
# every chunked launch of a forward and backward pass without the L2 norm (test_gdn_kernel_registers.py lists them)
LAUNCHES = ["_solve_kernel", "_wu_kernel", "_fwd_state_kernel", "_fwd_output_kernel", "_wu_kernel",
            "_bwd_dd_local_kernel", "_fwd_state_kernel", "_bwd_state_kernel", "_bwd_dqkw_kernel", "_wy_bwd_kernel"]
GATE_ARGUMENTS = ("g", "b", "dg", "dg_part")  # the kernels' parameters that hold the gate or something made from it


def delta_inputs(B, T, H, K, V, normalized_keys=True, n_states=None, seed=0):
    """((q, k, v, beta) fp32, h0) of conftest.gated_delta_rule_inputs, its gate left out."""
    q, k, v, _, beta, h0 = gated_delta_rule_inputs(B, T, H, K, V, "slow", normalized_keys, n_states, seed)
    return (q, k, v, beta), h0


def chunk_op(backend):
    def run(q, k, v, beta, **kwargs):
        return chunk_gated_delta_rule(q, k, v, None, beta, backend=backend, **kwargs)
    return run


def naive_op(q, k, v, beta, **kwargs):
    return naive_recurrent_gated_delta_rule(q, k, v, None, beta, **kwargs)


def outputs_and_grads(fn, inputs, h0, seed=1, **kwargs):
    """{name: tensor}: o, the final state and the gradients of sum(o * do) + sum(ht * dht) (random do, dht) with
    respect to q, k, v, beta and h0 where given."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, ht = fn(*leaves, initial_state=h0, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    named = {"o": o, "ht": ht, **{name: x.grad for name, x in zip(["dq", "dk", "dv", "dbeta"], leaves)}}
    if h0 is not None:
        named["dh0"] = h0.grad
    return named


def assert_matches_fp64(fn, inputs, h0, **kwargs):
    out = outputs_and_grads(fn, inputs, h0, **kwargs)
    ref = outputs_and_grads(delta_rule_fp64, inputs, h0, **kwargs)
    assert out.keys() == ref.keys()
    errors = {name: rel_err(out[name], ref[name]) for name in ref}
    bad = {name: e for name, e in errors.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad} (all: {errors})"


BACKENDS = ["torch", pytest.param("triton", marks=cpu_only)]


# ---------------------------------------------------------------- the chunked op, both paths, and the oracle


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_chunk_matches_fp64_delta_rule(backend, with_h0, use_qk_l2norm):
    # 100 tokens: a whole chunk and a partial one; K = 32 and V = 48 leave part of each 64-wide tile masked
    inputs, h0 = delta_inputs(2, 100, 2, 32, 48, normalized_keys=not use_qk_l2norm, seed=1)
    assert_matches_fp64(chunk_op(backend), inputs, h0 if with_h0 else None, use_qk_l2norm=use_qk_l2norm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_h0", [False, True])
def test_varlen_matches_fp64_delta_rule_per_document(backend, with_h0):
    # documents of length 1, 1, 38, 0, 1, 65, 1, 64: single rows, an empty one, one ending a row into its second
    # chunk, one of exactly a chunk; each from its own initial state, with its own final state
    offsets = [0, 1, 2, 40, 40, 41, 106, 107, 171]
    cu = torch.tensor(offsets, dtype=torch.int32)
    inputs, h0 = delta_inputs(1, 171, 2, 32, 48, normalized_keys=False, n_states=len(offsets) - 1, seed=2)
    assert_matches_fp64(chunk_op(backend), inputs, h0 if with_h0 else None, cu_seqlens=cu, use_qk_l2norm=True)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 3, 3, 40, 70]])
def test_naive_oracle_without_a_gate_matches_fp64(cu_seqlens):
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    inputs, h0 = delta_inputs(1, 70, 2, 8, 12, n_states=1 if cu is None else 4, seed=3)
    assert_matches_fp64(naive_op, inputs, h0, cu_seqlens=cu)


@cpu_only
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_triton_error_within_fla_chunk_delta_rule(use_qk_l2norm):
    # where flash-linear-attention is importable (its kernels in the interpreter too): fla's chunk_delta_rule at fp32's
    # rounding of the fp64 reference (which so agrees with an implementation of its own), and no tensor of ours further
    # from it than 1.25 times fla's error on the same inputs, or than fp32's rounding where both are at it
    pytest.importorskip("fla.ops.delta_rule")
    from fla.ops.delta_rule.chunk import ChunkDeltaRuleFunction

    K = 64

    def fla_op(q, k, v, beta, initial_state=None, output_final_state=True, use_qk_l2norm=False):
        # its autograd Function itself: fla's chunk_delta_rule refuses fp32 inputs (a rule for its GPU kernels),
        # and the interpreter's bf16 dots are wrong, so fp32 is the only fair precision here
        return ChunkDeltaRuleFunction.apply(q, k, v, beta, K**-0.5, initial_state, output_final_state, use_qk_l2norm,
                                            None, None, 64)

    inputs, h0 = delta_inputs(1, 150, 2, K, 32, normalized_keys=not use_qk_l2norm, seed=4)
    ref = outputs_and_grads(delta_rule_fp64, inputs, h0, use_qk_l2norm=use_qk_l2norm)
    ours = outputs_and_grads(chunk_op("triton"), inputs, h0, use_qk_l2norm=use_qk_l2norm)
    with fla_in_interpreter():
        theirs = outputs_and_grads(fla_op, inputs, h0, use_qk_l2norm=use_qk_l2norm)
    errors = {name: (rel_rms(ours[name], ref[name]), rel_rms(theirs[name], ref[name])) for name in ref}
    assert all(e[1] < 1e-5 for e in errors.values()), f"fla is not at fp32's rounding of the reference: {errors}"
    worse = {name: e for name, e in errors.items() if not e[0] <= max(1.25 * e[1], 1e-6)}
    assert not worse, f"(ours, fla's) relative RMS errors: {worse} (all: {errors})"


@cpu_only
def test_torch_compile_captures_the_op_without_a_gate():
    # g=None reaches the two custom ops as an absent tensor, and their fake functions shape the outputs without it
    inputs, h0 = delta_inputs(1, 70, 2, 16, 32, seed=5)

    def f(q, k, v, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, None, beta, initial_state=h0, output_final_state=True, backend="triton")
        return o.square().mean() + ht.mean()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(*inputs, h0)
    assert explain.graph_break_count == 0, explain.break_reasons
    leaves = [x.clone().requires_grad_(True) for x in (*inputs, h0)]
    loss, forward_ops, backward_ops = compiled_graph_ops(f, *leaves)
    assert "fabric_lin.chunk_gdn_fwd.default" in forward_ops, forward_ops
    assert "fabric_lin.chunk_gdn_bwd.default" in backward_ops, backward_ops
    leaves_ref = [x.clone().double().requires_grad_(True) for x in (*inputs, h0)]
    o_ref, ht_ref = delta_rule_fp64(*leaves_ref[:4], initial_state=leaves_ref[4])
    loss_ref = o_ref.square().mean() + ht_ref.mean()
    loss_ref.backward()
    assert rel_err(loss, loss_ref) <= TOL
    for name, a, b in zip(["dq", "dk", "dv", "dbeta", "dh0"], leaves, leaves_ref):
        assert rel_err(a.grad, b.grad) <= TOL, name


# ---------------------------------------------------------------- the decoding step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_decoding_steps_match_fp64_delta_rule(backend, use_qk_l2norm):
    # V = 96: the Triton step's two value tiles, the second partly masked; from a state and from None (zeros)
    B, T, H, K, V = 2, 20, 2, 48, 96
    (q, k, v, beta), h0 = delta_inputs(B, T, H, K, V, normalized_keys=not use_qk_l2norm, seed=6)
    for initial in (h0, None):
        o_ref, state_ref = delta_rule_fp64(q, k, v, beta, initial_state=initial, use_qk_l2norm=use_qk_l2norm)
        state, outputs = initial, []
        for t in range(T):
            o_t, state = fused_recurrent_gated_delta_rule_step(q[:, t], k[:, t], v[:, t], None, beta[:, t], state,
                                                               use_qk_l2norm=use_qk_l2norm, backend=backend)
            outputs.append(o_t)
        assert rel_err(torch.stack(outputs, dim=1), o_ref) <= TOL
        assert rel_err(state, state_ref) <= TOL


# ---------------------------------------------------------------- what the decay's absence means for the code


@pytest.fixture
def launches(monkeypatch):
    """Every Triton kernel launch while the test runs, as (kernel name, {parameter: argument}); the kernels run as
    usual. Kernels are JITFunctions when compiled and InterpretedFunctions in the interpreter: the spy wraps the
    launch of whichever this process makes."""
    from fabric_lin.ops.gdn import wy

    kernel_type = type(wy._solve_kernel)
    run = kernel_type.run
    seen = []

    def spy(self, *args, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update({key: value for key, value in kwargs.items() if key in self.arg_names})
        seen.append((self.fn.__name__, named))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(kernel_type, "run", spy)
    return seen


def assert_no_gate(launches):
    for name, args in launches:
        assert args.get("USE_GATE") is False, f"{name} compiled with USE_GATE={args.get('USE_GATE')!r}"
        handed = {arg: type(args[arg]).__name__ for arg in GATE_ARGUMENTS if args.get(arg) is not None}
        assert not handed, f"{name} was handed {handed}"


@cpu_only
def test_triton_path_without_a_gate_hands_no_kernel_a_gate(launches):
    inputs, h0 = delta_inputs(1, 70, 2, 16, 32, seed=7)
    outputs_and_grads(chunk_op("triton"), inputs, h0)
    assert [name for name, _ in launches] == LAUNCHES
    assert_no_gate(launches)
    # one head: a state pass of one program (the interpreter's device counts one multiprocessor), so the backward
    # pass runs the state pass again beside the reverse pass, in one launch
    launches.clear()
    inputs, h0 = delta_inputs(1, 70, 1, 16, 32, seed=7)
    outputs_and_grads(chunk_op("triton"), inputs, h0)
    assert [name for name, _ in launches] == LAUNCHES[:6] + ["_state_passes_kernel"] + LAUNCHES[8:]
    assert_no_gate(launches)
    # the same spy sees the gate where there is one: the gated forward pass hands its kernels g and its cumsum
    launches.clear()
    q, k, v, beta = inputs
    chunk_gated_delta_rule(q, k, v, -torch.rand(q.shape[:3]), beta, backend="triton")
    assert [name for name, _ in launches] == LAUNCHES[:4]
    assert all(args["USE_GATE"] is True and args["b"] is not None for _, args in launches)


@cpu_only
@pytest.mark.parametrize("multiprocessors,paired", [(2, False), (4, True)])
def test_state_passes_pair_by_the_programs_of_the_launch_taken(monkeypatch, launches, multiprocessors, paired):
    # 2 heads of V = 32: the reverse pass's own 32-wide tile makes 2 programs, no more than the multiprocessors, so
    # it takes the 16-wide narrow tile: 4 programs, which pair the two passes on 4 multiprocessors but not on 2.
    # fp16 inputs from an initial state, no final state asked for: the recomputed states are fp32 on either path,
    # and the paired launch reads the initial state but no final state's gradient
    from fabric_lin.ops import launch as launch_helpers
    from fabric_lin.ops.gdn.launch import GDNLaunch
    from fabric_lin.ops.launch import KernelLaunch

    monkeypatch.setattr(launch_helpers, "multiprocessors", lambda device: multiprocessors)
    (q, k, v, beta), h0 = delta_inputs(1, 70, 2, 16, 32, seed=7)
    q, k, v, beta = (x.half().requires_grad_(True) for x in (q, k, v, beta))
    launch = GDNLaunch(dstate=KernelLaunch(BV=32), narrow_dstate=KernelLaunch(BV=16))
    o, _ = chunk_gated_delta_rule(q, k, v, None, beta, initial_state=h0, backend="triton", launch=launch)
    launches.clear()
    o.float().sum().backward()
    state_passes = [(name, args) for name, args in launches if "state" in name]
    if paired:
        assert [name for name, _ in state_passes] == ["_state_passes_kernel"]
        assert state_passes[0][1]["USE_H0"] is True and state_passes[0][1]["USE_DHT"] is False
    else:
        assert [name for name, _ in state_passes] == ["_fwd_state_kernel", "_bwd_state_kernel"]
    assert state_passes[-1][1]["BV"] == 16
    assert state_passes[0][1]["h"].dtype == torch.float32
    assert all(x.grad.isfinite().all() for x in (q, k, v, beta))


@cpu_only
def test_triton_step_without_a_gate_is_handed_none(launches):
    (q, k, v, beta), h0 = delta_inputs(2, 1, 3, 16, 32, seed=8)
    fused_recurrent_gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], None, beta[:, 0], h0, backend="triton")
    assert [name for name, _ in launches] == ["_gdn_step_kernel"]
    assert_no_gate(launches)


def test_pytorch_paths_are_handed_none_not_zeros(monkeypatch):
    import fabric_lin.ops.gdn as gdn

    handed = []
    for name in ("chunk_gated_delta_rule_torch", "recurrent_gated_delta_rule_step"):
        def traced(q, k, v, g, *args, _run=getattr(gdn, name), _name=name, **kwargs):
            handed.append((_name, g))
            return _run(q, k, v, g, *args, **kwargs)
        monkeypatch.setattr(gdn, name, traced)
    (q, k, v, beta), h0 = delta_inputs(1, 10, 2, 8, 12, seed=9)
    chunk_gated_delta_rule(q, k, v, None, beta, backend="torch")
    fused_recurrent_gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], None, beta[:, 0], h0, backend="torch")
    assert handed == [("chunk_gated_delta_rule_torch", None), ("recurrent_gated_delta_rule_step", None)]
