"""The short convolution (causal, depthwise, W = 4 taps, then SiLU) at gdn-340M's shapes: forward and
forward+backward milliseconds of the shipped launch (fabric_lin.ops.fused_launch.ShortConvLaunch) against
flash-linear-attention's causal_conv1d (when importable) in the same process, and the GPU time of forward+backward
by kernel (torch.profiler), with its fraction of the copy bandwidth that the ideal traffic needs.

    python benchmarks/short_conv.py --out short_conv.json
    python benchmarks/short_conv.py --variants c256:channels=256 w8:warps=8 r64:rows=64,rows_per_load=4
    python benchmarks/short_conv.py --documents 64            # each batch as 64 packed documents (cu_seqlens)
    TRITON_INTERPRET=1 python benchmarks/short_conv.py --batch 1 --seq 40 --channels 24 --no-fla   # CPU smoke run

x is [batch, seq, C] bf16 on a GPU (fp32 in Triton's interpreter) for C = 512 (q and k), 1024 (v) and 2048 (the
three side by side, as one call over the concatenated channels makes them). The shipped launch, then each
--variants NAME:KEY=VALUE,... (changes to it: channels, rows, rows_per_load, warps), is timed, with its outputs'
distance from the shipped launch's. Ideal traffic: forward reads x and writes y, backward reads x and dy and writes
dx (bf16: 2 + 2 and 6 bytes per element).

Prints one JSON document.
"""
import argparse
import dataclasses
import json
import time

import torch

from common import kernel_ms, out_arg, parse_variants, positive_int, time_ms, write_result
from fabric_lin.ops.fused_launch import SHIPPED_SHORT_CONV as SHIPPED
from fabric_lin.ops.gla.tune import rel_rms
from fabric_lin.ops.short_conv import causal_conv1d

W = 4


def time_pair(fn, inputs, dy, cuda):
    """(forward ms, forward+backward ms, forward+backward GPU ms by kernel or None) of fn(*inputs) -> y; on
    the CPU (the interpreter, nothing compiled: a smoke run, whose times say nothing of a GPU's) the wall time of
    one call, no kernel breakdown."""
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(dy)

    if cuda:
        return time_ms(fwd), time_ms(fwd_bwd), kernel_ms(fwd_bwd, calls=5)
    timings = []
    for step in (fwd, fwd_bwd):
        start = time.perf_counter()
        step()
        timings.append((time.perf_counter() - start) * 1e3)
    return timings[0], timings[1], None


def outputs_of(fn, inputs, dy):
    """(y, dx, dweight) of one forward and backward call."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), leaves[0].grad, leaves[1].grad


def ours(launch, cu_seqlens):
    return lambda x, weight: causal_conv1d(x, weight, cu_seqlens=cu_seqlens, backend="triton", launch=launch)[0]


def load_fla(cu_seqlens):
    """fla's causal_conv1d with SiLU as a function of (x, weight), or None, and the import error if any."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    except Exception as e:  # not installed, or it fails to import against this torch/triton
        return None, f"{type(e).__name__}: {e}"
    return lambda x, weight: fla_conv(x, weight, activation="silu", cu_seqlens=cu_seqlens)[0], None


def document_offsets(tokens, documents, device):
    """cu_seqlens of `documents` documents of random lengths (at least one token each) filling the tokens."""
    generator = torch.Generator().manual_seed(0)
    cuts = torch.randperm(tokens - 1, generator=generator)[: documents - 1].add(1).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).to(device=device, dtype=torch.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--seq", type=positive_int, default=2048)
    parser.add_argument("--channels", type=positive_int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--documents", type=positive_int, help="each run as one row of this many packed documents")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch settings (changes to the shipped ShortConvLaunch), each timed beside it")
    parser.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    launches = {"shipped": SHIPPED, **parse_variants(args.variants, SHIPPED)}
    B, T = (1, args.batch * args.seq) if args.documents else (args.batch, args.seq)
    cu_seqlens = document_offsets(T, args.documents, device) if args.documents else None
    fla, fla_error = (None, "left out (--no-fla)") if args.no_fla or not cuda else load_fla(cu_seqlens)
    copy_gb_s = None
    if cuda:  # the copy bandwidth this GPU reaches, for the fractions below
        a = torch.empty(2**28, device="cuda", dtype=torch.uint8)
        copy_gb_s = 2 * a.numel() / time_ms(lambda: torch.empty_like(a).copy_(a)) / 1e6
        del a
    report = {"batch": B, "seq": T, "documents": args.documents, "width": W, "dtype": str(dtype).split(".")[-1],
              "fla": fla_error or "flash-linear-attention causal_conv1d, activation silu",
              "copy_gb_s": copy_gb_s and round(copy_gb_s),
              "launches": {name: dataclasses.asdict(launch) for name, launch in launches.items()}, "results": []}
    for C in args.channels:
        generator = torch.Generator().manual_seed(C)
        x = torch.randn(B, T, C, generator=generator).to(device, dtype).requires_grad_(True)
        weight = (torch.randn(C, W, generator=generator) * 0.5).to(device).requires_grad_(True)  # fp32, as trained
        dy = torch.randn(B, T, C, generator=generator).to(device, dtype)
        ideal_bytes = x.numel() * x.element_size() * (2 + 3)  # forward x, y; backward x, dy, dx
        shipped_out = outputs_of(ours(SHIPPED, cu_seqlens), (x, weight), dy)
        row = {"channels": C}
        for name, fn in [(name, ours(launch, cu_seqlens)) for name, launch in launches.items()] + (
                [("fla", fla)] if fla is not None else []):
            try:
                fwd_ms, fwd_bwd_ms, by_kernel = time_pair(fn, (x, weight), dy, cuda)
                out = outputs_of(fn, (x, weight), dy)
            except Exception as e:  # a setting that does not compile or fit is reported, not fatal
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            gpu_ms = sum(by_kernel.values()) if by_kernel else None
            row[name] = {
                "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
                "fwd_bwd_gpu_ms": gpu_ms and round(gpu_ms, 4),
                "fwd_bwd_gpu_fraction_of_copy_bandwidth": gpu_ms and round(ideal_bytes / (gpu_ms * 1e6) / copy_gb_s, 3),
                "gpu_ms_by_kernel": by_kernel and {k: round(v, 4) for k, v in by_kernel.items()},
                "rel_rms_vs_shipped": {part: rel_rms(a, b) for part, a, b in zip(("y", "dx", "dweight"), out, shipped_out)},
            }
        if "fwd_bwd_ms" in row.get("fla", {}):
            for name in launches:
                if "fwd_bwd_ms" in row[name]:
                    row[name]["ratio_fwd_bwd_vs_fla"] = round(row[name]["fwd_bwd_ms"] / row["fla"]["fwd_bwd_ms"], 3)
        report["results"].append(row)
        print(json.dumps(row), flush=True)
    write_result(report, args.out, fla_ran=fla is not None)


if __name__ == "__main__":
    main()
