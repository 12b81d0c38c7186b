"""The short convolution's Triton kernels (forward, backward, decoding step), against fp64 references written
here: F.conv1d with groups = D. Also the checks that take the convolution's decoding step and the fused Gated
DeltaNet decoding step together: both compile as opaque ops, and both are compiled for an H100/H200 (sm_90).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1), in fp32. The sm_90
compilation uses bf16 inputs at gdn-340M's shapes and runs nothing (benchmarks/kernel_registers.py's compile-only
driver): run as a script, this file prints that report as JSON (so conftest.py, which sets TRITON_INTERPRET, is
imported only inside tests). With CUDA the GPU tests compare bf16 inputs with fp32 references. The GDN decoding
step's own tests are in test_gdn_recurrent.py.
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if __name__ != "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import GDN_STEP_SHAPE, assert_close, leaves  # noqa: E402

from fabric_lin.ops.fused_launch import SHIPPED_SHORT_CONV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# blocks of 8 rows loaded 2 at a time and 64 channels: these tests' short sequences cross blocks and loads (an odd
# length ends on a partial load), and 100 channels are two tiles, the second partial. The interpreter runs a
# block's rows one by one: its time grows with the rows walked, so the sequences are short.
SMALL = dataclasses.replace(SHIPPED_SHORT_CONV, channels=64, rows=8, rows_per_load=2)


# ---------------------------------------------------------------- references (fp64, independent of the code under test)


def conv_reference(x, weight, cache=None, activation=True):
    """F.conv1d over channels (groups = D) with the cache, or W - 1 zeros, on the left; then SiLU. fp64.
    Returns (y [B, T, D], the last W - 1 inputs)."""
    B, T, D = x.shape
    W = weight.shape[1]
    x = x.double()
    left = cache.double() if cache is not None else x.new_zeros(B, W - 1, D)
    padded = torch.cat([left, x], dim=1)
    z = F.conv1d(padded.transpose(1, 2), weight.double()[:, None, :], groups=D).transpose(1, 2)
    return (F.silu(z) if activation else z), padded[:, T:]


def conv_reference_varlen(x, weight, bounds, activation=True):
    """Each document of the packed row x [1, T, D] convolved on its own, from zeros."""
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat([conv_reference(x[:, s:e], weight, activation=activation)[0] for s, e in spans], dim=1)


def grads_of(out, inputs, upstream):
    """Gradients of sum(out_i * upstream_i) with respect to inputs (zeros for one the outputs do not use)."""
    loss = sum((o.double() * u.double()).sum() for o, u in zip(out, upstream))
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]


# ---------------------------------------------------------------- the convolution, in Triton's interpreter


def conv_inputs(B, T, D, W, seed=0, cache=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen)
    weight = torch.randn(D, W, generator=gen) * 0.7
    c = torch.randn(B, W - 1, D, generator=gen) if cache else None
    return x, weight, c


@cpu_only
@pytest.mark.parametrize("W,T,launch", [
    *(pytest.param(W, T, SMALL, id=f"W{W}-T{T}") for W, T in ((2, 1), (4, 2), (2, 19), (3, 19), (4, 19))),
    pytest.param(4, 130, None, id="shipped-W4-T130"),  # the shipped launch, its second block of 128 rows
])
def test_conv_matches_grouped_conv1d(W, T, launch):
    from fabric_lin.ops.short_conv import causal_conv1d

    D = 100
    x, weight, _ = conv_inputs(2, T, D, W, seed=T * 10 + W)
    xk, wk = leaves(x, weight)
    y, new_cache = causal_conv1d(xk, wk, backend="triton", launch=launch)
    xr, wr = leaves(x, weight)
    y_ref, cache_ref = conv_reference(xr, wr)
    assert y.dtype == torch.float32 and new_cache.shape == (2, W - 1, D)
    assert_close(y, y_ref, "y")
    assert_close(new_cache, cache_ref, "new cache")
    up = [torch.randn_like(y), torch.randn_like(new_cache)]
    got, want = grads_of((y, new_cache), (xk, wk), up), grads_of((y_ref, cache_ref), (xr, wr), up)
    for name, a, b in zip(["dx", "dweight"], got, want):
        assert_close(a, b, name)


@cpu_only
def test_conv_without_activation():
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(2, 19, 70, 4, seed=3, cache=True)
    ins = leaves(x, weight, cache)
    y, _ = causal_conv1d(*ins, activation=False, backend="triton", launch=SMALL)
    refs = leaves(x, weight, cache)
    y_ref, _ = conv_reference(*refs, activation=False)
    assert_close(y, y_ref, "y")
    up = [torch.randn_like(y)]
    for name, a, b in zip(["dx", "dweight", "dcache"], grads_of((y,), ins, up), grads_of((y_ref,), refs, up)):
        assert_close(a, b, name)


@cpu_only
@pytest.mark.parametrize("W,T", [(2, 1), (3, 1), (4, 1), (4, 2), (2, 11), (3, 11), (4, 11)])  # T = 1, 2 < W - 1
# for W = 4: the new cache keeps cached inputs; 11 rows: two blocks of SMALL
def test_conv_continues_from_a_cache_and_gives_its_gradient(W, T):
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(3, T, 40, W, seed=T + W, cache=True)
    ins = leaves(x, weight, cache)
    with torch.enable_grad():  # a gradient wanted: the full kernels, not the decoding step
        y, new_cache = causal_conv1d(*ins, backend="triton", launch=SMALL)
    refs = leaves(x, weight, cache)
    y_ref, cache_ref = conv_reference(*refs)
    assert_close(y, y_ref, "y")
    assert_close(new_cache, cache_ref, "new cache")
    up = [torch.randn_like(y), torch.randn_like(new_cache)]
    got, want = grads_of((y, new_cache), ins, up), grads_of((y_ref, cache_ref), refs, up)
    for name, a, b in zip(["dx", "dweight", "dcache"], got, want):
        assert_close(a, b, name)
    # a cache that needs no gradient (x and weight do): none is computed, the others unchanged
    xk, wk = leaves(x, weight)
    y2, _ = causal_conv1d(xk, wk, cache, backend="triton", launch=SMALL)
    y2.backward(up[0])
    xr, wr = leaves(x, weight)
    want = grads_of(conv_reference(xr, wr, cache)[:1], (xr, wr), up)
    for name, a, b in zip(["dx", "dweight"], (xk.grad, wk.grad), want):
        assert_close(a, b, name)


@cpu_only
def test_conv_in_fp16_rounds_only_its_outputs():
    # fp16 inputs, fp32 weight: y, dx and the cache's gradient within fp16's rounding of the fp64 result (2^-11
    # of each value), dweight (fp32) within fp32's
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(2, 19, 40, 4, seed=11, cache=True)
    ins = leaves(x.half(), weight, cache.half())
    y, _ = causal_conv1d(*ins, backend="triton", launch=SMALL)
    refs = leaves(x.half().double(), weight.double(), cache.half().double())
    y_ref, _ = conv_reference(*refs)
    assert y.dtype == torch.float16
    assert_close(y, y_ref, "y", tol=1e-3)
    up = [torch.randn_like(y)]
    got, want = grads_of((y,), ins, up), grads_of((y_ref,), refs, up)
    assert got[0].dtype == got[2].dtype == torch.float16 and got[1].dtype == torch.float32
    for name, a, b, tol in zip(["dx", "dweight", "dcache"], got, want, [1e-3, 2e-5, 1e-3]):
        assert_close(a, b, name, tol=tol)


def test_conv_with_a_cache_of_another_dtype_stays_in_the_inputs_dtype():
    # the PyTorch path given an fp32 cache and bf16 inputs: the cache is read as bf16, and the new cache (the
    # last W - 1 inputs) comes back in x's dtype, as decoding keeps it
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(2, 5, 8, 4, seed=3, cache=True)
    x = x.bfloat16()
    y, new_cache = causal_conv1d(x, weight, cache, backend="torch")
    assert y.dtype == new_cache.dtype == torch.bfloat16
    y_ref, cache_ref = conv_reference(x, weight, cache.bfloat16())
    torch.testing.assert_close(new_cache, cache_ref.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-2, atol=1e-2)


@cpu_only
@pytest.mark.parametrize("T,W", [(0, 4), (5, 1), (1, 1)])
def test_conv_empty_sequences_and_width_one(T, W):
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(2, T, 20, W, seed=T + W, cache=True)
    ins = leaves(x, weight, cache)
    y, new_cache = causal_conv1d(*ins, backend="triton", launch=SMALL)
    refs = leaves(x, weight, cache)
    y_ref, cache_ref = conv_reference(*refs) if T else (refs[0].double(), torch.cat([refs[2], refs[0]], 1).double())
    assert y.shape == (2, T, 20) and new_cache.shape == (2, W - 1, 20)
    assert_close(y, y_ref, "y")
    assert_close(new_cache, cache_ref, "new cache")
    up = [torch.randn_like(y), torch.randn_like(new_cache)]
    got, want = grads_of((y, new_cache), ins, up), grads_of((y_ref, cache_ref), refs, up)
    for name, a, b in zip(["dx", "dweight", "dcache"], got, want):
        assert_close(a, b, name)


@cpu_only
@pytest.mark.parametrize("W,dtype", [(2, torch.int64), (3, torch.int32), (4, torch.int32)])
def test_conv_varlen_restarts_at_every_document(W, dtype):
    from fabric_lin.ops.short_conv import causal_conv1d

    # empty documents (first, middle and last; two at once inside a block, before a one-row document), documents
    # shorter than W, documents across SMALL's blocks (8 rows) and loads (2 rows), a block starting a document (row 24)
    bounds = [0, 0, 1, 1, 3, 4, 13, 14, 18, 18, 18, 19, 24, 30, 30]
    T = bounds[-1]
    x, weight, _ = conv_inputs(1, T, 40, W, seed=W)
    cu = torch.tensor(bounds, dtype=dtype)
    ins = leaves(x, weight)
    y, _ = causal_conv1d(*ins, cu_seqlens=cu, backend="triton", launch=SMALL)
    refs = leaves(x, weight)
    y_ref = conv_reference_varlen(refs[0], refs[1], bounds)
    assert_close(y, y_ref, "y")
    up = [torch.randn_like(y)]
    for name, a, b in zip(["dx", "dweight"], grads_of((y,), ins, up), grads_of((y_ref,), refs, up)):
        assert_close(a, b, name)
    # and the document bounds do matter: the whole row convolved as one sequence differs
    assert (conv_reference(x, weight)[0] - y_ref).abs().max() > 0.1


@cpu_only
@pytest.mark.parametrize("sizes", [(20, 50, 30), (70, 30)])  # partial channel tiles in every output; 70: two tiles
def test_split_outputs_are_the_convolution_of_all_channels_in_parts(sizes):
    from fabric_lin.ops.short_conv import causal_conv1d_split

    x, weight, cache = conv_inputs(2, 13, sum(sizes), 4, seed=len(sizes), cache=True)
    ins = leaves(x, weight, cache)
    ys, new_cache = causal_conv1d_split(*ins[:2], sizes, ins[2], backend="triton", launch=SMALL)
    refs = leaves(x, weight, cache)
    y_ref, cache_ref = conv_reference(*refs)
    assert [tuple(y.shape) for y in ys] == [(2, 13, n) for n in sizes] and all(y.is_contiguous() for y in ys)
    assert_close(torch.cat(ys, dim=2), y_ref, "y")
    assert_close(new_cache, cache_ref, "new cache")
    # the first output unused: its gradient is zeros
    up = [torch.randn_like(y) for y in ys[1:]] + [torch.randn_like(new_cache)]
    want_up = [torch.cat([torch.zeros_like(ys[0]), *up[:-1]], dim=2), up[-1]]
    got, want = grads_of((*ys[1:], new_cache), ins, up), grads_of((y_ref, cache_ref), refs, want_up)
    for name, a, b in zip(["dx", "dweight", "dcache"], got, want):
        assert_close(a, b, name)


@cpu_only
def test_split_outputs_restart_at_documents_and_step_from_a_cache():
    from fabric_lin.ops.short_conv import causal_conv1d_split

    bounds = [0, 2, 3, 19]
    x, weight, cache = conv_inputs(1, 19, 60, 4, seed=4, cache=True)
    ins = leaves(x, weight)
    ys, _ = causal_conv1d_split(*ins, [10, 20, 30], cu_seqlens=torch.tensor(bounds), backend="triton", launch=SMALL)
    refs = leaves(x, weight)
    y_ref = conv_reference_varlen(*refs, bounds)
    assert_close(torch.cat(ys, dim=2), y_ref, "y")
    up = [torch.randn_like(y) for y in ys]
    for name, a, b in zip(["dx", "dweight"], grads_of(ys, ins, up), grads_of((y_ref,), refs, [torch.cat(up, 2)])):
        assert_close(a, b, name)
    with torch.no_grad():  # one decoding step
        ys, new_cache = causal_conv1d_split(x[:, :1], weight, [10, 50], cache, backend="triton")
    y_ref, cache_ref = conv_reference(x[:, :1], weight, cache)
    assert [tuple(y.shape) for y in ys] == [(1, 1, 10), (1, 1, 50)]
    assert_close(torch.cat(ys, dim=2), y_ref, "stepped y")
    torch.testing.assert_close(new_cache, cache_ref.float(), rtol=0, atol=0)


@cpu_only
def test_split_sizes_are_checked():
    from fabric_lin.ops.short_conv import causal_conv1d_split

    x, weight, _ = conv_inputs(1, 5, 12, 4)
    for sizes, message in [([5, 5], "add up to x's 12 channels, got \\[5, 5\\]"), ([12, 0], "must be positive"),
                           ([3, 3, 3, 3], "at most 3 outputs")]:
        with pytest.raises(ValueError, match=message):
            causal_conv1d_split(x, weight, sizes, backend="triton")
    assert len(causal_conv1d_split(x, weight, [3] * 4, backend="torch")[0]) == 4  # any number on the PyTorch path


@cpu_only
@pytest.mark.parametrize("W", [2, 4])
def test_conv_decoding_steps_equal_the_full_convolution(W):
    from fabric_lin.ops.short_conv import causal_conv1d
    from fabric_lin.ops.short_conv_triton import causal_conv1d_step_triton

    x, weight, _ = conv_inputs(3, 12, 50, W, seed=7)
    y_full, cache_full = conv_reference(x, weight)
    with torch.no_grad():
        y, cache = causal_conv1d(x[:, :5], weight, backend="triton")  # a prompt, then token by token
        outs, direct_cache = [y], cache.clone()
        for t in range(5, 12):
            y_t, cache = causal_conv1d(x[:, t : t + 1], weight, cache, backend="triton")
            y_direct, direct_cache = causal_conv1d_step_triton(x[:, t], weight, direct_cache)
            torch.testing.assert_close(y_t[:, 0], y_direct, rtol=0, atol=0)
            outs.append(y_t)
    assert_close(torch.cat(outs, dim=1), y_full, "stepped y")
    torch.testing.assert_close(cache, cache_full.float(), rtol=0, atol=0)  # the inputs themselves, shifted
    torch.testing.assert_close(direct_cache, cache, rtol=0, atol=0)


@cpu_only
def test_conv_reads_a_view_of_projections_side_by_side():
    from fabric_lin.ops.short_conv import causal_conv1d

    qkv, weight, _ = conv_inputs(2, 19, 120, 4, seed=5)
    q = qkv[..., 20:70]  # rows 120 apart, channels contiguous
    w = weight[20:70]
    ins = leaves(qkv, w)
    y, _ = causal_conv1d(ins[0][..., 20:70], ins[1], backend="triton", launch=SMALL)
    refs = leaves(qkv, w)
    y_ref, _ = conv_reference(refs[0][..., 20:70], refs[1])
    assert_close(y, y_ref, "y")
    up = [torch.randn_like(y)]
    got, want = grads_of((y,), ins, up), grads_of((y_ref,), refs, up)
    assert_close(got[0], want[0], "d(side by side)")
    assert got[0][..., :20].abs().max() == 0 and q.shape == y.shape


@cpu_only
def test_conv_compiles_to_one_node_each_way_without_graph_breaks():
    from conftest import compiled_graph_ops

    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, _ = conv_inputs(1, 8, 40, 4, seed=9)
    cu = torch.tensor([0, 5, 6, 8], dtype=torch.int32)

    def f(x, weight):
        y, cache = causal_conv1d(x, weight, cu_seqlens=cu, backend="triton")
        return y.square().mean() + cache.mean()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(x, weight)
    assert explain.graph_break_count == 0, explain.break_reasons
    ins = leaves(x, weight)
    out, forward_ops, backward_ops = compiled_graph_ops(f, *ins)
    assert "fabric_lin.causal_conv1d_fwd.default" in forward_ops, forward_ops
    assert "fabric_lin.causal_conv1d_bwd.default" in backward_ops, backward_ops
    refs = leaves(x, weight)
    eager = f(*refs)
    eager.backward()
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    for name, a, b in zip(["dx", "dweight"], ins, refs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"compiled {name}: {m}")


def dynamo_graph_ops(f, *inputs):
    """(f's output compiled with fullgraph=True, the op names in the graph dynamo captured)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(f, backend=capture, fullgraph=True)(*inputs)
    return out, {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


@cpu_only
def test_decoding_steps_compile_as_opaque_ops():
    from conftest import gdn_inputs, gdn_step_reference

    from fabric_lin.ops.gdn.fused_recurrent import fused_recurrent_gated_delta_rule_step_triton
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(2, 1, 40, 4, seed=2, cache=True)
    with torch.no_grad():
        (y, new_cache), ops = dynamo_graph_ops(lambda *a: causal_conv1d(*a, backend="triton"), x, weight, cache)
    assert "fabric_lin.causal_conv1d_step.default" in ops, ops
    y_ref, cache_ref = conv_reference(x, weight, cache)
    assert_close(y, y_ref, "compiled step y")
    torch.testing.assert_close(new_cache, cache_ref.float(), rtol=0, atol=0)

    q, k, v, g, beta, state = gdn_inputs(2, 2, 48, 96, seed=4)
    (o, s), ops = dynamo_graph_ops(
        lambda *a: fused_recurrent_gated_delta_rule_step_triton(*a, use_qk_l2norm=True), q, k, v, g, beta, state
    )
    assert "fabric_lin.recurrent_gated_delta_rule_step.default" in ops, ops
    o_ref, s_ref = gdn_step_reference(q, k, v, g, beta, state, 48**-0.5, True)
    assert_close(o, o_ref, "compiled gdn o")
    assert_close(s, s_ref, "compiled gdn state")


@cpu_only
def test_conv_errors_name_the_argument():
    from fabric_lin.ops.short_conv import causal_conv1d

    x, weight, cache = conv_inputs(2, 5, 16, 4, cache=True)
    cases = [
        (dict(x=x[0], weight=weight), "x must be"),
        (dict(x=x, weight=weight[:8]), "weight must be"),
        (dict(x=x, weight=weight[:, 0]), "weight must be"),
        (dict(x=x, weight=weight, cache=cache[:, :2]), "cache must be"),
        (dict(x=x, weight=weight, cu_seqlens=torch.tensor([0, 5])), "cu_seqlens needs x with batch size 1"),
        (dict(x=x[:1], weight=weight, cu_seqlens=torch.tensor([0.0, 5.0])), "cu_seqlens must be"),
        (dict(x=x[:1], weight=weight, cache=cache[:1], cu_seqlens=torch.tensor([0, 5])), "does not combine"),
        (dict(x=x, weight=torch.randn(16, 9)), "W <= 8"),
        (dict(x=x, weight=weight, backend="cuda"), "backend must be"),
    ]
    for kwargs, message in cases:
        kwargs.setdefault("backend", "triton")
        with pytest.raises(ValueError, match=message):
            causal_conv1d(**kwargs)
    # the reference takes widths the kernels do not
    assert causal_conv1d(x, torch.randn(16, 9), backend="torch")[0].shape == x.shape


@cpu_only
def test_benchmark_times_the_shipped_launch_and_variants_in_the_interpreter(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import short_conv as bench

    out = tmp_path / "short_conv.json"
    monkeypatch.setattr(sys, "argv", ["short_conv.py", "--batch", "1", "--seq", "9", "--channels", "24", "40",
                                      "--documents", "3", "--out", str(out),
                                      "--variants", "short:rows=8,rows_per_load=2"])
    bench.main()
    report = json.loads(out.read_text())
    assert report["launches"]["short"]["rows"] == 8 and report["documents"] == 3
    assert report["launches"]["shipped"] == dataclasses.asdict(SHIPPED_SHORT_CONV)
    assert [row["channels"] for row in report["results"]] == [24, 40]
    for row in report["results"]:
        assert set(row) == {"channels", "shipped", "short"}
        assert row["short"]["fwd_bwd_ms"] > 0 and max(row["short"]["rel_rms_vs_shipped"].values()) < 1e-5, row
    for variant, message in [
        ("bad:chanels=64", "unknown ShortConvLaunch setting 'chanels'"),
        ("bad:rows=20,rows_per_load=8", "rows must be a multiple of rows_per_load"),
        ("bad:channels=96", "channels must be a power of two, got 96"),
    ]:
        monkeypatch.setattr(sys, "argv", ["short_conv.py", "--variants", variant])
        with pytest.raises(SystemExit, match=f"--variants bad: .*{message}"):
            bench.main()


# ---------------------------------------------------------------- compiled for sm_90 (bf16, gdn-340M's shapes)

CONV_SHAPES = [(16, 2048, 512), (16, 2048, 1024)]  # B, T, D: gdn-340M's key and value convolutions
# the convolution's launches, each as its outputs' channels: q (or k) alone; q, k and v side by side, as gdn-340M
# convolves them in one launch (the registers of a launch do not depend on its channels, but a split adds outputs)
CONV_SPLITS = {"D=512": [512], "q|k|v D=512+512+1024": [512, 512, 1024]}


def sm90_report() -> dict:
    """Every launch of the convolution (forward and backward, batched and varlen), its decoding step and the GDN
    decoding step (gated, and without a gate), compiled for sm_90 with bf16 inputs and not run; registers and spills
    as the compiled cubins record them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_registers  # noqa: E402  (compile, do not interpret: it clears TRITON_INTERPRET)

    from fabric_lin.ops.gdn.fused_recurrent import fused_recurrent_gated_delta_rule_step_triton
    from fabric_lin.ops.short_conv_triton import causal_conv1d_split_triton, causal_conv1d_step_triton

    report = {"triton": kernel_registers.triton.__version__, "target": f"sm_{kernel_registers.TARGET.arch}",
              "launches": []}

    def compiled(label, run):
        records = []
        with kernel_registers.compile_only(records, set()):
            run()
        report["launches"] += [{"case": label, **row} for row in records]

    bf16 = torch.bfloat16
    B, T = CONV_SHAPES[0][:2]
    cu = torch.arange(0, B * T + 1, 1000, dtype=torch.int32)
    cu = torch.cat([cu, torch.tensor([B * T], dtype=torch.int32)]) if cu[-1] != B * T else cu
    # the launches compile and never run, so no value is read: inputs of zeros (drawing these 64M elements at random
    # costs about a second)
    for label, sizes in CONV_SPLITS.items():
        weight = torch.randn(sum(sizes), 4, requires_grad=True)  # an fp32 parameter, bf16 activations (bf16-mixed)

        def conv(x, cu_seqlens=None):
            ys, _ = causal_conv1d_split_triton(x, weight, sizes, cu_seqlens=cu_seqlens)
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])

        compiled(f"conv B={B} T={T} {label}",
                 lambda: conv(torch.zeros(B, T, sum(sizes), dtype=bf16, requires_grad=True)))
        compiled(f"conv varlen T={B * T} {label}",
                 lambda: conv(torch.zeros(1, B * T, sum(sizes), dtype=bf16, requires_grad=True), cu))
    for B, T, D in CONV_SHAPES:
        compiled(f"conv step B={B} D={D}", lambda: causal_conv1d_step_triton(
            torch.randn(B, D, dtype=bf16), torch.randn(D, 4), torch.randn(B, 3, D, dtype=bf16)))
    B, H, K, V = GDN_STEP_SHAPE
    q, k, v = (torch.randn(B, H, n, dtype=bf16) for n in (K, K, V))
    g, beta = -torch.rand(B, H), torch.rand(B, H)
    state = torch.randn(B, H, K, V)
    compiled(f"gdn step B={B} H={H} K={K} V={V}",
             lambda: fused_recurrent_gated_delta_rule_step_triton(q, k, v, g, beta, state, use_qk_l2norm=True))
    compiled(f"delta rule step B={B} H={H} K={K} V={V}",  # g None: DeltaNet's step, USE_GATE off
             lambda: fused_recurrent_gated_delta_rule_step_triton(q, k, v, None, beta, state, use_qk_l2norm=True))
    return report


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                    reason="this Triton wheel has no ptxas")
@pytest.mark.slow
def test_kernels_compile_for_sm90_in_bf16_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["target"] == "sm_90"
    by_case = {}
    for row in report["launches"]:
        by_case.setdefault(row["case"], []).append(row["kernel"])
        assert 0 < row["regs_per_thread"] <= 255, row
        assert row["spills"] == 0, row
    B, T = CONV_SHAPES[0][:2]
    for label in CONV_SPLITS:
        assert by_case[f"conv B={B} T={T} {label}"] == ["_conv_fwd_kernel", "_conv_bwd_kernel"]
        assert by_case[f"conv varlen T={B * T} {label}"] == ["_conv_fwd_kernel", "_conv_bwd_kernel"]
    for B, T, D in CONV_SHAPES:
        assert by_case[f"conv step B={B} D={D}"] == ["_conv_step_kernel"]
    assert by_case["gdn step B=16 H=4 K=128 V=256"] == ["_gdn_step_kernel"]
    assert by_case["delta rule step B=16 H=4 K=128 V=256"] == ["_gdn_step_kernel"]


# ---------------------------------------------------------------- GPU: bf16 against fp32 references


@needs_cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_conv_bf16_matches_fp32(varlen):
    from conftest import rel_rms

    from fabric_lin.ops.short_conv import causal_conv1d, causal_conv1d_ref

    B, T, D, W = (1, 8192, 1024, 4) if varlen else (4, 2048, 1024, 4)
    x = torch.randn(B, T, D, device="cuda")
    weight = torch.randn(D, W, device="cuda") * 0.5
    cu = torch.tensor([0, 1, 1, 700, 701, 4000, 8192], device="cuda", dtype=torch.int32) if varlen else None
    xb, wk = x.bfloat16().requires_grad_(True), weight.clone().requires_grad_(True)
    y, _ = causal_conv1d(xb, wk, cu_seqlens=cu)  # auto: the kernels on CUDA
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    y_ref, _ = causal_conv1d_ref(xr, wr, cu_seqlens=cu)
    y_ref.backward(dy.float())
    assert y.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16 and wk.grad.dtype == torch.float32
    for name, a, b in [("y", y, y_ref), ("dx", xb.grad, xr.grad), ("dweight", wk.grad, wr.grad)]:
        assert rel_rms(a, b) < 0.01, (name, rel_rms(a, b))


@needs_cuda
def test_gpu_conv_step_bf16_matches_the_full_convolution():
    from fabric_lin.ops.short_conv import causal_conv1d, causal_conv1d_ref

    B, T, D, W = 16, 9, 1024, 4
    x = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(D, W, device="cuda")
    with torch.no_grad():
        y_ref, cache_ref = causal_conv1d_ref(x, weight)
        cache, outs = torch.zeros(B, W - 1, D, device="cuda", dtype=torch.bfloat16), []
        for t in range(T):
            y, cache = causal_conv1d(x[:, t : t + 1], weight, cache)
            outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), y_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)


if __name__ == "__main__":
    print(json.dumps(sm90_report()))
