"""The Triton kernel behind fp8_matmul.py's row-by-row cast to e4m3: each program reads one row once, keeps it in
registers, finds its largest magnitude and writes the row in FP8 and its scale."""
from typing import Tuple

import torch
import triton
import triton.language as tl

from fabric_lin.ops.custom_op import kernel_op
from fabric_lin.ops.launch import next_power_of_2

FP8 = torch.float8_e4m3fn  # as fp8_matmul.py's
FP8_MAX = torch.finfo(FP8).max


@triton.jit
def _rowwise_fp8_kernel(x, q, scale, n_cols, row_stride, fp8_max, inv_fp8_max, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    b_x = tl.load(x + row * row_stride + cols, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(b_x), axis=0)
    # rounded as rowwise_fp8_ref's are (Triton's `/` is approximate): the same bits
    b_scale = tl.where(amax > 0, amax * inv_fp8_max, 1.0)
    b_q = tl.minimum(tl.maximum(tl.div_rn(b_x, b_scale), -fp8_max), fp8_max)
    tl.store(q + row * n_cols + cols, b_q.to(q.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)
    tl.store(scale + row, b_scale)


@kernel_op("rowwise_fp8")
def rowwise_fp8_triton(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()  # rows may be apart (the leading columns of a wider tensor), their elements not
    q = torch.empty(rows, cols, device=x.device, dtype=FP8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    if rows:
        block = next_power_of_2(cols)
        _rowwise_fp8_kernel[(rows,)](x, q, scale, cols, x.stride(0), FP8_MAX, 1.0 / FP8_MAX, BLOCK=block,
                                     num_warps=min(16, max(1, block // 512)))
    return q, scale


@rowwise_fp8_triton.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], 1, dtype=torch.float32)
