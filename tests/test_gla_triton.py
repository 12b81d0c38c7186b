"""The Triton GLA kernels against the naive fp32 recurrence.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
Triton is imported), in fp32, on small shapes. With CUDA the GPU tests run bf16 inputs on the real
shapes and compare with the fp32 naive recurrence by relative RMS error.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import compiled_graph_ops, rel_rms  # noqa: E402

from fabric_lin.ops.gla import chunk_gla, chunk_gla_from_logits, naive_recurrent_gla, recurrent_gla_step  # noqa: E402
from fabric_lin.ops.gla.fused_recurrent import fused_recurrent_gla_step  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_inputs(B, T, H, K, V, N=None, seed=0, device="cpu", dtype=torch.float32, gate_logit=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    logits = torch.randn(B, T, H, K, generator=g) if gate_logit is None else torch.full((B, T, H, K), gate_logit)
    gk = F.logsigmoid(logits) / 16
    h0 = torch.randn(N or B, H, K, V, generator=g)
    q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    return q, k, v, gk.to(device), h0.to(device)


def forward_backward(fn, q, k, v, gk, h0, cu_seqlens, seed=1):
    """Output, final state and gradients of sum(o * do) + sum(ht * dht), inputs taken as leaves."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, gk)]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, ht = fn(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g).to(o.device)
    dht = torch.randn(ht.shape, generator=g).to(o.device)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad for x in leaves] + ([h0.grad] if h0 is not None else [])
    return [o, ht] + grads


def triton_gla(*args, **kwargs):
    return chunk_gla(*args, backend="triton", **kwargs)


NAMES = ["o", "ht", "dq", "dk", "dv", "dgk", "dh0"]


def assert_close_scaled(a, b, name):
    """fp32 agreement: elementwise within 1e-4 relative, or 1e-4 of the tensor's largest magnitude
    (dgk is a long cumulative sum whose small entries carry the rounding of the large ones)."""
    atol = 1e-4 * max(1.0, b.abs().max().item())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


@cpu_only
def test_kernels_run_in_the_interpreter():
    from fabric_lin.ops.gla import chunk

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(chunk._fwd_output_kernel).__name__ == "InterpretedFunction", "chunk.py was imported before TRITON_INTERPRET was set"


