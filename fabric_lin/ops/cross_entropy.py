"""Linear + cross-entropy that never holds the full [N, vocab] logits, and never any fp32 logits.

The rows are taken `chunk_size` at a time: logits = hidden_chunk @ weight^T (in the input dtype), one
Triton program per row computes log-sum-exp and the row's loss in fp32 and overwrites the logits with
their gradient, softmax - onehot; then d hidden_chunk = grad @ weight and d weight += grad^T @ hidden_chunk.
All of that happens in the forward pass (the loss is a scalar, so the backward only scales the saved
gradients), so the peak is one [chunk_size, vocab] buffer in the input dtype.

`linear_cross_entropy_ref` is the PyTorch definition; `backend="auto"` runs Triton on CUDA.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fabric_lin.ops.launch import next_power_of_2, op_or_fn


def linear_cross_entropy_ref(hidden, weight, targets, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight^T against targets over the rows whose target is not ignore_index
    (0 when there are none, as the kernel and the model's chunked_cross_entropy give, not F.cross_entropy's NaN)."""
    total = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index, reduction="sum")
    return total / (targets != ignore_index).sum().clamp(min=1)


@triton.jit
def _ce_rows_kernel(logits, targets, loss, stride, V, ignore_index, BV: tl.constexpr):
    """Loss of one row, and its logits replaced by softmax - onehot (zeros for an ignored row). A target
    outside [0, V) gives NaN loss and gradient: raising would need a host sync every step, and the
    training loop reports and skips a non-finite loss."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits + row * stride
    t = tl.load(targets + row)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    target = t.to(tl.int32)
    cols = tl.arange(0, BV)
    m_vec = tl.full([BV], float("-inf"), tl.float32)
    s_vec = tl.zeros([BV], dtype=tl.float32)
    for start in range(0, V, BV):
        x = tl.load(ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # lanes that have seen only padding stay at 0
        s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    lse = m + tl.log(tl.sum(s_vec * tl.exp(m_vec - m), axis=0))
    x_target = tl.load(ptr + tl.where(valid & in_range, target, 0)).to(tl.float32)
    tl.store(loss + row, tl.where(valid, tl.where(in_range, lse - x_target, float("nan")), 0.0))
    for start in range(0, V, BV):
        mask = start + cols < V
        x = tl.load(ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
        grad = tl.where(valid, tl.where(in_range, grad, float("nan")), 0.0)
        tl.store(ptr + start + cols, grad.to(logits.dtype.element_ty), mask=mask)


def _forward(hidden, weight, targets, ignore_index, chunk_size, need_dw):
    N, d = hidden.shape
    V = weight.shape[0]
    losses = torch.empty(N, device=hidden.device, dtype=torch.float32)
    dh = torch.empty_like(hidden)
    dw = torch.zeros(V, d, device=hidden.device, dtype=torch.float32) if need_dw else None
    BV = min(4096, next_power_of_2(V))
    for start in range(0, N, chunk_size):
        h = hidden[start : start + chunk_size]
        logits = h @ weight.t()  # [rows, V], input dtype
        _ce_rows_kernel[(h.shape[0],)](logits, targets[start : start + chunk_size], losses[start:],
                                       logits.stride(0), V, ignore_index, BV=BV, num_warps=8)
        dh[start : start + chunk_size] = logits @ weight
        if need_dw:
            dw += logits.t() @ h  # the input-dtype product added into fp32 as it is read (no fp32 copy of it first)
    count = (targets != ignore_index).sum().clamp(min=1).float()
    loss = losses.sum() / count
    dh = (dh.float() / count).to(hidden.dtype)
    dw = (dw / count).to(weight.dtype) if need_dw else weight.new_empty(0)
    return loss, dh, dw


@torch.library.custom_op("fabric_lin::linear_cross_entropy_fwd", mutates_args=())
def _linear_ce_fwd_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk_size: int,
    need_dw: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(hidden, weight, targets, ignore_index, chunk_size, need_dw)


@_linear_ce_fwd_op.register_fake
def _(hidden, weight, targets, ignore_index, chunk_size, need_dw):
    dw = torch.empty_like(weight) if need_dw else weight.new_empty(0)
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), dw


def _ce_fwd(*args):
    return op_or_fn(_linear_ce_fwd_op, _forward)(*args)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size):
        loss, dh, dw = _ce_fwd(hidden, weight, targets, ignore_index, chunk_size, weight.requires_grad)
        ctx.save_for_backward(dh, dw)
        ctx.need_dw = weight.requires_grad
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dh, dw = ctx.saved_tensors
        return dh * dloss.to(dh.dtype), (dw * dloss.to(dw.dtype) if ctx.need_dw else None), None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of hidden [N, d] @ weight[V, d]^T against targets [N] (ignore_index rows left out).
    A target outside [0, V) raises on the PyTorch path and makes the loss NaN on the Triton path."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'torch'), got {backend!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, d], weight [V, d], targets [N], got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
            f"{tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class indices, got {targets.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if backend == "torch" or (backend == "auto" and not hidden.is_cuda):
        return linear_cross_entropy_ref(hidden, weight, targets, ignore_index)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        # no gradient wanted: the same kernel, its gradients dropped
        return _ce_fwd(hidden.contiguous(), weight.contiguous(), targets.contiguous(), ignore_index, chunk_size, False)[0]
    return _LinearCrossEntropy.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(), ignore_index, chunk_size)
