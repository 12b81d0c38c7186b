"""GLA's forget gate in log space: logsigmoid(gate_logits) / normalizer, in fp32.

Written as an autograd Function so that the backward pass keeps the gate logits in their own dtype
(bf16 in training), where `F.logsigmoid(x.float())` would keep the fp32 copy: half the bytes.
"""
import torch
import torch.nn.functional as F


class _LogDecay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, normalizer: float) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.normalizer = normalizer
        return F.logsigmoid(logits.float()) / normalizer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        # d/dx logsigmoid(x) = sigmoid(-x)
        return (grad * torch.sigmoid(-logits.float()) / ctx.normalizer).to(logits.dtype), None


def log_decay(gate_logits: torch.Tensor, normalizer: float = 16.0) -> torch.Tensor:
    """logsigmoid(gate_logits) / normalizer as fp32 (every value <= 0: the per-step log decay gk)."""
    return _LogDecay.apply(gate_logits, float(normalizer))
