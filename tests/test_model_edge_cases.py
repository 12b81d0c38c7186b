"""The model on configurations other than the shipped ones, against float64 references written here
from the model's own weights (a per-token GLA recurrence, plain softmax attention, each query head reading its
group's key/value head: every head layout of GLA, the transformer and the hybrids' attention layers), plus
causality, the analytic FLOPs against a direct count, and the errors that bad config values get."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fabric_lin.config import Config
from fabric_lin.flops import flops_per_token, matmul_params
from fabric_lin.model import GPT

# GLA: grouped key/value heads; hidden 60 is no multiple of 8 heads, heads of K=3 and V=15 (odd, K != V)
GLA_CONFIGS = {
    "gla-gqa-tied": dict(hidden_size=64, num_heads=4, num_kv_heads=2, tie_embeddings=True),
    "gla-mqa-odd-heads": dict(hidden_size=60, num_heads=8, num_kv_heads=1, expand_k=0.4, expand_v=2.0),
}
TRANSFORMER_CONFIGS = {
    "transformer-gqa": dict(hidden_size=64, num_heads=8, num_kv_heads=2),
    "transformer-mqa": dict(hidden_size=64, num_heads=4, num_kv_heads=1),
    "transformer-tied": dict(hidden_size=48, num_heads=4, tie_embeddings=True),
}
VOCAB = 101  # prime: no multiple of any padding


def build(name: str, **fields) -> GPT:
    base = name.split("-")[0] + "-debug"  # the family's debug model
    torch.manual_seed(0)
    model = GPT(Config.from_name(base, vocab_size=VOCAB, num_layers=2, **fields)).double().eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so that a missing one shows
        for name_, p in model.named_parameters():
            if name_.endswith("norm.weight") or name_.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def rms_norm(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def reference_gla_attention(attn, x):
    """Token by token: S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t, o_t = (q_t K^-0.5) S_t, in float64."""
    c = attn.config
    B, T, _ = x.shape
    H, K, V, groups = c.num_heads, c.head_k_dim, c.head_v_dim, c.num_heads // c.num_kv_heads
    q = (x @ attn.q_proj.weight.T).view(B, T, H, K)
    k = (x @ attn.k_proj.weight.T).view(B, T, -1, K)
    v = (x @ attn.v_proj.weight.T).view(B, T, -1, V)
    low, high = attn.gk_proj
    gk = (F.logsigmoid(x @ low.weight.T @ high.weight.T + high.bias) / c.gate_logit_normalizer).view(B, T, -1, K)
    g = (x @ attn.g_proj.weight.T).view(B, T, H, V)
    state = x.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        for h in range(H):
            kv = h // groups  # query head h reads key/value head h // groups
            state[:, h] = gk[:, t, kv].exp()[..., None] * state[:, h] + k[:, t, kv, :, None] * v[:, t, kv, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, state))
    o = torch.stack(outs, dim=1)
    o = rms_norm(o, attn.g_norm) * F.silu(g)
    return o.reshape(B, T, H * V) @ attn.o_proj.weight.T


def reference_softmax_attention(attn, x, heads: int, kv_heads: int):
    """Causal softmax attention with Llama's rotary embedding (rotate_half), from scratch in float64; query head h
    reads key/value head h // (heads // kv_heads)."""
    c = attn.config
    B, T, d = x.shape
    H, D, groups = heads, d // heads, heads // kv_heads
    q = (x @ attn.q_proj.weight.T).view(B, T, H, D)
    k = (x @ attn.k_proj.weight.T).view(B, T, -1, D)
    v = (x @ attn.v_proj.weight.T).view(B, T, -1, D)
    freq = c.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freq
    cos, sin = angle.cos().repeat(1, 2)[:, None], angle.sin().repeat(1, 2)[:, None]

    def rope(t):
        half = D // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rope(q), rope(k)
    head_of = torch.arange(H) // groups
    scores = torch.einsum("bihd,bjhd->bhij", q, k[:, :, head_of]) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v[:, :, head_of])
    return o.reshape(B, T, d) @ attn.o_proj.weight.T


def reference_logits(model, ids):
    x = model.embeddings.weight[ids]
    c = model.config
    for block in model.layers:
        a = block.attn
        normed = rms_norm(x, block.attn_norm)
        x = x + (reference_gla_attention(a, normed) if c.block_type == "gla" else
                 reference_softmax_attention(a, normed, c.num_heads, c.num_kv_heads))
        m, normed = block.mlp, rms_norm(x, block.mlp_norm)
        x = x + F.silu(normed @ m.gate_proj.weight.T) * (normed @ m.up_proj.weight.T) @ m.down_proj.weight.T
    head = model.embeddings.weight if model.config.tie_embeddings else model.lm_head.weight
    return rms_norm(x, model.norm) @ head.T


