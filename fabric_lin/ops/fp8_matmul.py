"""Matrix products in FP8 with one scale per row, for the fused ops' projections (norm_triton.py, swiglu_triton.py).

    matmul_nt(a, b, fp8)   ->  a @ b.T        a [..., K], b [N, K], in a's dtype
    matmuls_nt(a, bs, fp8) ->  [a @ b.T for b in bs]
    matmul_nn(a, b, fp8)   ->  a @ b          b [N, K]: an input gradient through a weight

With fp8 both operands are cast to float8_e4m3fn, each row of a and each row of b with its own scale (its
largest magnitude maps to e4m3's largest, 448), and the product runs on the GPU's FP8 tensor cores
(torch._scaled_mm), accumulating in fp32 and scaling each output element by its row's and column's scales.
A fused op calls it for its forward product (the normed activation times the weight) and for its input
gradient (the output gradient times the weight: b is then the weight transposed, so that its scales run
along the input features); the weight gradient stays in bf16, from the recomputed activation, so nothing
more is kept for the backward pass than bf16 keeps (in FP8 its operands would need scales along the tokens: a cast
of each column over all of them, written transposed, which costs more than the faster product saves). `rowwise_fp8_ref` is the cast written in PyTorch, beside
the Triton kernel that makes it in one read of the row (`rowwise_fp8`).
"""
from typing import List, Sequence, Tuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def rowwise_fp8_ref(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x cast to e4m3 row by row, each row's scale [rows, 1] in fp32) for x [rows, cols]: x ~= q * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def rowwise_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """rowwise_fp8_ref, by a Triton kernel on CUDA tensors (one program per row)."""
    if not x.is_cuda:
        return rowwise_fp8_ref(x)
    from fabric_lin.ops.fp8_matmul_triton import rowwise_fp8_triton

    return rowwise_fp8_triton(x)


def matmul_nt(a: torch.Tensor, b: torch.Tensor, fp8: bool) -> torch.Tensor:
    """a @ b.T for a [..., K] and b [N, K], in a's dtype; with fp8, both cast row by row to e4m3 first."""
    return matmuls_nt(a, [b], fp8)[0]


def matmuls_nt(a: torch.Tensor, bs: Sequence[torch.Tensor], fp8: bool) -> List[torch.Tensor]:
    """[a @ b.T for b in bs] (one input, several projections), a cast to FP8 once."""
    if not fp8 or a.shape[-1] % 16:
        return [torch.matmul(a, b.t()) for b in bs]
    qa, sa = rowwise_fp8(a.reshape(-1, a.shape[-1]))
    outs = []
    for b in bs:
        if b.shape[0] % 16:  # FP8 products need widths in multiples of 16: a narrow gate projection stays as it is
            outs.append(torch.matmul(a, b.t()))
            continue
        qb, sb = rowwise_fp8(b)
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=a.dtype)
        outs.append(out.view(*a.shape[:-1], b.shape[0]))
    return outs


def matmul_nn(a: torch.Tensor, b: torch.Tensor, fp8: bool) -> torch.Tensor:
    """a @ b for a [..., N] and b [N, K] (an input gradient from a weight); with fp8 through matmul_nt on b
    transposed, whose row scales then run along the product's output features. Of N, the largest multiple of
    16 goes through FP8 and the remaining rows are added in a's dtype."""
    wide = b.shape[0] // 16 * 16
    if not fp8 or b.shape[1] % 16 or wide == 0:
        return torch.matmul(a, b)
    out = matmul_nt(a[..., :wide], b[:wide].t().contiguous(), True)
    if wide == b.shape[0]:
        return out
    a2, out2 = a.reshape(-1, a.shape[-1]), out.view(-1, out.shape[-1])
    return torch.addmm(out2, a2[:, wide:], b[wide:]).view(out.shape)
