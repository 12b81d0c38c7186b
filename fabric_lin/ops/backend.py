"""The one rule that picks an op's implementation: every public op takes `backend` = "auto", "triton" or
"torch" and resolves it here. "auto" runs the Triton kernels on CUDA tensors and the PyTorch reference
(written once, beside each kernel) anywhere else; "triton" also runs the kernels on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1), which is how CI tests them. A model chooses once, when it
is built (`GPT(config, fused=...)`), and passes "triton" or "torch" to every op it calls.
"""
import os

import torch

BACKENDS = ("auto", "triton", "torch")


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_AVAILABLE = _triton_imports()  # Triton does not import on every platform


def resolve_backend(backend: str, device: torch.device) -> str:
    """"triton" or "torch" for an op whose inputs are on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and TRITON_AVAILABLE else "torch"
    if backend == "triton" and not TRITON_AVAILABLE:
        raise RuntimeError("backend='triton' needs the triton package, which does not import on this platform")
    if backend == "triton" and device.type != "cuda" and not torch.compiler.is_compiling() and not _interpreting():
        # Triton itself would stop at the launch with '0 active drivers ([]). There should only be one.' (Asked in
        # eager mode only: torch.compile cannot trace Triton's reading of the variable.)
        raise ValueError(f"backend='triton' runs the kernels on CUDA tensors, or on the CPU in Triton's interpreter "
                         f"(TRITON_INTERPRET=1 set before fabric_lin is imported); these are on {device}: use "
                         "backend='torch' (a model: GPT(config, fused=False))")
    return backend


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, as Triton reads TRITON_INTERPRET."""
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton 3.4 on; before it, the variable alone
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"
