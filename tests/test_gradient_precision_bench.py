"""benchmarks/gradient_precision.py on the CPU with a one-layer debug model (fla's peer needs a GPU): the per-kind
error and cosine are those of the tensors' own gradients, the kinds cover every parameter, and bf16's rounding shows
as an error that is small but not zero."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gradient_precision  # noqa: E402
import learning_parity  # noqa: E402

from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402


def test_a_kind_gathers_every_layer_and_its_error_is_over_all_of_them():
    reference = {"blocks.0.w": torch.tensor([3.0, 0.0]), "blocks.1.w": torch.tensor([0.0, 4.0]),
                 "head": torch.tensor([1.0, 1.0])}
    grads = {"blocks.0.w": torch.tensor([3.0, 0.0]), "blocks.1.w": torch.tensor([0.0, 5.0]),
             "head": torch.tensor([-1.0, -1.0])}
    kinds = gradient_precision.compare(grads, reference)
    assert set(kinds) == {"blocks.*.w", "head"}
    # |(0, 0, 0, 1)| / |(3, 0, 0, 4)| = 1 / 5; cosine (3 * 3 + 5 * 4) / (sqrt(34) * 5)
    assert kinds["blocks.*.w"]["relative_error"] == pytest.approx(0.2)
    assert kinds["blocks.*.w"]["cosine"] == pytest.approx(29 / (5 * 34 ** 0.5))
    assert kinds["head"] == pytest.approx({"relative_error": 2.0, "cosine": -1.0})


def test_a_cpu_run_reports_every_parameter_kind_with_bf16_rounding_errors(tmp_path, monkeypatch):
    one_layer = lambda name: Config.from_name(name, num_layers=1)  # noqa: E731
    monkeypatch.setattr(gradient_precision, "Config", SimpleNamespace(from_name=one_layer))
    report = gradient_precision.main(["--model", "gla-debug", "--after", "1", "--data", "sample", "--batch_size", "2",
                                      "--seq_len", "32", "--out", str(tmp_path / "g.json"),
                                      "--peers", "reference-bf16", "ours-reference-attention", "ours-unfused-projections"])
    expected_kinds = {gradient_precision.parameter_kind(n) for n, _ in GPT(one_layer("gla-debug")).named_parameters()}
    assert set(report["models"]) == {"ours", "reference-bf16", "ours-reference-attention", "ours-unfused-projections"}
    for name in report["models"]:
        kinds = report["models"][name]["kinds"]
        assert set(kinds) == expected_kinds
        errors = [k["relative_error"] for k in kinds.values()]
        assert all(0 < e < 0.1 for e in errors), kinds
        assert all(k["cosine"] > 0.99 for k in kinds.values())
        assert report["models"][name]["loss"] == pytest.approx(report["fp32"]["loss"], rel=1e-2)
    assert (tmp_path / "g.json").exists()


def test_fla_is_refused_on_the_cpu():
    with pytest.raises(SystemExit, match="fla"):
        gradient_precision.main(["--peers", "fla", "--device", "cpu"])


def test_the_bisecting_peers_put_one_part_back_on_its_reference_and_keep_the_weights():
    config = Config.from_name("gla-debug", num_layers=2)
    fused = GPT(config, fused=True)
    attention = learning_parity.part_peer(fused, config, "ours-reference-attention")
    projections = learning_parity.part_peer(fused, config, "ours-unfused-projections")
    only_attention = learning_parity.part_peer(fused, config, "reference-our-attention")
    for block in attention.layers:
        assert block.attn.backend == "torch" and block.attn.fused_linears and block.mlp.fused_linears
        assert block.mlp.backend == "triton" and block.attn_norm.backend == "triton"
    for block in projections.layers:
        assert block.attn.backend == "triton"
        assert not block.attn.fused_linears and not block.mlp.fused_linears
    for block in only_attention.layers:
        assert block.attn.backend == "triton" and not block.attn.fused_linears and not block.mlp.fused_linears
        assert block.mlp.backend == "torch" and block.attn_norm.backend == "torch"
    assert not only_attention.fused
    for copy in (attention, projections, only_attention):
        for (name, p), (_, q) in zip(fused.state_dict().items(), copy.state_dict().items()):
            assert torch.equal(p, q), name


def test_the_gla_op_is_compared_at_the_layers_asked_from_the_inputs_it_met(tmp_path, monkeypatch):
    two_layers = lambda name: Config.from_name(name, num_layers=2)  # noqa: E731
    monkeypatch.setattr(gradient_precision, "Config", SimpleNamespace(from_name=two_layers))
    report = gradient_precision.main(["--model", "gla-debug", "--data", "sample", "--batch_size", "2", "--seq_len", "64",
                                      "--op_layers", "1"])
    assert list(report["gla_op"]) == ["layer 1"]
    assert set(report["models"]["ours"]["layers"]) == {"0", "1", "outside the layers"}
    errors = report["gla_op"]["layer 1"]["reference-bf16"]
    assert set(errors) == {"o", "dq", "dk", "dv", "dgate_logits"}
    assert all(0 < e < 0.05 for e in errors.values()), errors
    # the recording wrapper is gone after the run
    assert gradient_precision.fabric_lin.model.chunk_gla_from_logits is gradient_precision.chunk_gla_from_logits


def test_an_op_run_starts_from_fresh_gradients_each_time():
    torch.manual_seed(0)
    q, k, gate = (torch.randn(1, 64, 2, 16) for _ in range(3))
    call = {"inputs": [q, k, torch.randn(1, 64, 2, 32), gate], "normalizer": 16.0, "do": torch.randn(1, 64, 2, 32)}
    first = gradient_precision.op_gradients(call, "torch", autocast=False, fp32=False)
    second = gradient_precision.op_gradients(call, "torch", autocast=False, fp32=False)
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert all(t.grad is None for t in call["inputs"])
