"""Gated DeltaNet's decay and write strength from their projections, per head and token, in fp32:

    g    = -exp(A_log) * softplus(a + dt_bias)     (the log decay, <= 0)
    beta = sigmoid(b)                              (the write strength, in (0, 1))

as flash-linear-attention's GatedDeltaNet forms them (its use_gate_in_kernel / use_beta_sigmoid_in_kernel).
"""
from typing import Tuple

import torch
import torch.nn.functional as F


def gdn_gate(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """a, b: [B, T, H]; A_log, dt_bias: [H]. Returns (g, beta), both [B, T, H] fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()
