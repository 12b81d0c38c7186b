"""GLA kernel speed on one GPU: forward and forward+backward milliseconds (triton.testing.do_bench).

Compares fabric-lin's Triton `chunk_gla`, flash-linear-attention's `chunk_gla` (when the
`flash-linear-attention` package is importable) and SDPA flash attention (causal, head dim K) at the
same B, T, H, in one process. Prints one JSON document (and writes it to --out if given), with ratios
ours / fla and ours / SDPA, the memory each forward pass keeps for its backward (MiB), at every shape a
per-kernel time breakdown of our forward+backward and fla's, and after the first shape each of our
compiled kernels' registers, spills and shared memory (what limits its programs per SM).

    python benchmarks/gla_kernel.py --out gla_kernel.json
    python benchmarks/gla_kernel.py --shapes 16,2048,4,128,256 --gates slow fast mixed
    python benchmarks/gla_kernel.py --variants w8:output.warps=8 wide:state.BV=64,output.BV=128

--gates: the forget gates the kernels are timed on. slow: logsigmoid(randn) / 16, as fla's own benchmarks draw
them (a decay of ~0.05 per step); fast: logsigmoid(randn - 24) / 16, ~1.5 per step, as a trained model's
short-memory channels forget; mixed: the two in alternate key columns, so that every key tile holds both.
--launch and --variants time other launch settings (fields of fabric_lin.ops.gla.launch.GLALaunch, written
kernel.field=value) against the same fla figures, and report how far each one's output is from the shipped
settings'.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from common import kernel_ms, out_arg, shape_arg, time_ms, write_result
from fabric_lin.ops.gla.chunk import chunk_gla_triton
from fabric_lin.ops.gla.launch import SHIPPED
from fabric_lin.ops.gla.tune import rel_rms, tune_launch, with_settings

SHAPES = [(16, 2048, 4, 128, 256), (4, 8192, 16, 128, 128), (1, 32768, 8, 128, 128)]
GATES = ("slow", "fast", "mixed")


def gate_logits(B, T, H, K, gates, device="cuda"):
    x = torch.randn(B, T, H, K, device=device)
    if gates == "fast":
        return x - 24
    if gates == "mixed":
        return torch.where(torch.arange(K, device=device) % 2 == 0, x, x - 24)
    if gates != "slow":
        raise SystemExit(f"--gates {gates!r}: expected one of {GATES}")
    return x


def gla_inputs(B, T, H, K, V, gates="slow", dtype=torch.bfloat16, device="cuda"):
    q = torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, H, V, device=device, dtype=dtype, requires_grad=True)
    gk = (F.logsigmoid(gate_logits(B, T, H, K, gates, device)) / 16).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=device, dtype=dtype)
    return (q, k, v, gk), do


def ours_with(launch):
    return lambda q, k, v, gk: chunk_gla_triton(q, k, v, gk, launch=launch)[0]


def time_fn(fn, inputs, do):
    """(forward ms, forward+backward ms)."""
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        fn(*inputs).backward(do)

    return time_ms(fwd), time_ms(fwd_bwd, grad_to_none=list(inputs))


def saved_mib(fn, inputs):
    """MiB the forward pass leaves allocated for the backward (what autograd keeps, the output excluded)."""
    for x in inputs:
        x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = fn(*inputs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - o.numel() * o.element_size()
    del o
    return round(kept / 2**20, 1)


def load_fla():
    try:
        from fla.ops.gla import chunk_gla
    except Exception as e:  # not installed, or it fails to import against this torch/triton
        return None, f"{type(e).__name__}: {e}"
    return (lambda q, k, v, gk: chunk_gla(q, k, v, g=gk)[0]), None


def sdpa_inputs(B, T, H, D, dtype=torch.bfloat16):
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    return (q, k, v), torch.randn(B, H, T, D, device="cuda", dtype=dtype)


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kernel_breakdown(fn, inputs, do):
    """Per-kernel GPU time (ms per call, the 15 largest) of forward+backward; the inputs' gradients are dropped
    before each call, so no accumulation kernel is counted."""
    def fwd_bwd():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(do)

    rows = kernel_ms(fwd_bwd)
    return {name[:80]: round(ms, 4) for name, ms in list(rows.items())[:15]}


def kernel_modules():
    from fabric_lin.ops.gla import chunk_bwd, chunk_fwd, cumsum, state_pass

    return [cumsum, state_pass, chunk_fwd, chunk_bwd]


def kernel_resources():
    """Registers, spills, shared memory and warps of each of our compiled GLA kernels, and how many of its
    programs one multiprocessor can hold by registers (64K per SM) and shared memory (228 KiB on an H200)."""
    import triton

    rows = {}
    for module in kernel_modules():
        for name in sorted(vars(module)):
            fn = getattr(module, name)
            if not isinstance(fn, triton.runtime.JITFunction):
                continue
            for caches in getattr(fn, "device_caches", {}).values():
                for i, kernel in enumerate(caches[0].values()):
                    try:
                        kernel._init_handles()
                        warps, regs, shared = kernel.metadata.num_warps, kernel.n_regs, kernel.metadata.shared
                        rows[f"{name}#{i}"] = {
                            "warps": warps, "regs_per_thread": regs, "spills": kernel.n_spills, "shared_bytes": shared,
                            "programs_per_sm_by_regs": 65536 // max(1, regs * 32 * warps),
                            "programs_per_sm_by_shared": (233472 // shared) if shared else None,
                        }
                    except Exception as e:  # another Triton's internals: report, do not fail the benchmark
                        rows[f"{name}#{i}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return rows


def sweep(shape):
    """The opt-in launch search (fabric_lin.ops.gla.tune) at one shape: every setting it tried, and how far
    the shipped settings are from the best one."""
    result = tune_launch(*shape)
    best = result["launch"]
    return {"shape": list(shape), "best_launch": best.as_json, "best_fwd_bwd_ms": result["fwd_bwd_ms"],
            "shipped_fwd_bwd_ms": result["start_fwd_bwd_ms"],
            "shipped_vs_best": result["start_fwd_bwd_ms"] / result["fwd_bwd_ms"], "tried": result["tried"]}


def parse_settings(items, what):
    """{"kernel.field": value} from KEY=VALUE strings, values as ints, floats, or None ("none")."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what} {item!r}: expected KEY=VALUE, e.g. dqk.warps=4")
        settings[key] = None if value.lower() == "none" else _number(value, f"{what} {item}")
    try:
        with_settings(SHIPPED, settings)
    except ValueError as e:
        raise SystemExit(f"{what}: {e}; the fields are those of fabric_lin.ops.gla.launch.GLALaunch") from None
    return settings


