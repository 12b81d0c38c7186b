"""Chunked GLA in plain PyTorch: the CPU path and the readable version of what the Triton kernels do.

The sequence is cut into chunks of C=64 tokens. Inside a chunk, with b = cumsum(gk) (b <= 0, falling):
  * the state carried in from the previous chunk reaches token i through exp(b_i):
        o_i += (q_i * exp(b_i)) @ S
  * token j <= i of the same chunk reaches token i through exp(b_i - b_j):
        A_ij = sum_k q_ik k_jk exp(b_ik - b_jk),  o_i += sum_{j<=i} A_ij v_j
  * the state leaving the chunk is  S' = exp(b_last) * S + (k * exp(b_last - b))^T v.
Every exponent above is <= 0, so nothing overflows. The one place where a naive chunked form would
overflow is A: writing it as (q*exp(b)) @ (k*exp(-b))^T needs exp(-b), which reaches exp(80) for
64 steps of a gate of logsigmoid(-20)/16. We split the chunk into sub-chunks of 16 and, for a pair
of sub-chunks J < I, factor through the last position r of J:
        exp(b_i - b_j) = exp(b_i - b_r) * exp(b_r - b_j),  both factors <= 1.
The 16x16 blocks on the diagonal are computed pairwise, exactly. Gradients come from autograd.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from fabric_lin.ops.chunked.layout import CHUNK_SIZE
from fabric_lin.ops.chunked.varlen import as_padded_batch

SUB = 16  # rows per sub-chunk of the intra-chunk scores


def chunk_gla_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if cu_seqlens is not None:
        return _chunk_gla_varlen(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = q.dtype
    scale = K**-0.5 if scale is None else scale

    # Pad T up to a multiple of the chunk: padded tokens have k = v = q = 0 and gk = 0 (no decay),
    # so they change neither the outputs before them nor the final state.
    pad = (-T) % CHUNK_SIZE
    N = (T + pad) // CHUNK_SIZE
    # [B, T, H, D] -> [B, H, N, C, D], fp32 for the arithmetic
    def to_chunks(x):
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
        return x.view(B, N, CHUNK_SIZE, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, gk = to_chunks(q) * scale, to_chunks(k), to_chunks(v), to_chunks(gk)
    b = gk.cumsum(dim=3)  # [B, H, N, C, K]
    b_last = b[:, :, :, -1:]  # [B, H, N, 1, K]

    attn = _intra_chunk_scores(q, k, b)  # [B, H, N, C, C], causal, diagonal included
    o_intra = attn @ v  # [B, H, N, C, V]
    q_decayed = q * b.exp()
    k_to_end = k * (b_last - b).exp()
    chunk_state_update = k_to_end.transpose(-1, -2) @ v  # [B, H, N, K, V]
    chunk_decay = b_last.squeeze(3).exp()  # [B, H, N, K]

    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    o_inter = []
    for n in range(N):
        o_inter.append(q_decayed[:, :, n] @ state)
        state = chunk_decay[:, :, n, :, None] * state + chunk_state_update[:, :, n]
    o = o_intra + torch.stack(o_inter, dim=2) if o_inter else o_intra  # no chunks (T = 0): nothing to add
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * CHUNK_SIZE, H, V)[:, :T]
    return o.to(dtype), (state if output_final_state else None)


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) for j <= i inside each chunk, 0 above the diagonal."""
    *lead, C, K = q.shape
    S = C // SUB
    qs, ks, bs = (x.view(*lead, S, SUB, K) for x in (q, k, b))
    blocks = [[None] * S for _ in range(S)]
    causal = torch.ones(SUB, SUB, dtype=torch.bool, device=q.device).tril()
    for J in range(S):
        ref = bs[..., J, -1:, :]  # b at the last token of sub-chunk J
        k_ref = ks[..., J, :, :] * (ref - bs[..., J, :, :]).exp()
        for I in range(J + 1, S):
            q_ref = qs[..., I, :, :] * (bs[..., I, :, :] - ref).exp()
            blocks[I][J] = q_ref @ k_ref.transpose(-1, -2)
        # diagonal block, pairwise: [.., SUB_i, SUB_j, K]; masked before exp so no inf*0 appears
        diff = bs[..., J, :, None, :] - bs[..., J, None, :, :]
        diff = diff.masked_fill(~causal[..., None], float("-inf"))
        blocks[J][J] = (qs[..., J, :, None, :] * ks[..., J, None, :, :] * diff.exp()).sum(-1)
    zeros = q.new_zeros(*lead, SUB, SUB)
    rows = [torch.cat([blocks[I][J] if blocks[I][J] is not None else zeros for J in range(S)], dim=-1) for I in range(S)]
    return torch.cat(rows, dim=-2)


def _chunk_gla_varlen(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens):
    """Documents packed along T (B=1): one padded row each (padding at a row's end, where it changes nothing)."""
    def run(q, k, v, gk, initial_state, output_final_state):
        return chunk_gla_torch(q, k, v, gk, scale, initial_state, output_final_state)

    return as_padded_batch(run, cu_seqlens, (q, k, v, gk), initial_state, output_final_state)
