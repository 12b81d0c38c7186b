"""The Triton kernel behind cross_entropy.py's linear_cross_entropy, its torch.library op and autograd Function."""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.custom_op import kernel_op, refuse_second_derivative
from fabric_lin.ops.fused_launch import SHIPPED_CROSS_ENTROPY as SHIPPED, CrossEntropyLaunch
from fabric_lin.ops.launch import launch_json, next_power_of_2


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


@kernel_op("linear_cross_entropy_fwd")
def linear_ce_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk_size: int,
    need_dw: bool, launch: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, the gradients of the summed loss for hidden and weight, the count of rows the mean divides
    by). The gradients stay those of the sum until the backward pass scales them by dloss / count: the mean's,
    ~1e-5 and below over a few thousand rows, would be float16 subnormals (below 6.1e-5) before GradScaler's
    factor could lift them. A row's d hidden is at most 2 max |weight|; d weight is kept in fp32 where the
    weight is float16, whose range a frequent token's sum over the rows can pass."""
    N, d = hidden.shape
    V = weight.shape[0]
    losses = torch.empty(N, device=hidden.device, dtype=torch.float32)
    dh = torch.empty_like(hidden)
    dw = torch.zeros(V, d, device=hidden.device, dtype=torch.float32) if need_dw else None
    settings = CrossEntropyLaunch.from_json(launch)
    BV = min(settings.vocab_tile, next_power_of_2(V))
    for start in range(0, N, chunk_size):
        h = hidden[start : start + chunk_size]
        logits = h @ weight.t()  # [rows, V], input dtype
        _ce_rows_kernel[(h.shape[0],)](logits, targets[start : start + chunk_size], losses[start:],
                                       logits.stride(0), V, ignore_index, BV=BV, num_warps=settings.warps)
        dh[start : start + chunk_size] = logits @ weight
        if need_dw:
            dw += logits.t() @ h  # the input-dtype product added into fp32 as it is read (no fp32 copy of it first)
    count = (targets != ignore_index).sum().clamp(min=1).float()
    loss = losses.sum() / count
    if not need_dw:
        dw = weight.new_empty(0)
    elif weight.dtype != torch.float16:
        dw = dw.to(weight.dtype)
    return loss, dh, dw, count


@linear_ce_fwd.register_fake
def _(hidden, weight, targets, ignore_index, chunk_size, need_dw, launch):
    if need_dw:
        dw = torch.empty_like(weight, dtype=torch.float32 if weight.dtype == torch.float16 else weight.dtype)
    else:
        dw = weight.new_empty(0)
    scalar = hidden.new_empty((), dtype=torch.float32)
    return scalar, torch.empty_like(hidden), dw, torch.empty_like(scalar)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, launch):
        loss, dh, dw, count = linear_ce_fwd(hidden, weight, targets, ignore_index, chunk_size, weight.requires_grad,
                                            launch)
        ctx.save_for_backward(dh, dw, count)
        ctx.need_dw, ctx.weight_dtype = weight.requires_grad, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        refuse_second_derivative("linear_cross_entropy")
        dh, dw, count = ctx.saved_tensors
        # an fp32 scalar, which the products take in fp32 (GradScaler's first factor, 2**16, is past float16's range)
        scale = dloss / count
        return dh * scale, ((dw * scale).to(ctx.weight_dtype) if ctx.need_dw else None), None, None, None, None


def linear_cross_entropy_triton(hidden, weight, targets, ignore_index: int, chunk_size: int,
                                launch: Optional[CrossEntropyLaunch] = None) -> torch.Tensor:
    launch = launch_json(launch, SHIPPED)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        # no gradient wanted: the same kernel, its gradients dropped
        return linear_ce_fwd(hidden.contiguous(), weight.contiguous(), targets.contiguous(), ignore_index, chunk_size,
                             False, launch)[0]
    return _LinearCrossEntropy.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(), ignore_index, chunk_size,
                                     launch)
