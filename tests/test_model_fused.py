"""The model's fused path (the Triton ops it uses on CUDA) against its plain PyTorch path: the same
loss and the same gradient for every parameter. Without CUDA the kernels run in Triton's interpreter
(set before Triton is imported), in fp32 (and float16 autocast, 16-mixed's); with CUDA both paths run on the
GPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from conftest import rel_rms  # noqa: E402

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


def loss_and_grads(model, ids, targets, loss_scale=1.0):
    """The loss and every parameter's gradient, the backward pass run on loss * loss_scale (as GradScaler does)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=targets)
    (loss * loss_scale).backward()
    return loss.detach(), {name: p.grad.detach() / loss_scale for name, p in model.named_parameters()}


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


def test_16_mixed_gradients_of_fast_forgetting_gates_near_fp32():
    # 16-mixed: float16 autocast, and GradScaler's first loss scale, 2**16 (past float16's 65504), on a GLA model
    # whose forget gates forget fast (gate bias -6: logsigmoid(-6) / 16 ~ -0.37 a step, ~12 over half a chunk,
    # where exp(12) is past 65504 too). Fused and PyTorch paths: the loss and every parameter's gradient finite
    # and within float16's precision of the fp32 model's (q_proj's and k_proj's, the least precise, ~1e-2 on
    # the PyTorch path; ~4e-2 there under bf16 autocast).
    config = Config.from_name("gla-debug", num_layers=1, vocab_size=512)
    fused, reference = fused_and_reference(config)
    with torch.no_grad():
        for model in (fused, reference):
            model.layers[0].attn.gk_proj[1].bias.fill_(-6.0)
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    targets = torch.roll(ids, -1, dims=1)
    ref_loss, ref_grads = loss_and_grads(reference, ids, targets)
    for path, model in (("torch", reference), ("fused", fused)):
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss, grads = loss_and_grads(model, ids, targets, loss_scale=2.0**16)
        assert torch.isfinite(loss) and abs(loss - ref_loss) < 1e-3 * ref_loss, (path, loss, ref_loss)
        bad = [name for name, g in grads.items() if not torch.isfinite(g).all()]
        assert not bad, f"{path}: gradients not finite: {bad}"
        errors = {name: rel_rms(grads[name], ref) for name, ref in ref_grads.items()}
        over = {name: f"{e:.2e}" for name, e in errors.items() if not e < 2e-2}
        assert not over, f"{path}: relative RMS error against fp32 above 2e-2: {over}"


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