@cpu_only
@pytest.mark.parametrize(
    "B,T,H,K,V,with_h0",
    [(2, 1, 1, 16, 32, True), (1, 63, 2, 32, 16, True), (2, 64, 1, 16, 64, False), (1, 130, 1, 64, 16, True)],
)
def test_triton_matches_naive_fp32(B, T, H, K, V, with_h0):
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, seed=T + K)
    h0 = h0 if with_h0 else None
    ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, None)
    out = forward_backward(triton_gla, q, k, v, gk, h0, None)
    for name, a, b in zip(NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
def test_triton_varlen_matches_naive_fp32():
    offsets = torch.tensor([0, 15, 64, 100, 130, 131], dtype=torch.int32)
    q, k, v, gk, h0 = make_inputs(1, 131, 2, 16, 32, N=5, seed=7)
    ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = forward_backward(triton_gla, q, k, v, gk, h0, offsets)
    for name, a, b in zip(NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize(
    "dqk_fine_rows,dqk_early_loads,output_fine_rows", [(16, True, 0), (16, False, 16), (32, False, 32), (0, True, 16), (0, False, 0)]
)
def test_triton_level_forms_match_naive_fp32(monkeypatch, dqk_fine_rows, dqk_early_loads, output_fine_rows):
    # dq/dk's finest levels inside blocks of 16 or 32 rows as products batched over the blocks (dqk_fine_rows,
    # 16 the table's) or as 64x64 products masked to the blocks (0), before or after the chunk's own tiles are
    # loaded; the forward's scores split the same way (output_fine_rows);
    # varlen with sequences ending inside a block, an initial state, 32-wide key tiles over K = 40 (the
    # second one mostly masked); the levels taken for every chunk (the shipped table takes them only where the
    # gate's spread is past single_reference_limit)
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "single_reference", "off")
    monkeypatch.setitem(chunk.LAUNCH, "dqk_fine_rows", dqk_fine_rows)
    monkeypatch.setitem(chunk.LAUNCH, "output_fine_rows", output_fine_rows)
    monkeypatch.setitem(chunk.LAUNCH, "dqk_early_loads", dqk_early_loads)
    monkeypatch.setitem(chunk.LAUNCH, "BK", 32)
    offsets = torch.tensor([0, 7, 64, 100, 163], dtype=torch.int32)
    q, k, v, gk, h0 = make_inputs(1, 163, 2, 40, 48, N=4, seed=11)
    ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = forward_backward(triton_gla, q, k, v, gk, h0, offsets)
    for name, a, b in zip(NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize(
    "state_split,fused_bwd_states,separate_cumsum,separate_scores,state_prefetch,dqk_prefetch,dqk_early_loads", [
        (False, False, False, False, True, True, False), (False, True, True, True, False, False, True),
        (False, True, True, False, True, True, True), (True, False, False, True, False, False, False),
    ])
def test_triton_narrow_tiles_and_both_state_passes(monkeypatch, state_split, fused_bwd_states, separate_cumsum,
                                                   separate_scores, state_prefetch, dqk_prefetch, dqk_early_loads):
    # the state passes split K and V into 16-wide tiles here, the per-chunk kernels into 32-wide ones;
    # state_split picks the sequential pass with the products inside, or chunk-parallel updates + scan;
    # fused_bwd_states runs the backward's two sequential passes as one launch; separate_cumsum computes
    # the in-chunk cumulative gate by its own kernel rather than inside the forward state pass;
    # separate_scores computes the intra-chunk scores by their own kernel, which the output kernel reads;
    # state_prefetch has the sequential passes load the next chunk while the current one's products run;
    # dqk_prefetch has dq/dk's state part load the next value tile before the current one's products;
    # dqk_early_loads has dq/dk load the chunk's q, k, gate and dA before its state part
    from fabric_lin.ops.gla import chunk

    tiles = {"state_BK": 16, "state_BV": 16, "BK": 32, "BV": 32, "BV_out": 32, "dv_BK": 32, "scan_SK": 16,
             "scan_SV": 16, "state_maxnreg": 128, "output_maxnreg": 128, "dv_maxnreg": 128, "dqk_maxnreg": 128}
    settings = dict(tiles, state_split=state_split, fused_bwd_states=fused_bwd_states, separate_cumsum=separate_cumsum,
                    separate_scores=separate_scores, state_prefetch=state_prefetch, dqk_prefetch=dqk_prefetch,
                    dqk_early_loads=dqk_early_loads)
    for key, value in settings.items():
        monkeypatch.setitem(chunk.LAUNCH, key, value)
    offsets = torch.tensor([0, 300, 330], dtype=torch.int32)  # 5 chunks, then 1
    q, k, v, gk, h0 = make_inputs(1, 330, 1, 40, 48, N=2, seed=9)
    ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = forward_backward(triton_gla, q, k, v, gk, h0, offsets)
    for name, a, b in zip(NAMES, out, ref):
        assert_close_scaled(a, b, name)


def naive_from_logits(q, k, v, logits, **kwargs):
    return naive_recurrent_gla(q, k, v, F.logsigmoid(logits.float()) / 16, **kwargs)


def triton_from_logits(q, k, v, logits, **kwargs):
    return chunk_gla_from_logits(q, k, v, logits, 16, backend="triton", **kwargs)


@cpu_only
@pytest.mark.parametrize("T,offsets,logit_scale,state_split", [
    (63, None, 3, False), (130, None, 3, True), (330, [0, 1, 64, 200, 330], 3, False),
    (130, None, 40, False),  # logits up to ~+-150: exp(|x|) overflows fp32 unless logsigmoid and sigmoid avoid it
])
def test_triton_from_logits_matches_naive_fp32(monkeypatch, T, offsets, logit_scale, state_split):
    # the gate formed inside the gate cumsum kernel from its logits; the backward recomputes gk's cumulative
    # sums and the dq/dk kernel writes the logits' gradient; state_split: chunk-parallel state passes
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "state_split", state_split)
    N = 1 if offsets is None else len(offsets) - 1
    q, k, v, _, h0 = make_inputs(1, T, 2, 32, 48, N=N, seed=12)
    logits = logit_scale * torch.randn(1, T, 2, 32, generator=torch.Generator().manual_seed(13))
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    ref = forward_backward(naive_from_logits, q, k, v, logits, h0, cu)
    out = forward_backward(triton_from_logits, q, k, v, logits, h0, cu)
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dlogits", "dh0"], out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("decayed_keys", ["recompute", "backward", "saved"])
@pytest.mark.parametrize("state_split,fused_bwd_states", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("from_logits", [False, True])
def test_triton_decayed_key_forms_match_naive_fp32(monkeypatch, decayed_keys, state_split, fused_bwd_states, from_logits):
    # the decayed keys k * exp(b_last - b) of the backward's state recomputation and dv kernel: formed by each
    # (recompute), once in the backward (by the gate cumsum from logits, else by the sequential state pass),
    # or written by the forward's state pass and kept (saved; gk given, sequential pass only). Varlen with
    # sequences ending inside a chunk, an initial state, K = 40 over 32-wide key tiles
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "decayed_keys", decayed_keys)
    monkeypatch.setitem(chunk.LAUNCH, "state_split", state_split)
    monkeypatch.setitem(chunk.LAUNCH, "fused_bwd_states", fused_bwd_states)
    monkeypatch.setitem(chunk.LAUNCH, "BK", 32)
    monkeypatch.setitem(chunk.LAUNCH, "state_BK", 32)
    offsets = torch.tensor([0, 7, 64, 100, 163], dtype=torch.int32)
    q, k, v, gk, h0 = make_inputs(1, 163, 2, 40, 48, N=4, seed=14)
    if from_logits:
        logits = 3 * torch.randn(1, 163, 2, 40, generator=torch.Generator().manual_seed(15))
        ref = forward_backward(naive_from_logits, q, k, v, logits, h0, offsets)
        out = forward_backward(triton_from_logits, q, k, v, logits, h0, offsets)
    else:
        ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
        out = forward_backward(triton_gla, q, k, v, gk, h0, offsets)
    for name, a, b in zip(NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
def test_decayed_keys_stay_out_of_narrow_state_tiles(monkeypatch):
    # on an H200 the state passes went wrong writing or reading the decayed keys over 32-wide value tiles:
    # "saved" keeps none there (the backward forms them), and keeps them where the tiles are 64 wide or more
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "decayed_keys", "saved")
    monkeypatch.setitem(chunk.LAUNCH, "state_split", False)
    for V, kept in [(32, False), (48, True)]:
        q, k, v, gk, _ = make_inputs(1, 70, 2, 16, V, seed=V)
        kd = chunk._forward(q, k, v, gk, 0.25, None, None)[4]
        assert (kd.shape == k.shape) if kept else (kd.numel() == 0), (V, tuple(kd.shape))
        assert chunk._state_pass_takes_decayed_keys(16, V, 1, 2, q.device) == kept
    # with the gate as logits, the backward's gate cumsum writes them only over the wider tiles too (at V = 32,
    # written there and read by the dv kernel, they gave an illegal memory access on an H200)
    monkeypatch.setitem(chunk.LAUNCH, "decayed_keys", "backward")
    gate_cumsum, writes = chunk._gate_cumsum, []

    def recording_gate_cumsum(*args):
        writes.append(len(args) > 6 and args[6] is not None)
        return gate_cumsum(*args)

    monkeypatch.setattr(chunk, "_gate_cumsum", recording_gate_cumsum)
    for V in (32, 48):
        q, k, v, _, _ = make_inputs(1, 70, 2, 16, V, seed=V)
        logits = torch.randn(1, 70, 2, 16, generator=torch.Generator().manual_seed(V))
        q.requires_grad_(True)
        chunk_gla_from_logits(q, k, v, logits, 16.0, backend="triton")[0].sum().backward()
    assert writes == [False, False, False, True], writes  # forward, backward at V = 32; forward, backward at 48
    monkeypatch.setitem(chunk.LAUNCH, "state_BV", 32)  # a table with 32-wide state tiles at any V
    assert not chunk._state_pass_takes_decayed_keys(16, 128, 1, 2, torch.device("cpu"))


def test_state_pass_warps_follow_the_launch_programs(monkeypatch):
    # 8 warps where a launch has no more programs than multiprocessors; the backward's fused pair counts both
    # passes' programs (at 8K tokens, 16 heads, K = V = 128: 128 a pass on 132 multiprocessors, 256 both)
    from fabric_lin.ops.gla import chunk

    monkeypatch.setattr(chunk, "_multiprocessors", lambda device: 132)
    device = torch.device("cuda")
    assert chunk._state_programs(128, 128, 4, 16) == 128
    assert chunk._state_warps(128, 128, 4, 16, device) == 8
    assert chunk._both_states_warps(128, 128, 4, 16, device) == 4
    assert chunk._both_states_warps(128, 128, 1, 16, device) == 8  # 64 programs both
    monkeypatch.setitem(chunk.LAUNCH, "both_states_warps", 0)  # as one pass
    assert chunk._both_states_warps(128, 128, 4, 16, device) == 8
    monkeypatch.setitem(chunk.LAUNCH, "both_states_warps", "auto")
    monkeypatch.setitem(chunk.LAUNCH, "state_warps", 8)
    assert chunk._both_states_warps(128, 128, 4, 16, device) == 8


@cpu_only
def test_triton_head_dims_not_powers_of_two_and_custom_scale():
    # K=40 and V=72 leave partly masked tiles; V spans two value tiles of 64
    q, k, v, gk, _ = make_inputs(1, 70, 1, 40, 72, seed=3)
    ref = forward_backward(lambda *a, **kw: naive_recurrent_gla(*a, scale=0.3, **kw), q, k, v, gk, None, None)
    out = forward_backward(lambda *a, **kw: triton_gla(*a, scale=0.3, **kw), q, k, v, gk, None, None)
    for name, a, b in zip(NAMES, out, ref):
        assert_close_scaled(a, b, name)


@cpu_only
@pytest.mark.parametrize("separate_scores,decay", [(False, -20.0), (True, -20.0), (False, -3000.0)])
def test_triton_strong_gates_stay_finite(monkeypatch, separate_scores, decay):
    # half the channels decay by logsigmoid(-20)/16 ~ -1.25 per step: -80 over one chunk, where a
    # chunked form that divides by exp(b) overflows fp32; -3000 decays by ~190 per step, where any factor
    # with a positive exponent of one step or more overflows; both ways of computing the intra-chunk scores
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "separate_scores", separate_scores)
    q, k, v, _, h0 = make_inputs(1, 130, 1, 16, 16, seed=5)
    logits = torch.where(torch.rand(1, 130, 1, 16, generator=torch.Generator().manual_seed(0)) < 0.5, decay, 8.0)
    gk = F.logsigmoid(logits) / 16
    ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, None)
    out = forward_backward(triton_gla, q, k, v, gk, h0, None)
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert_close_scaled(a, b, name)


