"""Registers, spills and programs per SM of each Gated DeltaNet Triton kernel, compiled for an H100/H200 (sm_90)
on any machine, with or without a GPU: kernel_registers.py's compile-only driver applied to
`chunk_gated_delta_rule_triton`'s forward and backward pass with bf16 inputs.

    python benchmarks/gdn_kernel_registers.py                          # the gdn-340M layer and a 16-head shape
    python benchmarks/gdn_kernel_registers.py --shapes 2,130,2,48,80 --varlen --initial-state
    python benchmarks/gdn_kernel_registers.py --variants w8:dqkw.warps=8 narrow:state.BV=32

The call is a training layer's (q/k L2 norm inside, no initial or final state) unless --initial-state (an
initial state and a final state's gradient) or --varlen (the sequences packed as three documents) ask for
the other specialisations. Prints one JSON document.
"""
import argparse
import json
import os
import sys

import torch

from kernel_registers import NVIDIA_BIN, TARGET, compile_only  # noqa: E402 (it sets the compile-only mode)
import triton  # noqa: E402

from common import write_result  # noqa: E402
from fabric_lin.ops.launch import with_settings  # noqa: E402

SHAPES = [(16, 2048, 4, 128, 256), (4, 8192, 16, 128, 128)]


def parse_variants(texts):
    """{"name": GDNLaunch} from "name:kernel.field=value,..." strings."""
    from fabric_lin.ops.gdn.launch import SHIPPED

    variants = {}
    for text in texts:
        name, _, body = text.partition(":")
        settings = {}
        for item in body.split(","):
            key, _, value = item.partition("=")
            settings[key] = None if value == "None" else int(value)
        variants[name] = with_settings(SHIPPED, settings)
    return variants


def kernel_resources(shape, launch, varlen: bool, initial_state: bool, lines_of=()) -> list:
    """One row per launch of a bf16 forward + backward at shape (B, T, H, K, V), in launch order."""
    from fabric_lin.ops.gdn.chunk import chunk_gated_delta_rule_triton

    B, T, H, K, V = shape
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16)
    g = -torch.rand(B, T, H)
    beta = torch.rand(B, T, H, dtype=torch.bfloat16)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]
    cu_seqlens = None
    if varlen:  # the batch as one packed row of three documents
        leaves = [x.detach().reshape(1, B * T, *x.shape[2:]).requires_grad_(True) for x in leaves]
        cu_seqlens = torch.tensor([0, 1, B * T // 3, B * T], dtype=torch.int32)
    N = 3 if varlen else B
    h0 = torch.randn(N, H, K, V, requires_grad=True) if initial_state else None
    records = []
    with compile_only(records, set(lines_of)):
        o, ht = chunk_gated_delta_rule_triton(*leaves, initial_state=h0, output_final_state=initial_state,
                                              cu_seqlens=cu_seqlens, use_qk_l2norm=True, launch=launch)
        loss = (o.float() * torch.randn_like(o, dtype=torch.float32)).sum()
        if ht is not None:
            loss = loss + ht.sum()
        loss.backward()
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", help="B,T,H,K,V (default: the gdn-340M layer and 4,8192,16,128,128)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="other launch settings (changes to the shipped GDNLaunch), each compiled beside it")
    parser.add_argument("--varlen", action="store_true", help="the sequences packed along T with cu_seqlens")
    parser.add_argument("--initial-state", action="store_true", help="an initial state and a final state's gradient")
    parser.add_argument("--spill-lines", nargs="*", default=[], metavar="KERNEL",
                        help="kernels whose spill instructions to count by source line")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(NVIDIA_BIN, "ptxas")):
        raise SystemExit(f"no ptxas in {NVIDIA_BIN}: this Triton wheel cannot compile for NVIDIA GPUs")
    from fabric_lin.ops.gdn.launch import SHIPPED

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    variants = {"shipped": SHIPPED, **parse_variants(args.variants)}
    report = {"triton": triton.__version__, "target": f"sm_{TARGET.arch}", "dtype": "bfloat16",
              "varlen": args.varlen, "initial_state": args.initial_state, "shapes": []}
    for shape in shapes:
        row = {"shape": list(shape)}
        for name, launch in variants.items():
            row[name] = kernel_resources(shape, launch, args.varlen, args.initial_state, args.spill_lines)
        report["shapes"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    write_result(report, args.out)


if __name__ == "__main__":
    main()
