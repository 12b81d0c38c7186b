"""GLA's chunked Triton path: its forward and backward kernel ops around `chunk_fwd.forward` and
`chunk_bwd.backward`, their autograd Function (`fabric_lin/ops/chunked/autograd.py`), and the two entry points
`chunk_gla_triton` (the log gate given) and `chunk_gla_from_logits_triton` (the gate's logits given;
logsigmoid(logits) / normalizer is formed inside).

The math is chunk_torch.py's (chunks of 64 tokens, b = cumsum(gk) inside a chunk, fp32 state), arranged so
that every matrix product is a full tile: see `scores.py` (the intra-chunk scores), `chunk_fwd.py` and
`chunk_bwd.py` (the launches), `cumsum.py` (the gate's cumsum) and `state_pass.py` (the state pass). Eight
launches for forward plus backward with the sequential state pass, nine from logits.

From logits, the backward pass keeps the logits (2 bytes per gate entry in bf16) where it would keep fp32
cumulative sums (4, and the fp32 logsigmoid input besides), recomputes the sums in one launch and writes
the logits' gradient from the dq/dk kernel: no elementwise pass over the gate runs outside the kernels.
"""
from typing import Optional, Tuple

import torch

from fabric_lin.ops.chunked.autograd import apply_chunked, chunked_function
from fabric_lin.ops.chunked.layout import CHUNK_SIZE
from fabric_lin.ops.custom_op import kernel_op
from fabric_lin.ops.gla.chunk_bwd import backward
from fabric_lin.ops.gla.chunk_fwd import forward
from fabric_lin.ops.gla.launch import SHIPPED, GLALaunch
from fabric_lin.ops.launch import launch_json


@kernel_op("chunk_gla_fwd")
def chunk_gla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: float, normalizer: Optional[float], launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final state, gc = the in-chunk cumulative gate (fp32), A = the intra-chunk scores). g: the log gate gk,
    or with a normalizer the gate's logits."""
    return forward(q, k, v, g, scale, initial_state, cu_seqlens, normalizer, GLALaunch.from_json(launch))


@chunk_gla_fwd.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, scale, normalizer, launch):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (q.new_empty(B, T, H, V), q.new_empty(N, H, K, V, dtype=torch.float32),
            torch.empty_like(g, dtype=torch.float32), q.new_empty(B, T, H, CHUNK_SIZE))


@kernel_op("chunk_gla_bwd")
def chunk_gla_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, A: torch.Tensor,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
    dht: Optional[torch.Tensor], scale: float, normalizer: Optional[float], launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d gate, dh0; dh0 empty without an initial state). gate: gc, or with a normalizer the logits."""
    dq, dk, dv, dg, dh0 = backward(q, k, v, gate, A, scale, initial_state, cu_seqlens, do, dht, normalizer,
                                   GLALaunch.from_json(launch))
    if dh0 is None:
        dh0 = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dg, dh0


@chunk_gla_bwd.register_fake
def _(q, k, v, gate, A, initial_state, cu_seqlens, do, dht, scale, normalizer, launch):
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gate), dh0


def _kept(inputs, outputs, settings):
    """The backward pass reads q, k, v, A and the gate: from logits (a normalizer given) the logits, which it
    recomputes the cumulative sums from, else those sums (fp32)."""
    q, k, v, g = inputs
    gc, A = outputs
    normalizer = settings[1]
    return q, k, v, (g if normalizer is not None else gc), A


ChunkGLAFunction = chunked_function("ChunkGLAFunction", chunk_gla_fwd, chunk_gla_bwd, _kept)


def chunk_gla_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    launch: Optional[GLALaunch] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as chunk_gla_torch: q, k, gk [B, T, H, K], v [B, T, H, V], states [B or N, H, K, V] fp32
    (checked by the caller, fabric_lin.ops.gla). launch: the kernels' launch settings (default: the shipped ones)."""
    return apply_chunked(ChunkGLAFunction, (q, k, v, gk), scale, initial_state, output_final_state, cu_seqlens, None,
                         launch_json(launch, SHIPPED))


def chunk_gla_from_logits_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    normalizer: float,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    launch: Optional[GLALaunch] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """chunk_gla_triton with gk = logsigmoid(gate_logits) / normalizer (gate_logits [B, T, H, K], any float dtype)."""
    return apply_chunked(ChunkGLAFunction, (q, k, v, gate_logits), scale, initial_state, output_final_state,
                         cu_seqlens, float(normalizer), launch_json(launch, SHIPPED))
