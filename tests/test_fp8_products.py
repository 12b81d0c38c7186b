"""benchmarks/fp8_products.py on the CPU (its timings need a GPU): the Block's ops it times run forward and backward
in both precisions at a debug model's shapes, and its kernel kinds sort the names a GPU profile shows."""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fp8_products  # noqa: E402

from fabric_lin.config import Config  # noqa: E402


# the kernels run where Triton can reach the tensors: the GPU where there is one, else the interpreter on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_block_ops_run_in_both_precisions():
    ops = fp8_products.block_ops(Config.from_name("gla-debug"), rows=32, device=DEVICE, dtype=torch.float32)
    assert [op for op, _, _ in ops] == ["norm + projections", "gated norm + o_proj", "norm + gate/up", "swiglu + down"]
    for op, fn, inputs in ops:
        for fp8 in (False, True):
            fp8_products.forward_backward(fn, inputs, fp8)()
    # GDN's projections as its layer stacks them: q, k, v, its two one-per-head gates (a, b), g
    gdn = Config.from_name("gdn-debug")
    _, _, inputs = fp8_products.block_ops(gdn, rows=32, device=DEVICE, dtype=torch.float32)[0]
    assert [w.shape[0] for w in inputs[3:]] == [gdn.key_dim, gdn.key_dim, gdn.value_dim, gdn.num_heads, gdn.num_heads,
                                                gdn.value_dim]


def test_kernel_names_are_sorted_by_kind():
    kernels = {"_rowwise_fp8_kernel": 1.0, "_norm_fwd_kernel": 2.0, "_swiglu_bwd_kernel": 0.5,
               "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128": 4.0,
               "nvjet_tst_192x192_64x4_1x2_h_bz_coopA_TNN": 8.0,
               "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<float_e4m3_t, f8f8bf16_rowwise>>": 3.0,
               "void at::native::elementwise_kernel<128, 4>": 0.25}
    assert fp8_products.by_kind(kernels) == {"fp8 products": 7.0, "bf16 products": 8.0, "row casts": 1.0,
                                             "fused norm / swiglu": 2.5, "other": 0.25}
