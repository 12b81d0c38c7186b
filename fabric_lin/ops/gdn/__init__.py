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
from fabric_lin.ops.chunked.checks import check_inputs, check_step_inputs
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
    g: Optional[torch.Tensor],
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

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] fp32, the log decay (<= 0), or None: no decay, the delta
    rule of DeltaNet (both paths then leave the decay out rather than apply zeros); beta: [B, T, H], the write
    strength (in (0, 1) for a stable state). initial_state / final state: [B, H, K, V] fp32 ([N, H, K, V] with
    cu_seqlens, where B = 1 and cu_seqlens holds the N+1 document offsets).
    scale defaults to K ** -0.5. use_qk_l2norm normalises q and k over K inside the op (fla's
    use_qk_l2norm_in_kernel). launch: the Triton kernels' launch settings (default: the shipped ones).
    Returns (o [B, T, H, V] in q's dtype, final state or None).
    """
    chosen = resolve_backend(backend, q.device)
    gate = {} if g is None else {"g": g}
    check_inputs("chunk_gated_delta_rule", q, k, v, per_head={**gate, "beta": beta}, float32=tuple(gate),
                 initial_state=initial_state, cu_seqlens=cu_seqlens)
    if chosen == "triton":
        from fabric_lin.ops.gdn.chunk import chunk_gated_delta_rule_triton

        return chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                             use_qk_l2norm, launch)
    dtype = q.dtype
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)  # fp32, so the normalised vectors are not rounded to q's dtype
    o, final_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return o.to(dtype), final_state


def fused_recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor],
    beta: torch.Tensor,
    state: Optional[torch.Tensor],
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    backend: str = "auto",
    launch: Optional[GDNLaunch] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: q, k [B, H, K]; v [B, H, V]; g (None: no decay), beta [B, H]; state [B, H, K, V] fp32 or
    None (zeros).
    Returns o [B, H, V] in q's dtype and the new fp32 state; "triton": one launch (fused_recurrent.py), launched as
    `launch` says (its step_warps)."""
    chosen = resolve_backend(backend, q.device)
    gate = {} if g is None else {"g": g}
    check_step_inputs("fused_recurrent_gated_delta_rule_step", q, k, v, per_head={**gate, "beta": beta}, state=state)
    if chosen == "torch":
        return recurrent_gated_delta_rule_step(q, k, v, g, beta, state, scale, use_qk_l2norm)
    from fabric_lin.ops.gdn.fused_recurrent import fused_recurrent_gated_delta_rule_step_triton

    return fused_recurrent_gated_delta_rule_step_triton(q, k, v, g, beta, state, scale, use_qk_l2norm, launch)


__all__ = [
    "GDNLaunch", "chunk_gated_delta_rule", "chunk_gated_delta_rule_torch", "fused_recurrent_gated_delta_rule_step",
    "gdn_gate", "l2norm", "naive_recurrent_gated_delta_rule", "recurrent_gated_delta_rule_step", "resolve_backend",
]
