"""One decoding step of the gated delta rule: the state in, one token, the state out."""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.gdn.l2norm import l2norm


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor],
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, H, K]; v: [B, H, V]; g (None: no decay), beta: [B, H]; state: [B, H, K, V] fp32 or None (zeros).

    use_qk_l2norm normalises q and k as chunk_gated_delta_rule(use_qk_l2norm=True) does, so a prefill
    through the chunked op and token steps here continue the same sequence.
    Returns o [B, H, V] in q's dtype and the new fp32 state.
    """
    dtype = q.dtype
    B, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta = (x.float() for x in (q, k, v, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if state is None:
        state = q.new_zeros(B, H, K, V)
    if g is not None:
        state = state * g.float().exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))  # [B, H, V]
    state = state + k[..., None] * delta[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o.to(dtype), state
