"""The gated delta rule written as plainly as possible: the test oracle for every faster path.

Per head, with a state S of shape [K, V], a log decay g_t <= 0 and a write strength beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1}                              (forget)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T          (delta rule: move S^T k_t toward v_t)
    o_t = S_t^T (scale q_t)
The correction reads the state after the decay, as flash-linear-attention's recurrence does. Without a gate
(g None) there is no forget step: the delta rule of DeltaNet, S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T.
Everything is computed in fp32, one token at a time.
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.chunked.varlen import per_document


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor],
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g (or None: no decay), beta: [B, T, H]; initial_state: [B or N, H, K, V].

    Returns o [B, T, H, V] in q's dtype and, if asked, the final state [B or N, H, K, V] in fp32.
    With `cu_seqlens` (B must be 1, N+1 document offsets) the state starts afresh at every document.
    """
    if cu_seqlens is not None:
        def run(q, k, v, g, beta, initial_state, output_final_state):
            return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state)

        return per_document(run, cu_seqlens, (q, k, v, g, beta), initial_state, output_final_state)

    dtype = q.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta = (x.float() for x in (q, k, v, beta))
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    o = q.new_zeros(B, T, H, V)
    for t in range(T):
        k_t = k[:, t]  # [B, H, K]
        if g is not None:
            state = state * g[:, t].float().exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t))  # [B, H, V]
        state = state + k_t[..., None] * delta[..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state)
    return o.to(dtype), (state if output_final_state else None)
