"""GLA kernel speed on one GPU: forward and forward+backward milliseconds (triton.testing.do_bench).

Compares fabric-lin's Triton `chunk_gla`, flash-linear-attention's `chunk_gla` (when the
`flash-linear-attention` package is importable) and SDPA flash attention (causal, head dim K) at the
same B, T, H. Prints one JSON document (and writes it to --out if given), with ratios ours / fla and
ours / SDPA, the memory each forward pass keeps for its backward (MiB), at every shape a per-kernel time
breakdown of our forward+backward and fla's, and after the first shape each of our compiled kernels'
registers, spills and shared memory (what limits its programs per SM).

    python benchmarks/gla_kernel.py --out gla_kernel.json
    python benchmarks/gla_kernel.py --shapes 16,2048,4,128,256
    python benchmarks/gla_kernel.py --variants sep:separate_scores=true wide:state_BV=128,BV_out=256

--variants times other launch tables (fabric_lin.ops.gla.chunk.LAUNCH) in the same run, each against
the same fla figures, and reports how far each one's output is from the table in place.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fabric_lin.ops.gla.chunk import chunk_gla_triton
from fabric_lin.ops.gla.tune import rel_rms

SHAPES = [(16, 2048, 4, 128, 256), (4, 8192, 16, 128, 128), (1, 32768, 8, 128, 128)]


def gla_inputs(B, T, H, K, V, dtype=torch.bfloat16, device="cuda"):
    q = torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, H, V, device=device, dtype=dtype, requires_grad=True)
    gk = (F.logsigmoid(torch.randn(B, T, H, K, device=device)) / 16).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=device, dtype=dtype)
    return (q, k, v, gk), do


def ours(q, k, v, gk):
    return chunk_gla_triton(q, k, v, gk)[0]


def time_fn(fn, inputs, do):
    """(forward ms, forward+backward ms)."""
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        o = fn(*inputs)
        o.backward(do)

    return do_bench(fwd, warmup=25, rep=100), do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=list(inputs))


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


def kernel_breakdown(fn, inputs, do, steps=5):
    """Per-kernel CUDA time (ms per call) of forward+backward, from torch.profiler. The inputs' gradients are
    dropped before each call, as do_bench's grad_to_none does, so no accumulation kernel is counted."""
    from torch.profiler import ProfilerActivity, profile

    def fwd_bwd():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(do)

    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd_bwd()
        torch.cuda.synchronize()
    rows = {}
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if device_us > 0 and evt.count > 0:
            rows[evt.key[:80]] = round(device_us / 1000 / steps, 4)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1])[:15])