def mixed_spread_gates(T, H, K, strong_rows, strong_cols, seed=0, strong_logit=-30.0):
    """Gates of logsigmoid(randn) / 16 (a spread of ~2 over a chunk), but logsigmoid(strong_logit) / 16 at the
    strong rows and columns: -30 decays by ~1.9 per step, a spread of ~60 from the chunk's middle row, past
    single_reference_limit; -20 by ~1.25, a spread of ~40, just inside it."""
    logits = torch.randn(1, T, H, K, generator=torch.Generator().manual_seed(seed))
    logits[:, strong_rows, :, strong_cols] = strong_logit
    return F.logsigmoid(logits) / 16


@cpu_only
@pytest.mark.parametrize("mode", ["off", "split"])
def test_triton_single_reference_matches_naive_fp32(monkeypatch, mode):
    # the scores and their gradients with one reference row where the gate's spread allows it, the levels
    # where it does not: varlen, an initial state, 32-wide key tiles over K = 40; the sequence from row 100
    # decays fast in columns 0-7 (its chunk's first key tile past the limit, the second not)
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "single_reference", mode)
    monkeypatch.setitem(chunk.LAUNCH, "BK", 32)
    flags = []
    make_flags = chunk._reference_flags
    monkeypatch.setattr(chunk, "_reference_flags", lambda n, device: flags.append(make_flags(n, device)) or flags[-1])
    offsets = torch.tensor([0, 7, 64, 100, 163], dtype=torch.int32)
    q, k, v, _, h0 = make_inputs(1, 163, 2, 40, 48, N=4, seed=11)
    gk = mixed_spread_gates(163, 2, 40, slice(100, 163), slice(0, 8))
    ref = forward_backward(naive_recurrent_gla, q, k, v, gk, h0, offsets)
    out = forward_backward(triton_gla, q, k, v, gk, h0, offsets)
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert_close_scaled(a, b, name)
    output_flags, dqk_flags = (f.view(-1).tolist() for f in flags)
    if mode == "split":  # chunks (sequence, chunk): (0,0) (1,0) (2,0) (3,0); grids (chunk, head), (key tile, chunk, head)
        assert output_flags == [0, 0, 0, 0, 0, 0, 1, 1], output_flags
        assert dqk_flags == [0, 0, 0, 0, 0, 0, 1, 1] + [0] * 8, dqk_flags
    else:  # one unused element each
        assert len(output_flags) == len(dqk_flags) == 1


