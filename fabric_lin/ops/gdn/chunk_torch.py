"""Chunked gated delta rule in plain PyTorch: the CPU path and the readable version of the kernels.

The sequence is cut into chunks of C=64 tokens. Inside a chunk, with b = cumsum(g) (b <= 0, falling)
and S the state carried in from the previous chunk, write the state after token i as
    S_i = exp(b_i) S + sum_{j<=i} exp(b_i - b_j) k_j d_j^T,
where d_j = beta_j (v_j - (decayed S_{j-1})^T k_j) is the correction token j writes. Substituting
S_{j-1} gives a lower-triangular system for the corrections of the whole chunk, d [C, V]:
    (I + A) d = beta * v - (beta * exp(b) * k) S,    A_ij = beta_i (k_i . k_j) exp(b_i - b_j), j < i.
With T = (I + A)^{-1} (unit lower triangular, the UT/WY form of the DeltaNet papers), the corrections
split into a part that depends only on the chunk and a part linear in the incoming state:
    u = T (beta * v)               [C, V]
    w = T (beta * exp(b) * k)      [C, K]
    d = u - w S
u and w are computed for all chunks at once; the pass over chunks is then GLA's with a scalar decay:
    o      = (scale q * exp(b)) S + (scale q k^T * exp(b_i - b_j), j <= i) d
    S_next = exp(b_C) S + (k * exp(b_C - b))^T d
Every exponent above is a difference b_i - b_j with i >= j, or b itself, so each is <= 0: nothing
overflows however fast the gate decays. The i < j half of exp(b_i - b_j) is masked to -inf before
the exp, so no inf (or inf * 0 in the backward pass) appears. The state crosses chunks in fp32.
Without a gate (g None: the delta rule of DeltaNet) b = 0: exp(b_i - b_j) is the causal mask, and q, k and the
state are used as they are, with no decay made or applied.
Gradients come from autograd.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from fabric_lin.ops.chunked.layout import CHUNK_SIZE
from fabric_lin.ops.chunked.varlen import as_padded_batch



def chunk_gated_delta_rule_torch(
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
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g (None: no decay), beta: [B, T, H]; initial_state: [B or N, H, K, V]
    fp32.

    Returns o [B, T, H, V] in q's dtype and, if asked, the final state [B or N, H, K, V] in fp32.
    Inputs are assumed valid (chunk_gated_delta_rule checks them).
    """
    if cu_seqlens is not None:
        return _chunk_varlen(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = q.dtype
    scale = K**-0.5 if scale is None else scale

    # Pad T up to a multiple of the chunk. Padded tokens have q = k = v = 0, beta = 0 (no write) and
    # g = 0 (no decay), so they change neither the outputs before them nor the final state.
    pad = (-T) % CHUNK_SIZE
    N = (T + pad) // CHUNK_SIZE

    def to_chunks(x):  # [B, T, H, *D] -> [B, H, N, C, *D], fp32 for the arithmetic
        x = x.float()
        if x.dim() == 3:
            return F.pad(x, (0, 0, 0, pad)).view(B, N, CHUNK_SIZE, H).permute(0, 3, 1, 2)
        return F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, N, CHUNK_SIZE, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, beta = to_chunks(q) * scale, to_chunks(k), to_chunks(v), to_chunks(beta)
    eye = torch.eye(CHUNK_SIZE, dtype=q.dtype, device=q.device)
    kk, qk = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)  # [B, H, N, C, C]
    if g is None:
        # the delta rule: every decay is 1, so A and the scores are K K^T and q k^T masked, W is made from k itself,
        # and the state passes the chunk's end undecayed
        A = (beta[..., None] * kk).tril(-1)
        w_rhs = beta[..., None] * k
        scores = qk.tril()  # causal, diagonal included
        q_decayed, k_to_end, chunk_decay = q, k, None
    else:
        g = to_chunks(g)
        b = g.cumsum(dim=-1)  # [B, H, N, C]
        b_last = b[..., -1:]  # [B, H, N, 1]
        # b_last - b_i = g_{i+1} + ... + g_C, summed as such: taken as a difference, the last row's zero would pass
        # b_last's gradient to every g and take it back through b_C's, and with a fast gate that rounding is all of its
        # gradient
        to_end = F.pad(g[..., 1:], (0, 1)).flip(-1).cumsum(dim=-1).flip(-1)  # [B, H, N, C]

        # exp(b_i - b_j) for j < i, the diagonal a constant 1 (for the same reason), zero above: [B, H, N, C, C]
        strict = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril(-1)
        decay = (b[..., :, None] - b[..., None, :]).masked_fill(~strict, float("-inf")).exp() + eye

        A = (beta[..., None] * kk * decay).tril(-1)
        w_rhs = (beta * b.exp())[..., None] * k
        scores = qk * decay  # causal, diagonal included
        q_decayed = q * b.exp()[..., None]
        k_to_end = k * to_end.exp()[..., None]
        chunk_decay = b_last.exp()[..., None]  # [B, H, N, 1, 1]

    # The UT transform of the chunk: A is strictly lower triangular, I + A unit lower triangular.
    rhs = torch.cat([beta[..., None] * v, w_rhs], dim=-1)  # [B, H, N, C, V + K]
    uw = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :V], uw[..., V:]  # [B, H, N, C, V], [B, H, N, C, K]

    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outputs = []
    for n in range(N):
        d = u[:, :, n] - w[:, :, n] @ state  # [B, H, C, V], the corrections the chunk writes
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ d)
        if chunk_decay is not None:
            state = chunk_decay[:, :, n] * state
        state = state + k_to_end[:, :, n].transpose(-1, -2) @ d
    o = torch.stack(outputs, dim=2) if outputs else q.new_zeros(B, H, 0, CHUNK_SIZE, V)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * CHUNK_SIZE, H, V)[:, :T]
    return o.to(dtype), (state if output_final_state else None)


def _chunk_varlen(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Documents packed along T (B=1): one padded row each. A row's padding sits after its document and, as in
    the chunked path, leaves its state unchanged, so the final state of an empty document is its initial state."""
    def run(q, k, v, g, beta, initial_state, output_final_state):
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state)

    return as_padded_batch(run, cu_seqlens, (q, k, v, g, beta), initial_state, output_final_state)
