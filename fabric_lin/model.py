"""The whole model in one file: norms, GLA attention, the transformer baseline's attention, MLP,
block and the language model. Tensor layout everywhere is [B, T, H, D].

GLA block (pre-norm, as flash-linear-attention's GLAForCausalLM):
    h   = x + attn(attn_norm(x))
    out = h + mlp(mlp_norm(h))
The last add is made by the next block's attn_norm (or the final norm), which reads both terms anyway: a
Block takes and returns (x, pending) with out = x + pending, pending = mlp(...) (zeros before the first).
"""
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fabric_lin.config import Config
from fabric_lin.ops.gla import chunk_gla, chunk_gla_from_logits, log_decay, recurrent_gla_step

# Fused Triton kernels for the training step on CUDA (fabric_lin/ops/); the plain PyTorch lines below
# are the reference and the CPU path. FABRIC_LIN_FUSED_OPS=0 turns the kernels off.
try:
    from fabric_lin.ops.cross_entropy import linear_cross_entropy
    from fabric_lin.ops.gla.fused_recurrent import fused_recurrent_gla_step
    from fabric_lin.ops.norm import rms_norm, rms_norm_gated_linear, rms_norm_linears
    from fabric_lin.ops.swiglu import swiglu_linear

    FUSED_OPS = os.environ.get("FABRIC_LIN_FUSED_OPS", "1") != "0"
except ImportError:  # no Triton on this platform
    FUSED_OPS = False


def use_fused(x: torch.Tensor) -> bool:
    return FUSED_OPS and x.is_cuda


