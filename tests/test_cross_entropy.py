"""The fused linear + cross-entropy (the LM head's projection and the loss, the logits never whole in memory) against
its PyTorch reference and float64, values and gradients: ignored targets, several vocabulary blocks, float16 under
a loss scale, out-of-range targets, bad arguments. Without CUDA the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is imported), in fp32 (the loss-scale test in float16). The checks over every
fused op at once (compiled without graph breaks, the PyTorch paths against float64, bad shapes reported) are in
test_norm.py."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import rel_rms  # noqa: E402
from helpers import DEVICE, DTYPES, check, leaves  # noqa: E402

from fabric_lin.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref  # noqa: E402



@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    N, d, V = 37, 16, 300  # several row chunks, the last partial; one vocabulary block, partly padding
    hidden = torch.randn(N, d, generator=g).to(DEVICE, dtype)
    weight = (0.5 * torch.randn(V, d, generator=g)).to(DEVICE, dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[0, 5, 36]] = -100
    targets = targets.to(DEVICE)
    ref_in, out_in = leaves(hidden, weight), leaves(hidden, weight)
    ref = linear_cross_entropy_ref(*ref_in, targets)
    out = linear_cross_entropy(*out_in, targets, chunk_size=16, backend="triton")
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    (2.5 * ref).backward()
    (2.5 * out).backward()
    check(out_in[0].grad, ref_in[0].grad, dtype, "dhidden")
    check(out_in[1].grad, ref_in[1].grad, dtype, "dweight")


def test_linear_cross_entropy_float16_under_a_loss_scale():
    # 16-mixed: GradScaler multiplies the loss by 2**16, past float16's 65504, before the backward pass; and the
    # gradients of the mean over 256 rows (|weight| ~ 0.005: entries ~3e-5) would be float16 subnormals. The
    # scaled gradients come out finite and as precise as float16 holds them, against fp64.
    g = torch.Generator().manual_seed(6)
    N, d, V = 256, 16, 300
    hidden = torch.randn(N, d, generator=g).to(DEVICE, torch.float16)
    weight = (0.005 * torch.randn(V, d, generator=g)).to(DEVICE, torch.float16)
    targets = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    targets[:10] = -100
    for loss_scale in (2.0**16, 2.0**10):
        out_in, ref_in = leaves(hidden, weight), leaves(hidden.double(), weight.double())
        (linear_cross_entropy(*out_in, targets, backend="triton") * loss_scale).backward()
        (linear_cross_entropy_ref(*ref_in, targets) * loss_scale).backward()
        for name, a, b in zip(["dhidden", "dweight"], [x.grad for x in out_in], [x.grad for x in ref_in]):
            assert a.dtype == torch.float16 and torch.isfinite(a).all(), f"{name} at loss scale {loss_scale}"
            assert rel_rms(a, b) < 5e-4, f"{name} at loss scale {loss_scale}: relative RMS error {rel_rms(a, b):.2e}"


def test_linear_cross_entropy_without_grad_and_all_ignored():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(9, 8, generator=g).to(DEVICE), torch.randn(50, 8, generator=g).to(DEVICE)
    targets = torch.randint(0, 50, (9,), generator=g).to(DEVICE)
    with torch.no_grad():
        out = linear_cross_entropy(hidden, weight, targets, chunk_size=4, backend="triton")
    torch.testing.assert_close(out, F.cross_entropy(hidden @ weight.t(), targets), rtol=1e-5, atol=1e-5)
    ignored = torch.full((9,), -100, device=DEVICE)
    assert linear_cross_entropy(hidden, weight, ignored, backend="triton").item() == 0.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_cross_entropy_with_no_counted_target_is_zero_on_both_backends(backend):
    # every target ignored, or no rows: the mean over no rows is 0 with zero gradients, on either backend, not NaN on one and 0 on the other
    g = torch.Generator().manual_seed(13)
    hidden, weight = torch.randn(6, 8, generator=g).to(DEVICE), torch.randn(20, 8, generator=g).to(DEVICE)
    for n in (6, 0):
        h_in, w_in = leaves(hidden[:n], weight)
        loss = linear_cross_entropy(h_in, w_in, torch.full((n,), -100, device=DEVICE), backend=backend)
        assert loss.item() == 0.0, f"{n} rows: loss {loss.item()}"
        loss.backward()
        assert torch.equal(h_in.grad, torch.zeros_like(h_in)) and torch.equal(w_in.grad, torch.zeros_like(w_in))


@pytest.mark.parametrize("bad_target", [20, -1])
def test_linear_cross_entropy_does_not_turn_an_out_of_range_target_into_a_loss(bad_target):
    # a target outside [0, V) that is not ignore_index: the PyTorch path raises; the kernel, which cannot
    # raise without a host sync, gives NaN (which the training loop reports and skips) rather than
    # reading a logit outside the row
    g = torch.Generator().manual_seed(14)
    hidden, weight = torch.randn(4, 8, generator=g).to(DEVICE), torch.randn(20, 8, generator=g).to(DEVICE)
    targets = torch.tensor([1, bad_target, 3, -100], device=DEVICE)
    h_in, w_in = leaves(hidden, weight)
    loss = linear_cross_entropy(h_in, w_in, targets, backend="triton")
    assert torch.isnan(loss), f"target {bad_target} of a vocabulary of 20 gave the loss {loss.item()}"
    loss.backward()
    assert torch.isnan(h_in.grad[1]).all() and torch.isfinite(h_in.grad[[0, 2, 3]]).all()
    # on the CPU: on a GPU, PyTorch's cross-entropy fails a device-side assert, which ends the process's use of
    # the GPU (every later test in it would fail)
    with pytest.raises(IndexError, match=f"Target {bad_target} is out of bounds"):
        linear_cross_entropy(hidden.cpu(), weight.cpu(), targets.cpu(), backend="torch")


def test_linear_cross_entropy_rejects_a_bad_chunk_size_and_float_targets():
    hidden, weight, targets = torch.randn(4, 8), torch.randn(20, 8), torch.tensor([1, 2, 3, 4])
    for chunk_size in (0, -1):
        with pytest.raises(ValueError, match=f"chunk_size must be a positive int, got {chunk_size}"):
            linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, backend="triton")
    with pytest.raises(ValueError, match="targets must be integer class indices, got torch.float32"):
        linear_cross_entropy(hidden, weight, targets.float(), backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_cross_entropy_takes_targets_of_any_integer_dtype(backend):
    # int32 token ids (as a data pipeline may hold them) give the int64 targets' loss on both backends; the PyTorch
    # path raised 'expected target dtype to be Long or Byte' where the kernel took them
    g = torch.Generator().manual_seed(15)
    hidden, weight = torch.randn(5, 8, generator=g, dtype=torch.float64), torch.randn(20, 8, generator=g, dtype=torch.float64)
    targets = torch.tensor([1, 19, 0, -100, 7])
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    for dtype in (torch.int32, torch.int16):
        loss = linear_cross_entropy(hidden.float().to(DEVICE), weight.float().to(DEVICE), targets.to(DEVICE, dtype),
                                    backend=backend)
        torch.testing.assert_close(loss.double().cpu(), expected, rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_over_several_vocabulary_blocks():
    # V above the kernel's 4096-wide block: the running max and sum are merged across blocks, the last
    # one partial; rows whose largest logit lies in the first block, and in the second
    g = torch.Generator().manual_seed(15)
    N, d, V = 5, 8, 5001
    hidden = torch.randn(N, d, generator=g).to(DEVICE)
    weight = torch.randn(V, d, generator=g).to(DEVICE)
    weight[[7, 4900]] *= 4  # large logits in either block
    targets = torch.tensor([7, 4900, 4096, -100, 5000], device=DEVICE)
    h_in, w_in = leaves(hidden, weight)
    h_64, w_64 = leaves(hidden.double(), weight.double())
    out = linear_cross_entropy(h_in, w_in, targets, chunk_size=2, backend="triton")
    ref = F.cross_entropy(h_64 @ w_64.t(), targets)
    check(out, ref, torch.float32, "loss")
    out.backward()
    ref.backward()
    check(h_in.grad, h_64.grad, torch.float32, "dhidden")
    check(w_in.grad, w_64.grad, torch.float32, "dweight")
