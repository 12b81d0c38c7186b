"""Documents packed along T (B = 1, `cu_seqlens` holding the N + 1 offsets) for the PyTorch paths and the
oracles: run each document on its own, or scatter them into a padded batch of one row per document.
Every recurrence here starts afresh at a document's first token, from that document's initial state.
The offsets are checked as they are read (`layout.check_offsets`, as the Triton path does). A sequence given as None
(the delta rule's absent gate) reaches `run` as None; the first (q), which gives the batch and the length, never is."""
from typing import Callable, Optional, Sequence, Tuple

import torch

from fabric_lin.ops.chunked.layout import check_offsets


def per_document(
    run: Callable, cu_seqlens: torch.Tensor, sequences: Sequence[torch.Tensor], initial_state: Optional[torch.Tensor],
    output_final_state: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`run(*document's slices, initial_state=..., output_final_state=True) -> (o, state)` document by document;
    the outputs concatenated along T, the final states stacked [N, ...] (or None)."""
    if sequences[0].shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {sequences[0].shape[0]}")
    outputs, states = [], []
    bounds = cu_seqlens.tolist()
    check_offsets(bounds, sequences[0].shape[1])
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[i : i + 1]
        o, ht = run(*(None if x is None else x[:, start:end] for x in sequences), initial_state=h0,
                    output_final_state=True)
        outputs.append(o)
        states.append(ht)
    return torch.cat(outputs, dim=1), (torch.cat(states) if output_final_state else None)


def as_padded_batch(
    run: Callable, cu_seqlens: torch.Tensor, sequences: Sequence[torch.Tensor], initial_state: Optional[torch.Tensor],
    output_final_state: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`run(*batch, initial_state=..., output_final_state=...) -> (o, state)` once, on a batch of one row per
    document, each padded with zeros at its end (the callers' padding changes neither the outputs before it
    nor the state); the outputs gathered back along T."""
    if sequences[0].shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {sequences[0].shape[0]}")
    device = sequences[0].device
    bounds = cu_seqlens.tolist()
    check_offsets(bounds, sequences[0].shape[1])
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # token t of document i lands at row i, position t - bounds[i]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    pos = torch.arange(sequences[0].shape[1], device=device) - torch.tensor(bounds[:-1], device=device)[doc]

    def to_batch(x):
        out = x.new_zeros(len(lengths), max(lengths, default=0), *x.shape[2:])
        out[doc, pos] = x[0]
        return out

    o, final = run(*(None if x is None else to_batch(x) for x in sequences), initial_state=initial_state,
                   output_final_state=output_final_state)
    return o[doc, pos].unsqueeze(0), final
