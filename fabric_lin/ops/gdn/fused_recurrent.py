"""One Gated DeltaNet decoding step in one Triton launch: read the fp32 state, decay it, apply the delta
rule, read out q.

Same contract as recurrent.py's `recurrent_gated_delta_rule_step` (the PyTorch path):
    S' = exp(g) S,   S' += beta k (v - S'^T k)^T,   o = S'^T (scale q)
with q and k optionally L2-normalised inside (fla's eps 1e-6 inside the square root, l2norm.py). g None is the delta
rule (DeltaNet): the kernel compiled with USE_GATE off, so no decay is read or applied.
Each program owns one (batch, head) and a tile of value columns. The correction S'^T k of a value column
sums over every key row, so a program holds the whole K column of its tile: the state is read and written
once, and the programs of one head need nothing from each other.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import sequence_state_offset
from fabric_lin.ops.custom_op import kernel_op
from fabric_lin.ops.gdn.launch import SHIPPED, GDNLaunch
from fabric_lin.ops.launch import cdiv, launch_json, next_power_of_2

L2NORM_EPS = 1e-6  # fabric_lin/ops/gdn/l2norm.py's, fla's


@triton.jit
def _gdn_step_kernel(q, k, v, g, beta, s_in, s_out, o, scale, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, USE_STATE: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EPS: tl.constexpr,
                     USE_GATE: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    b_q = tl.load(q + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    if USE_GATE:
        b_g = tl.load(g + i_bh).to(tl.float32)
    b_beta = tl.load(beta + i_bh).to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + EPS)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + EPS)
    state_offs = sequence_state_offset(i_bh, K, V) + o_k[:, None] * V + o_v[None, :]
    if USE_STATE:
        S = tl.load(s_in + state_offs, mask=m_kv, other=0.0)
        if USE_GATE:
            S = S * tl.exp(b_g)
        delta = b_beta * (b_v - tl.sum(b_k[:, None] * S, axis=0))  # [BV]
        S += b_k[:, None] * delta[None, :]
    else:  # from zeros: S'^T k = 0
        S = b_k[:, None] * (b_beta * b_v)[None, :]
    tl.store(s_out + state_offs, S, mask=m_kv)
    tl.store(o + i_bh * V + o_v, tl.sum((b_q * scale)[:, None] * S, axis=0).to(o.dtype.element_ty), mask=m_v)


def _value_tile(K: int, V: int) -> Tuple[int, int]:
    """(BK, BV): the whole key column (next power of two), and value columns enough to keep the fp32 state
    tile at 4,096 elements (32 registers a thread at 4 warps), so K = 128 takes 32 columns and the 340M
    model's B x H x V / BV programs (16 x 4 x 256 / 32 = 512) fill an H200's 132 multiprocessors."""
    BK = max(16, next_power_of_2(K))
    BV = min(max(16, next_power_of_2(V)), max(16, 4096 // BK))
    return BK, BV


# a kernel op, so that torch.compile keeps the step one opaque call
@kernel_op("recurrent_gated_delta_rule_step")
def gdn_step_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], beta: torch.Tensor,
    state: Optional[torch.Tensor], scale: float, use_qk_l2norm: bool, launch: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    B, H, K = q.shape
    V = v.shape[-1]
    o = q.new_empty(B, H, V)
    new_state = q.new_empty(B, H, K, V, dtype=torch.float32)
    if o.numel():
        BK, BV = _value_tile(K, V)
        _gdn_step_kernel[(cdiv(V, BV), B * H)](
            q, k, v, g, beta, state, new_state, o, scale, K, V, BK, BV, USE_STATE=state is not None,
            USE_QK_L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, USE_GATE=g is not None,
            num_warps=GDNLaunch.from_json(launch).step_warps,
        )
    return o, new_state


@gdn_step_kernel.register_fake
def _(q, k, v, g, beta, state, scale, use_qk_l2norm, launch):
    B, H, K = q.shape
    return q.new_empty(B, H, v.shape[-1]), q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32)


def fused_recurrent_gated_delta_rule_step_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], beta: torch.Tensor,
    state: Optional[torch.Tensor], scale: Optional[float] = None, use_qk_l2norm: bool = False,
    launch: Optional[GDNLaunch] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """recurrent_gated_delta_rule_step in one launch: q, k [B, H, K]; v [B, H, V]; g (log decay; None: no decay),
    beta [B, H]; state [B, H, K, V] (read as fp32) or None (zeros). Returns o [B, H, V] in q's dtype and the new fp32
    state (a new tensor). Not differentiable (decoding); the shapes checked by the caller (fabric_lin.ops.gdn)."""
    if state is not None:
        state = state.float().contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    g = None if g is None else g.contiguous()
    return gdn_step_kernel(q.contiguous(), k.contiguous(), v.contiguous(), g, beta.contiguous(), state, scale,
                           bool(use_qk_l2norm), launch_json(launch, SHIPPED))
