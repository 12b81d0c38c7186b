"""benchmarks/activation_memory.py: a value it cannot use (an unknown model name, an --out it cannot write, no tokens)
is one line naming it, not a traceback. The script runs forked from an interpreter that has imported torch
(fabric_lin_process, scripts=True), as `python benchmarks/activation_memory.py` in a process of its own."""
import sys
from pathlib import Path

import pytest

import fabric_lin_process

ROOT = Path(__file__).resolve().parents[1]


def test_an_unknown_model_is_one_line_with_exit_code_2():
    script = str(ROOT / "benchmarks" / "activation_memory.py")
    out = fabric_lin_process.run([sys.executable, script, "--model", "gla-34OM"], 60, cwd=ROOT, scripts=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("activation_memory.py: error: "), out.stderr
    assert "'gla-34OM'" in out.stderr and out.stdout == ""


@pytest.mark.parametrize("arguments, named", [(["--out", "{in_the_way}/result.json"], "--out"), (["--tokens", "0"], "--tokens")])
def test_a_value_it_cannot_use_is_refused_before_the_model_is_built(tmp_path, arguments, named):
    """An --out under a regular file was a traceback once the measurement had run; --tokens 0 one from the model."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    arguments = [a.format(in_the_way=in_the_way) for a in arguments]
    script = str(ROOT / "benchmarks" / "activation_memory.py")
    out = fabric_lin_process.run([sys.executable, script, "--model", "gla-debug", *arguments], 120, cwd=ROOT,
                                 scripts=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"activation_memory.py: error: argument {named}: "), out.stderr
    assert out.stdout == "" and in_the_way.read_text() == ""
