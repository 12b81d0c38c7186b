"""Registers, spills and programs per SM of each Gated DeltaNet Triton kernel, compiled for an H100/H200 (sm_90)
on any machine, with or without a GPU: kernel_registers.py's compile-only driver applied to
`chunk_gated_delta_rule_triton`'s forward and backward pass with bf16 inputs.

    python benchmarks/gdn_kernel_registers.py                          # the gdn-340M layer and a 16-head shape
    python benchmarks/gdn_kernel_registers.py --shapes 2,130,2,48,80 --varlen --initial-state
    python benchmarks/gdn_kernel_registers.py --variants w8:dqkw.warps=8 narrow:state.BV=32
    python benchmarks/gdn_kernel_registers.py --no-gate                # DeltaNet's delta rule (g None)

The call is a training layer's (q/k L2 norm inside, no initial or final state) unless --initial-state (an
initial state and a final state's gradient) or --varlen (the sequences packed as three documents) ask for
the other specialisations; --no-gate compiles the delta rule without a decay (every kernel's USE_GATE off)
instead of the gated rule. Launch decisions that depend on the GPU (the state passes' launch, GDNLaunch's
narrow_state) are made for --sms multiprocessors. Prints one JSON document, with the path of the fabric_lin
package it compiled (the checkout this script is in, whatever else is installed).
"""
import argparse
import json
import os
import sys

from pathlib import Path

import torch

from kernel_registers import NVIDIA_BIN, TARGET, compile_only  # noqa: E402 (compile-only mode, this checkout's fabric_lin)
import triton  # noqa: E402

from common import out_arg, parse_variants, shape_arg, write_result  # noqa: E402

SHAPES = [(16, 2048, 4, 128, 256), (4, 8192, 16, 128, 128)]


def kernel_resources(shape, launch, varlen: bool, initial_state: bool, sms: int = 132, lines_of=(),
                     gate: bool = True) -> list:
    """One row per launch of a bf16 forward + backward at shape (B, T, H, K, V), in launch order, as launched on a
    GPU of `sms` multiprocessors; gate False: the delta rule (g None)."""
    from fabric_lin.ops import launch as launch_helpers
    from fabric_lin.ops.gdn.chunk import chunk_gated_delta_rule_triton

    B, T, H, K, V = shape
    # the launches compile and never run, so no value is read: zeros, which cost nothing to make at these sizes
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    k = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    v = torch.zeros(B, T, H, V, dtype=torch.bfloat16)
    g = torch.zeros(B, T, H)
    beta = torch.zeros(B, T, H, dtype=torch.bfloat16)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]
    cu_seqlens = None
    if varlen:  # the batch as one packed row of three documents
        leaves = [x.detach().reshape(1, B * T, *x.shape[2:]).requires_grad_(True) for x in leaves]
        cu_seqlens = torch.tensor([0, 1, B * T // 3, B * T], dtype=torch.int32)
    if not gate:
        leaves[3] = None
    N = 3 if varlen else B
    h0 = torch.zeros(N, H, K, V, requires_grad=True) if initial_state else None
    records = []
    multiprocessors = launch_helpers.multiprocessors
    launch_helpers.multiprocessors = lambda device: sms
    try:
        with compile_only(records, set(lines_of)):
            o, ht = chunk_gated_delta_rule_triton(*leaves, initial_state=h0, output_final_state=initial_state,
                                                  cu_seqlens=cu_seqlens, use_qk_l2norm=True, launch=launch)
            loss = o.float().sum()
            if ht is not None:
                loss = loss + ht.sum()
            loss.backward()
    finally:
        launch_helpers.multiprocessors = multiprocessors
    return records


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", type=shape_arg,
                        help="B,T,H,K,V (default: the gdn-340M layer and 4,8192,16,128,128)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch settings (changes to the shipped GDNLaunch), each compiled beside it")
    parser.add_argument("--varlen", action="store_true", help="the sequences packed along T with cu_seqlens")
    parser.add_argument("--initial-state", action="store_true", help="an initial state and a final state's gradient")
    parser.add_argument("--no-gate", action="store_true", help="the delta rule without a decay (g None, DeltaNet)")
    parser.add_argument("--spill-lines", nargs="*", default=[], metavar="KERNEL",
                        help="kernels whose spill instructions to count by source line")
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors of the GPU compiled for (H200: 132)")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    return parser


def build_report(args: argparse.Namespace) -> dict:
    """The report of `arguments()`' options (its rows also printed to stderr as each shape is done)."""
    if not os.path.exists(os.path.join(NVIDIA_BIN, "ptxas")):
        raise SystemExit(f"no ptxas in {NVIDIA_BIN}: this Triton wheel cannot compile for NVIDIA GPUs")
    import fabric_lin
    from fabric_lin.ops.gdn.launch import SHIPPED

    shapes = args.shapes or SHAPES
    variants = {"shipped": SHIPPED, **parse_variants(args.variants, SHIPPED)}
    report = {"triton": triton.__version__, "target": f"sm_{TARGET.arch}", "sms": args.sms, "dtype": "bfloat16",
              "varlen": args.varlen, "initial_state": args.initial_state, "gate": not args.no_gate,
              "fabric_lin": str(Path(fabric_lin.__file__).parent), "shapes": []}
    for shape in shapes:
        row = {"shape": list(shape)}
        for name, launch in variants.items():
            row[name] = kernel_resources(shape, launch, args.varlen, args.initial_state, args.sms, args.spill_lines,
                                         gate=not args.no_gate)
        report["shapes"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return report


def main():
    args = arguments().parse_args()
    write_result(build_report(args), args.out)


if __name__ == "__main__":
    main()
