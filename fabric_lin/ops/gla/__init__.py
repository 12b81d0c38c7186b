"""Gated Linear Attention ops. One public entry point per op; `backend` picks the implementation
(`fabric_lin/ops/backend.py`: "auto" runs Triton on CUDA and PyTorch elsewhere).

    naive.py            naive_recurrent_gla: fp32 token-by-token recurrence, the test oracle
    chunk_torch.py      chunk_gla_torch: chunked form in PyTorch (CPU path, autograd backward)
    chunk.py            the Triton path's ops and entry points (chunk_fwd.py, chunk_bwd.py, scores.py, cumsum.py
                        and state_pass.py hold its kernels; fabric_lin/ops/chunked/ the core every family runs on)
    launch.py           GLALaunch: how the Triton kernels are launched (SHIPPED, or tune.py's search)
    gate.py             log_decay: logsigmoid(gate_logits) / normalizer
    recurrent.py        recurrent_gla_step: one decoding step in PyTorch; fused_recurrent.py: the same in one
                        Triton launch; fused_recurrent_gla_step picks one
The Triton modules are imported only when their backend runs: Triton does not import on every platform.
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.backend import resolve_backend
from fabric_lin.ops.chunked.checks import check_inputs, check_step_inputs
from fabric_lin.ops.gla.chunk_torch import chunk_gla_torch
from fabric_lin.ops.gla.gate import log_decay
from fabric_lin.ops.gla.launch import GLALaunch
from fabric_lin.ops.gla.naive import naive_recurrent_gla
from fabric_lin.ops.gla.recurrent import recurrent_gla_step


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
    launch: Optional[GLALaunch] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated linear attention over a whole sequence.

    q, k, gk: [B, T, H, K]; v: [B, T, H, V]; gk is the log forget gate (<= 0), fp32.
    initial_state / final state: [B, H, K, V] fp32 ([N, H, K, V] with cu_seqlens, where B = 1 and
    cu_seqlens holds the N+1 document offsets). scale defaults to K ** -0.5.
    launch: the Triton kernels' launch settings (default: the shipped ones).
    Returns (o [B, T, H, V] in q's dtype, final state or None).
    """
    chosen = resolve_backend(backend, q.device)
    check_inputs("chunk_gla", q, k, v, per_key={"gk": gk}, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if chosen == "triton":
        from fabric_lin.ops.gla.chunk import chunk_gla_triton

        return chunk_gla_triton(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens, launch)
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
    launch: Optional[GLALaunch] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """chunk_gla with gk = logsigmoid(gate_logits) / normalizer formed inside (GLA's forget gate). The
    Triton path's backward pass keeps the logits (in their dtype) rather than gk's fp32 cumulative sums."""
    chosen = resolve_backend(backend, q.device)
    check_inputs("chunk_gla_from_logits", q, k, v, per_key={"gate_logits": gate_logits}, initial_state=initial_state,
                 cu_seqlens=cu_seqlens)
    if not normalizer > 0:
        raise ValueError(f"chunk_gla_from_logits: normalizer must be a positive number, got {normalizer!r}")
    if chosen == "triton":
        from fabric_lin.ops.gla.chunk import chunk_gla_from_logits_triton

        return chunk_gla_from_logits_triton(q, k, v, gate_logits, normalizer, scale, initial_state, output_final_state,
                                            cu_seqlens, launch)
    gk = log_decay(gate_logits, normalizer)
    return chunk_gla_torch(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens)


def fused_recurrent_gla_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    state: Optional[torch.Tensor],
    scale: Optional[float] = None,
    backend: str = "auto",
    launch: Optional[GLALaunch] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: q, k, gk [B, H, K]; v [B, H, V]; state [B, H, K, V] fp32 or None (zeros).
    Returns o [B, H, V] in q's dtype and the new fp32 state. launch: the kernel's launch settings (its step_warps)."""
    chosen = resolve_backend(backend, q.device)
    check_step_inputs("fused_recurrent_gla_step", q, k, v, per_key={"gk": gk}, state=state)
    if chosen == "torch":
        return recurrent_gla_step(q, k, v, gk, state, scale)
    from fabric_lin.ops.gla.fused_recurrent import fused_recurrent_gla_step_triton

    return fused_recurrent_gla_step_triton(q, k, v, gk, state, scale, launch)


__all__ = [
    "GLALaunch", "chunk_gla", "chunk_gla_from_logits", "chunk_gla_torch", "fused_recurrent_gla_step", "log_decay",
    "naive_recurrent_gla", "recurrent_gla_step",
]
