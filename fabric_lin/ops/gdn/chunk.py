"""The gated delta rule's chunked Triton path: its forward and backward kernel ops around `chunk_fwd.forward` and
`chunk_bwd.backward`, their autograd Function (`fabric_lin/ops/chunked/autograd.py`), and its entry point
`chunk_gated_delta_rule_triton`.

The math is chunk_torch.py's (chunks of 64 tokens, the WY/UT form, fp32 state); `wy.py` holds the chunk-local
kernels, `chunk_fwd.py` and `chunk_bwd.py` the passes and launches, `l2norm_triton.py` the q/k normalisation.
Seven launches forward (eight with the L2 norm), eight backward (nine): the backward pass keeps only b (the gate's
in-chunk cumsum, fp32) and (I + A)^-1 per chunk besides the inputs, and recomputes W, U, the states and D.
g None is the delta rule (DeltaNet): the same launches with the gate compiled out (USE_GATE, wy.py), no b kept, and
no gradient for g.
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.chunked.autograd import apply_chunked, chunked_function
from fabric_lin.ops.chunked.layout import CHUNK_SIZE
from fabric_lin.ops.custom_op import kernel_op
from fabric_lin.ops.gdn.chunk_bwd import backward
from fabric_lin.ops.gdn.chunk_fwd import forward
from fabric_lin.ops.gdn.l2norm_triton import l2norm_bwd, l2norm_fwd
from fabric_lin.ops.gdn.launch import SHIPPED, GDNLaunch
from fabric_lin.ops.launch import launch_json


@kernel_op("chunk_gdn_fwd")
def chunk_gdn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], beta: torch.Tensor,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float, use_qk_l2norm: bool,
    launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """(o, final state, b, (I + A)^-1, and with use_qk_l2norm the normalised q and k with their 1 / norms;
    without, those four are empty: the backward pass reads the inputs). g None: no decay, and b empty."""
    settings = GDNLaunch.from_json(launch)
    if use_qk_l2norm:
        q, q_rstd = l2norm_fwd(q, settings.l2norm)
        k, k_rstd = l2norm_fwd(k, settings.l2norm)
    o, ht, b, A_inv = forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, settings)
    if b is None:  # a custom op returns tensors, never None
        b = q.new_empty(0, dtype=torch.float32)
    if use_qk_l2norm:
        return o, ht, b, A_inv, q, k, q_rstd, k_rstd
    # a custom op's outputs may alias neither its inputs nor each other: four distinct empty tensors
    return (o, ht, b, A_inv) + tuple(q.new_empty(0) for _ in range(4))


@chunk_gdn_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, launch):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    normed = (torch.empty_like(q), torch.empty_like(k), q.new_empty(B, T, H, dtype=torch.float32),
              q.new_empty(B, T, H, dtype=torch.float32)) if use_qk_l2norm else tuple(q.new_empty(0) for _ in range(4))
    return (torch.empty_like(v), q.new_empty(N, H, K, V, dtype=torch.float32),
            torch.empty_like(g, dtype=torch.float32) if g is not None else q.new_empty(0, dtype=torch.float32),
            q.new_empty(B, T, H, CHUNK_SIZE)) + normed


@kernel_op("chunk_gdn_bwd")
def chunk_gdn_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Optional[torch.Tensor], beta: torch.Tensor, A_inv: torch.Tensor,
    q_rstd: Optional[torch.Tensor], k_rstd: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], do: torch.Tensor, dht: Optional[torch.Tensor], scale: float,
    use_qk_l2norm: bool, launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0; dh0 empty without an initial state, dg empty without a gate: b None). q, k as
    the recurrence read them; with use_qk_l2norm, q_rstd and k_rstd (the L2 norm's) take the gradients on through the
    norm to the op's inputs."""
    settings = GDNLaunch.from_json(launch)
    dq, dk, dv, dg, dbeta, dh0 = backward(q, k, v, b, beta, A_inv, scale, initial_state, cu_seqlens, do, dht,
                                          settings, torch.float32 if use_qk_l2norm else None)
    if use_qk_l2norm:
        dq = l2norm_bwd(q, q_rstd, dq, q.dtype, settings.l2norm)
        dk = l2norm_bwd(k, k_rstd, dk, k.dtype, settings.l2norm)
    if dh0 is None:
        dh0 = q.new_zeros(0, dtype=torch.float32)
    if dg is None:
        dg = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dg, dbeta, dh0


@chunk_gdn_bwd.register_fake
def _(q, k, v, b, beta, A_inv, q_rstd, k_rstd, initial_state, cu_seqlens, do, dht, scale, use_qk_l2norm, launch):
    dh0 = (torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None
           else q.new_empty(0, dtype=torch.float32))
    dg = torch.empty_like(b) if b is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dg, torch.empty_like(beta), dh0


def _kept(inputs, outputs, settings):
    """The backward pass reads q and k as the recurrence read them (normalised where asked, with the norm's 1 / norms),
    v, beta, b (None without a gate) and (I + A)^-1."""
    q, k, v, g, beta = inputs
    b, A_inv, q_n, k_n, q_rstd, k_rstd = outputs
    if g is None:
        b = None
    if settings[1]:  # use_qk_l2norm
        return q_n, k_n, v, b, beta, A_inv, q_rstd, k_rstd
    return q, k, v, b, beta, A_inv, None, None


ChunkGatedDeltaRuleFunction = chunked_function("ChunkGatedDeltaRuleFunction", chunk_gdn_fwd, chunk_gdn_bwd, _kept)


def chunk_gated_delta_rule_triton(
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
    launch: Optional[GDNLaunch] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """chunk_gated_delta_rule's contract (inputs checked there): q, k [B, T, H, K], v [B, T, H, V], g (fp32; None:
    no decay, the delta rule) and beta [B, T, H], states [B or N, H, K, V] fp32. launch: the kernels' launch settings
    (default: the shipped ones)."""
    return apply_chunked(ChunkGatedDeltaRuleFunction, (q, k, v, g, beta), scale, initial_state, output_final_state,
                         cu_seqlens, bool(use_qk_l2norm), launch_json(launch, SHIPPED))
