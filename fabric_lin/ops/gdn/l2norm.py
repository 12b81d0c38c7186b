"""L2 normalisation of q and k over the head dimension, with flash-linear-attention's epsilon."""
import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32; [..., D] -> [..., D] fp32.

    eps sits inside the square root as in fla's l2norm_fwd (fla/modules/l2norm.py, default 1e-6),
    not as F.normalize's lower bound on the norm, so the two differ for short vectors.
    """
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
