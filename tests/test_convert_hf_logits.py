"""convert_to_hf's exports compute the logits flash-linear-attention defines for them: GLA (plain, grouped-query,
tied, another norm eps), Gated DeltaNet (plain, hybrid with softmax-attention layers, tied) and the transformer
baseline (multi-head, grouped-query), each against a reference written from fla's modeling code that reads only the
export's config.json and safetensors file and runs token by token in fp64."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fabric_lin.convert.hf import convert_to_hf
from fabric_lin.convert.model_dir import load_model_dir_weights
from fabric_lin.model import GPT
from helpers import make_model_dir, small_config


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def fla_mlp(x, p, eps):
    """fla's GatedMLP of a layer after its mlp_norm; p(name) gives that layer's weight."""
    h = rms(x, p("mlp_norm.weight"), eps)
    return (F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T


def fla_logits(x, w, eps):
    """The final norm and the head (the embeddings where tied) of fla's weights w."""
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embeddings.weight"]
    return rms(x, w["model.norm.weight"], eps) @ head.T


def fla_gla_reference_logits(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """GLAForCausalLM's forward as fla defines it, written from fla's modeling_gla.py / layers/gla.py
    and reading only config.json and the safetensors file: token-by-token recurrence in fp64."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(hf_dir / "model.safetensors").items()}
    eps, H = cfg["norm_eps"], cfg["num_heads"]
    groups = H // (cfg["num_kv_heads"] or H)
    x = F.embedding(input_ids, w["model.embeddings.weight"])
    B, T, d = x.shape
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: w[f"model.layers.{i}.{n}"]  # noqa: E731
        h = rms(x, p("attn_norm.weight"), eps)
        q, k, v, g = (h @ p(f"attn.{n}_proj.weight").T for n in "qkvg")
        gk = (h @ p("attn.gk_proj.0.weight").T) @ p("attn.gk_proj.1.weight").T + p("attn.gk_proj.1.bias")
        Dk, Dv = q.shape[-1] // H, v.shape[-1] // (H // groups)
        # fla: repeat(x, '... (h d) -> ... (h g) d', g=groups)
        q = q.view(B, T, H, Dk)
        k, gk = (t.view(B, T, H // groups, 1, Dk).expand(-1, -1, -1, groups, -1).reshape(B, T, H, Dk) for t in (k, gk))
        v = v.view(B, T, H // groups, 1, Dv).expand(-1, -1, -1, groups, -1).reshape(B, T, H, Dv)
        gk = F.logsigmoid(gk) / 16
        S = torch.zeros(B, H, Dk, Dv, dtype=torch.float64)
        o = torch.empty(B, T, H, Dv, dtype=torch.float64)
        for t in range(T):
            S = S * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * Dk**-0.5, S)
        o = rms(o, p("attn.g_norm_swish_gate.weight"), eps) * F.silu(g.view(B, T, H, Dv))
        x = x + o.reshape(B, T, H * Dv) @ p("attn.o_proj.weight").T
        x = x + fla_mlp(x, p, eps)
    return fla_logits(x, w, eps)


def rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE as Llama and fla's TransformerForCausalLM apply it, one 2x2 rotation per pair of dims: x[..., i]
    and x[..., i + D/2] of the token at position t turn by t * base^(-2i/D). x: [B, T, H, D]."""
    B, T, H, D = x.shape
    out = torch.empty_like(x)
    for t in range(T):
        for i in range(D // 2):
            angle = t * base ** (-2 * i / D)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, t, :, i], x[:, t, :, i + D // 2]
            out[:, t, :, i], out[:, t, :, i + D // 2] = a * c - b * s, b * c + a * s
    return out


def fla_transformer_reference_logits(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """TransformerForCausalLM's forward as fla defines it (pre-norm blocks, RoPE, causal softmax attention,
    SwiGLU), reading only config.json and the safetensors file; fp64, one query at a time."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(hf_dir / "model.safetensors").items()}
    eps, H, base = cfg["norm_eps"], cfg["num_heads"], cfg["rope_theta"]
    x = F.embedding(input_ids, w["model.embeddings.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: w[f"model.layers.{i}.{n}"]  # noqa: E731
        x = x + fla_attention_layer(rms(x, p("attn_norm.weight"), eps), p, H, cfg["num_kv_heads"] or H, base)
        x = x + fla_mlp(x, p, eps)
    return fla_logits(x, w, eps)


def fla_attention_layer(h: torch.Tensor, p, heads: int, kv_heads: int, base: float) -> torch.Tensor:
    """fla's Attention layer (no biases, RoPE, causal softmax over the whole context), fp64, one query at a time."""
    B, T, d = h.shape
    D, groups = d // heads, heads // kv_heads
    q, k, v = (h @ p(f"attn.{n}_proj.weight").T for n in "qkv")
    q, k = rotate(q.view(B, T, heads, D), base), rotate(k.view(B, T, kv_heads, D), base)
    v = v.view(B, T, kv_heads, D)
    o = torch.empty(B, T, heads, D, dtype=torch.float64)
    for head in range(heads):
        kv = head // groups  # query heads share their group's key/value head
        for t in range(T):
            scores = (k[:, : t + 1, kv] @ q[:, t, head, :, None])[..., 0] / math.sqrt(D)  # [B, t+1]
            o[:, t, head] = (scores.softmax(-1)[:, None, :] @ v[:, : t + 1, kv])[:, 0]
    return o.reshape(B, T, d) @ p("attn.o_proj.weight").T


def fla_gdn_reference_logits(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """GatedDeltaNetForCausalLM's forward as fla defines it, written from fla's layers/gated_deltanet.py and
    reading only config.json and the safetensors file: short causal convolutions with SiLU, per-head decay
    -exp(A_log) * softplus(a + dt_bias) and write strength sigmoid(b), q and k L2-normalised (eps 1e-6 under the
    square root), the delta rule token by token, the head norm times swish(g); fp64. The layers in `attn` are
    softmax attention."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(hf_dir / "model.safetensors").items()}
    eps, H, K = cfg["norm_eps"], cfg["num_heads"], cfg["head_dim"]
    V = int(K * cfg["expand_v"])
    attn = cfg.get("attn") or {"layers": []}
    x = F.embedding(input_ids, w["model.embeddings.weight"])
    B, T, d = x.shape

    def conv_silu(x, weight):  # weight [D, 1, W]: y_t = sum_j weight[:, j] * x_{t - W + 1 + j}
        W = weight.shape[-1]
        padded = torch.cat([x.new_zeros(B, W - 1, x.shape[-1]), x], dim=1)
        return F.silu(sum(weight[:, 0, j] * padded[:, j : j + T] for j in range(W)))

    def l2(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: w[f"model.layers.{i}.{n}"]  # noqa: E731
        h = rms(x, p("attn_norm.weight"), eps)
        if i in attn["layers"]:
            x = x + fla_attention_layer(h, p, attn["num_heads"], attn.get("num_kv_heads") or attn["num_heads"], attn["rope_theta"])
        else:
            q, k, v = (conv_silu(h @ p(f"attn.{n}_proj.weight").T, p(f"attn.{n}_conv1d.weight")) for n in "qkv")
            q, k, v = l2(q.view(B, T, H, K)), l2(k.view(B, T, H, K)), v.view(B, T, H, V)
            decay = -p("attn.A_log").exp() * F.softplus(h @ p("attn.a_proj.weight").T + p("attn.dt_bias"))
            beta = torch.sigmoid(h @ p("attn.b_proj.weight").T)
            S = torch.zeros(B, H, K, V, dtype=torch.float64)
            o = torch.empty(B, T, H, V, dtype=torch.float64)
            for t in range(T):
                S = S * decay[:, t].exp()[..., None, None]
                correction = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
                S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * correction[:, :, None, :]
                o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S)
            o = rms(o, p("attn.o_norm.weight"), eps) * F.silu((h @ p("attn.g_proj.weight").T).view(B, T, H, V))
            x = x + o.reshape(B, T, H * V) @ p("attn.o_proj.weight").T
        x = x + fla_mlp(x, p, eps)
    return fla_logits(x, w, eps)


def exported_and_our_logits(tmp_path: Path, config, length: int):
    """(the fla export's directory, token ids [2, length], our model's logits for them in fp64): the model of a model
    directory with random weights, written by convert_to_hf into tmp_path/hf."""
    make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    model = GPT(config)
    model.load_state_dict(load_model_dir_weights(tmp_path / "model"))
    ids = torch.randint(0, config.vocab_size, (2, length))
    with torch.no_grad():
        return tmp_path / "hf", ids, model(ids).double()


@pytest.mark.parametrize("overrides", [{}, {"attn_layers": [1], "attn_num_heads": 4, "attn_num_kv_heads": 2, "rope_base": 500.0},
                                       {"tie_embeddings": True, "head_dim": 32, "expand_v": 1.5}],
                         ids=["gdn", "gdn-hybrid", "gdn-tied"])
def test_exported_gdn_computes_fla_logits(tmp_path, overrides):
    config = small_config(block_type="gdn", **{"head_dim": 48, "expand_v": 2.0, **overrides})
    hf_dir, ids, ours = exported_and_our_logits(tmp_path, config, 70)  # more than one 64-token chunk
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "gated_deltanet" and cfg["architectures"] == ["GatedDeltaNetForCausalLM"]
    assert (cfg["head_dim"], cfg["num_heads"], cfg["use_gate"], cfg["use_short_conv"], cfg["conv_size"]) == (
        config.head_dim, 2, True, True, 4)
    ref = fla_gdn_reference_logits(hf_dir, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 2}], ids=["mha", "gqa"])
def test_exported_transformer_computes_fla_logits(tmp_path, overrides):
    config = small_config(block_type="transformer", num_heads=4, rope_base=500.0, **overrides)  # fast turns
    hf_dir, ids, ours = exported_and_our_logits(tmp_path, config, 40)
    ref = fla_transformer_reference_logits(hf_dir, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides", [{}, {"num_heads": 4, "num_kv_heads": 2, "tie_embeddings": True},
                                       {"norm_eps": 1e-5, "head_norm_eps": 1e-5}],  # Mistral's eps (convert_from_llama)
                         ids=["mha", "gqa-tied", "norm-eps-1e-5"])
def test_exported_model_computes_fla_logits(tmp_path, overrides):
    # fla's head norm eps is norm_eps; with head_norm_eps equal to it the two models are the same function
    config = small_config(**{"head_norm_eps": 1e-6, **overrides})
    hf_dir, ids, ours = exported_and_our_logits(tmp_path, config, 70)  # more than one 64-token chunk
    ref = fla_gla_reference_logits(hf_dir, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
