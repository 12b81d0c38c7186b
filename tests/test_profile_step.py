"""benchmarks/profile_step.py's trace summary, on a hand-made Chrome trace whose answer is worked out here."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from profile_step import kind_of, summarize_trace, union_us  # noqa: E402


def test_union_counts_overlaps_once():
    assert union_us([]) == 0
    assert union_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25  # [0, 15] and [20, 30]


def test_kernel_kinds():
    assert kind_of("ncclDevKernel_AllGather_RING_LL(x)") == "communication"
    assert kind_of("_bwd_dqk_kernel") == "linear-attention recurrence"
    assert kind_of("chunk_gla_bwd_kernel_intra") == "linear-attention recurrence"
    assert kind_of("_wy_bwd_kernel") == kind_of("prepare_wy_repr_bwd_kernel") == "linear-attention recurrence"
    assert kind_of("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "linear-attention recurrence"
    assert kind_of("_l2norm_bwd_kernel") == kind_of("l2norm_fwd_kernel_row") == "linear-attention recurrence"
    assert kind_of("_conv_fwd_kernel") == kind_of("causal_conv1d_fwd_kernel") == "short convolution"
    assert kind_of("_conv_bwd_kernel") == kind_of("causal_conv1d_bwd_kernel") == "short convolution"
    assert kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kind_of("_norm_bwd_kernel") == "fused norm/swiglu/cross-entropy"
    assert kind_of("triton_poi_fused_add_11") == "inductor-compiled"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, add>") == "other (torch elementwise, reductions)"


def test_summary_of_two_steps(tmp_path):
    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        kernel("nvjet_gemm", 0, 1000), kernel("_fwd_output_kernel", 1000, 500),
        kernel("ncclDevKernel_AllGather", 800, 1000),  # overlaps compute, then runs alone 1500..1800
        kernel("nvjet_gemm", 2000, 1000), kernel("_fwd_output_kernel", 3000, 500),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4000},  # not a GPU kernel: ignored
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = summarize_trace(trace, steps=2, wall_s=0.004)
    assert summary["wall_ms_per_step"] == 2.0
    assert summary["compute_busy_ms"] == 1.5  # 3000 us of compute over 2 steps
    assert summary["compute_idle_ms"] == 0.5
    assert summary["any_kernel_busy_ms"] == 1.65  # compute plus the 300 us the all-gather ran alone
    assert summary["ms_by_kind"] == {"matmul": 1.0, "communication": 0.5, "linear-attention recurrence": 0.5}
    assert list(summary["top_kernels_ms"])[0] == "nvjet_gemm"
    # one idle gap between compute kernels: 1500..2000 us (the all-gather is not compute), over 2 steps
    gaps = summary["idle_gaps"]
    assert gaps["gaps over 20 us, ms per step"] == 0.25
    assert gaps["largest (ms per step, gaps per step)"] == {"_fwd_output_kernel -> nvjet_gemm": [0.25, 0.5]}
