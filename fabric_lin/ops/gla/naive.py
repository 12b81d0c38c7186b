"""The GLA recurrence written as plainly as possible: the test oracle for every faster path.

Per head, with a state S of shape [K, V]:
    S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t
    o_t = (q_t * scale) S_t
Everything is computed in fp32, one token at a time.
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.chunked.varlen import per_document


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k, gk: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B or N, H, K, V] (fp32).

    Returns o [B, T, H, V] in q's dtype and, if asked, the final state [B or N, H, K, V] in fp32.
    With `cu_seqlens` (B must be 1) the state starts afresh at every document boundary.
    """
    if cu_seqlens is not None:
        def run(q, k, v, gk, initial_state, output_final_state):
            return naive_recurrent_gla(q, k, v, gk, scale, initial_state, output_final_state)

        return per_document(run, cu_seqlens, (q, k, v, gk), initial_state, output_final_state)

    dtype = q.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, gk = (x.float() for x in (q, k, v, gk))
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    o = q.new_zeros(B, T, H, V)
    for t in range(T):
        state = state * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state)
    return o.to(dtype), (state if output_final_state else None)
