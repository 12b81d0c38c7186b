"""One decoding step of GLA: the state in, one token, the state out. Constant memory per token."""
from typing import Optional, Tuple

import torch


def recurrent_gla_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    state: Optional[torch.Tensor],
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k, gk: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] fp32 or None (zeros).

    Returns o [B, H, V] in q's dtype and the new fp32 state.
    """
    B, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    if state is None:
        state = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    state = state * gk.float().exp()[..., None] + k.float()[..., None] * v.float()[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q.float() * scale, state)
    return o.to(q.dtype), state
