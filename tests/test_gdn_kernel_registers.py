"""benchmarks/gdn_kernel_registers.py: every Gated DeltaNet kernel compiled for sm_90 with bf16 inputs on this
machine, as launched at the gdn-340M layer shape and a 16-head one, and in its other specialisations."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no ptxas")

# one forward + backward with the q/k L2 norm: the norm twice, the solve, W/U, the state pass and the output
# kernel; then W/U and the state pass again, dD's own part, the reverse pass, dq/dk/dW, the WY backward and
# the norm's backward twice
LAUNCHES = ["_l2norm_fwd_kernel", "_l2norm_fwd_kernel", "_solve_kernel", "_wu_kernel", "_fwd_state_kernel",
            "_fwd_output_kernel", "_wu_kernel", "_fwd_state_kernel", "_bwd_dd_local_kernel", "_bwd_state_kernel",
            "_bwd_dqkw_kernel", "_wy_bwd_kernel", "_l2norm_bwd_kernel", "_l2norm_bwd_kernel"]


def kernel_registers(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gdn_kernel_registers.py"), *args],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def check_rows(rows):
    assert [r["kernel"] for r in rows] == LAUNCHES
    for row in rows:
        assert 0 < row["regs_per_thread"] <= 255 and row["spills"] >= 0, row
        assert row["programs_per_sm_by_regs"] >= 1, row


def test_layer_shapes_compile_for_sm90():
    report = kernel_registers("--shapes", "16,2048,4,128,256", "4,8192,16,128,128")
    assert report["target"] == "sm_90" and report["dtype"] == "bfloat16"
    for shape in report["shapes"]:
        check_rows(shape["shipped"])


def test_varlen_states_and_odd_head_dims_compile_for_sm90():
    # cu_seqlens, an initial state and a final state's gradient; K = 256 and V = 72 (masked tiles), K = 48
    report = kernel_registers("--shapes", "2,256,2,256,72", "2,256,2,48,100", "--varlen", "--initial-state",
                              "--variants", "narrow:state.BV=32,dstate.BV=32,dqkw.warps=8")
    for shape in report["shapes"]:
        check_rows(shape["shipped"])
        check_rows(shape["narrow"])
