"""benchmarks/first_step.py on the CPU with the debug model: both of its runs (empty caches, then a resumed run
into the same out_dir) reach a first step and report it. The figures themselves are GPU work.

The benchmark starts each `python -m fabric_lin.cli pretrain` with subprocess.Popen; here they are forked as the
suite's runs are (fabric_lin_process): the same command line, run as __main__ in a process of its own, its output in
the benchmark's log file, without ~4 s of imports each."""
import subprocess
import sys
import types
from pathlib import Path

import pytest

import fabric_lin_process

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import first_step  # noqa: E402


@pytest.fixture(autouse=True)
def forked_runs(monkeypatch):
    def popen(command, env=None, stdout=None, stderr=None, cwd=None):
        assert command[:3] == fabric_lin_process.FABRIC_LIN and stderr is subprocess.STDOUT, (command, stderr)
        return fabric_lin_process.start(command, stdout.name, env, cwd=cwd)

    monkeypatch.setattr(first_step, "subprocess", types.SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))


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
