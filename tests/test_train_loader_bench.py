"""benchmarks/train_loader.py: a value it cannot use is one line from its argument parser, not a traceback."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_values_below_their_least_are_refused_before_anything_runs(tmp_path):
    for arguments, named in ((["--batches", "0"], "--batches"), (["--num_workers", "0", "-1"], "--num_workers")):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_loader.py"), *arguments],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith(f"train_loader.py: error: {named}"), out.stderr
        assert out.stdout == ""
