"""fabric_lin/flops.py: the multiply-adds per token (the models' matrices) and the FLOPs per token against
independent arithmetic."""
import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.flops import flops_per_token, matmul_params
from fabric_lin.model import GPT


def test_matmul_params_equal_the_models_matrices():
    # every family, GLA with grouped key/value heads (its forget gate's low-rank output is per key/value head), and
    # hybrids, whose attention layers have heads of their own
    configs = [("gla-debug", {}), ("transformer-debug", {}), ("gla-340M", {}), ("gdn-debug", {}), ("deltanet-debug", {}),
               ("gla-debug", dict(num_heads=4, num_kv_heads=2)), ("transformer-debug", dict(num_kv_heads=2)),
               ("gla-debug", dict(attn_layers=[1], attn_num_heads=4, attn_num_kv_heads=2)),
               ("gdn-debug", dict(attn_layers=[0], attn_num_heads=2))]
    for name, overrides in configs:
        config = Config.from_name(name, **overrides)
        with torch.device("meta"):
            model = GPT(config)
        # every Linear weight is one multiply-add per token; the embedding is a lookup
        expected = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert matmul_params(config) == expected, (name, overrides)


def test_flops_per_token_gla_340m():
    config = Config.from_name("gla-340M")
    # independent arithmetic for d=1024, 24 layers, 4 heads of K=128, V=256, chunk 64, vocab 32000
    per_layer = 1024 * 512 * 2 + 1024 * 1024 * 2 + 1024 * 16 + 16 * 512 + 1024 * 1024 + 3 * 1024 * 2816
    n = 24 * per_layer + 1024 * 32000
    attention = 24 * 4 * (2 * 64 * (128 + 256) + 4 * 128 * 256)
    assert flops_per_token(config, 2048) == 3 * (2 * n + attention)
    t = Config.from_name("transformer-340M")
    assert flops_per_token(t, 2048) == 3 * (2 * matmul_params(t) + 24 * 4 * 2048 * 1024)


def test_flops_per_token_gdn_deltanet_and_a_hybrid():
    # independent arithmetic, per layer and head at chunk 64: the delta rule's 6*C*K + 4*C*V + 6*K*V + (2/3)*C*C;
    # GLA's 2*C*(K + V) + 4*K*V; a softmax-attention layer 4*T*d
    gdn = Config.from_name("gdn-debug")  # d = 128, 4 layers, 2 heads of K = 48, V = 96
    recurrence = 4 * 2 * (6 * 64 * 48 + 4 * 64 * 96 + 6 * 48 * 96 + 2 * 64 * 64 / 3)
    assert flops_per_token(gdn, 2048) == pytest.approx(3 * (2 * matmul_params(gdn) + recurrence), rel=1e-12)
    deltanet = Config.from_name("deltanet-debug")  # 2 heads of K = V = 64
    recurrence = 4 * 2 * (6 * 64 * 64 + 4 * 64 * 64 + 6 * 64 * 64 + 2 * 64 * 64 / 3)
    assert flops_per_token(deltanet, 2048) == pytest.approx(3 * (2 * matmul_params(deltanet) + recurrence), rel=1e-12)
    hybrid = Config.from_name("gla-debug", attn_layers=[1], attn_num_heads=4)  # GLA: 2 heads of K = 32, V = 64
    mixing = 3 * 2 * (2 * 64 * (32 + 64) + 4 * 32 * 64) + 4 * 2048 * 128
    assert flops_per_token(hybrid, 2048) == 3 * (2 * matmul_params(hybrid) + mixing)


def test_a_sequence_shorter_than_a_chunk_is_one_chunk_of_its_length():
    # 16 tokens at chunk size 64: the kernels' one chunk holds 16 positions, so C = 16 (gla-debug: 4 layers of 2 heads,
    # K = 32, V = 64)
    config = Config.from_name("gla-debug")
    recurrence = 4 * 2 * (2 * 16 * (32 + 64) + 4 * 32 * 64)
    assert flops_per_token(config, 16) == 3 * (2 * matmul_params(config) + recurrence)


def test_peak_flops_by_device_name_and_precision(monkeypatch):
    # dense (no sparsity) peaks of NVIDIA's data sheets, TFLOP/s: H100 SXM 989 bf16/fp16 and 67 fp32, H100 PCIe 756 and
    # 51, H200 as H100 SXM (the same compute); as torch.cuda.get_device_name names them
    from fabric_lin.flops import peak_flops

    devices = {"NVIDIA H100 80GB HBM3": (989, 67), "NVIDIA H100 PCIe": (756, 51), "NVIDIA A100-SXM4-80GB": (312, 19.5),
               "NVIDIA H200": (989, 67)}
    for name, (half, single) in devices.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        for precision in ("bf16-mixed", "bf16-true", "16-mixed", "16-true"):
            assert peak_flops(torch.device("cuda", 0), precision) == half * 1e12, (name, precision)
        assert peak_flops(torch.device("cuda", 0), "32-true") == single * 1e12, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    assert peak_flops(torch.device("cuda", 0), "bf16-mixed") is None  # unknown: no MFU rather than a wrong one
    assert peak_flops(torch.device("cpu"), "32-true") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None  # a CPU run beside a GPU: no GPU's peak
