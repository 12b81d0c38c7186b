"""The model's fused path (the Triton ops it uses on CUDA) against its plain PyTorch path: the same
loss and the same gradient for every parameter. Without CUDA the kernels run in Triton's interpreter
(set before Triton is imported), in fp32; with CUDA both paths run on the GPU in fp32."""
import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fabric_lin.model as model_module  # noqa: E402
from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_FUNCTIONS = ("chunk_gla_from_logits", "rms_norm", "rms_norm_gated_linear", "swiglu_linear", "linear_cross_entropy")


def loss_and_grads(model, ids, targets):
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=targets)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gla-debug", "transformer-debug"])
def test_fused_path_matches_torch_path(monkeypatch, name):
    config = Config.from_name(name, num_layers=2)
    torch.manual_seed(0)
    model = GPT(config).to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (2, 80), device=DEVICE)
    targets = torch.roll(ids, -1, dims=1)
    targets[0, :5] = -100  # ignored positions go through both cross-entropies too

    monkeypatch.setattr(model_module, "use_fused", lambda x: False)
    ref_loss, ref_grads = loss_and_grads(model, ids, targets)

    monkeypatch.setattr(model_module, "use_fused", lambda x: True)
    for fn in FUSED_FUNCTIONS:  # the Triton implementations, also where "auto" would pick PyTorch (CPU)
        monkeypatch.setattr(model_module, fn, functools.partial(getattr(model_module, fn), backend="triton"))
    loss, grads = loss_and_grads(model, ids, targets)

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for param, ref in ref_grads.items():
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(grads[param], ref, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{param}: {m}")
