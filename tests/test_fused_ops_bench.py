"""benchmarks/fused_ops.py on the CPU (its timings need a GPU): the rms_norm_linears cases it times are the layers'
own shapes, and run forward and backward at a debug model's shapes; its command line parses (the script forked from
an interpreter that has imported torch: fabric_lin_process, scripts=True)."""
import os
import sys
from pathlib import Path

import torch

import fabric_lin_process

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fused_ops  # noqa: E402

# the kernels run where Triton can reach the tensors: the GPU where there is one, else the interpreter on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_linears_cases_take_the_models_widths():
    cases = fused_ops.linears_cases(rows=8, device="meta")  # shapes only: nothing is run
    assert [(name, widths) for name, _, _, widths in cases] == [
        ("rms_norm_linears gdn-340M attention", [2048, 4, 4, 1024]),
        ("rms_norm_linears gla-340M attention", [512, 512, 1024, 16, 1024]),
        ("rms_norm_linears gdn-340M mlp", [5632]),
    ]
    assert [tuple(t.shape) for t in cases[0][2][:3]] == [(8, 1024), (8, 1024), (1024,)]


def test_linears_cases_run_forward_and_backward():
    for name, fn, inputs, widths in fused_ops.linears_cases(rows=24, models=("gdn-debug", "gla-debug"), device=DEVICE,
                                                            dtype=torch.float32):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        outs = fn(*leaves)
        assert [o.shape[-1] for o in outs[:-1]] == widths, name
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves), name


def test_the_command_line_parses():
    script = str(ROOT / "benchmarks" / "fused_ops.py")
    result = fabric_lin_process.run([sys.executable, script, "--help"], 120, scripts=True)
    assert result.returncode == 0 and "--linears-only" in result.stdout, result.stderr
