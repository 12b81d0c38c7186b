"""The Gated DeltaNet family: configs and parameter counts as flash-linear-attention counts them, the init, the
short convolution and gate against independent formulas, decoding and packed documents against the full
forward, hybrids with softmax-attention layers, and the fused path against the PyTorch one."""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT, CausalSelfAttention, GatedDeltaNet  # noqa: E402
from fabric_lin.ops.gdn import gdn_gate  # noqa: E402
from fabric_lin.ops.short_conv import causal_conv1d  # noqa: E402
from helpers import (  # noqa: E402
    assert_decoding_equals_the_full_forward,
    assert_fused_path_matches_torch_path,
    assert_packed_documents_equal_separate_documents,
    eager_model_built_as_from_meta,
)


def tiny(**overrides) -> Config:
    return Config.from_name("gdn-debug", vocab_size=97, num_layers=2, **overrides)


def count_on_meta(config: Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def test_parameter_counts_match_flash_linear_attention():
    # fla's GatedDeltaNetForCausalLM counts, per layer: q, k d x H*K; v, g d x H*V; o H*V x d; a, b d x H; A_log,
    # dt_bias H; convolutions (2 H*K + H*V) x 4; head norm V; MLP 3 x d x 2816 (5632); two norms; then both
    # embeddings and the final norm. gdn-340M: H=4, K=128, V=256, d=1024; gdn-1.3B: H=6, K=256, V=512, d=2048
    def expected(d, layers, H, K, mlp):
        V = 2 * K
        attn = 2 * d * H * K + 3 * d * H * V + 2 * d * H + 2 * H + 4 * (2 * H * K + H * V) + V
        return layers * (attn + 3 * d * mlp + 2 * d) + 2 * 32000 * d + d

    assert expected(1024, 24, 4, 128, 2816) == 374_267_072 == count_on_meta(Config.from_name("gdn-340M"))
    assert expected(2048, 21, 6, 256, 5632) == 1_387_348_732 == count_on_meta(Config.from_name("gdn-1.3B"))


def test_gdn_config_errors_name_the_key():
    with pytest.raises(ValueError, match="needs head_dim"):
        Config(block_type="gdn", hidden_size=64, num_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads \\(1\\) must equal num_heads \\(2\\)"):
        Config(block_type="gdn", hidden_size=64, num_heads=2, head_dim=16, num_kv_heads=1)
    with pytest.raises(ValueError, match="head_dim \\* expand_v = 15 \\* 1.5"):
        Config(block_type="gdn", hidden_size=64, num_heads=2, head_dim=15, expand_v=1.5)
    with pytest.raises(ValueError, match="attn_layers \\[5\\] out of range"):
        tiny(attn_layers=[5], attn_num_heads=4)
    with pytest.raises(ValueError, match="attn_layers needs attn_num_heads"):
        tiny(attn_layers=[1])
    with pytest.raises(ValueError, match="a transformer is all attention"):
        Config.from_name("transformer-debug", attn_layers=[1], attn_num_heads=4)
    with pytest.raises(ValueError, match="attn_layers must be a list"):
        tiny(attn_layers="1")


def test_meta_build_then_reset_equals_eager_init_and_init_is_flas():
    config = tiny(attn_layers=[1], attn_num_heads=4)
    eager = eager_model_built_as_from_meta(config, seed=3)
    attn = eager.layers[0].attn
    assert isinstance(attn, GatedDeltaNet) and isinstance(eager.layers[1].attn, CausalSelfAttention)
    # A = exp(A_log) ~ U(0, 16); dt = softplus(dt_bias) in [1e-4, 0.1], log-uniform from 1e-3
    many = GPT(Config.from_name("gdn-debug", num_heads=64, head_dim=2, vocab_size=8, num_layers=1)).layers[0].attn
    A, dt = many.A_log.exp(), F.softplus(many.dt_bias)
    assert 0 < A.min() and A.max() < 16 and 4 < A.mean() < 12
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
    assert math.log(1e-3) - 0.5 < dt.log().mean() < math.log(0.1) + 0.5
    assert abs(attn.q_conv1d.weight.std().item() - 0.02) < 0.01 and attn.q_conv1d.weight.shape == (config.key_dim, 1, 4)
    assert attn.o_norm.eps == config.norm_eps == 1e-6



def test_decay_init_draws_flas_distributions():
    """4096 draws of A = exp(A_log) against U(0, 16) (Mamba2 draws A from U(1, 16): an easy mix-up) and of dt =
    softplus(dt_bias) against log-uniform on [1e-3, 0.1]: each empirical CDF within 0.04 of the exact one (the
    Kolmogorov-Smirnov distance that 4096 true draws exceed a few times in a million)."""
    torch.manual_seed(0)
    layer = GPT(Config.from_name("gdn-debug", num_heads=64, head_dim=2, vocab_size=8, num_layers=1)).layers[0].attn
    A, dt = [], []
    for _ in range(64):
        layer.reset_parameters()
        A.append(layer.A_log.detach().exp())
        dt.append(F.softplus(layer.dt_bias.detach()))
    A, dt = torch.cat(A).double().sort().values, torch.cat(dt).double().sort().values
    empirical = torch.arange(1, len(A) + 1, dtype=torch.float64) / len(A)

    def ks_distance(exact_cdf):
        return (empirical - exact_cdf).abs().max().item()

    assert ks_distance(A / 16) < 0.04
    assert ks_distance((dt.log() - math.log(1e-3)) / (math.log(0.1) - math.log(1e-3))) < 0.04

def test_short_convolution_equals_conv1d_and_continues_from_its_cache():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 11, 6, generator=g), torch.randn(6, 4, generator=g)
    reference = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=6)[..., :11]).transpose(1, 2)
    y, cache = causal_conv1d(x, w)
    torch.testing.assert_close(y, reference)
    torch.testing.assert_close(cache, x[:, -3:])
    first, cache = causal_conv1d(x[:, :5], w)  # a prompt, then one token at a time from the cache
    steps = [first]
    for t in range(5, 11):
        out, cache = causal_conv1d(x[:, t : t + 1], w, cache)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), reference)
    # documents packed along T start from zeros, as separate sequences
    docs = [x[:1, :3], x[:1, 3:4], x[:1, 4:11]]
    packed, _ = causal_conv1d(torch.cat(docs, 1), w, cu_seqlens=torch.tensor([0, 3, 4, 11]))
    torch.testing.assert_close(packed, torch.cat([causal_conv1d(d, w)[0] for d in docs], 1))


