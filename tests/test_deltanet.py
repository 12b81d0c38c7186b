"""The DeltaNet family: configs and parameter counts as flash-linear-attention counts them (and its model's
parameter names), the layer against a float64 delta rule written from its definition, decoding and packed
documents against the full forward, hybrids, the fused path against the PyTorch one, FLOPs, and the debug
recipe learning end to end. The export to fla's DeltaNetForCausalLM is compared in test_convert_fla_cpu.py."""
import importlib.util
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fabric_lin_process  # noqa: E402
from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT, CausalSelfAttention, DeltaNet  # noqa: E402
from helpers import (  # noqa: E402
    assert_decoding_equals_the_full_forward,
    assert_fused_path_matches_torch_path,
    assert_packed_documents_equal_separate_documents,
    eager_model_built_as_from_meta,
)

ROOT = Path(__file__).resolve().parents[1]


def tiny(**overrides) -> Config:
    return Config.from_name("deltanet-debug", vocab_size=97, num_layers=2, **overrides)


def count_on_meta(config: Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def test_parameter_counts_match_flash_linear_attention():
    # fla's DeltaNetForCausalLM, per layer: q, k, v, o d x d (expand_k = expand_v = 1); b d x H; convolutions
    # 3 d x 4; head norm d / H; MLP 3 x d x 2816 (5632 at d = 2048); two norms; then both embeddings and the
    # final norm. deltanet-340M: d=1024, 24 layers, 8 heads; deltanet-1.3B: d=2048, 24 layers, 16 heads
    def expected(d, layers, H, mlp):
        attn = 4 * d * d + d * H + 3 * d * 4 + d // H
        return layers * (attn + 3 * d * mlp + 2 * d) + 2 * 32000 * d + d

    assert expected(1024, 24, 8, 2816) == 374_362_112 == count_on_meta(Config.from_name("deltanet-340M"))
    assert expected(2048, 24, 16, 5632) == 1_365_677_056 == count_on_meta(Config.from_name("deltanet-1.3B"))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
def test_parameter_names_and_shapes_are_flas():
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    config = Config.from_name("deltanet-debug")
    with torch.device("meta"):
        theirs = DeltaNetForCausalLM(DeltaNetConfig(
            vocab_size=4096, hidden_size=128, num_heads=2, num_hidden_layers=4, expand_k=1, expand_v=1, hidden_ratio=4))
        ours = GPT(config)
    expected = {name.removeprefix("model."): tuple(p.shape) for name, p in theirs.named_parameters()}
    assert {name: tuple(p.shape) for name, p in ours.named_parameters()} == expected


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) must equal num_heads \(2\)"):
        Config(block_type="deltanet", hidden_size=64, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"hidden_size \* expand_k = 64 \* 0.3 = 19 must be a positive multiple of num_heads=2"):
        Config(block_type="deltanet", hidden_size=64, num_heads=2, expand_k=0.3)
    with pytest.raises(ValueError, match="block_type must be 'gla', 'gdn', 'deltanet' or 'transformer'"):
        Config(block_type="delta")


def test_meta_build_then_reset_equals_eager_init():
    config = tiny(attn_layers=[1], attn_num_heads=4)
    eager = eager_model_built_as_from_meta(config, seed=3)
    attn = eager.layers[0].attn
    assert isinstance(attn, DeltaNet) and isinstance(eager.layers[1].attn, CausalSelfAttention)
    assert abs(attn.q_proj.weight.std().item() - 0.02) < 0.005 and attn.o_norm.eps == config.norm_eps == 1e-6


def delta_rule_fp64(q, k, v, beta, scale):
    """The delta rule token by token in float64, from its definition, with q and k L2-normalised: S_t =
    S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T, o_t = S_t^T (scale q_t). q, k [B, T, H, K]; v [B, T, H, V]."""
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        correction = vt - torch.einsum("bhkv,bhk->bhv", S, kt)
        S = S + beta[:, t, :, None, None] * kt[..., None] * correction[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(outs, 1)


def test_the_layer_is_the_delta_rule_of_its_projections():
    # the layer's recurrence against the float64 delta rule on the same projections, convolutions and beta
    torch.manual_seed(0)
    config = tiny()
    block = GPT(config).layers[0]
    attn, norm = block.attn, block.attn_norm
    x = torch.randn(2, 100, config.hidden_size)
    captured = {}
    attn.o_norm.register_forward_hook(lambda module, inputs, output: captured.update(o=inputs[0]))
    with torch.no_grad():
        attn(norm, x, torch.zeros_like(x))  # the stream x + delta = x
        y = norm(x)
        q, _ = attn.q_conv1d(attn.q_proj(y))
        k, _ = attn.k_conv1d(attn.k_proj(y))
        v, _ = attn.v_conv1d(attn.v_proj(y))
        beta = attn.b_proj(y).float().sigmoid()
    H, K, V = config.num_heads, config.head_k_dim, config.head_v_dim
    expected = delta_rule_fp64(q.view(2, 100, H, K), k.view(2, 100, H, K), v.view(2, 100, H, V), beta, K ** -0.5)
    torch.testing.assert_close(captured["o"].double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hybrid", [False, True])
def test_prefill_then_token_steps_equal_the_full_forward(hybrid):
    assert_decoding_equals_the_full_forward(tiny(attn_layers=[1], attn_num_heads=4) if hybrid else tiny())


def test_packed_documents_equal_separate_documents():
    assert_packed_documents_equal_separate_documents(tiny())


def test_fused_path_matches_torch_path():
    # the fused norms with their projections, SwiGLU, convolutions, the delta rule's kernels and cross-entropy
    assert_fused_path_matches_torch_path(tiny(), seq_len=70)


def test_matmul_params_and_flops_per_token():
    from fabric_lin.flops import flops_per_token, matmul_params

    config = Config.from_name("deltanet-340M")
    with torch.device("meta"):
        model = GPT(config)
    assert matmul_params(config) == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # independent arithmetic for d=1024, 24 layers, 8 heads of K=V=128, chunk 64, vocab 32000
    per_layer = 4 * 1024 * 1024 + 1024 * 8 + 3 * 1024 * 2816
    n = 24 * per_layer + 1024 * 32000
    rule = 24 * 8 * (6 * 64 * 128 + 4 * 64 * 128 + 6 * 128 * 128 + 2 * 64 * 64 / 3)
    assert flops_per_token(config, 2048) == pytest.approx(3 * (2 * n + rule), rel=1e-12)


@pytest.mark.slow
def test_the_debug_recipe_learns(tmp_path):
    out = tmp_path / "out"
    cmd = [*fabric_lin_process.FABRIC_LIN, "pretrain", "--config", str(ROOT / "config_hub" / "debug_deltanet.yaml"),
           "--train.max_steps", "12", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
           "--train.max_seq_length", "96", "--train.lr_warmup_steps", "2", "--train.save_interval", "null",
           "--eval.initial_validation", "false", "--eval.final_validation", "false", "--logger_name", "csv",
           "--out_dir", str(out)]
    result = fabric_lin_process.run(cmd, 300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    losses = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1] - 0.5
    weights = torch.load(out / "final" / "lit_model.pth", map_location="cpu", weights_only=True)["model"]
    assert any(".attn.b_proj" in n for n in weights) and not any(".attn.a_proj" in n or "A_log" in n for n in weights)
