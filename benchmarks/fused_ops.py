"""The fused norm and SwiGLU kernels against flash-linear-attention's, at the gla-340M training step's shapes.

One GPU, bf16, each op of ours beside fla's equivalent (when importable) in the same process: forward and
forward+backward milliseconds of wall time (triton.testing.do_bench), and the GPU time of forward+backward
(the kernels' time, from torch.profiler). At these sizes a norm's wall time in isolation came out far
above its kernels' time in a training step's profile, by all appearances the host's time to launch them
through autograd; in a training step the host runs ahead and the GPU time is what the op costs. Ours also as a fraction of the copy bandwidth
its minimal traffic needs in that GPU time (every input read once, every output written once):

    python benchmarks/fused_ops.py --out fused_ops.json
    python benchmarks/fused_ops.py --rows 8192            # a smaller batch

  rms_norm + residual   x + residual -> (y, h), hidden 1024 (a block's two pre-norms)
  rms_norm_gated        per-head rmsnorm(o) * swish(g), 4 heads of 256 (GLA's output norm and gate)
  swiglu                silu(gate) * up, 2816 wide (the MLP)

Prints one JSON document.
"""
import argparse
import dataclasses
import json

import torch

from common import kernel_ms, out_arg, time_ms, write_result
from fabric_lin.ops.norm import rms_norm, rms_norm_gated
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


def time_op(fn, inputs, profiled_calls=10):
    """(forward ms, forward+backward ms, forward+backward GPU ms) of fn, the output gradients fixed random
    tensors; the inputs' gradients dropped before each call (no accumulation kernel counted)."""
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
    gpu_ms = sum(kernel_ms(fwd_bwd, calls=profiled_calls).values())
    return fwd_ms, fwd_bwd_ms, (gpu_ms or None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16 * 2048, help="tokens (micro batch x sequence length)")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    args = parser.parse_args()
    peers = fla_ops()
    # the copy bandwidth this GPU reaches, for the fraction below
    a = torch.empty(2**28, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    copy_gb_s = 2 * a.numel() / time_ms(lambda: b.copy_(a)) / 1e6
    results = []
    for name, fn, inputs, (fwd_tensors, bwd_tensors) in cases(args.rows):
        big = inputs[0].numel() * inputs[0].element_size()  # bytes of one activation-sized tensor

        def fraction_of_copy(gpu_ms):
            return gpu_ms and round((fwd_tensors + bwd_tensors) * big / (gpu_ms * 1e6) / copy_gb_s, 3)

        fwd_ms, fwd_bwd_ms, gpu_ms = time_op(fn, inputs)
        row = {"op": name, "shape": list(inputs[0].shape), "ours_fwd_ms": round(fwd_ms, 4),
               "ours_fwd_bwd_ms": round(fwd_bwd_ms, 4), "ours_fwd_bwd_gpu_ms": gpu_ms and round(gpu_ms, 4),
               "ours_fwd_bwd_gpu_fraction_of_copy_bandwidth": fraction_of_copy(gpu_ms)}
        if name in peers:
            fla_fwd, fla_fwd_bwd, fla_gpu = time_op(peers[name], inputs)
            row.update(fla_fwd_ms=round(fla_fwd, 4), fla_fwd_bwd_ms=round(fla_fwd_bwd, 4),
                       fla_fwd_bwd_gpu_ms=fla_gpu and round(fla_gpu, 4),
                       ratio_fwd_vs_fla=round(fwd_ms / fla_fwd, 3), ratio_fwd_bwd_vs_fla=round(fwd_bwd_ms / fla_fwd_bwd, 3),
                       ratio_fwd_bwd_gpu_vs_fla=round(gpu_ms / fla_gpu, 3) if gpu_ms and fla_gpu else None)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"rows": args.rows, "copy_gb_s": round(copy_gb_s), "fla": bool(peers),
              "norm_launch": dataclasses.asdict(NORM_LAUNCH), "ops": results}
    write_result(report, args.out, fla_ran=bool(peers))


if __name__ == "__main__":
    main()
