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
from helpers import DEVICE  # noqa: E402

from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402


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
        # to 1e-4 of the gradient's own largest entry: a floor of 1e-4 absolute would pass a small one 10% off
        torch.testing.assert_close(grads[param], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                                   msg=lambda m: f"{param}: {m}")


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


@pytest.mark.parametrize("name", ["gla-debug", "gdn-debug"])
def test_every_kernel_op_is_launched_with_the_models_launch_settings(monkeypatch, name):
    # GPT(config, launch=Launches(...)): every kernel op of a training step and of decoding gets its family's
    # settings from the model (each op takes them last, as JSON), none falls back to the shipped ones. The
    # settings here differ from the shipped ones only where the kernels' results do not depend on them (warps)
    import dataclasses

    from fabric_lin.model import Launches
    from fabric_lin.ops import cross_entropy_triton, norm_triton, short_conv_triton, swiglu_triton
    from fabric_lin.ops.gdn import chunk as gdn_chunk, fused_recurrent as gdn_step
    from fabric_lin.ops.gla import chunk as gla_chunk, fused_recurrent as gla_step
    from fabric_lin.ops.launch import with_settings

    shipped = Launches()
    launch = Launches(
        gla=with_settings(shipped.gla, {"output.warps": 2, "step_warps": 2}),
        gdn=with_settings(shipped.gdn, {"output.warps": 2, "step_warps": 2}),
        norm=dataclasses.replace(shipped.norm, elements_per_thread=16),
        short_conv=dataclasses.replace(shipped.short_conv, warps=2),
        swiglu=dataclasses.replace(shipped.swiglu, warps=2),
        cross_entropy=dataclasses.replace(shipped.cross_entropy, warps=4),
    )
    family_of = {
        gla_chunk.chunk_gla_fwd: "gla", gla_chunk.chunk_gla_bwd: "gla", gla_step.recurrent_gla_step_kernel: "gla",
        gdn_chunk.chunk_gdn_fwd: "gdn", gdn_chunk.chunk_gdn_bwd: "gdn", gdn_step.gdn_step_kernel: "gdn",
        norm_triton.norm_fwd: "norm", norm_triton.norm_bwd: "norm",
        short_conv_triton.conv_fwd: "short_conv", short_conv_triton.conv_bwd: "short_conv",
        short_conv_triton.conv_step: "short_conv",
        swiglu_triton.swiglu_linear_fwd: "swiglu", swiglu_triton.swiglu_linear_bwd: "swiglu",
        cross_entropy_triton.linear_ce_fwd: "cross_entropy",
    }
    seen = []
    for op, family in family_of.items():
        def spy(*args, _fn=op.fn, _op=op, _family=family):
            seen.append((_op.name, _family, args[-1]))
            return _fn(*args)
        monkeypatch.setattr(op, "fn", spy)

    config = Config.from_name(name, num_layers=1, vocab_size=128)
    model = GPT(config, fused=True, launch=launch).to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    model(ids, targets=torch.roll(ids, -1, dims=1)).backward()
    with torch.no_grad():  # decoding: a prompt, then one token (the decoding step kernels)
        cache = model.new_cache()
        model(ids[:, :3], cache=cache)
        model(ids[:, 3:4], cache=cache)

    families = {"norm", "swiglu", "cross_entropy"} | ({"gla"} if name == "gla-debug" else {"gdn", "short_conv"})
    assert {family for _, family, _ in seen} == families, seen
    wrong = [(op, family) for op, family, text in seen if text != getattr(launch, family).as_json]
    assert not wrong, f"kernel ops launched with other settings than the model's: {wrong}"
    assert all(getattr(launch, family) != getattr(shipped, family) for family in families)
    step = "recurrent_gla_step" if name == "gla-debug" else "recurrent_gated_delta_rule_step"
    assert step in {op for op, _, _ in seen}


def test_offsets_rewritten_through_data_between_two_forwards_are_read_anew(monkeypatch):
    """A caller's cu_seqlens buffer, filled anew through .data (which leaves its version as it was) between two
    forward passes: the fused model follows the new documents as the PyTorch path does, the layers of each pass
    reading the offsets once. (The layout of the first offsets, kept by identity and version, was used for the second
    pass: the kernels wrote past the documents' ends.)"""
    from fabric_lin.ops.chunked import layout as layout_module

    reads = []
    read = layout_module.documents_layout
    monkeypatch.setattr(layout_module, "documents_layout", lambda cu, T, BT: reads.append(cu.tolist()) or read(cu, T, BT))
    fused, reference = fused_and_reference(Config.from_name("gla-debug", num_layers=2))
    ids = torch.randint(0, fused.config.vocab_size, (1, 130), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    cu = torch.tensor([0, 65, 130], dtype=torch.int32, device=DEVICE)  # documents of 65 and 65 rows
    with torch.no_grad():
        first = fused(ids, cu_seqlens=cu)
        cu.data.copy_(torch.tensor([0, 1, 130]))  # 1 and 129 rows: other chunks
        second = fused(ids, cu_seqlens=cu)
        expected = reference(ids, cu_seqlens=cu)
    assert reads == [[0, 65, 130], [0, 1, 130]]
    assert rel_rms(second, expected) < 1e-5 and rel_rms(first, second) > 1e-3