class Linear(nn.Linear):
    """nn.Linear initialised N(0, std) with zero bias, so `reset_parameters` gives the model's init."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, std: float = 0.02):
        self.std = std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 0.02):
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """RMSNorm(x); with `residual`, h = x + residual is normalised and (RMSNorm(h), h) returned."""
        if use_fused(x):
            return rms_norm(x, self.weight, self.eps, residual)
        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        h_fp32 = h.float()
        y = (h_fp32 * torch.rsqrt(h_fp32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)
        return y if residual is None else (y, h)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in for input x: autocast's, where it is on, else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def normed_projections(
    norm: RMSNorm, x: torch.Tensor, linears: List[nn.Linear], residual: Optional[torch.Tensor] = None,
    side_by_side: bool = False,
):
    """[linear(norm(x)) for linear in linears] for bias-free linears; with `residual`, norm(x + residual) and
    also h = x + residual: (projections, h). On the fused path the normed activation is recomputed in the
    backward pass instead of being kept for the projections (one [tokens, hidden] tensor less per call).
    side_by_side: one tensor, the projections concatenated on the last dim."""
    if use_fused(x):
        return rms_norm_linears(x, norm.weight, norm.eps, [lin.weight for lin in linears], residual, compute_dtype(x),
                                side_by_side=side_by_side)
    normed = norm(x, residual)
    y, h = normed if residual is not None else (normed, None)
    outs = [lin(y) for lin in linears]
    if side_by_side:
        outs = torch.cat(outs, dim=-1)
    return (outs, h) if residual is not None else outs


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), x = the normed block stream."""

    def __init__(self, config: Config):
        super().__init__()
        d, i, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.gate_proj = Linear(d, i, std=std)
        self.up_proj = Linear(d, i, std=std)
        self.down_proj = Linear(i, d, std=std)

    def forward(self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), x + residual)."""
        if use_fused(x):
            # gate and up side by side in one tensor, whose gradient the SwiGLU kernel writes as one tensor
            # (no concatenation in the projections' backward); the activation is recomputed in the
            # backward pass rather than kept
            gate_up, h = normed_projections(norm, x, [self.gate_proj, self.up_proj], residual, side_by_side=True)
            return swiglu_linear(gate_up, self.down_proj.weight), h
        (gate, up), h = normed_projections(norm, x, [self.gate_proj, self.up_proj], residual)
        return self.down_proj(F.silu(gate) * up), h


class GatedLinearAttention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        d, std = config.hidden_size, config.initializer_range
        groups = config.num_heads // config.num_kv_heads
        self.q_proj = Linear(d, config.key_dim, std=std)
        self.k_proj = Linear(d, config.key_dim // groups, std=std)
        self.v_proj = Linear(d, config.value_dim // groups, std=std)
        self.g_proj = Linear(d, config.value_dim, std=std)  # output gate
        # low-rank forget gate: d -> 16 -> key width
        self.gk_proj = nn.Sequential(
            Linear(d, config.gate_low_rank_dim, std=std),
            Linear(config.gate_low_rank_dim, config.key_dim // groups, bias=True, std=std),
        )
        self.o_proj = Linear(config.value_dim, d, std=std)
        self.g_norm = RMSNorm(config.head_v_dim, eps=config.head_norm_eps)  # per head, before the gate

    def forward(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional["DecodeCache"] = None, layer: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(attention(norm(x + residual)), x + residual)."""
        c = self.config
        B, T, _ = x.shape
        groups = c.num_heads // c.num_kv_heads
        (q, k, v, gate_low_rank, g), h = normed_projections(
            norm, x, [self.q_proj, self.k_proj, self.v_proj, self.gk_proj[0], self.g_proj], residual
        )
        q = q.view(B, T, c.num_heads, c.head_k_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_k_dim)
        v = v.view(B, T, c.num_kv_heads, c.head_v_dim)
        gate_logits = self.gk_proj[1](gate_low_rank).view(B, T, c.num_kv_heads, c.head_k_dim)
        if groups > 1:  # key/value head h serves query heads h*groups ... h*groups + groups - 1
            k, v, gate_logits = (t.repeat_interleave(groups, dim=2) for t in (k, v, gate_logits))

        if cache is None:  # training: the log forget gate logsigmoid(logits) / normalizer is formed inside the op
            o, _ = chunk_gla_from_logits(q, k, v, gate_logits, c.gate_logit_normalizer, cu_seqlens=cu_seqlens)
        else:  # decoding from the cached state: one token, or a prompt
            gk = log_decay(gate_logits, c.gate_logit_normalizer)  # fp32, <= 0
            if T == 1:
                step = fused_recurrent_gla_step if use_fused(x) else recurrent_gla_step
                o, cache.layers[layer] = step(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], cache.layers[layer])
                o = o.unsqueeze(1)
            else:
                o, cache.layers[layer] = chunk_gla(q, k, v, gk, initial_state=cache.layers[layer], output_final_state=True)

        g = g.view(B, T, c.num_heads, c.head_v_dim)
        if use_fused(x):  # per-head RMSNorm times swish(gate) in one kernel, then o_proj; recomputed in backward
            return rms_norm_gated_linear(o.to(g.dtype), g, self.g_norm.weight, self.g_norm.eps, self.o_proj.weight), h
        o = (self.g_norm(o).float() * F.silu(g.float())).to(g.dtype)
        return self.o_proj(o.reshape(B, T, c.value_dim)), h


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding on [B, T, H, D], Llama's half-split convention."""
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Softmax attention with RoPE through SDPA: the Llama-style baseline."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        d, std = config.hidden_size, config.initializer_range
        head_dim = d // config.num_heads
        self.q_proj = Linear(d, d, std=std)
        self.k_proj = Linear(d, config.num_kv_heads * head_dim, std=std)
        self.v_proj = Linear(d, config.num_kv_heads * head_dim, std=std)
        self.o_proj = Linear(d, d, std=std)

    def forward(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional["DecodeCache"] = None, layer: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(attention(norm(x + residual)), x + residual)."""
        c = self.config
        B, T, d = x.shape
        head_dim = d // c.num_heads
        start = cache.position if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)
        (q, k, v), h = normed_projections(norm, x, [self.q_proj, self.k_proj, self.v_proj], residual)
        q = apply_rope(q.view(B, T, c.num_heads, head_dim), positions, c.rope_base)
        k = apply_rope(k.view(B, T, c.num_kv_heads, head_dim), positions, c.rope_base)
        v = v.view(B, T, c.num_kv_heads, head_dim)
        if cache is not None:
            if cache.layers[layer] is not None:
                k_past, v_past = cache.layers[layer]
                k, v = torch.cat([k_past, k], dim=1), torch.cat([v_past, v], dim=1)
            cache.layers[layer] = (k, v)
        groups = c.num_heads // c.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D] for SDPA
        if cu_seqlens is not None:
            # documents packed in one row (B=1): attend only within the same document
            doc = torch.searchsorted(cu_seqlens[1:].to(x.device), torch.arange(T, device=x.device), right=True)
            mask = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif cache is not None and T == 1:
            o = F.scaled_dot_product_attention(q, k, v)  # one new token sees every cached one
        elif cache is not None and start > 0:
            # a prompt appended to a cache: token i sees the past and new tokens up to itself
            total = k.shape[2]
            mask = torch.ones(T, total, dtype=torch.bool, device=x.device).tril(diagonal=total - T)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, d)), h


class Block(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GatedLinearAttention(config) if config.block_type == "gla" else CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, pending, cu_seqlens=None, cache=None, layer: int = 0):
        """(residual stream, pending) -> the same after this block. The stream's value after a block is
        stream + pending: the last sublayer's output is added by the next pre-norm kernel, which reads both
        anyway (no add of its own, and no sum of two gradients of the stream in the backward pass)."""
        # each sublayer applies its pre-norm together with its input projections (normed_projections);
        # h = x + pending in x's dtype (fp32 residual stream under bf16-mixed), the attention sees attn_norm(h)
        attn_out, h = self.attn(x, self.attn_norm, pending, cu_seqlens=cu_seqlens, cache=cache, layer=layer)
        mlp_out, h = self.mlp(h, self.mlp_norm, residual=attn_out)
        return h, mlp_out


@dataclass
class DecodeCache:
    """Per-layer decoding state: GLA keeps a [B, H, K, V] fp32 state (constant size),
    the transformer keeps growing (keys, values)."""

    layers: List = field(default_factory=list)
    position: int = 0


class GPT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        # Draws made while the submodules are constructed must not shift the generator: the model's
        # init is `reset_parameters()` below, so an eager build and a meta build followed by
        # `reset_parameters()` give the same weights for the same seed.
        with _preserve_rng():
            self.embeddings = Embedding(config.vocab_size, config.hidden_size, std=config.initializer_range)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.lm_head = None if config.tie_embeddings else Linear(
                config.hidden_size, config.vocab_size, std=config.initializer_range
            )
        if self.embeddings.weight.device.type != "meta":
            self.reset_parameters()
        # With compiled blocks: mark the batch and sequence dimensions dynamic, so that a new context
        # length or a smaller last batch reuses the compiled graph instead of compiling another one.
        self.dynamic_shapes = False

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embeddings.weight if self.lm_head is None else self.lm_head.weight

    def reset_parameters(self) -> None:
        """(Re)initialise every parameter, module by module in registration order."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def new_cache(self) -> DecodeCache:
        return DecodeCache(layers=[None] * self.config.num_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[DecodeCache] = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]; with `targets` [B, T], the mean cross-entropy
        (computed in chunks, the full fp32 logits are never held); with `return_hidden`, the final
        normed hidden states [B, T, d]."""
        x = self.embeddings(input_ids)
        # the first block's pending output: zeros in the dtype the sublayers' outputs have, so that every block
        # is called alike (a compiled Block reuses one graph; x + 0 is exactly x)
        pending = torch.zeros_like(x, dtype=compute_dtype(x))
        if self.dynamic_shapes and cache is None:
            for t in (x, pending):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
        for i, block in enumerate(self.layers):
            if cache is None:  # no per-layer int argument in training: a compiled Block would specialise on it
                x, pending = block(x, pending, cu_seqlens=cu_seqlens)
            else:
                x, pending = block(x, pending, cu_seqlens=cu_seqlens, cache=cache, layer=i)
        x, _ = self.norm(x, residual=pending)
        if cache is not None:
            cache.position += input_ids.shape[1]
        if return_hidden:
            return x
        if targets is not None:
            hidden, weight = x.flatten(0, 1), self.output_weight
            if use_fused(x):
                if torch.is_autocast_enabled("cuda"):  # the kernel is opaque to autocast: cast as autocast would
                    dtype = torch.get_autocast_dtype("cuda")
                    hidden, weight = hidden.to(dtype), weight.to(dtype)
                return linear_cross_entropy(hidden, weight, targets.flatten())
            return chunked_cross_entropy(hidden, weight, targets.flatten())
        return F.linear(x, self.output_weight)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 4096, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, one chunk of rows at a time.

    Each chunk's logits are recomputed in the backward pass (activation checkpointing), so at most
    [chunk_size, vocab] logits exist at once, forward or backward.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss_sum, h, weight, t, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, weight, t, ignore_index)
    count = (targets != ignore_index).sum().clamp(min=1)
    return total / count


def _chunk_loss_sum(h, weight, t, ignore_index):
    return F.cross_entropy(F.linear(h, weight).float(), t, ignore_index=ignore_index, reduction="sum")


class _preserve_rng:
    """Restore the CPU (and current CUDA device's) generator state on exit."""

    def __enter__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def __exit__(self, *exc):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
