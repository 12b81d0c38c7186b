"""The fused ops with their products in FP8 (`--fp8.recipe fused`, fabric_lin/ops/fp8_matmul.py) against the same ops
in bf16, at a model's layer shapes: where FP8 gains and where its casts cost.

One GPU, bf16 inputs, the ops of one Block as the model calls them:

  norm + projections   RMSNorm with the residual, then the attention's input projections (small gates kept in bf16)
  gated norm + o_proj  per-head RMSNorm x swish(gate), then the output projection
  norm + gate/up       RMSNorm with the residual, then the MLP's two input projections side by side
  swiglu + down        SwiGLU, then the down projection

For each, the GPU time of forward+backward (torch.profiler, kernels only) in bf16 and in FP8, and FP8's time by
kind of kernel: the bf16 products, the FP8 products, the row casts, the fused kernels, and the rest (transposes,
copies). Prints one JSON document:

    python benchmarks/fp8_products.py --model gla-1.3B --out fp8_products.json
    python benchmarks/fp8_products.py --model gla-340M --rows 16384
"""
import argparse
import json
from typing import Callable, Dict, List, Tuple

import torch

from common import kernel_ms, out_arg, write_result
from fabric_lin.config import Config

KINDS = ("fp8 products", "bf16 products", "row casts", "fused norm / swiglu", "other")


def kind_of(kernel: str) -> str:
    """The kind of a kernel, from its name (cuBLAS / CUTLASS products, ours by their function names)."""
    name = kernel.lower()
    if "rowwise_fp8" in name:
        return "row casts"
    if "_norm_" in name or "swiglu" in name:
        return "fused norm / swiglu"
    if any(tag in name for tag in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "matmul")):
        return "fp8 products" if any(tag in name for tag in ("e4m3", "f8", "fp8", "float8")) else "bf16 products"
    return "other"


def by_kind(kernels: Dict[str, float]) -> Dict[str, float]:
    totals = dict.fromkeys(KINDS, 0.0)
    for kernel, ms in kernels.items():
        totals[kind_of(kernel)] += ms
    return {kind: round(ms, 4) for kind, ms in totals.items()}


def block_ops(config: Config, rows: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
              ) -> List[Tuple[str, Callable, list]]:
    """(name, fn(*inputs, fp8), inputs) for the fused ops of one Block of `config` (GLA or GDN), `rows` tokens."""
    from fabric_lin.ops.norm import rms_norm_gated_linear, rms_norm_linears
    from fabric_lin.ops.swiglu import swiglu_linear

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, device=device, dtype=dtype)

    d, std = config.hidden_size, config.initializer_range
    heads, head_v = config.num_heads, config.head_v_dim
    # the attention's input projections as the GLA/GDN layers stack them: q, k, v, the small gates, g
    groups = config.num_heads // config.num_kv_heads
    gates = [config.gate_low_rank_dim] if config.block_type == "gla" else [heads, heads]
    widths = [config.key_dim, config.key_dim // groups, config.value_dim // groups, *gates, config.value_dim]
    x, residual, norm_w = randn(rows, d), randn(rows, d), randn(d, scale=0.1) + 1
    projs = [randn(w, d, scale=std) for w in widths]
    o, g, head_w = randn(rows, heads, head_v), randn(rows, heads, head_v), randn(head_v, scale=0.1) + 1
    o_proj = randn(d, heads * head_v, scale=std)
    gate_up_ws = [randn(config.intermediate_size, d, scale=std) for _ in range(2)]
    gate_up, down = randn(rows, 2 * config.intermediate_size), randn(d, config.intermediate_size, scale=std)
    return [
        ("norm + projections", lambda x, r, w, *p, fp8: rms_norm_linears(
            x, w, 1e-6, p, residual=r, backend="triton", fp8=fp8), [x, residual, norm_w, *projs]),
        ("gated norm + o_proj", lambda o, g, w, p, fp8: rms_norm_gated_linear(
            o, g, w, 1e-5, p, backend="triton", fp8=fp8), [o, g, head_w, o_proj]),
        ("norm + gate/up", lambda x, r, w, *p, fp8: rms_norm_linears(
            x, w, 1e-6, p, residual=r, backend="triton", side_by_side=True, fp8=fp8), [x, residual, norm_w, *gate_up_ws]),
        ("swiglu + down", lambda gu, w, fp8: swiglu_linear(gu, w, backend="triton", fp8=fp8), [gate_up, down]),
    ]


def output_tensors(result) -> List[torch.Tensor]:
    """An op's outputs as one list: a tensor, or a tuple of tensors and lists of them (projections, h)."""
    parts = result if isinstance(result, tuple) else (result,)
    return [t for part in parts for t in (part if isinstance(part, (list, tuple)) else [part])]


def forward_backward(fn: Callable, inputs: list, fp8: bool) -> Callable[[], None]:
    """A call of fn's forward and backward passes (fixed random output gradients; the inputs' gradients dropped first)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.no_grad():
        grads = [torch.randn_like(t) for t in output_tensors(fn(*leaves, fp8=fp8))]

    def call():
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(output_tensors(fn(*leaves, fp8=fp8)), grads)

    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gla-1.3B", help="a fabric-lin model name (its layer shapes)")
    parser.add_argument("--rows", type=int, default=16 * 2048, help="tokens (micro batch x sequence length)")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    args = parser.parse_args()
    config = Config.from_name(args.model)
    ops = []
    for name, fn, inputs in block_ops(config, args.rows):
        bf16 = kernel_ms(forward_backward(fn, inputs, fp8=False))
        fp8 = kernel_ms(forward_backward(fn, inputs, fp8=True))
        row = {"op": name, "bf16_gpu_ms": round(sum(bf16.values()), 4), "fp8_gpu_ms": round(sum(fp8.values()), 4),
               "bf16_by_kind": by_kind(bf16), "fp8_by_kind": by_kind(fp8),
               "fp8_kernels": {kernel: round(ms, 4) for kernel, ms in list(fp8.items())[:12]}}
        row["fp8_vs_bf16"] = round(row["fp8_gpu_ms"] / row["bf16_gpu_ms"], 3)
        ops.append(row)
        print(json.dumps({k: row[k] for k in ("op", "bf16_gpu_ms", "fp8_gpu_ms", "fp8_vs_bf16")}), flush=True)
    total_bf16, total_fp8 = sum(r["bf16_gpu_ms"] for r in ops), sum(r["fp8_gpu_ms"] for r in ops)
    report = {"model": args.model, "rows": args.rows, "ops": ops,
              "block": {"bf16_gpu_ms": round(total_bf16, 4), "fp8_gpu_ms": round(total_fp8, 4),
                        "fp8_vs_bf16": round(total_fp8 / total_bf16, 3)}}
    write_result(report, args.out)


if __name__ == "__main__":
    main()
