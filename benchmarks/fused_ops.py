"""The fused norm and SwiGLU kernels against flash-linear-attention's, at the gla-340M training step's shapes.

One GPU, bf16, each op of ours beside fla's equivalent (when importable) in the same process: forward and
forward+backward milliseconds of wall time (triton.testing.do_bench), and the GPU time of forward+backward
(the kernels' time, from torch.profiler). At these sizes a norm's wall time in isolation came out far
above its kernels' time in a training step's profile, by all appearances the host's time to launch them
through autograd; in a training step the host runs ahead and the GPU time is what the op costs. Ours also as a fraction of the copy bandwidth
its minimal traffic needs in that GPU time (every input read once, every output written once):

    python benchmarks/fused_ops.py --out fused_ops.json
    python benchmarks/fused_ops.py --rows 8192            # a smaller batch
    python benchmarks/fused_ops.py --linears-only         # only the pre-norms with their projections

  rms_norm + residual   x + residual -> (y, h), hidden 1024 (a block's two pre-norms)
  rms_norm_gated        per-head rmsnorm(o) * swish(g), 4 heads of 256 (GLA's output norm and gate)
  swiglu                silu(gate) * up, 2816 wide (the MLP)
  rms_norm_linears      the attention's pre-norm with its input projections as each model's layer calls it
                        (gdn-340M: q, k and v side by side 2048 wide, a and b 4 wide, g 1024; gla-340M: q, k 512,
                        v 1024, the low-rank gate 16, g 1024), and the MLP's with gate and up side by side; no
                        peer in fla. Their times (mostly matrix products) come with the GPU time of each kernel.

Prints one JSON document.
"""
import argparse
import dataclasses
import json

import torch

from common import kernel_ms, out_arg, time_ms, write_result
from fabric_lin.config import Config
from fabric_lin.ops.norm import rms_norm, rms_norm_gated, rms_norm_linears
from fabric_lin.ops.fused_launch import SHIPPED_NORM as NORM_LAUNCH
from fabric_lin.ops.swiglu import swiglu


def fla_ops():
    """{op name: fla's function with our op's signature}, or {} without flash-linear-attention."""
    try:
        from fla.modules.activations import swiglu as fla_swiglu
        from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm as fla_rms_norm
    except ImportError:
        return {}
    return {
        "rms_norm + residual": lambda x, r, w: fla_rms_norm(x, w, None, residual=r, eps=1e-6, prenorm=True),
        "rms_norm_gated": lambda x, g, w: fla_rms_norm_gated(x, g, w, None, activation="swish", eps=1e-5),
        "swiglu": lambda gate, up: fla_swiglu(gate, up),
    }


def cases(rows: int):
    """(name, our function, its inputs, tensors of the minimal traffic forward and backward)."""
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, r, w = randn(rows, 1024), randn(rows, 1024), 1 + 0.1 * randn(1024)
    o, g, w_head = randn(rows, 4, 256), randn(rows, 4, 256), 1 + 0.1 * randn(256)
    gate, up = randn(rows, 2816), randn(rows, 2816)
    return [
        # forward: x, r in, y, h out; backward: h, dy, dh in, dx out
        ("rms_norm + residual", lambda x, r, w: rms_norm(x, w, 1e-6, residual=r), (x, r, w), (4, 4)),
        # forward: o, g in, y out; backward: o, g, dy in, do, dg out
        ("rms_norm_gated", lambda o, g, w: rms_norm_gated(o, g, w, 1e-5), (o, g, w_head), (3, 5)),
        # forward: gate, up in, y out; backward: gate, up, dy in, dgate, dup out
        ("swiglu", swiglu, (gate, up), (3, 5)),
    ]


LINEARS_MODELS = ("gdn-340M", "gla-340M")


