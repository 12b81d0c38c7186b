"""benchmarks/gdn_kernel_registers.py: every Gated DeltaNet kernel compiled for sm_90 with bf16 inputs on this
machine, as launched at the gdn-340M layer shape and a 16-head one, and in its other specialisations."""
from pathlib import Path

import pytest
import triton
from compile_reports import compile_reports

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

pytestmark = [pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no ptxas"), pytest.mark.slow]

# one forward + backward with the q/k L2 norm: the norm twice, the solve, W/U, the state pass and the output
# kernel; then W/U again, dD's own part, the state pass again, the reverse pass, dq/dk/dW, the WY backward and
# the norm's backward twice
LAUNCHES = ["_l2norm_fwd_kernel", "_l2norm_fwd_kernel", "_solve_kernel", "_wu_kernel", "_fwd_state_kernel",
            "_fwd_output_kernel", "_wu_kernel", "_bwd_dd_local_kernel", "_fwd_state_kernel", "_bwd_state_kernel",
            "_bwd_dqkw_kernel", "_wy_bwd_kernel", "_l2norm_bwd_kernel", "_l2norm_bwd_kernel"]
# where a state pass has no more programs than the GPU has multiprocessors, the state pass runs again beside the
# reverse pass, in one launch
PAIRED_LAUNCHES = LAUNCHES[:8] + ["_state_passes_kernel"] + LAUNCHES[10:]


# each test's report: the script's options
REPORTS = {
    "layer_shapes": ["--shapes", "16,2048,4,128,256", "4,8192,16,128,128"],
    # cu_seqlens, an initial state and a final state's gradient; K = 256 and V = 72 (masked tiles), K = 48
    "varlen_and_odd_head_dims": ["--shapes", "2,256,2,256,72", "2,256,2,48,100", "--varlen", "--initial-state",
                                 "--variants", "narrow:state.BV=32,dstate.BV=32,dqkw.warps=8"],
    # g None (DeltaNet): the same launches with every kernel's USE_GATE off
    "delta_rule": ["--no-gate", "--shapes", "16,2048,4,128,256", "4,8192,16,128,128"],
}


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every report of REPORTS, from one process."""
    reports = compile_reports("gdn_kernel_registers", REPORTS)
    for report in reports.values():
        # the kernels of this checkout, not of a fabric-lin installed elsewhere (which python's path would find first)
        assert Path(report["fabric_lin"]) == ROOT / "fabric_lin", report["fabric_lin"]
    return reports


def check_rows(rows, paired=False):
    assert [r["kernel"] for r in rows] == (PAIRED_LAUNCHES if paired else LAUNCHES)
    for row in rows:
        assert 0 < row["regs_per_thread"] <= 255 and row["spills"] >= 0, row
        assert row["programs_per_sm_by_regs"] >= 1, row


def test_layer_shapes_compile_for_sm90(reports):
    report = reports["layer_shapes"]
    assert report["target"] == "sm_90" and report["dtype"] == "bfloat16" and report["sms"] == 132
    for shape in report["shapes"]:
        check_rows(shape["shipped"])
        for row in shape["shipped"]:
            assert row["spills"] == 0, row
    # the state passes on an H200: the gdn-340M layer's 16 x 4 heads in 64-wide value tiles of V = 256 (256
    # programs), the 16-head shape's 4 x 16 heads in 32-wide tiles of V = 128 (narrow_state: 256, not 128)
    for shape, value_tiles in zip(report["shapes"], [4, 4]):
        passes = [r for r in shape["shipped"] if r["kernel"] in ("_fwd_state_kernel", "_bwd_state_kernel")]
        assert [r["grid"] for r in passes] == [[value_tiles, 64]] * 3, passes


def test_varlen_states_and_odd_head_dims_compile_for_sm90(reports):
    report = reports["varlen_and_odd_head_dims"]
    for shape in report["shapes"]:
        # three documents of two heads: 12 programs a state pass (6 in the narrow launch's 32-wide tiles of V = 100,
        # 4 x 6 = 24), few enough on 132 multiprocessors to run the two passes side by side
        check_rows(shape["shipped"], paired=True)
        check_rows(shape["narrow"], paired=True)
        paired = [r for r in shape["shipped"] if r["kernel"] == "_state_passes_kernel"]
        assert paired[0]["grid"][1:] == [6, 2], paired


def test_delta_rule_compiles_for_sm90_without_spills(reports):
    # none of the delta rule's launches spills at the layer shapes
    report = reports["delta_rule"]
    assert report["gate"] is False
    for shape in report["shapes"]:
        check_rows(shape["shipped"])
        for row in shape["shipped"]:
            assert row["spills"] == 0, row