def test_gate_and_beta_formulas():
    a, b = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    A_log, dt_bias = torch.randn(3), torch.randn(3)
    g, beta = gdn_gate(a.bfloat16(), b.bfloat16(), A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    expected = -A_log.exp() * torch.log1p(torch.exp(a.bfloat16().float() + dt_bias))
    torch.testing.assert_close(g, expected)
    torch.testing.assert_close(beta, 1 / (1 + torch.exp(-b.bfloat16().float())))


@pytest.mark.parametrize("hybrid", [False, True])
def test_prefill_then_token_steps_equal_the_full_forward(hybrid):
    assert_decoding_equals_the_full_forward(tiny(attn_layers=[1], attn_num_heads=4) if hybrid else tiny())


@pytest.mark.parametrize("hybrid", [False, True])
def test_packed_documents_equal_separate_documents(hybrid):
    # cu_seqlens resets the delta state, the convolution window (and attention) at each document start
    assert_packed_documents_equal_separate_documents(tiny(attn_layers=[0], attn_num_heads=2) if hybrid else tiny())


def test_loss_and_gradients_equal_full_cross_entropy():
    torch.manual_seed(0)
    model = GPT(tiny())
    ids, targets = torch.randint(0, 97, (2, 70)), torch.randint(0, 97, (2, 70))
    loss = model(ids, targets=targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    reference = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    ref_grads = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        assert g.abs().sum() > 0, f"{name} gets no gradient"
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_fused_path_matches_torch_path():
    # the fused norms with their projections, SwiGLU and cross-entropy
    assert_fused_path_matches_torch_path(tiny(attn_layers=[1], attn_num_heads=4), seq_len=40)


@pytest.mark.parametrize("config", [Config.from_name("gdn-340M"), tiny(attn_layers=[1], attn_num_heads=4, attn_num_kv_heads=2)],
                         ids=["gdn-340M", "hybrid"])
def test_matmul_params_equal_the_models_matrices(config):
    from fabric_lin.flops import matmul_params

    with torch.device("meta"):
        model = GPT(config)
    # every Linear weight is one multiply-add per token; embeddings, convolutions, A_log and dt_bias are not
    assert matmul_params(config) == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_flops_per_token_gdn_340m_and_a_hybrid():
    from fabric_lin.flops import flops_per_token, matmul_params

    # independent arithmetic for d=1024, 24 layers, 4 heads of K=128, V=256, chunk 64, vocab 32000
    per_layer = 2 * 1024 * 512 + 2 * 1024 * 1024 + 2 * 1024 * 4 + 1024 * 1024 + 3 * 1024 * 2816
    n = 24 * per_layer + 1024 * 32000
    rule = 24 * 4 * (6 * 64 * 128 + 4 * 64 * 256 + 6 * 128 * 256 + 2 * 64 * 64 / 3)
    assert flops_per_token(Config.from_name("gdn-340M"), 2048) == pytest.approx(3 * (2 * n + rule), rel=1e-12)
    # a hybrid's attention layer costs what a transformer layer's attention does over the context
    hybrid, plain = tiny(attn_layers=[1], attn_num_heads=4), tiny()
    gdn_layer = 2 * (6 * 64 * 48 + 4 * 64 * 96 + 6 * 48 * 96 + 2 * 64 * 64 / 3)
    expected = 3 * (2 * matmul_params(hybrid) + 4 * 512 * 128 + gdn_layer)
    assert flops_per_token(hybrid, 512) == pytest.approx(expected, rel=1e-12)
    assert flops_per_token(plain, 512) == pytest.approx(3 * (2 * matmul_params(plain) + 2 * gdn_layer), rel=1e-12)


def test_a_log_and_dt_bias_take_no_weight_decay():
    from fabric_lin.model_setup import no_decay_parameter_names

    model = GPT(tiny(attn_layers=[1], attn_num_heads=4))
    names = no_decay_parameter_names(model)
    # every 1-D parameter (norm weights, A_log, dt_bias) and nothing else; convolution weights are decayed
    assert names == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert {"layers.0.attn.A_log", "layers.0.attn.dt_bias"} <= names and "layers.0.attn.q_conv1d.weight" not in names


@pytest.mark.parametrize("name", ["gdn-debug", "deltanet-debug"])
def test_fused_layer_convolves_q_k_and_v_in_one_launch_each_way(monkeypatch, name):
    # the fused projection writes q, k and v side by side in one tensor; one convolution over its channels
    # gives q, k and v as three tensors, and its backward one gradient for the projection
    from fabric_lin.ops import short_conv_triton

    calls = []
    for op in (short_conv_triton.conv_fwd, short_conv_triton.conv_bwd):
        def spy(*args, _fn=op.fn, _name=op.name):
            calls.append((_name, tuple(args[0].shape)))
            return _fn(*args)
        monkeypatch.setattr(op, "fn", spy)
    config = Config.from_name(name, vocab_size=97, num_layers=1)
    model = GPT(config, fused=True)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    model(ids, targets=torch.roll(ids, -1, dims=1)).backward()
    qkv = (1, 20, 2 * config.key_dim + config.value_dim)
    assert calls == [("causal_conv1d_fwd", qkv), ("causal_conv1d_bwd", qkv)]
    attn = model.layers[0].attn
    assert attn.q_conv1d.weight.grad.abs().sum() > 0 and attn.v_conv1d.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("prompt", [1, 65])
def test_fused_decoding_path_matches_full_forward(prompt):
    # the CUDA path (the Triton chunked prefill, convolution and decoding-step kernels; the interpreter on a CPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT(Config.from_name("gdn-debug", vocab_size=97, num_layers=1), fused=True).to(device).eval()
    ids = torch.randint(0, 97, (1, prompt + 3), generator=torch.Generator().manual_seed(prompt)).to(device)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :prompt], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(prompt, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
