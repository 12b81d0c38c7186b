import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable must be set before any
# kernel is defined, and fabric_lin.model imports the fused kernels, so it is set here, before any
# test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against the reference b, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()
