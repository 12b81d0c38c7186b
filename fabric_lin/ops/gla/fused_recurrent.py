"""One GLA decoding step in one Triton launch: read the fp32 state, decay it, add k^T v, read out q.

Same contract as recurrent.py's `recurrent_gla_step` (the PyTorch path); `fused_recurrent_gla_step` in
fabric_lin.ops.gla picks one of them:
    S' = diag(exp(gk)) S + k^T v,   o = (q * scale) S'
Each program owns one (batch, head) and a tile of value columns, so the state is read and written once.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import sequence_state_offset
from fabric_lin.ops.custom_op import kernel_op
from fabric_lin.ops.gla.launch import SHIPPED, GLALaunch
from fabric_lin.ops.launch import cdiv, launch_json, next_power_of_2


@triton.jit
def _recurrent_step_kernel(q, k, v, g, s_in, s_out, o, scale, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, USE_STATE: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # q, k, g [B, H, K] and v [B, H, V] are V (or K) times smaller than the states [B, H, K, V]: int32 offsets fit
    # them where the states' need int64
    b_q = tl.load(q + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    state_offs = sequence_state_offset(i_bh, K, V) + o_k[:, None] * V + o_v[None, :]
    S = b_k[:, None] * b_v[None, :]
    if USE_STATE:
        S += tl.load(s_in + state_offs, mask=m_kv, other=0.0) * tl.exp(b_g)[:, None]
    tl.store(s_out + state_offs, S, mask=m_kv)
    tl.store(o + i_bh * V + o_v, tl.sum(b_q[:, None] * S, axis=0).to(o.dtype.element_ty), mask=m_v)


# a kernel op, so that torch.compile keeps the step one opaque call
@kernel_op("recurrent_gla_step")
def recurrent_gla_step_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, state: Optional[torch.Tensor], scale: float,
    launch: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    B, H, K = q.shape
    V = v.shape[-1]
    o = q.new_empty(B, H, V)
    new_state = q.new_empty(B, H, K, V, dtype=torch.float32)
    BK = max(16, next_power_of_2(K))
    BV = min(max(16, next_power_of_2(V)), 64 if BK <= 128 else 32)
    _recurrent_step_kernel[(cdiv(V, BV), B * H)](
        q, k, v, gk, state, new_state, o, scale, K, V, BK, BV, USE_STATE=state is not None,
        num_warps=GLALaunch.from_json(launch).step_warps,
    )
    return o, new_state


@recurrent_gla_step_kernel.register_fake
def _(q, k, v, gk, state, scale, launch):
    B, H, K = q.shape
    return q.new_empty(B, H, v.shape[-1]), q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32)


def fused_recurrent_gla_step_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, state: Optional[torch.Tensor],
    scale: Optional[float] = None, launch: Optional[GLALaunch] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """recurrent_gla_step in one launch; the shapes checked by the caller (fabric_lin.ops.gla). launch: None for
    the shipped settings."""
    if state is not None:
        state = state.float().contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return recurrent_gla_step_kernel(q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), state, scale,
                                     launch_json(launch, SHIPPED))
