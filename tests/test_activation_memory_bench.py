"""benchmarks/activation_memory.py: an unknown model name is one line naming it, not a traceback."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_unknown_model_is_one_line_with_exit_code_2():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "activation_memory.py"), "--model", "gla-34OM"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("activation_memory.py: error: "), out.stderr
    assert "'gla-34OM'" in out.stderr and out.stdout == ""
