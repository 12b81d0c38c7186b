"""Gated DeltaNet kernel speed on one GPU: forward and forward+backward milliseconds of fabric-lin's Triton
`chunk_gated_delta_rule` against flash-linear-attention's (when importable), in one process, with q/k L2-normalised
inside both ops (the model's call). Prints one JSON document (and writes it to --out), with the ratios ours / fla,
the memory each forward keeps for its backward (MiB), each output's distance from fla's, and per shape a
per-kernel time breakdown of both.

    python benchmarks/gdn_kernel.py --out gdn_kernel.json
    python benchmarks/gdn_kernel.py --shapes 16,2048,4,128,256 --gates slow fast
    python benchmarks/gdn_kernel.py --shapes 4,8192,16,128,128 --variants wide:narrow_state.BV=64
    python benchmarks/gdn_kernel.py --gates none --out delta_rule_kernel.json             # DeltaNet
    python benchmarks/gdn_kernel.py --shapes 1,32768,8,128,128 --varlen 64                # 64 documents

The default shapes (B, T, H, K, V) are the gdn-340M layer (16, 2048, 4, 128, 256), (4, 8192, 16, 128, 128) and
(1, 32768, 8, 128, 128); with --gates none, the deltanet-340M layer (16, 2048, 8, 128, 128) and the same tokens
at 8K, (4, 8192, 8, 128, 128). --gates: slow, a per-step log decay logsigmoid(randn) / 16 (~0.05); init, the
model's gate as it is initialised (-exp(A_log) * softplus(a + dt_bias), a ~ N(0, 1)); fast, ~1.5 per step, as a
trained model's short-memory heads forget; none, DeltaNet's delta rule (g=None: our kernels with the
decay compiled out, against fla's chunk_delta_rule), timed beside our gated op on the same shape with slow gates
(`gated_*_ms`, `ratio_fwd_bwd_vs_gated`). beta = sigmoid(randn).
--variants times other launch settings (fields of fabric_lin.ops.gdn.launch.GDNLaunch, written kernel.field=value)
against the same fla figures, each with its output's distance from the shipped settings'.
"""
import argparse
import functools
import json
import math
import time

import torch
import torch.nn.functional as F

from common import lift_fla_gdn_hopper_guard, out_arg, parse_variants, shape_arg, write_result
from fabric_lin.ops.gdn import chunk_gated_delta_rule
from fabric_lin.ops.gdn.launch import SHIPPED
from fabric_lin.ops.gla.tune import rel_rms
from gla_kernel import kernel_breakdown, saved_mib, time_fn

SHAPES = [(16, 2048, 4, 128, 256), (4, 8192, 16, 128, 128), (1, 32768, 8, 128, 128)]
# --gates none: the deltanet-340M layer (8 heads of K = V = 128) at 2K and, the same tokens a step, at 8K
DELTA_SHAPES = [(16, 2048, 8, 128, 128), (4, 8192, 8, 128, 128)]
GATES = ("slow", "init", "fast", "none")


def gdn_inputs(B, T, H, K, V, gates="slow", dtype=torch.bfloat16, device="cuda"):
    """((q, k, v, g, beta), do); gates "none": ((q, k, v, beta), do)."""
    q, k = (torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device, dtype=dtype, requires_grad=True)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device)).to(dtype).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=device, dtype=dtype)
    if gates == "none":
        return (q, k, v, beta), do
    x = torch.randn(B, T, H, device=device)
    if gates == "init":  # the model's gate at initialisation: -exp(A_log) * softplus(a + dt_bias), a ~ N(0, 1)
        A = torch.empty(H, device=device).uniform_(0, 16)
        dt = torch.exp(torch.empty(H, device=device).uniform_(math.log(1e-3), math.log(1e-1)))
        g = -A * F.softplus(x + dt + torch.log(-torch.expm1(-dt)))
    else:
        g = F.logsigmoid(x - (24 if gates == "fast" else 0)) / 16
    return (q, k, v, g.requires_grad_(True), beta), do


def document_offsets(T, documents, device="cuda"):
    """cu_seqlens of `documents` documents of random lengths (at least 64 tokens each) filling T tokens."""
    generator = torch.Generator().manual_seed(0)
    cuts = torch.randperm(T // 64 - 1, generator=generator)[: documents - 1].add(1).sort().values * 64
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(device=device, dtype=torch.int32)


def ours_with(launch, gated=True, cu_seqlens=None):
    """Our op as a function of gdn_inputs' tensors: the gated rule, or (gated False) the delta rule, g=None."""
    if not gated:
        return lambda q, k, v, beta: chunk_gated_delta_rule(q, k, v, None, beta, use_qk_l2norm=True,
                                                            cu_seqlens=cu_seqlens, backend="triton", launch=launch)[0]
    return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, backend="triton",
                                                           cu_seqlens=cu_seqlens, launch=launch)[0]


