"""The model's fused path (the Triton ops it uses on CUDA) against its plain PyTorch path: the same
loss and the same gradient for every parameter. Without CUDA the kernels run in Triton's interpreter
(set before Triton is imported), in fp32; with CUDA both paths run on the GPU in fp32."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused_and_reference(config):
    """The model built on the fused kernels and on the PyTorch references, with the same weights."""
    torch.manual_seed(0)
    reference = GPT(config, fused=False).to(DEVICE)
    fused = GPT(config, fused=True).to(DEVICE)
    fused.load_state_dict(reference.state_dict())
    return fused, reference


def loss_and_grads(model, ids, targets):
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=targets)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gla-debug", "transformer-debug"])
def test_fused_path_matches_torch_path(name):
    config = Config.from_name(name, num_layers=2)
    fused, reference = fused_and_reference(config)
    ids = torch.randint(0, config.vocab_size, (2, 80), device=DEVICE)
    targets = torch.roll(ids, -1, dims=1)
    targets[0, :5] = -100  # ignored positions go through both cross-entropies too

    ref_loss, ref_grads = loss_and_grads(reference, ids, targets)
    loss, grads = loss_and_grads(fused, ids, targets)

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for param, ref in ref_grads.items():
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(grads[param], ref, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{param}: {m}")


@pytest.mark.parametrize("dynamic", [True, False])
def test_compiled_blocks_do_not_recompile_for_new_batch_or_length(dynamic):
    # Regional compilation as the trainer does it, on the fused path (as on CUDA: the GLA op is opaque
    # to the compiler). The eager backend: what is tested is Dynamo's guards, which shapes a compiled
    # graph accepts. With dynamic_shapes a new batch size or context length reuses the first graph;
    # with specialised shapes each one compiles anew (the control). Two layers: every block, the first one
    # included, is called alike and reuses the same graph.
    from fabric_lin.metrics import compiled_graphs

    torch._dynamo.reset()
    config = Config.from_name("gla-debug", num_layers=2)
    model = GPT(config, fused=True).to(DEVICE)
    for block in model.layers:
        block.compile(backend="eager")
    model.dynamic_shapes = dynamic
    before = compiled_graphs()
    with torch.no_grad():  # the forward's guards decide; the interpreter makes every kernel slow
        for batch, length in [(2, 40), (3, 100)]:
            ids = torch.randint(0, config.vocab_size, (batch, length), device=DEVICE)
            model(ids, return_hidden=True)
    graphs = compiled_graphs() - before
    torch._dynamo.reset()
    assert graphs == (1 if dynamic else 2), graphs