def linears_cases(rows: int, models=LINEARS_MODELS, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """(name, fn(x, residual, norm weight, *projection weights) -> a tuple of tensors, inputs, the outputs' widths)
    for rms_norm_linears as each model's attention calls it, then as its MLP does (gate and up side by side)."""
    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, device=device, dtype=dtype)

    found = []
    for model in models:
        c = Config.from_name(model)
        d, std = c.hidden_size, c.initializer_range
        if c.block_type == "gdn":  # q, k and v side by side (one output: their short convolutions' input), a, b, g
            widths, groups = [c.key_dim, c.key_dim, c.value_dim, c.num_heads, c.num_heads, c.value_dim], [3, 1, 1, 1]
        elif c.block_type == "gla":
            kv = c.num_heads // c.num_kv_heads
            widths, groups = [c.key_dim, c.key_dim // kv, c.value_dim // kv, c.gate_low_rank_dim, c.value_dim], None
        else:
            raise ValueError(f"fused_ops.py: no rms_norm_linears case for {model} (block type {c.block_type})")
        inputs = [randn(rows, d), randn(rows, d), 1 + randn(d, scale=0.1), *(randn(n, d, scale=std) for n in widths)]

        def attention(x, r, w, *p, _groups=groups):
            outs, h = rms_norm_linears(x, w, 1e-6, p, residual=r, backend="triton", groups=_groups)
            return (*outs, h)

        outs = [sum(widths[sum(groups[:i]):sum(groups[:i + 1])]) for i in range(len(groups))] if groups else widths
        found.append((f"rms_norm_linears {model} attention", attention, inputs, outs))
    c = Config.from_name(models[0])
    inputs = [randn(rows, c.hidden_size), randn(rows, c.hidden_size), 1 + randn(c.hidden_size, scale=0.1),
              *(randn(c.intermediate_size, c.hidden_size, scale=c.initializer_range) for _ in range(2))]

    def mlp(x, r, w, *p):
        return rms_norm_linears(x, w, 1e-6, p, residual=r, backend="triton", side_by_side=True)

    found.append((f"rms_norm_linears {models[0]} mlp", mlp, inputs, [2 * c.intermediate_size]))
    return found


def time_op(fn, inputs, profiled_calls=10):
    """(forward ms, forward+backward ms, forward+backward GPU ms, that GPU time by kernel) of fn, the output
    gradients fixed random tensors; the inputs' gradients dropped before each call (no accumulation kernel
    counted)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.no_grad():
        outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(t) for t in outs]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        out = fn(*leaves)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)

    with torch.no_grad():
        fwd_ms = time_ms(lambda: fn(*leaves))
    fwd_bwd_ms = time_ms(fwd_bwd)
    kernels = kernel_ms(fwd_bwd, calls=profiled_calls)
    return fwd_ms, fwd_bwd_ms, (sum(kernels.values()) or None), kernels


def linears_row(name, fn, inputs, widths):
    fwd_ms, fwd_bwd_ms, gpu_ms, kernels = time_op(fn, inputs)
    return {"op": name, "tokens": inputs[0].shape[0], "hidden": inputs[0].shape[1], "output_widths": widths,
            "ours_fwd_ms": round(fwd_ms, 4), "ours_fwd_bwd_ms": round(fwd_bwd_ms, 4),
            "ours_fwd_bwd_gpu_ms": gpu_ms and round(gpu_ms, 4),
            "fwd_bwd_gpu_ms_by_kernel": {kernel: round(ms, 4) for kernel, ms in kernels.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16 * 2048, help="tokens (micro batch x sequence length)")
    parser.add_argument("--linears-only", action="store_true",
                        help="time only rms_norm_linears, at the shapes of " + " and ".join(LINEARS_MODELS))
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    args = parser.parse_args()
    peers = {} if args.linears_only else fla_ops()
    # the copy bandwidth this GPU reaches, for the fraction below
    a = torch.empty(2**28, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    copy_gb_s = 2 * a.numel() / time_ms(lambda: b.copy_(a)) / 1e6
    del a, b
    results = []
    for name, fn, inputs, (fwd_tensors, bwd_tensors) in ([] if args.linears_only else cases(args.rows)):
        big = inputs[0].numel() * inputs[0].element_size()  # bytes of one activation-sized tensor

        def fraction_of_copy(gpu_ms):
            return gpu_ms and round((fwd_tensors + bwd_tensors) * big / (gpu_ms * 1e6) / copy_gb_s, 3)

        fwd_ms, fwd_bwd_ms, gpu_ms, _ = time_op(fn, inputs)
        row = {"op": name, "shape": list(inputs[0].shape), "ours_fwd_ms": round(fwd_ms, 4),
               "ours_fwd_bwd_ms": round(fwd_bwd_ms, 4), "ours_fwd_bwd_gpu_ms": gpu_ms and round(gpu_ms, 4),
               "ours_fwd_bwd_gpu_fraction_of_copy_bandwidth": fraction_of_copy(gpu_ms)}
        if name in peers:
            fla_fwd, fla_fwd_bwd, fla_gpu, _ = time_op(peers[name], inputs)
            row.update(fla_fwd_ms=round(fla_fwd, 4), fla_fwd_bwd_ms=round(fla_fwd_bwd, 4),
                       fla_fwd_bwd_gpu_ms=fla_gpu and round(fla_gpu, 4),
                       ratio_fwd_vs_fla=round(fwd_ms / fla_fwd, 3), ratio_fwd_bwd_vs_fla=round(fwd_bwd_ms / fla_fwd_bwd, 3),
                       ratio_fwd_bwd_gpu_vs_fla=round(gpu_ms / fla_gpu, 3) if gpu_ms and fla_gpu else None)
        results.append(row)
        print(json.dumps(row), flush=True)
    for case in linears_cases(args.rows):
        row = linears_row(*case)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "fwd_bwd_gpu_ms_by_kernel"}), flush=True)
    report = {"rows": args.rows, "copy_gb_s": round(copy_gb_s), "fla": bool(peers),
              "norm_launch": dataclasses.asdict(NORM_LAUNCH), "ops": results}
    write_result(report, args.out, fla_ran=bool(peers))


if __name__ == "__main__":
    main()
