"""fabric_lin/flops.py: the multiply-adds per token (the models' matrices) and the FLOPs per token against
independent arithmetic."""
import torch

from fabric_lin.config import Config
from fabric_lin.flops import flops_per_token, matmul_params
from fabric_lin.model import GPT


def test_matmul_params_equal_the_models_matrices():
    for name in ("gla-debug", "transformer-debug", "gla-340M"):
        config = Config.from_name(name)
        with torch.device("meta"):
            model = GPT(config)
        # every Linear weight is one multiply-add per token; the embedding is a lookup
        expected = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert matmul_params(config) == expected, name


def test_flops_per_token_gla_340m():
    config = Config.from_name("gla-340M")
    # independent arithmetic for d=1024, 24 layers, 4 heads of K=128, V=256, chunk 64, vocab 32000
    per_layer = 1024 * 512 * 2 + 1024 * 1024 * 2 + 1024 * 16 + 16 * 512 + 1024 * 1024 + 3 * 1024 * 2816
    n = 24 * per_layer + 1024 * 32000
    attention = 24 * 4 * (2 * 64 * (128 + 256) + 4 * 128 * 256)
    assert flops_per_token(config, 2048) == 3 * (2 * n + attention)
    t = Config.from_name("transformer-340M")
    assert flops_per_token(t, 2048) == 3 * (2 * matmul_params(t) + 24 * 4 * 2048 * 1024)


def test_peak_flops_by_device_name_and_precision(monkeypatch):
    # dense (no sparsity) peaks of NVIDIA's data sheets, TFLOP/s: H100 SXM 989 bf16/fp16 and 67 fp32, H100 PCIe 756 and
    # 51; as torch.cuda.get_device_name names them
    from fabric_lin.flops import peak_flops

    devices = {"NVIDIA H100 80GB HBM3": (989, 67), "NVIDIA H100 PCIe": (756, 51), "NVIDIA A100-SXM4-80GB": (312, 19.5)}
    for name, (half, single) in devices.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        for precision in ("bf16-mixed", "bf16-true", "16-mixed", "16-true"):
            assert peak_flops(torch.device("cuda", 0), precision) == half * 1e12, (name, precision)
        assert peak_flops(torch.device("cuda", 0), "32-true") == single * 1e12, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    assert peak_flops(torch.device("cuda", 0), "bf16-mixed") is None  # unknown: no MFU rather than a wrong one
    assert peak_flops(torch.device("cpu"), "32-true") is None
