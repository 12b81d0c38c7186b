"""GLA's chunked Triton path: the autograd Functions and torch.library ops around `chunk_fwd.forward` and
`chunk_bwd.backward`, and the two entry points `chunk_gla_triton` (the log gate given) and
`chunk_gla_from_logits_triton` (the gate's logits given; logsigmoid(logits) / normalizer is formed inside).

The math is chunk_torch.py's (chunks of 64 tokens, b = cumsum(gk) inside a chunk, fp32 state), arranged so
that every matrix product is a full tile: see `scores.py` (the intra-chunk scores), `chunk_fwd.py` and
`chunk_bwd.py` (the launches), `cumsum.py` (the gate's cumsum) and `state_pass.py` (the state pass). Eight
launches for forward plus backward with the sequential state pass, nine from logits.

From logits, the backward pass keeps the logits (2 bytes per gate entry in bf16) where it would keep fp32
cumulative sums (4, and the fp32 logsigmoid input besides), recomputes the sums in one launch and writes
the logits' gradient from the dq/dk kernel: no elementwise pass over the gate runs outside the kernels.
"""
import functools
import json
from typing import Optional, Tuple

import torch

from fabric_lin.ops.gla.chunk_bwd import backward
from fabric_lin.ops.gla.chunk_fwd import forward
from fabric_lin.ops.chunked.layout import CHUNK_SIZE
from fabric_lin.ops.gla.launch import SHIPPED, GLALaunch
from fabric_lin.ops.launch import op_or_fn


@functools.lru_cache(maxsize=64)
def _launch_of(text: str) -> GLALaunch:
    return GLALaunch.from_dict(json.loads(text))


# The ops take the launch as its JSON text: torch.library ops accept strings, not Python objects, and
# torch.compile bakes a string argument into the graph as a constant.
def _gla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], normalizer: Optional[float],
    launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward(q, k, v, g, scale, initial_state, cu_seqlens, normalizer, _launch_of(launch))


chunk_gla_fwd_op = torch.library.custom_op("fabric_lin::chunk_gla_fwd", mutates_args=())(_gla_fwd)


@chunk_gla_fwd_op.register_fake
def _(q, k, v, g, scale, initial_state, cu_seqlens, normalizer, launch):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (q.new_empty(B, T, H, V), q.new_empty(N, H, K, V, dtype=torch.float32),
            torch.empty_like(g, dtype=torch.float32), q.new_empty(B, T, H, CHUNK_SIZE))


def _gla_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, A: torch.Tensor, scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
    dht: Optional[torch.Tensor], normalizer: Optional[float], launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dg, dh0 = backward(q, k, v, gate, A, scale, initial_state, cu_seqlens, do, dht, normalizer,
                                   _launch_of(launch))
    if dh0 is None:
        dh0 = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dg, dh0


chunk_gla_bwd_op = torch.library.custom_op("fabric_lin::chunk_gla_bwd", mutates_args=())(_gla_bwd)


@chunk_gla_bwd_op.register_fake
def _(q, k, v, gate, A, scale, initial_state, cu_seqlens, do, dht, normalizer, launch):
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gate), dh0


class ChunkGLAFunction(torch.autograd.Function):
    """The log gate gk given: its in-chunk cumulative sums (fp32) are kept for the backward pass."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, launch):
        o, ht, gc, A = op_or_fn(chunk_gla_fwd_op, _gla_fwd)(q, k, v, g, scale, initial_state, cu_seqlens, None, launch)
        ctx.save_for_backward(q, k, v, gc, A, initial_state, cu_seqlens)
        ctx.scale, ctx.output_final_state, ctx.launch = scale, output_final_state, launch
        ctx.g_dtype = g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, A, initial_state, cu_seqlens = ctx.saved_tensors
        dht = dht.contiguous() if ctx.output_final_state and dht is not None else None
        dq, dk, dv, dg, dh0 = op_or_fn(chunk_gla_bwd_op, _gla_bwd)(
            q, k, v, gc, A, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht, None, ctx.launch
        )
        return dq, dk, dv, dg.to(ctx.g_dtype), None, (dh0 if initial_state is not None else None), None, None, None


class ChunkGLAFromLogitsFunction(torch.autograd.Function):
    """The gate's logits given: only they are kept for the backward pass, which recomputes the cumulative gate."""

    @staticmethod
    def forward(ctx, q, k, v, gate_logits, normalizer, scale, initial_state, output_final_state, cu_seqlens, launch):
        o, ht, _, A = op_or_fn(chunk_gla_fwd_op, _gla_fwd)(q, k, v, gate_logits, scale, initial_state, cu_seqlens,
                                                           normalizer, launch)
        ctx.save_for_backward(q, k, v, gate_logits, A, initial_state, cu_seqlens)
        ctx.scale, ctx.normalizer, ctx.output_final_state, ctx.launch = scale, normalizer, output_final_state, launch
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gate_logits, A, initial_state, cu_seqlens = ctx.saved_tensors
        dht = dht.contiguous() if ctx.output_final_state and dht is not None else None
        dq, dk, dv, d_logits, dh0 = op_or_fn(chunk_gla_bwd_op, _gla_bwd)(
            q, k, v, gate_logits, A, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht, ctx.normalizer,
            ctx.launch,
        )
        return dq, dk, dv, d_logits, None, None, (dh0 if initial_state is not None else None), None, None, None


def _checked_inputs(q, k, v, gate, gate_name, scale, initial_state, cu_seqlens):
    """(scale, initial_state, cu_seqlens) ready for the kernels (the shapes checked by the caller)."""
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    return scale, initial_state, cu_seqlens


def _checked_launch(launch: Optional[GLALaunch]) -> str:
    if launch is None:
        launch = SHIPPED
    if not isinstance(launch, GLALaunch):
        raise TypeError(f"launch must be a fabric_lin.ops.gla.launch.GLALaunch, got {type(launch).__name__}")
    return launch.as_json


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
    """Same contract as chunk_gla_torch: q, k, gk [B, T, H, K], v [B, T, H, V], states [B or N, H, K, V] fp32.
    launch: the kernels' launch settings (default: `SHIPPED`)."""
    scale, initial_state, cu_seqlens = _checked_inputs(q, k, v, gk, "gk", scale, initial_state, cu_seqlens)
    o, ht = ChunkGLAFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), scale, initial_state, output_final_state,
        cu_seqlens, _checked_launch(launch),
    )
    return o, (ht if output_final_state else None)


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
    scale, initial_state, cu_seqlens = _checked_inputs(q, k, v, gate_logits, "gate_logits", scale, initial_state, cu_seqlens)
    o, ht = ChunkGLAFromLogitsFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), gate_logits.contiguous(), float(normalizer), scale,
        initial_state, output_final_state, cu_seqlens, _checked_launch(launch),
    )
    return o, (ht if output_final_state else None)