def _number(value, what):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise SystemExit(f"{what}: {value!r} is not a number")


def parse_variants(items):
    """{name: launch} from NAME:KEY=VALUE[,KEY=VALUE...] strings (--variants)."""
    variants = {}
    for item in items:
        name, sep, changes = item.partition(":")
        if not sep or not changes:
            raise SystemExit(f"--variants {item!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        variants[name] = with_settings(SHIPPED, parse_settings(changes.split(","), f"--variants {name}:"))
    return variants


def time_variants(variants, launch, inputs, do, fla_fwd_bwd_ms):
    """{name: ms and ratio} for each launch variant, its output against `launch`'s."""
    with torch.no_grad():
        o_base = ours_with(launch)(*inputs)
    results = {}
    for name, variant in variants.items():
        fn = ours_with(variant)
        try:
            with torch.no_grad():
                o = fn(*inputs)
            fwd_ms, fwd_bwd_ms = time_fn(fn, inputs, do)
            row = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "o_rel_rms_vs_shipped": rel_rms(o, o_base),
                   "saved_mib": saved_mib(fn, inputs)}
            if fla_fwd_bwd_ms:
                row["ratio_fwd_bwd_vs_fla"] = fwd_bwd_ms / fla_fwd_bwd_ms
            results[name] = row
        except Exception as e:  # a setting that does not compile or fit is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", type=shape_arg, help="B,T,H,K,V (default: the three reference shapes)")
    parser.add_argument("--gates", nargs="*", default=["slow"], choices=GATES, help="gate families to time on")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
    parser.add_argument("--fla-only", action="store_true",
                        help="time flash-linear-attention alone (e.g. to fill its autotuning cache ahead of a comparison)")
    parser.add_argument("--launch", nargs="*", default=[], metavar="KEY=VALUE",
                        help="launch settings in place of the shipped ones, e.g. dqk.warps=4 state.warps=none")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch settings to time at every shape, each as changes to the shipped ones")
    parser.add_argument("--just-run", type=int, default=0, metavar="N",
                        help="only run our forward+backward N times at the first shape, untimed (a short workload "
                             "for a profiler such as Nsight Compute), and exit")
    parser.add_argument("--sweep", action="store_true",
                        help="first run the launch search (tiles, warps) at the first shape and report it")
    args = parser.parse_args()
    shapes = args.shapes or SHAPES
    launch = with_settings(SHIPPED, parse_settings(args.launch, "--launch"))
    variants = parse_variants(args.variants)
    ours = ours_with(launch)
    if args.just_run:
        inputs, do = gla_inputs(*shapes[0], gates=args.gates[0])
        for _ in range(args.just_run):
            ours(*inputs).backward(do)
        torch.cuda.synchronize()
        print(f"ran forward+backward {args.just_run} times at {shapes[0]}")
        return

    fla, fla_error = (None, "left out (--no-fla)") if args.no_fla else load_fla()
    if args.fla_only and fla is None:
        raise SystemExit(f"--fla-only: flash-linear-attention is not usable: {fla_error}")
    report = {"dtype": "bfloat16", "fla": fla_error or "flash-linear-attention chunk_gla", "launch": launch.as_json,
              "variants": {name: v.as_json for name, v in variants.items()}, "results": []}
    if args.sweep:
        report["sweep"] = sweep(shapes[0])
    for gates in args.gates:
        for shape in shapes:
            B, T, H, K, V = shape
            inputs, do = gla_inputs(*shape, gates=gates)
            row = {"shape": list(shape), "gates": gates}
            for name, fn in [("fla", fla)] if args.fla_only else [("ours", ours)]:
                start = time.perf_counter()
                fn(*inputs).backward(do)  # compilation (and for fla, autotuning) happens here
                torch.cuda.synchronize()
                row[f"{name}_first_call_s"] = round(time.perf_counter() - start, 2)
                row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = time_fn(fn, inputs, do)
                row[f"{name}_saved_mib"] = saved_mib(fn, inputs)
            if args.fla_only:
                report["results"].append(row)
                print(json.dumps(row), flush=True)
                continue
            if fla is not None:
                with torch.no_grad():
                    row["o_rel_rms_vs_fla"] = rel_rms(ours(*inputs), fla(*inputs))
                row["fla_fwd_ms"], row["fla_fwd_bwd_ms"] = time_fn(fla, inputs, do)
                row["fla_saved_mib"] = saved_mib(fla, inputs)
                row["ratio_fwd_vs_fla"] = row["ours_fwd_ms"] / row["fla_fwd_ms"]
                row["ratio_fwd_bwd_vs_fla"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_ms"]
            if variants:
                row["variants"] = time_variants(variants, launch, inputs, do, row.get("fla_fwd_bwd_ms"))
            del inputs, do
            s_inputs, s_do = sdpa_inputs(B, T, H, K)
            row["sdpa_flash_fwd_ms"], row["sdpa_flash_fwd_bwd_ms"] = time_fn(sdpa_flash, s_inputs, s_do)
            row["ratio_fwd_bwd_vs_sdpa"] = row["ours_fwd_bwd_ms"] / row["sdpa_flash_fwd_bwd_ms"]
            del s_inputs, s_do
            if not args.no_breakdown:  # per shape: which kernel bounds the time changes with the shape
                inputs, do = gla_inputs(*shape, gates=gates)
                row["breakdown_ours_ms"] = kernel_breakdown(ours, inputs, do)
                if fla is not None:
                    row["breakdown_fla_ms"] = kernel_breakdown(fla, inputs, do)
                del inputs, do
                if "resources_ours" not in report:
                    report["resources_ours"] = kernel_resources()
            report["results"].append(row)
            print(json.dumps(row), flush=True)  # each row as it finishes: a run cut short keeps them in its log
    write_result(report, args.out, fla_ran=fla is not None)


if __name__ == "__main__":
    main()