@pytest.mark.parametrize("name", [*GLA_CONFIGS, *TRANSFORMER_CONFIGS])
@pytest.mark.parametrize("T", [1, 63, 65, 130])  # around and across the chunk size 64
def test_forward_matches_float64_reference(name, T):
    model = build(name, **{**GLA_CONFIGS, **TRANSFORMER_CONFIGS}[name])
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        logits, expected = model(ids), reference_logits(model, ids)
    # the norms, the rotary embedding and the GLA op compute in fp32 whatever the input dtype
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2), (8, 4), (4, 1)])
@pytest.mark.parametrize("family", ["gla", "gdn", "deltanet"])
def test_a_hybrids_attention_layer_matches_float64_reference(family, heads, kv_heads):
    """The softmax-attention layer of a hybrid, with its own heads and key/value heads (grouped, and one shared),
    against the reference: the query heads of a group read their own key/value head."""
    model = build(f"{family}-hybrid", attn_layers=[1], attn_num_heads=heads, attn_num_kv_heads=kv_heads)
    block = model.layers[1]
    x = torch.randn(2, 37, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(heads))
    with torch.no_grad():
        _, out = block.attn(block.attn_norm, x, torch.zeros_like(x))
        expected = reference_softmax_attention(block.attn, rms_norm(x, block.attn_norm), heads, kv_heads)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [*GLA_CONFIGS, *TRANSFORMER_CONFIGS])
def test_a_later_token_does_not_change_earlier_logits(name):
    model = build(name, **{**GLA_CONFIGS, **TRANSFORMER_CONFIGS}[name])
    ids = torch.randint(0, VOCAB, (1, 130), generator=torch.Generator().manual_seed(0))
    for t in (0, 63, 64, 100, 129):  # first, either side of a chunk boundary, mid-chunk, last
        changed = ids.clone()
        changed[0, t] = (ids[0, t] + 1) % VOCAB
        with torch.no_grad():
            a, b = model(ids), model(changed)
        torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(a[:, t], b[:, t])  # the changed token itself is seen


# ---------------------------------------------------------------- FLOPs


def mm_flops_per_token(model, T=16):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(2, T, dtype=torch.long))
    return counter.get_total_flops() / (2 * T)


@pytest.mark.parametrize("name", [*GLA_CONFIGS, *TRANSFORMER_CONFIGS])
def test_matmul_flops_equal_a_direct_count(name):
    # Every matmul of the CPU forward pass outside the attention core (that runs as SDPA or the GLA op's
    # own arithmetic, which the counter does not see or does not see whole) is a Linear or the head.
    model = build(name, **{**GLA_CONFIGS, **TRANSFORMER_CONFIGS}[name])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.config.vocab_size * model.config.hidden_size if model.config.tie_embeddings else 0
    assert matmul_params(model.config) == sum(m.weight.numel() for m in linears) + head
    if name.startswith("transformer"):
        assert mm_flops_per_token(model) == 2 * matmul_params(model.config)


