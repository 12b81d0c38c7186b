"""Gated Linear Attention ops. One public entry point per op; `backend` picks the implementation.

    naive.py        naive_recurrent_gla: fp32 token-by-token recurrence, the test oracle
    chunk_torch.py  chunk_gla_torch: chunked form in PyTorch (CPU path, autograd backward)
    chunk.py        chunk_gla_triton: Triton forward/backward kernels (CUDA, or TRITON_INTERPRET=1);
                    chunk_gla_from_logits_triton: the same with the forget gate formed from its logits
    gate.py         log_decay: logsigmoid(gate_logits) / normalizer
    recurrent.py    recurrent_gla_step: one decoding step
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.gla.chunk_torch import chunk_gla_torch
from fabric_lin.ops.gla.gate import log_decay
from fabric_lin.ops.gla.naive import naive_recurrent_gla
from fabric_lin.ops.gla.recurrent import recurrent_gla_step

BACKENDS = ("auto", "triton", "torch")


def triton_kernels_available() -> bool:
    try:
        from fabric_lin.ops.gla import chunk  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_kernels_available() else "torch"
    return backend


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated linear attention over a whole sequence.

    q, k, gk: [B, T, H, K]; v: [B, T, H, V]; gk is the log forget gate (<= 0), fp32.
    initial_state / final state: [B, H, K, V] fp32 ([N, H, K, V] with cu_seqlens, where B = 1 and
    cu_seqlens holds the N+1 document offsets). scale defaults to K ** -0.5.
    Returns (o [B, T, H, V] in q's dtype, final state or None).
    """
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        from fabric_lin.ops.gla.chunk import chunk_gla_triton

        return chunk_gla_triton(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens)
    return chunk_gla_torch(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens)


def chunk_gla_from_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    normalizer: float = 16.0,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """chunk_gla with gk = logsigmoid(gate_logits) / normalizer formed inside (GLA's forget gate). The
    Triton path's backward pass keeps the logits (in their dtype) rather than gk's fp32 cumulative sums."""
    if not normalizer > 0:
        raise ValueError(f"chunk_gla_from_logits: normalizer must be a positive number, got {normalizer!r}")
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        from fabric_lin.ops.gla.chunk import chunk_gla_from_logits_triton

        return chunk_gla_from_logits_triton(q, k, v, gate_logits, normalizer, scale, initial_state, output_final_state, cu_seqlens)
    gk = log_decay(gate_logits, normalizer)
    return chunk_gla_torch(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens)


__all__ = [
    "chunk_gla", "chunk_gla_from_logits", "chunk_gla_torch", "log_decay", "naive_recurrent_gla", "recurrent_gla_step",
    "resolve_backend",
]
