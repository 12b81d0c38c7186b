"""Gated DeltaNet ops (the gated delta rule). One public entry point per op; `backend` picks the implementation
(`fabric_lin/ops/backend.py`: "auto" runs Triton on CUDA and PyTorch elsewhere).

    naive.py        naive_recurrent_gated_delta_rule: fp32 token-by-token recurrence, the test oracle
    chunk_torch.py  chunk_gated_delta_rule_torch: chunked UT/WY form in PyTorch (CPU path, autograd backward)
    chunk.py        the Triton path's autograd Function and ops (wy.py, chunk_fwd.py, chunk_bwd.py and
                    l2norm_triton.py hold its kernels; launch.py its launch settings, GDNLaunch)
    recurrent.py    recurrent_gated_delta_rule_step: one decoding step
    l2norm.py       l2norm: fla's q/k normalisation (eps 1e-6 inside the square root)
    gate.py         gdn_gate: the decay g and write strength beta from their projections
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.backend import resolve_backend
from fabric_lin.ops.gdn.chunk_torch import chunk_gated_delta_rule_torch
from fabric_lin.ops.gdn.gate import gdn_gate
from fabric_lin.ops.gdn.l2norm import l2norm
from fabric_lin.ops.gdn.launch import GDNLaunch
from fabric_lin.ops.gdn.naive import naive_recurrent_gated_delta_rule
from fabric_lin.ops.gdn.recurrent import recurrent_gated_delta_rule_step


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm: bool = False,
    backend: str = "auto",
    launch: Optional[GDNLaunch] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule over a whole sequence (recurrence in naive.py).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] fp32, the log decay (<= 0); beta: [B, T, H], the
    write strength (in (0, 1) for a stable state). initial_state / final state: [B, H, K, V] fp32
    ([N, H, K, V] with cu_seqlens, where B = 1 and cu_seqlens holds the N+1 document offsets).
    scale defaults to K ** -0.5. use_qk_l2norm normalises q and k over K inside the op (fla's
    use_qk_l2norm_in_kernel). launch: the Triton kernels' launch settings (default: the shipped ones).
    Returns (o [B, T, H, V] in q's dtype, final state or None).
    """
    chosen = resolve_backend(backend, q.device)
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chosen == "triton":
        from fabric_lin.ops.gdn.chunk import chunk_gated_delta_rule_triton

        return chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                             use_qk_l2norm, launch)
    dtype = q.dtype
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)  # fp32, so the normalised vectors are not rounded to q's dtype
    o, final_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return o.to(dtype), final_state


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    name = "chunk_gated_delta_rule"
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"{name}: k must be [B, T, H, K] = {(B, T, H, K)} like q, got shape {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{name}: v must be [B, T, H, V] with [B, T, H] = {(B, T, H)}, got shape {tuple(v.shape)}")
    for arg, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, H):
            raise ValueError(
                f"{name}: {arg} must be [B, T, H] = {(B, T, H)} (one value per head and token), got shape {tuple(x.shape)}"
            )
    for arg, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name}: {arg} must be a floating-point tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # g is summed over a chunk and its differences exponentiated: bf16 would lose the small gates
    if g.dtype != torch.float32:
        raise ValueError(f"{name}: g must be float32 (the log decay is cumulated inside the op), got {g.dtype}")

    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{name}: cu_seqlens needs batch size 1 (documents packed along T), got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"{name}: cu_seqlens must be a 1-D integer tensor of N+1 >= 2 document offsets, "
                f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != T or any(e < s for s, e in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"{name}: cu_seqlens must rise from 0 to T = {T} without falling, got {bounds}")
        N = len(bounds) - 1
    if initial_state is not None:
        V = v.shape[-1]
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"{name}: initial_state must be [N, H, K, V] = {(N, H, K, V)} "
                f"(N = {'documents in cu_seqlens' if cu_seqlens is not None else 'batch size'}), "
                f"got shape {tuple(initial_state.shape)}"
            )
        if initial_state.dtype != torch.float32:
            raise ValueError(f"{name}: initial_state must be float32, got {initial_state.dtype}")


def fused_recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor],
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: q, k [B, H, K]; v [B, H, V]; g, beta [B, H]; state [B, H, K, V] fp32 or None (zeros).
    Returns o [B, H, V] in q's dtype and the new fp32 state; "triton": one launch (fused_recurrent.py)."""
    if resolve_backend(backend, q.device) == "torch":
        return recurrent_gated_delta_rule_step(q, k, v, g, beta, state, scale, use_qk_l2norm)
    from fabric_lin.ops.gdn.fused_recurrent import (
        fused_recurrent_gated_delta_rule_step_triton,
    )

    return fused_recurrent_gated_delta_rule_step_triton(q, k, v, g, beta, state, scale, use_qk_l2norm)


__all__ = [
    "GDNLaunch", "chunk_gated_delta_rule", "chunk_gated_delta_rule_torch", "fused_recurrent_gated_delta_rule_step",
    "gdn_gate", "l2norm", "naive_recurrent_gated_delta_rule", "recurrent_gated_delta_rule_step", "resolve_backend",
]