@cpu_only
def test_triton_without_final_state_returns_none_and_same_output():
    q, k, v, gk, _ = make_inputs(1, 20, 1, 16, 16)
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
    q, k, v, gk, h0 = make_inputs(1, 70, 2, 16, 32, seed=11)
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


# ---------------------------------------------------------------- GPU, bf16 against the fp32 oracle


def check_bf16(B, T, H, K, V, cu_seqlens=None, seed=0, strong_logit=None):
    """With strong_logit, the second half of each sequence decays fast in the first quarter of the key columns
    (mixed_spread_gates), so that both the single-reference scores and the levels are taken."""
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, N=N, seed=seed, device="cuda", dtype=torch.bfloat16)
    if strong_logit is not None:
        gk = torch.cat([mixed_spread_gates(T, H, K, slice(T // 2, T), slice(0, max(1, K // 4)), seed=seed + b,
                                           strong_logit=strong_logit) for b in range(B)]).cuda()
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
    ref = forward_backward(naive_recurrent_gla, q.float(), k.float(), v.float(), gk, h0, cu)
    out = forward_backward(triton_gla, q, k, v, gk, h0, cu)
    errors = {name: rel_rms(a, b) for name, a, b in zip(NAMES, out, ref)}
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


# settings the launch search (tune.py) or a user (chunk.LAUNCH; gla_kernel.py --launch) can choose, on the
# same shapes: the shipped table's sequential state passes (its "auto" split takes the scan at these
# shapes), the earlier table, the separate score kernel, pipelined loads with narrower key tiles, register
# caps on every kernel, an 8-warp output kernel (output kernels over 32-wide value tiles failed on an H200;
# the launch keeps them at least 64 wide, so the V=32 shapes check that guard)
SEARCHED_SETTINGS = [
    {"state_split": False},
    {"state_BV": 64, "BV_out": 128, "output_warps": 8, "state_split": False},
    {"separate_scores": True, "scores_warps": 4},
    {"separate_scores": True, "scores_warps": 8, "BV_out": 128, "state_split": False},
    {"stages": 2, "dqk_stages": 2, "BK": 32},  # software-pipelined loads, 32-wide key tiles
    {"dqk_maxnreg": 128, "dv_maxnreg": 168, "output_maxnreg": 168, "state_maxnreg": 168},  # register caps
    {"state_prefetch": True, "state_split": False, "state_warps": 4},  # next chunk's loads issued early
    {"state_prefetch": False, "state_split": False},  # each chunk's loads when its step starts
    {"output_warps": 8},
    {"dqk_prefetch": False},  # dq/dk's state part loads each value tile when its step starts
    {"dv_BK": 64},  # the dv kernel looping over key tiles (K > 64) inside each value tile
    {"dqk_early_loads": True},  # dq/dk's q, k, gate and dA loaded before its state part at every V
    {"dqk_early_loads": "auto"},  # before it when V <= 128
    {"output_warps": 16, "dqk_warps": 16},  # the search's 16-warp programs
    {"separate_cumsum": False, "both_states_warps": 4},  # the gate's cumsum inside the forward state pass
    {"dqk_fine_rows": 0},  # dq/dk's finest levels as 64x64 products masked to the blocks of 16 rows
    {"dqk_fine_rows": 0, "dqk_early_loads": "auto"},
    {"dqk_fine_rows": 32, "output_fine_rows": 32},  # five levels inside blocks of 32 rows, batched over two blocks
    {"output_fine_rows": 0},  # the forward's scores in six 64x64 levels (the table before its 16-row blocks)
    {"state_BK": 128, "state_split": False},  # one key tile per state-pass program (K <= 128)
    {"state_BK": 128, "state_split": True, "state_prefetch": False},
    {"decayed_keys": "recompute"},  # the state recomputation and dv kernel each form the decayed keys
    {"decayed_keys": "saved", "state_split": False},  # the forward's state pass writes them, the op keeps them
    {"single_reference": "off"},  # the levels everywhere (the shipped "split" takes one reference row where it can)
    {"single_dqk_warps": 8},
]


@needs_cuda
@pytest.mark.parametrize("settings", SEARCHED_SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize(
    "B,T,H,K,V",
    [(2, 63, 2, 64, 64), (1, 1000, 2, 128, 256), (2, 300, 2, 100, 100), (2, 2048, 8, 128, 128), (1, 2, 1, 256, 32),
     (2, 63, 1, 64, 32)],
)
def test_gpu_bf16_searchable_settings_match_fp32_naive(monkeypatch, settings, B, T, H, K, V):
    from fabric_lin.ops.gla import chunk

    for key, value in settings.items():
        monkeypatch.setitem(chunk.LAUNCH, key, value)
    check_bf16(B, T, H, K, V, strong_logit=-30.0)  # chunks on both sides of single_reference_limit


@needs_cuda
# one chunk at V = 64, where the gate cumsum writes the decayed keys; at V = 32 (32-wide state tiles) every
# kernel forms them itself
@pytest.mark.parametrize("B,T,H,K,V,offsets", [(2, 1000, 4, 128, 256, None), (1, 2000, 4, 128, 128, [0, 15, 100, 300, 1200, 2000]),
                                                (2, 63, 2, 64, 64, None), (1, 2, 1, 256, 32, None), (2, 63, 1, 64, 32, None)])
def test_gpu_bf16_from_logits_matches_fp32_naive(B, T, H, K, V, offsets):
    N = B if offsets is None else len(offsets) - 1
    q, k, v, _, h0 = make_inputs(B, T, H, K, V, N=N, seed=3, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(B, T, H, K, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device="cuda")
    ref = forward_backward(naive_from_logits, q.float(), k.float(), v.float(), logits.float(), h0, cu)
    out = forward_backward(triton_from_logits, q, k, v, logits, h0, cu)
    errors = {name: rel_rms(a.float(), b) for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dlogits", "dh0"], out, ref)}
    bad = {name: e for name, e in errors.items() if not e <= 0.005}
    assert not bad, f"relative RMS error above 0.005: {bad} (all: {errors})"


@needs_cuda
@pytest.mark.parametrize("mode,strong_logit", [("off", -30.0), ("split", -30.0), ("split", -20.0)])
def test_gpu_bf16_mixed_gate_spreads_match_fp32_naive(monkeypatch, mode, strong_logit):
    # the second half of the sequence decays fast in a quarter of the key columns (the first key tile of its
    # chunks): past single_reference_limit (-30) or just inside it, factors up to ~exp(40) (-20)
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "single_reference", mode)
    check_bf16(2, 1000, 2, 128, 256, seed=2, strong_logit=strong_logit)


@needs_cuda
@pytest.mark.parametrize("state_split", [False, True])
def test_gpu_bf16_varlen_matches_fp32_naive(monkeypatch, state_split):
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "state_split", state_split)
    check_bf16(1, 2000, 4, 128, 128, cu_seqlens=[0, 15, 100, 300, 1200, 2000])


@needs_cuda
def test_gpu_bf16_scan_state_pass_matches_fp32_naive(monkeypatch):
    from fabric_lin.ops.gla import chunk

    monkeypatch.setitem(chunk.LAUNCH, "state_split", True)
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
    q, k, v, gk, h0 = make_inputs(2, 256, 4, 64, 128, device="cuda", dtype=torch.bfloat16)

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
