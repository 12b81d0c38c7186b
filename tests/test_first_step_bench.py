"""benchmarks/first_step.py on the CPU with the debug model: both of its runs (empty caches, then a resumed run
into the same out_dir) reach a first step and report it. The figures themselves are GPU work."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import first_step  # noqa: E402


def test_both_runs_reach_their_first_step(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(first_step.MICRO_BATCH, 64, 2)
    results = first_step.fabric_lin_runs(64, tmp_path, timeout=120, steps=1, config=ROOT / "config_hub/debug.yaml")
    assert [r["caches"] for r in results] == ["empty", "warm (resumed run, same out_dir)"]
    for r in results:
        assert r["exit_code"] == 0 and r["note"] is None, r
        assert 0 < r["time_to_first_step_s"] < 120
    # the resumed run went on from the first run's checkpoint: its first step is the run's second
    record = first_step.first_step_record(tmp_path / "fabric-lin-64" / "metrics.jsonl")
    assert record["step"] == 2, record


def test_compare_precompile_runs_both_settings_from_empty_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(first_step.MICRO_BATCH, 64, 2)
    results = first_step.precompile_runs(64, tmp_path, timeout=120, steps=1, config=ROOT / "config_hub/debug.yaml")
    assert [(r["precompile"], r["caches"]) for r in results] == [(True, "empty"), (False, "empty")]
    for r in results:
        assert r["exit_code"] == 0 and r["note"] is None, r
        assert 0 < r["time_to_first_step_s"] < 120
        assert r["precompile_lines"] == []  # the CPU runs PyTorch ops: no Triton kernel to compile
    for setting in ("true", "false"):
        hparams = (tmp_path / f"fabric-lin-64-precompile-{setting}" / "final" / "hyperparameters.yaml").read_text()
        assert f"precompile: {setting}" in hparams