def time_variants(variants, inputs, do, fla_fwd_ms, fla_fwd_bwd_ms, gated=True, cu_seqlens=None):
    """{name: ms, ratios against fla and the output's distance from the shipped settings'} per launch variant."""
    with torch.no_grad():
        o_shipped = ours_with(SHIPPED, gated, cu_seqlens)(*inputs)
    results = {}
    for name, launch in variants.items():
        fn = ours_with(launch, gated, cu_seqlens)
        try:
            with torch.no_grad():
                o = fn(*inputs)
            fwd_ms, fwd_bwd_ms = time_fn(fn, inputs, do)
            row = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "o_rel_rms_vs_shipped": rel_rms(o, o_shipped)}
            if fla_fwd_ms:
                row["ratio_fwd_vs_fla"] = fwd_ms / fla_fwd_ms
                row["ratio_fwd_bwd_vs_fla"] = fwd_bwd_ms / fla_fwd_bwd_ms
            results[name] = row
        except Exception as e:  # a setting that does not compile or fit is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return results


def load_fla():
    """({"gated": fla's chunk_gated_delta_rule, "none": its chunk_delta_rule}, each a function of gdn_inputs'
    tensors and cu_seqlens; or None) and the import error, if any."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    except Exception as e:  # not installed, or it fails to import against this torch/triton
        return None, f"{type(e).__name__}: {e}"
    lift_fla_gdn_hopper_guard()  # fla is timed here; its output is compared forward only
    return {"gated": lambda q, k, v, g, beta, cu_seqlens=None: fla_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                                       cu_seqlens=cu_seqlens)[0],
            "none": lambda q, k, v, beta, cu_seqlens=None: chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True,
                                                                            cu_seqlens=cu_seqlens)[0]}, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", type=shape_arg,
                        help="B,T,H,K,V (default: the three reference shapes; with gates none, DeltaNet's two)")
    parser.add_argument("--gates", nargs="*", default=["slow"], choices=GATES)
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch settings (changes to the shipped GDNLaunch), each timed beside it")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
    parser.add_argument("--varlen", type=int, metavar="DOCUMENTS",
                        help="each shape (B must be 1) as this many documents of random lengths (cu_seqlens)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_kernel.py needs a CUDA GPU")
    shapes = args.shapes
    if args.varlen and any(shape[0] != 1 for shape in shapes or SHAPES):
        raise SystemExit("--varlen: every shape needs B = 1 (the documents lie in one row); give --shapes 1,T,H,K,V")
    variants = parse_variants(args.variants, SHIPPED)
    fla_ops, fla_error = (None, "left out (--no-fla)") if args.no_fla else load_fla()
    report = {"dtype": "bfloat16", "documents": args.varlen,
              "fla": fla_error or "flash-linear-attention chunk_gated_delta_rule (gates none: chunk_delta_rule)",
              "variants": {name: launch.as_json for name, launch in variants.items()}, "results": []}
    for gates in args.gates:
        gated = gates != "none"
        for shape in shapes or (SHAPES if gated else DELTA_SHAPES):
            inputs, do = gdn_inputs(*shape, gates=gates)
            cu_seqlens = document_offsets(shape[1], args.varlen) if args.varlen else None
            ours = ours_with(SHIPPED, gated, cu_seqlens)
            fla = functools.partial(fla_ops["gated" if gated else "none"], cu_seqlens=cu_seqlens) if fla_ops else None
            row = {"shape": list(shape), "gates": gates, "documents": args.varlen}
            if not gated:  # the bar: the delta rule no slower than the gated kernels on the same shape
                gated_inputs, gated_do = gdn_inputs(*shape, gates="slow")
                gated_op = ours_with(SHIPPED, True, cu_seqlens)
                gated_op(*gated_inputs).backward(gated_do)  # compiled here, not timed
                row["gated_fwd_ms"], row["gated_fwd_bwd_ms"] = time_fn(gated_op, gated_inputs, gated_do)
                del gated_inputs, gated_do
            for name, fn in [("ours", ours)] + ([("fla", fla)] if fla is not None else []):
                start = time.perf_counter()
                fn(*inputs).backward(do)  # compilation (and for fla, autotuning) happens here
                torch.cuda.synchronize()
                row[f"{name}_first_call_s"] = round(time.perf_counter() - start, 2)
                row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = time_fn(fn, inputs, do)
                row[f"{name}_saved_mib"] = saved_mib(fn, inputs)
            if fla is not None:
                with torch.no_grad():
                    row["o_rel_rms_vs_fla"] = rel_rms(ours(*inputs), fla(*inputs))
                row["ratio_fwd_vs_fla"] = row["ours_fwd_ms"] / row["fla_fwd_ms"]
                row["ratio_fwd_bwd_vs_fla"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_ms"]
            if not gated:
                row["ratio_fwd_bwd_vs_gated"] = row["ours_fwd_bwd_ms"] / row["gated_fwd_bwd_ms"]
            if variants:
                row["variants"] = time_variants(variants, inputs, do, row.get("fla_fwd_ms"), row.get("fla_fwd_bwd_ms"),
                                                gated, cu_seqlens)
            if not args.no_breakdown:
                row["breakdown_ours_ms"] = kernel_breakdown(ours, inputs, do)
                if fla is not None:
                    row["breakdown_fla_ms"] = kernel_breakdown(fla, inputs, do)
            del inputs, do
            report["results"].append(row)
            print(json.dumps(row), flush=True)
    write_result(report, args.out, fla_ran=fla is not None)


if __name__ == "__main__":
    main()