@pytest.mark.parametrize("name", [*GLA_CONFIGS, *TRANSFORMER_CONFIGS])
@pytest.mark.parametrize("T", [16, 128])
def test_attention_flops_equal_a_direct_count(name, T):
    # The attention core's matmuls written out densely and counted: q k^T and scores times v over the
    # whole context for softmax attention; for GLA the chunked form of chunk_torch.py's docstring
    # (whole C x C blocks, the inter-chunk output and the state update).
    c = build(name, **{**GLA_CONFIGS, **TRANSFORMER_CONFIGS}[name]).config
    H, B = c.num_heads, 1
    if c.block_type == "gla":
        K, V, C = c.head_k_dim, c.head_v_dim, min(64, T)
        q, k, v, S = torch.zeros(B, H, T // C, C, K), torch.zeros(B, H, T // C, C, K), torch.zeros(B, H, T // C, C, V), torch.zeros(B, H, K, V)
        with FlopCounterMode(display=False) as counter:
            for n in range(T // C):
                (q[:, :, n] @ k[:, :, n].transpose(-1, -2)) @ v[:, :, n]
                q[:, :, n] @ S
                k[:, :, n].transpose(-1, -2) @ v[:, :, n]
    else:
        D = c.hidden_size // H
        q, k, v = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
        with FlopCounterMode(display=False) as counter:
            (q @ k.transpose(-1, -2)) @ v
    core = counter.get_total_flops() / (B * T) * c.num_layers
    assert flops_per_token(c, T) == 3 * (2 * matmul_params(c) + core)


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "base, fields, names",
    [
        # softmax attention with rotary embeddings needs an even head dim
        ("transformer-debug", dict(hidden_size=12, num_heads=4), ["hidden_size", "num_heads", "even"]),
        # a zero width builds empty projections: an attention whose output is always zero
        ("gla-debug", dict(expand_v=0.0), ["expand_v"]),
        ("gla-debug", dict(expand_k=0.0), ["expand_k"]),
        ("gla-debug", dict(expand_k=-0.5), ["expand_k"]),
        ("gla-debug", dict(gate_low_rank_dim=0), ["gate_low_rank_dim"]),
        ("gla-debug", dict(gate_logit_normalizer=0), ["gate_logit_normalizer"]),
        ("gla-debug", dict(norm_eps=-1e-6), ["norm_eps"]),
        ("gla-debug", dict(head_norm_eps=-1e-5), ["head_norm_eps"]),
        ("gla-debug", dict(initializer_range=-0.02), ["initializer_range"]),
        ("transformer-debug", dict(rope_base=0.0), ["rope_base"]),
        ("gla-debug", dict(max_seq_length=0), ["max_seq_length"]),
        # a YAML value of the wrong type ("128" quoted, 2.0, a quoted "false" that would read as True)
        ("gla-debug", dict(hidden_size="128"), ["hidden_size", "'128'"]),
        ("gla-debug", dict(num_heads=2.0), ["num_heads", "2.0"]),
        ("gla-debug", dict(tie_embeddings="false"), ["tie_embeddings", "'false'"]),
        ("gla-debug", dict(num_layers=True), ["num_layers", "True"]),
        # the widths that must divide by num_heads name the config keys they come from
        ("gla-debug", dict(hidden_size=66, num_heads=4), ["hidden_size", "expand_k", "num_heads"]),
        ("transformer-debug", dict(hidden_size=130, num_heads=4), ["hidden_size", "num_heads"]),
        # a setting of another family, which this model's layers never read, would build another model than the
        # one asked for without a word
        ("deltanet-debug", dict(gate_low_rank_dim=32), ["gate_low_rank_dim", "32", "'deltanet'"]),
        ("gdn-debug", dict(gate_logit_normalizer=8), ["gate_logit_normalizer", "'gdn'"]),
        ("gdn-debug", dict(expand_k=1.0), ["expand_k", "'gdn'", "head_dim"]),
        ("transformer-debug", dict(conv_size=2), ["conv_size", "'transformer'"]),
        ("transformer-debug", dict(expand_v=2.0), ["expand_v", "'transformer'"]),
        ("gla-debug", dict(head_dim=64), ["head_dim", "'gla'"]),
        ("gla-debug", dict(conv_size=2), ["conv_size", "'gla'"]),
        ("deltanet-debug", dict(rope_base=500.0), ["rope_base", "attn_layers"]),
        # a layer listed twice is most likely a typo for another layer
        ("gla-debug", dict(attn_layers=[1, 1], attn_num_heads=2), ["attn_layers", "[1, 1]", "twice"]),
        # a count or width of zero, which would fail later with a division by zero or build an empty layer
        ("gla-debug", dict(num_kv_heads=0), ["num_kv_heads", "at least 1"]),
        ("deltanet-debug", dict(conv_size=0), ["conv_size", "at least 1"]),
        ("gdn-debug", dict(head_dim=0), ["head_dim", "got 0"]),
        ("gla-debug", dict(hidden_ratio=0), ["hidden_ratio", "positive"]),
        ("gla-debug", dict(hidden_ratio=None), ["hidden_ratio", "None"]),  # null in YAML, with no intermediate_size
        ("gla-debug", dict(expand_k=0.001), ["hidden_size * expand_k = 128 * 0.001 = 0", "num_heads=2"]),
        ("transformer-debug", dict(num_kv_heads=3), ["num_heads (4) must be a multiple of num_kv_heads (3)"]),
        # a hybrid's layers: each one of the model's, and softmax-attention heads that fit
        ("gla-debug", dict(attn_layers=[4], attn_num_heads=2), ["attn_layers [4] out of range", "0 .. 3"]),
        ("gla-debug", dict(attn_layers=[-1], attn_num_heads=2), ["attn_layers [-1] out of range"]),
        ("gla-debug", dict(attn_layers=[1], attn_num_heads=4, attn_num_kv_heads=3),
         ["attn_num_heads (4)", "attn_num_kv_heads (3)"]),
        ("gla-debug", dict(attn_layers=[1], attn_num_heads=128), ["hidden_size / attn_num_heads = 128 / 128", "even"]),
        ("gla-debug", dict(attn_num_heads=2), ["attn_num_heads", "attn_layers is empty"]),
    ],
)
def test_bad_config_values_are_named(base, fields, names):
    with pytest.raises(ValueError) as error:
        Config.from_name(base, **fields)
    for name in names:
        assert name in str(error.value), str(error.value)


def test_bad_value_in_model_config_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("name: x\nhidden_size: '128'\n")
    with pytest.raises(ValueError, match=r"model_config\.yaml.*hidden_size"):
        Config.from_file(path)


def test_accepted_values_of_other_types():
    # ints where floats are expected (YAML `expand_k: 1`), and a hidden_ratio that is unused
    # because intermediate_size is given (as Hugging Face configs may have it)
    c = Config.from_name("gla-debug", expand_k=1, expand_v=1, norm_eps=0, hidden_ratio=None, intermediate_size=384)
    assert (c.key_dim, c.intermediate_size) == (128, 384)
