"""benchmarks/prepare_throughput.py: a plain mistake in what it is given is one line, not a traceback. The script runs
forked from an interpreter that has imported torch (fabric_lin_process, scripts=True), in a process of its own."""
import sys
from pathlib import Path

import pytest

import fabric_lin_process

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arguments, named", [
    (["--input_dir", "{tmp}/no-such-dir"], "no-such-dir"),
    (["--num_workers", "0"], "--num_workers"),
    (["--megabytes", "0"], "--megabytes"),  # no corpus: was a line about a temporary folder the user never named
    (["--out", "{tmp}"], "--out"),  # a directory: was a traceback once every recipe had run
])
def test_a_mistake_is_one_line_with_exit_code_2(tmp_path, arguments, named):
    arguments = [a.format(tmp=tmp_path) for a in arguments]
    out = fabric_lin_process.run(
        [sys.executable, str(ROOT / "benchmarks" / "prepare_throughput.py"), "--megabytes", "0.05", "--work_dir",
         str(tmp_path), *arguments],
        120, cwd=ROOT, scripts=True,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("prepare_throughput.py: error: ") and named in out.stderr
    assert out.stdout == "" and list(tmp_path.glob("prepare-throughput-*")) == []  # its work folder is removed
