"""benchmarks/host_overhead.py: the fused path's launches per step, counted with the GPU taken out."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_launches_per_step_follow_the_layer_structure(tmp_path):
    layers = 3
    # run as documented: without TRITON_INTERPRET, which the test session sets
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--layers", str(layers), "--steps", "1",
         "--repeats", "1", "--out", str(tmp_path / "host.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert json.loads((tmp_path / "host.json").read_text()) == result
    assert "host_overhead.py --layers 3" in result["run"]["command"]
    launches = result["launches_per_step"]
    # per layer, forward: the attention's pre-norm, the gate cumsum, the state pass, the output, the gated
    # norm, the MLP's pre-norm, SwiGLU; backward: the three norms and SwiGLU recomputed, the gate cumsum
    # recomputed, both state passes in one launch, dv, dq/dk, the three norms' and SwiGLU's backward;
    # once: the final norm forward and backward and the cross-entropy
    assert launches == {
        "_norm_fwd_kernel": 6 * layers + 1, "_norm_bwd_kernel": 3 * layers + 1,
        # the output and dq/dk kernels as two launches each: the single-reference scores, then the levels for
        # the chunks they flagged
        "_gate_cumsum_kernel": 2 * layers, "_fwd_state_kernel": layers, "_fwd_output_kernel": 2 * layers,
        "_bwd_both_states_kernel": layers, "_bwd_dv_kernel": layers, "_bwd_dqk_kernel": 2 * layers,
        "_swiglu_fwd_kernel": 2 * layers, "_swiglu_bwd_kernel": layers, "_ce_rows_kernel": 1,
    }
    assert result["layers"] == layers and result["host_ms_per_fwd_bwd"] > 0
