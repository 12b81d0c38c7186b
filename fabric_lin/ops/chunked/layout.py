"""How a batch is cut into chunks, on the host: the chunk size, where each chunk lies (`chunk_layout`), the grid
of a chunk-parallel launch, and the dtypes the chunked kernels compute and keep states in. No Triton here: the
PyTorch paths read CHUNK_SIZE too, and Triton does not import on every platform.

Tensors are [B, T, H, D]. With `cu_seqlens` (varlen: B = 1, N documents laid end to end, N + 1 offsets) a chunk
never crosses a document boundary: chunks are numbered over all documents, and each chunk's (document, chunk
within it) and each document's first chunk are what the kernels read.
"""
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from fabric_lin.ops.launch import cdiv

CHUNK_SIZE = 64
"""Rows per chunk, for every family and path. Not a tuning knob: GLA's scores take six levels of halves (64 rows
down to 2) and GDN's triangular solve works on four blocks of 16 rows (its kernel asserts it)."""


class ChunkLayout(NamedTuple):
    """Where the chunks of a batch lie."""

    sequences: int
    """N: the batch size, or the documents of cu_seqlens."""
    chunks: int
    """Chunks over all sequences."""
    chunk_indices: Optional[torch.Tensor]
    """Varlen only (else None): (document, chunk within it) of every chunk, int32 [chunks * 2]."""
    chunk_offsets: Optional[torch.Tensor]
    """Varlen only (else None): each document's first chunk, int32 [N + 1]."""


def check_offsets(bounds: List[int], T: int) -> None:
    """cu_seqlens read as a list: the N + 1 document offsets must rise from 0 to T. Checked where the offsets are
    read anyway (reading them from a GPU waits for it)."""
    if bounds[0] != 0 or bounds[-1] != T or any(e < s for s, e in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T} without falling, got {bounds}")


# The layouts made of the last few offsets tensors that `private_offsets` made. A model passes one such tensor to every
# layer's forward and backward op, and reading it on the host waits for the GPU, so each op after the first finds its
# layout here. A tensor the caller holds is read at every call instead: the caller may write it between two calls in a
# way that leaves its version as it was (through .data, or a NumPy view), and a layout of other offsets would send the
# kernels outside the documents, or outside the tensors.
_RECENT_LAYOUTS: List[Tuple[torch.Tensor, Dict[tuple, ChunkLayout]]] = []
_RECENT_KEPT = 4


def private_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A copy of cu_seqlens (int32, contiguous) that only fabric-lin holds, for a model to pass to all its layers: the
    chunked ops read its offsets on the host once, for every layer's forward and backward pass."""
    integer = not (cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool)
    # offsets of another dtype are copied as they are, for the ops' input checks to refuse by name
    offsets = cu_seqlens.to(dtype=torch.int32 if integer else cu_seqlens.dtype, memory_format=torch.contiguous_format,
                            copy=True)
    _RECENT_LAYOUTS.insert(0, (offsets, {}))
    del _RECENT_LAYOUTS[_RECENT_KEPT:]
    return offsets


def chunk_layout(cu_seqlens: Optional[torch.Tensor], B: int, T: int, BT: int = CHUNK_SIZE) -> ChunkLayout:
    """The chunks of B sequences of T rows, or of the documents of cu_seqlens (B = 1), in chunks of BT rows; for
    offsets made by `private_offsets` recently and not written since, the layout made at their first use."""
    if cu_seqlens is None:
        return ChunkLayout(B, B * cdiv(T, BT), None, None)
    made = next((layouts for offsets, layouts in _RECENT_LAYOUTS if offsets is cu_seqlens), None)
    if made is None:
        return documents_layout(cu_seqlens, T, BT)
    key = (cu_seqlens._version, B, T, BT)
    if key not in made:
        made[key] = documents_layout(cu_seqlens, T, BT)
    return made[key]


def documents_layout(cu_seqlens: torch.Tensor, T: int, BT: int) -> ChunkLayout:
    """The chunks of the documents of cu_seqlens, read from it (on the host)."""
    bounds = cu_seqlens.tolist()
    check_offsets(bounds, T)
    counts = [cdiv(e - s, BT) for s, e in zip(bounds[:-1], bounds[1:])]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    indices = [(n, t) for n, c in enumerate(counts) for t in range(c)]
    device = cu_seqlens.device
    chunk_indices = torch.tensor(indices, dtype=torch.int32, device=device).view(-1)
    chunk_offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    return ChunkLayout(len(counts), offsets[-1], chunk_indices, chunk_offsets)


def chunk_grid(cu_seqlens: Optional[torch.Tensor], layout: ChunkLayout, T: int, B: int, H: int, BT: int = CHUNK_SIZE):
    """The (chunk, batch*head) grid of a chunk-parallel kernel: (chunks, H) for varlen, else
    (chunks per sequence, B * H)."""
    return (layout.chunks, H) if cu_seqlens is not None else (cdiv(T, BT), B * H)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 inputs stay exact (no tf32); bf16/fp16 dots run on the tensor cores
    whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


def state_dtype(x: torch.Tensor, boundary_state: bool) -> torch.dtype:
    """dtype of the per-chunk states h and dh: fp32 when a state crosses the op's boundary (an initial state
    given, a final state's gradient flowing), where rounding them costs most relative accuracy; else the
    inputs' dtype (half the traffic for bf16)."""
    return torch.float32 if boundary_state else x.dtype
