"""Linear + cross-entropy that never holds the full [N, vocab] logits, and never any fp32 logits.

The rows are taken `chunk_size` at a time: logits = hidden_chunk @ weight^T (in the input dtype), one
Triton program per row computes log-sum-exp and the row's loss in fp32 and overwrites the logits with
their gradient, softmax - onehot; then d hidden_chunk = grad @ weight and d weight += grad^T @ hidden_chunk.
All of that happens in the forward pass (the loss is a scalar, so the backward only scales the saved
gradients, those of the summed loss, by dloss / count), so the peak is one [chunk_size, vocab] buffer in the
input dtype.

The kernel is in cross_entropy_triton.py (imported only when it runs); `linear_cross_entropy_ref` is the
PyTorch definition (the CPU path, chunked the same way). `backend` picks one by the rule of
fabric_lin/ops/backend.py; `launch` (a CrossEntropyLaunch, by default the shipped settings: fabric_lin/ops/fused_launch.py) says how the kernel is launched.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fabric_lin.ops.backend import resolve_backend
from fabric_lin.ops.fused_launch import CrossEntropyLaunch




def linear_cross_entropy_ref(hidden, weight, targets, ignore_index: int = -100, chunk_size: int = 4096) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight^T against targets over the rows whose target is not ignore_index
    (0 when there are none, as the kernel gives, not F.cross_entropy's NaN), one chunk of rows at a time.
    Each chunk's logits are recomputed in the backward pass (activation checkpointing), so at most
    [chunk_size, vocab] logits exist at once, forward or backward."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, max(hidden.shape[0], 1), chunk_size):  # no rows: one empty chunk, for the graph
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss_sum, h, weight, t, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, weight, t, ignore_index)
    return total / (targets != ignore_index).sum().clamp(min=1)


def _chunk_loss_sum(h, weight, t, ignore_index):
    # F.cross_entropy takes int64 (or uint8) targets only; the kernel any integer dtype
    return F.cross_entropy(F.linear(h, weight).float(), t.long(), ignore_index=ignore_index, reduction="sum")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    backend: str = "auto",
    launch: Optional[CrossEntropyLaunch] = None,
) -> torch.Tensor:
    """Mean cross-entropy of hidden [N, d] @ weight[V, d]^T against targets [N] (ignore_index rows left out).
    A target outside [0, V) raises on the PyTorch path and makes the loss NaN on the Triton path."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, d], weight [V, d], targets [N], got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
            f"{tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class indices, got {targets.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if resolve_backend(backend, hidden.device) == "torch":
        return linear_cross_entropy_ref(hidden, weight, targets, ignore_index, chunk_size)
    if torch.is_autocast_enabled(hidden.device.type):  # the kernel is opaque to autocast: cast as autocast would
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    from fabric_lin.ops.cross_entropy_triton import linear_cross_entropy_triton

    return linear_cross_entropy_triton(hidden, weight, targets, ignore_index, chunk_size, launch)
