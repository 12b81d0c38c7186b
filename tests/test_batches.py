"""fabric_lin/batches.py: document boundaries from EOS, the packed loss (each document's loss as if alone), a
step's data fingerprint (the sum of per-sample checksums), and a data loader read epoch after epoch."""
import pytest
import torch

from fabric_lin.batches import CycleIterator, doc_boundaries
from fabric_lin.config import Config
from fabric_lin.model import GPT


def test_doc_boundaries_against_python_reference():
    eos = 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (3, 17), generator=g)
    ids[0, 4] = ids[0, 16] = ids[2, 0] = ids[2, 9] = eos
    expected = {0}
    flat = ids.flatten().tolist()
    for i, t in enumerate(flat):  # a document starts at each row start and after each EOS
        if i % 17 == 0:
            expected.add(i)
        if t == eos:
            expected.add(i + 1)
    expected.add(len(flat))
    got = doc_boundaries(ids, eos)
    assert got.dtype == torch.int32
    assert got.tolist() == sorted(expected)


def test_packed_loss_equals_per_document_losses():
    """cu_seqlens from EOS positions: the packed forward gives each document the loss it gets alone."""
    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1, vocab_size=64))
    eos = 2
    ids = torch.randint(3, 64, (2, 12))
    ids[0, 5] = eos  # row 0 = doc A (6 tokens incl. EOS) + doc B (6 tokens); row 1 = doc C
    targets = torch.randint(3, 64, (2, 12))
    from fabric_lin.batches import compute_loss

    packed = compute_loss(model, ids, targets, eos)
    pieces = [(ids[:1, :6], targets[:1, :6]), (ids[:1, 6:], targets[:1, 6:]), (ids[1:], targets[1:])]
    total = sum(model(x, targets=t) * t.numel() for x, t in pieces)
    torch.testing.assert_close(packed, total / targets.numel(), rtol=1e-5, atol=1e-5)


def test_batch_fingerprint_sums_per_sample_checksums():
    """Samples are told apart by their tokens and the tokens' order within them; which micro-batch or
    process (row order, split) a sample came in does not change the step's sum."""
    from fabric_lin.batches import batch_fingerprint

    batch = torch.arange(24).view(2, 12)
    reference = batch_fingerprint(batch)
    assert batch_fingerprint(batch.flip(0)) == reference  # rows in another order
    assert batch_fingerprint(batch[:1]) + batch_fingerprint(batch[1:]) == reference  # split over micro-batches
    changed = batch.clone()
    changed[1, 3] += 1
    assert batch_fingerprint(changed) != reference
    assert batch_fingerprint(batch.flip(1)) != reference  # tokens in another order within the samples
    swapped = batch.clone()
    swapped[0, 5], swapped[1, 5] = batch[1, 5], batch[0, 5]  # a token moved from one sample to the other
    assert batch_fingerprint(swapped) != reference
    assert batch_fingerprint(batch.to(torch.int32)) == reference  # stored dtype does not matter
    zeros = torch.zeros(1, 12, dtype=torch.int64)  # a sample of token 0 counts as any other
    assert batch_fingerprint(torch.cat([batch, zeros])) != reference


def test_cycle_iterator_reads_the_loader_again_and_again_and_names_an_empty_one():
    batches = CycleIterator([1, 2, 3])
    assert [next(batches) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match="^the data is too small$"):
        next(CycleIterator([], empty_error="the data is too small"))


def test_a_tokenizer_whose_eos_is_id_0_still_resets_the_state_at_each_document():
    """eos_id 0 is an EOS like any other (only None means no reset): the rows are laid end to end as one row, with a
    document starting after each 0."""
    from fabric_lin.batches import compute_loss

    calls = []

    def model(input_ids, targets, cu_seqlens=None):
        calls.append((input_ids, targets, cu_seqlens))
        return torch.tensor(0.0)

    ids = torch.tensor([[5, 0, 7, 8], [9, 9, 0, 4]])
    targets = ids + 1
    compute_loss(model, ids, targets, eos_id=0)
    input_ids, got_targets, cu_seqlens = calls.pop()
    assert input_ids.tolist() == [[5, 0, 7, 8, 9, 9, 0, 4]] and got_targets.tolist() == [[6, 1, 8, 9, 10, 10, 1, 5]]
    assert cu_seqlens.tolist() == [0, 2, 4, 7, 8]
    compute_loss(model, ids, targets, eos_id=None)  # no reset: the rows as they are, no boundaries
    input_ids, _, cu_seqlens = calls.pop()
    assert input_ids.shape == (2, 4) and cu_seqlens is None
