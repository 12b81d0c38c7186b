"""What the training loop does with a batch: the loss (with packed documents' boundaries where the state
resets at EOS), per-sample checksums of the tokens for checking two runs saw the same data, and a data loader read
forever, epoch after epoch."""
from typing import Iterator, Optional

import torch

from fabric_lin.errors import InvalidValue


def compute_loss(model, input_ids: torch.Tensor, targets: torch.Tensor, eos_id: Optional[int]) -> torch.Tensor:
    if eos_id is None:
        return model(input_ids, targets=targets)
    # packed documents: flatten the micro-batch to one row and reset the state after each EOS
    cu_seqlens = doc_boundaries(input_ids, eos_id)
    return model(input_ids.reshape(1, -1), targets=targets.reshape(1, -1), cu_seqlens=cu_seqlens)


def doc_boundaries(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """cu_seqlens (int32, starting at 0, ending at B*T) for the rows of `input_ids` [B, T] laid end to
    end: a document starts at each row start and after each EOS token."""
    B, T = input_ids.shape
    flat = input_ids.reshape(-1)
    after_eos = torch.nonzero(flat == eos_id).flatten() + 1
    row_starts = torch.arange(0, B * T + 1, T, device=flat.device)
    bounds = torch.unique(torch.cat([row_starts, after_eos]))  # sorted; B*T appears once
    return bounds.to(torch.int32)


def batch_fingerprint(batch: torch.Tensor) -> torch.Tensor:
    """The sum of the batch's per-sample checksums (int64, computed on the device). Logged per step (summed
    over micro-batches and processes), it tells whether two runs trained each step on the same samples,
    however those were split over processes and micro-batches."""
    weights = torch.arange(1, batch.shape[-1] + 1, device=batch.device, dtype=torch.int64) * 1_000_003 + 7
    per_sample = ((batch.to(torch.int64) + 1) * weights).sum(-1)
    # a non-linear mix of each sample's sum, so that tokens swapped between two samples change the total
    mixed = (per_sample ^ (per_sample >> 29)) * 0x5851F42D4C957F2D
    return (mixed ^ (mixed >> 32)).sum()


class CycleIterator:
    """Iterate a dataloader forever, starting a new epoch when one ends (`empty_error` if a new one is empty)."""

    def __init__(self, iterable, empty_error: str = "the dataloader yields no batch"):
        self.iterable = iterable
        self.empty_error = empty_error
        self._iterator: Optional[Iterator] = None

    def __next__(self):
        if self._iterator is None:
            self._iterator = iter(self.iterable)
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.iterable)
            try:
                return next(self._iterator)
            except StopIteration:  # a whole epoch without a batch: the data is too small
                raise InvalidValue(self.empty_error) from None

    def __iter__(self):
        return self