def kernel_resources():
    """Registers, spills, shared memory and warps of each of our compiled GLA kernels, and how many of its
    programs one multiprocessor can hold by registers (64K per SM) and shared memory (228 KiB on an H200)."""
    import triton
    from fabric_lin.ops.gla import chunk

    rows = {}
    for name in sorted(vars(chunk)):
        fn = getattr(chunk, name)
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
                        **_flags(fn, kernel),
                    }
                except Exception as e:  # another Triton's internals: report, do not fail the benchmark
                    rows[f"{name}#{i}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return rows


def _flags(fn, kernel):
    """The kernel's boolean compile-time flags (PREFETCH, EARLY_LOADS, ...), where Triton keeps them by argument
    index; {} where this Triton keeps them otherwise."""
    flags = {}
    for key, value in (getattr(getattr(kernel, "src", None), "constants", None) or {}).items():
        index = key[0] if isinstance(key, tuple) and key else key
        if isinstance(index, int) and index < len(fn.arg_names) and isinstance(value, bool):
            flags[fn.arg_names[index]] = value
    return flags


def sweep(shape):
    """The opt-in launch search (fabric_lin.ops.gla.tune) at one shape: every setting it tried, and how
    far the shipped table is from the best one. The shipped table is put back afterwards."""
    from fabric_lin.ops.gla import chunk
    from fabric_lin.ops.gla.tune import tune_launch

    shipped = dict(chunk.LAUNCH)
    result = tune_launch(*shape)
    chunk.LAUNCH.clear()
    chunk.LAUNCH.update(shipped)
    changed = {k: v for k, v in result["launch"].items() if shipped.get(k) != v}
    return {"shape": list(shape), "best_changes": changed, "best_fwd_bwd_ms": result["fwd_bwd_ms"],
            "shipped_fwd_bwd_ms": result["shipped_fwd_bwd_ms"],
            "shipped_vs_best": result["shipped_fwd_bwd_ms"] / result["fwd_bwd_ms"], "tried": result["tried"]}


def parse_launch(items, what, table=None):
    """{key: value} from KEY=VALUE strings, values as a launch table holds them (bool, int, float or str); the
    keys those of `table` (default: the GLA kernels' LAUNCH)."""
    if table is None:
        from fabric_lin.ops.gla.chunk import LAUNCH as table

    settings = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in table:
            raise SystemExit(f"{what} {item}: unknown key {key!r}, expected one of {sorted(table)}")
        settings[key] = {"true": True, "false": False}.get(value.lower(), _number_or_text(value))
    return settings


def _number_or_text(value):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_variants(items, table=None):
    """{name: settings} from NAME:KEY=VALUE[,KEY=VALUE...] strings (--variants), keys those of `table`."""
    variants = {}
    for item in items:
        name, sep, changes = item.partition(":")
        if not sep or not changes:
            raise SystemExit(f"--variants {item!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        variants[name] = parse_launch(changes.split(","), f"--variants {name}:", table)
    return variants


def time_variants(variants, inputs, do, fla_fwd_bwd_ms):
    """{name: ms and ratio} for each launch variant, timed with the table in place changed by it."""
    from fabric_lin.ops.gla import chunk

    base = dict(chunk.LAUNCH)
    with torch.no_grad():
        o_base = ours(*inputs)
    results = {}
    for name, settings in variants.items():
        chunk.LAUNCH.update(settings)
        try:
            with torch.no_grad():
                o = ours(*inputs)
            fwd_ms, fwd_bwd_ms = time_fn(ours, inputs, do)
            row = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "o_rel_rms_vs_table": rel_rms(o, o_base),
                   "saved_mib": saved_mib(ours, inputs)}
            if fla_fwd_bwd_ms:
                row["ratio_fwd_bwd_vs_fla"] = fwd_bwd_ms / fla_fwd_bwd_ms
            results[name] = row
        except Exception as e:  # a setting that does not compile or fit is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            chunk.LAUNCH.clear()
            chunk.LAUNCH.update(base)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", help="B,T,H,K,V (default: the three reference shapes)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
    parser.add_argument("--fla-only", action="store_true",
                        help="time flash-linear-attention alone (e.g. to fill its autotuning cache ahead of a comparison)")
    parser.add_argument("--launch", nargs="*", default=[], metavar="KEY=VALUE",
                        help="launch settings of fabric_lin.ops.gla.chunk.LAUNCH, e.g. state_split=auto dqk_warps=4")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch tables to time at every shape, each as changes to the one in place")
    parser.add_argument("--just-run", type=int, default=0, metavar="N",
                        help="only run our forward+backward N times at the first shape, untimed (a short workload "
                             "for a profiler such as Nsight Compute), and exit")
    parser.add_argument("--sweep", action="store_true",
                        help="first run the launch search (tiles, warps) at the first shape and report it; the timings use the shipped table")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    from fabric_lin.ops.gla import chunk

    chunk.LAUNCH.update(parse_launch(args.launch, "--launch"))
    variants = parse_variants(args.variants)
    if args.just_run:
        inputs, do = gla_inputs(*shapes[0])
        for _ in range(args.just_run):
            ours(*inputs).backward(do)
        torch.cuda.synchronize()
        print(f"ran forward+backward {args.just_run} times at {shapes[0]}")
        return

    fla, fla_error = (None, "left out (--no-fla)") if args.no_fla else load_fla()
    if args.fla_only and fla is None:
        raise SystemExit(f"--fla-only: flash-linear-attention is not usable: {fla_error}")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "fla": fla_error or "flash-linear-attention chunk_gla",
        "launch": dict(chunk.LAUNCH),
        "variants": variants,
        "results": [],
    }
    if args.sweep:
        report["sweep"] = sweep(shapes[0])
        print(json.dumps(report["sweep"]), flush=True)
    for shape in shapes:
        B, T, H, K, V = shape
        inputs, do = gla_inputs(*shape)
        row = {"shape": list(shape)}
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
            row["variants"] = time_variants(variants, inputs, do, row.get("fla_fwd_bwd_ms"))
        del inputs, do
        s_inputs, s_do = sdpa_inputs(B, T, H, K)
        row["sdpa_flash_fwd_ms"], row["sdpa_flash_fwd_bwd_ms"] = time_fn(sdpa_flash, s_inputs, s_do)
        row["ratio_fwd_bwd_vs_sdpa"] = row["ours_fwd_bwd_ms"] / row["sdpa_flash_fwd_bwd_ms"]
        del s_inputs, s_do
        if not args.no_breakdown:  # per shape: which kernel bounds the time changes with the shape
            inputs, do = gla_inputs(*shape)
            row["breakdown_ours_ms"] = kernel_breakdown(ours, inputs, do)
            if fla is not None:
                row["breakdown_fla_ms"] = kernel_breakdown(fla, inputs, do)
            del inputs, do
            if shape == shapes[0]:  # right after the first shape, so that a run cut short still has it
                report["resources_ours"] = kernel_resources()
                print(json.dumps({"resources_ours": report["resources_ours"]}), flush=True)
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # each shape as it finishes, so that an interrupted run keeps what it measured
            with open(args.out + ".partial", "a") as f:
                f.write(json.dumps(row) + "\n")
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
