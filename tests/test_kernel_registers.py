"""benchmarks/kernel_registers.py: the GLA kernels compiled for sm_90 on this CPU machine, as launched."""
from pathlib import Path

import pytest
import triton
from compile_reports import compile_reports

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

pytestmark = [pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no ptxas"), pytest.mark.slow]


# each test's report: the script's options
REPORTS = {
    "one_multiprocessor": ["--shapes", "2,130,2,32,32", "--sms", "1", "--spill-lines", "_bwd_dqk_kernel",
                           "--variants", "cap:dqk.maxnreg=128", "warps:dqk.warps=16,output.warps=8"],
    "many_multiprocessors": ["--shapes", "1,130,2,32,32"],  # 2 programs a pass, 132 SMs
}


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every report of REPORTS, from one process."""
    return compile_reports("kernel_registers", REPORTS)


def test_every_launch_compiled_with_its_launch_settings(reports):
    report = reports["one_multiprocessor"]
    assert report["target"] == "sm_90"
    (shape,) = report["shapes"]
    shipped = shape["shipped"]
    # one GPU multiprocessor: the sequential state passes; the output and dq/dk kernels as two launches each
    # (single-reference scores where the gate allows, then the levels for the chunks it flagged)
    assert [r["kernel"] for r in shipped] == ["_gate_cumsum_kernel", "_fwd_state_kernel", "_fwd_output_kernel",
                                              "_fwd_output_kernel", "_bwd_both_states_kernel", "_bwd_dv_kernel",
                                              "_bwd_dqk_kernel", "_bwd_dqk_kernel"]
    # K = 32: 32-wide key tiles, where both dq/dk launches take at least 8 warps (chunk_bwd.dqk_warps)
    assert [r["warps"] for r in shipped if r["kernel"] == "_bwd_dqk_kernel"] == [8, 8]
    for row in shipped:
        assert 0 < row["regs_per_thread"] <= 255 and row["spills"] >= 0
        assert row["programs_per_sm_by_regs"] == 65536 // (row["regs_per_thread"] * 32 * row["warps"])
    by_name = lambda rows: {r["kernel"]: r for r in rows}  # noqa: E731
    dqk, capped = by_name(shipped)["_bwd_dqk_kernel"], by_name(shape["cap"])["_bwd_dqk_kernel"]
    assert dqk["warps"] == 8 and dqk["regs_per_thread"] > 128  # uncapped, it takes more than the cap
    assert capped["regs_per_thread"] <= 128 and capped["spills"] > dqk["spills"]
    assert capped["spill_lines"] and all(line["line"] for line in capped["spill_lines"])
    assert sum(line["spill_stores"] + line["spill_loads"] for line in capped["spill_lines"]) > 0
    warps = by_name(shape["warps"])
    assert warps["_bwd_dqk_kernel"]["warps"] == 16 and warps["_fwd_output_kernel"]["warps"] == 8
    assert by_name(shape["warps"])["_bwd_dv_kernel"] == by_name(shipped)["_bwd_dv_kernel"]  # untouched


def test_many_multiprocessors_split_the_state_passes(reports):
    (shape,) = reports["many_multiprocessors"]["shapes"]
    names = [r["kernel"] for r in shape["shipped"]]
    assert names.count("_chunk_update_kernel") == 3 and names.count("_state_scan_kernel") == 3
    assert "_fwd_state_kernel" not in names and names[-3:] == ["_bwd_dv_kernel", "_bwd_dqk_kernel", "_bwd_dqk_kernel"]
