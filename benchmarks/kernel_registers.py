"""Registers, spills and programs per SM of each GLA Triton kernel, compiled for an H100/H200 (sm_90) on
any machine, with or without a GPU.

The forward and backward launch code of `chunk_gla_triton` runs on CPU tensors with Triton's driver
replaced by one that reports an sm_90 GPU: each launch is compiled with Triton's own specialization of
its arguments and not run. The cubin Triton built (with the ptxas in its wheel) records the registers per
thread and the local-memory frame, reported as Triton reports spills on a GPU (frame bytes / 4). Launch decisions that
depend on the GPU (the split state pass, the state passes' warps) are made for --sms multiprocessors.

    python benchmarks/kernel_registers.py                                  # the three reference shapes
    python benchmarks/kernel_registers.py --shapes 16,2048,4,128,256 --variants w8:output.warps=8
    python benchmarks/kernel_registers.py --shapes 4,8192,16,128,128 --spill-lines _bwd_dqk_kernel

The figures are the installed Triton's: Triton 3.6, the GPU image's, reproduces the H200's own report;
another Triton version compiles the same source differently.
--spill-lines counts each kernel's spill stores and loads (STL / LDL) by source line (nvdisasm -gi).
Prints one JSON document.
"""
import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (read when the kernels are defined)
# the fabric_lin of this checkout, ahead of any installed one: the kernels compiled are the ones beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from common import out_arg, shape_arg, write_result  # noqa: E402
from gla_kernel import SHAPES, parse_variants  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class CompileOnlyDriver:
    """What Triton's launcher asks of the active driver before it compiles, answered for an sm_90 GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        return torch.device("cpu")


def cubin_resources(cubin: bytes) -> tuple:
    """(registers per thread, local-memory frame bytes) of a compiled kernel, as its cubin records them: what the
    driver reports on a GPU (cuobjdump's resource usage, read from the binary Triton built)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        result = subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), "--dump-resource-usage", path],
                                capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", result.stdout)
    if result.returncode or not found:
        raise RuntimeError(f"cuobjdump could not read the kernel's resources: {result.stdout[-300:]}{result.stderr[-300:]}")
    return int(found.group(1)), int(found.group(2))


def spill_lines(cubin: bytes, top: int = 12) -> list:
    """The source lines with the most spill stores and loads in a compiled kernel, from nvdisasm -gi."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(NVIDIA_BIN, "nvdisasm"), "-c", "-gi", path],
                              capture_output=True, text=True, check=True).stdout
    where, stores, loads = None, collections.Counter(), collections.Counter()
    for line in sass.splitlines():
        found = re.search(r'File "([^"]+)", line (\d+)', line)
        if found:
            where = f"{os.path.basename(found.group(1))}:{found.group(2)}"
        elif re.search(r"\bSTL(\.\w+)*\b", line):
            stores[where] += 1
        elif re.search(r"\bLDL(\.\w+)*\b", line):
            loads[where] += 1
    rows = sorted((stores + loads).items(), key=lambda kv: -kv[1])[:top]
    return [{"line": key, "spill_stores": stores[key], "spill_loads": loads[key]} for key, _ in rows]


@contextlib.contextmanager
def compile_only(records: list, lines_of: set):
    """Within: every Triton launch compiles for sm_90 and appends its resources to records instead of
    running (the outputs stay as allocated)."""
    config = triton.runtime.driver
    run, driver = JITFunction.run, config._active  # not .active: on a machine without a GPU that raises

    def compile_and_report(fn, *args, grid, warmup, **kwargs):
        kernel = run(fn, *args, grid=grid, warmup=True, **kwargs)
        registers, frame = cubin_resources(kernel.asm["cubin"])
        warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
        row = {"kernel": fn.__name__, "grid": list(grid) if isinstance(grid, tuple) else None, "warps": warps,
               "regs_per_thread": registers, "spills": frame // 4,
               "shared_bytes": shared, "programs_per_sm_by_regs": 65536 // (registers * 32 * warps),
               "programs_per_sm_by_shared": 233472 // shared if shared else None}
        if fn.__name__ in lines_of:
            row["spill_lines"] = spill_lines(kernel.asm["cubin"])
        records.append(row)
        return kernel

    config.set_active(CompileOnlyDriver())
    JITFunction.run = compile_and_report
    try:
        yield
    finally:
        JITFunction.run = run
        config._active = driver


def kernel_resources(shape, sms: int, launch, lines_of=()) -> list:
    """One row per launch of a bf16 forward + backward at shape (B, T, H, K, V), in launch order."""
    from fabric_lin.ops import launch as launch_helpers
    from fabric_lin.ops.gla.chunk import chunk_gla_triton

    B, T, H, K, V = shape
    # the launches compile and never run, so no value is read: zeros, which cost nothing to make at these sizes
    q, k = torch.zeros(B, T, H, K, dtype=torch.bfloat16), torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    v = torch.zeros(B, T, H, V, dtype=torch.bfloat16)
    gk = torch.zeros(B, T, H, K)
    leaves = [x.requires_grad_(True) for x in (q, k, v, gk)]
    records = []
    multiprocessors = launch_helpers.multiprocessors
    launch_helpers.multiprocessors = lambda device: sms
    try:
        with compile_only(records, set(lines_of)):
            o, _ = chunk_gla_triton(*leaves, launch=launch)
            o.backward(torch.ones_like(o))
    finally:
        launch_helpers.multiprocessors = multiprocessors
    return records


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", type=shape_arg, help="B,T,H,K,V (default: the three reference shapes)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch settings (changes to the shipped GLALaunch), each compiled beside it")
    parser.add_argument("--spill-lines", nargs="*", default=[], metavar="KERNEL",
                        help="kernels whose spill instructions to count by source line")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors of the GPU compiled for (H200: 132)")
    return parser


def build_report(args: argparse.Namespace) -> dict:
    """The report of `arguments()`' options (its rows also printed to stderr as each shape is done)."""
    if not os.path.exists(os.path.join(NVIDIA_BIN, "ptxas")):
        raise SystemExit(f"no ptxas in {NVIDIA_BIN}: this Triton wheel cannot compile for NVIDIA GPUs")
    from fabric_lin.ops.gla.launch import SHIPPED

    shapes = args.shapes or SHAPES
    variants = {"shipped": SHIPPED, **parse_variants(args.variants)}
    report = {"triton": triton.__version__, "target": f"sm_{TARGET.arch}", "sms": args.sms, "shapes": []}
    for shape in shapes:
        row = {"shape": list(shape)}
        for name, launch in variants.items():
            row[name] = kernel_resources(shape, args.sms, launch, args.spill_lines)
        report["shapes"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return report


def main():
    args = arguments().parse_args()
    write_result(build_report(args), args.out)


if __name__ == "__main__":
    main()
