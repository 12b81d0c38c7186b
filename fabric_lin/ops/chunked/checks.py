"""The input checks of every family's ops, so that the families take their inputs alike and say alike what is wrong:
each error names the op, the tensor, the shape (or dtype) it was given and the one expected.

    check_inputs        a chunked op: q, k [B, T, H, K], v [B, T, H, V], the family's per-token inputs ([B, T, H, K]
                        per key column, or [B, T, H] per head), initial_state [N, H, K, V] fp32, cu_seqlens (B = 1)
    check_step_inputs   a decoding step: the same without T, state [B, H, K, V]

Shapes and dtypes only: nothing here reads a tensor's values, which would wait for the GPU. cu_seqlens' values
are checked where they are read anyway (`layout.check_offsets`).
"""
from typing import Dict, Optional, Sequence

import torch


def _shape(x: torch.Tensor) -> tuple:
    return tuple(x.shape)


def check_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 per_key: Optional[Dict[str, torch.Tensor]] = None, per_head: Optional[Dict[str, torch.Tensor]] = None,
                 float32: Sequence[str] = (), initial_state: Optional[torch.Tensor] = None,
                 cu_seqlens: Optional[torch.Tensor] = None) -> None:
    """A chunked op's inputs. per_key: inputs with one value per token, head and key column ([B, T, H, K], GLA's
    gate); per_head: one value per token and head ([B, T, H], the delta rule's decay and write strength); float32:
    the names among them that must be fp32 (those cumulated inside the op, where bf16 would lose small values)."""
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be [B, T, H, K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if _shape(k) != (B, T, H, K):
        raise ValueError(f"{op}: k must be [B, T, H, K] = {(B, T, H, K)} like q, got shape {_shape(k)}")
    if v.dim() != 4 or _shape(v)[:3] != (B, T, H):
        raise ValueError(f"{op}: v must be [B, T, H, V] with [B, T, H] = {(B, T, H)}, got shape {_shape(v)}")
    V = v.shape[-1]
    per_key, per_head = per_key or {}, per_head or {}
    for name, x in per_key.items():
        if _shape(x) != (B, T, H, K):
            raise ValueError(f"{op}: {name} must be [B, T, H, K] = {(B, T, H, K)} like q (one value per key column), "
                             f"got shape {_shape(x)}")
    for name, x in per_head.items():
        if _shape(x) != (B, T, H):
            raise ValueError(f"{op}: {name} must be [B, T, H] = {(B, T, H)} (one value per head and token), got shape "
                             f"{_shape(x)}")
    _check_dtypes(op, q, k, v, {**per_key, **per_head}, float32)
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{op}: cu_seqlens needs batch size 1 (documents packed along T), got B = {B}")
        expected = f"{op}: cu_seqlens must be a 1-D integer tensor of N+1 >= 2 document offsets, got"
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(f"{expected} a {type(cu_seqlens).__name__}")
        if (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point()
                or cu_seqlens.dtype == torch.bool):
            raise ValueError(f"{expected} {cu_seqlens.dtype} of shape {_shape(cu_seqlens)}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        if _shape(initial_state) != (N, H, K, V):
            what = "documents in cu_seqlens" if cu_seqlens is not None else "batch size"
            raise ValueError(f"{op}: initial_state must be [N, H, K, V] = {(N, H, K, V)} (N = {what}), got shape "
                             f"{_shape(initial_state)}")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"{op}: initial_state must be float32 (the state is carried in fp32), got "
                             f"{initial_state.dtype}")


def check_step_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      per_key: Optional[Dict[str, torch.Tensor]] = None,
                      per_head: Optional[Dict[str, torch.Tensor]] = None, state: Optional[torch.Tensor] = None) -> None:
    """A decoding step's inputs (one token per sequence): q, k [B, H, K], v [B, H, V], per_key inputs [B, H, K],
    per_head ones [B, H], state [B, H, K, V] or None."""
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [B, H, K], got shape {_shape(q)}")
    B, H, K = q.shape
    if _shape(k) != (B, H, K):
        raise ValueError(f"{op}: k must be [B, H, K] = {(B, H, K)} like q, got shape {_shape(k)}")
    if v.dim() != 3 or _shape(v)[:2] != (B, H):
        raise ValueError(f"{op}: v must be [B, H, V] with [B, H] = {(B, H)}, got shape {_shape(v)}")
    per_key, per_head = per_key or {}, per_head or {}
    for name, x in per_key.items():
        if _shape(x) != (B, H, K):
            raise ValueError(f"{op}: {name} must be [B, H, K] = {(B, H, K)} like q, got shape {_shape(x)}")
    for name, x in per_head.items():
        if _shape(x) != (B, H):
            raise ValueError(f"{op}: {name} must be [B, H] = {(B, H)} (one value per head), got shape {_shape(x)}")
    _check_dtypes(op, q, k, v, {**per_key, **per_head}, ())
    if state is not None and _shape(state) != (B, H, K, v.shape[-1]):
        raise ValueError(f"{op}: state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, got shape {_shape(state)}")


def _check_dtypes(op: str, q, k, v, others: Dict[str, torch.Tensor], float32: Sequence[str]) -> None:
    for name, x in {"q": q, "k": k, "v": v, **others}.items():
        if not x.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name in float32:
        if others[name].dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32 (it is cumulated inside the op), got {others[name].dtype}")
