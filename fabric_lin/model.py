"""The whole model in one file: norms, GLA attention, Gated DeltaNet attention, the transformer baseline's
attention, MLP, block and the language model. Tensor layout everywhere is [B, T, H, D].

Block (pre-norm, as flash-linear-attention's GLAForCausalLM and GatedDeltaNetForCausalLM):
    h   = x + attn(attn_norm(x))
    out = h + mlp(mlp_norm(h))
Each pre-norm also makes the add in front of it: a Block takes the residual stream as a pair (x, delta),
the stream being x + delta, and each sublayer returns (x + delta, its output), so that the norm kernel,
which reads both terms anyway, writes the sum (no add of its own, and no sum of two gradients of the
stream in the backward pass).

`GPT(config, fused=True)` runs the training step on fused Triton kernels (CUDA, or Triton's interpreter on
the CPU), `fused=False` on their PyTorch references (any device). The choice is made once, here: every
module keeps the backend its ops are called with, and each formula is written once, in fabric_lin/ops/. So is
how the kernels are launched: `GPT(config, launch=Launches(...))`, one launch-settings value per kernel family,
each module keeping its family's and handing it to every op it calls.
The fused kernels also make the matrix products around them (a norm and the projections after it, SwiGLU
and the down projection) and read the Linear layers' weights directly; `fp8_products=True` makes those products in
FP8 (fabric_lin/ops/fp8_matmul.py); `float8=True` calls the Linear layers as modules instead, so that
fabric_lin/fp8.py can swap them for torchao's FP8 ones.
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.ops.chunked.layout import private_offsets
from fabric_lin.ops.cross_entropy import linear_cross_entropy
from fabric_lin.ops.fused_launch import CrossEntropyLaunch, NormLaunch, ShortConvLaunch, SwiGLULaunch
from fabric_lin.ops.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule_step, gdn_gate
from fabric_lin.ops.gdn.launch import GDNLaunch
from fabric_lin.ops.gla import chunk_gla, chunk_gla_from_logits, fused_recurrent_gla_step, log_decay
from fabric_lin.ops.gla.launch import GLALaunch
from fabric_lin.ops.norm import rms_norm, rms_norm_gated, rms_norm_gated_linear, rms_norm_linears
from fabric_lin.ops.short_conv import causal_conv1d, causal_conv1d_split
from fabric_lin.ops.swiglu import swiglu, swiglu_linear


# the indices nn.Embedding takes; ids stored smaller (a prepared directory's uint16) the caller converts, as
# pretrain does
TOKEN_ID_DTYPES = (torch.int64, torch.int32)


def backend_of(fused: bool) -> str:
    return "triton" if fused else "torch"


@dataclass(frozen=True)
class Launches:
    """How the model's Triton kernels are launched: one immutable value per kernel family, each defaulting to the
    family's shipped settings (fabric_lin/ops/gla/tune.py searches GLA's). The PyTorch path ignores them."""

    gla: GLALaunch = GLALaunch()
    gdn: GDNLaunch = GDNLaunch()
    norm: NormLaunch = NormLaunch()
    short_conv: ShortConvLaunch = ShortConvLaunch()
    swiglu: SwiGLULaunch = SwiGLULaunch()
    cross_entropy: CrossEntropyLaunch = CrossEntropyLaunch()


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
    def __init__(self, dim: int, eps: float = 1e-6, fused: bool = False, launch: NormLaunch = NormLaunch()):
        super().__init__()
        self.eps = eps
        self.backend = backend_of(fused)
        self.launch = launch
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """RMSNorm(x); with `residual`, h = x + residual is normalised and (RMSNorm(h), h) returned."""
        return rms_norm(x, self.weight, self.eps, residual, backend=self.backend, launch=self.launch)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in for input x: autocast's, where it is on, else x's. Meta tensors (a model
    built on the meta device, run for its shapes) have no autocast, and torch refuses to be asked of it."""
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def prenorm_projections(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, linears: List[nn.Linear],
                        fused_linears: bool, fp8: bool = False, groups: Optional[List[int]] = None):
    """(x + delta, [linear(norm(x + delta)) for linear in linears]) for bias-free linears. fused_linears: one
    kernel makes the norm and a matrix product makes the projections from the weights, the normed activation
    recomputed in the backward pass instead of being kept for them (one [tokens, hidden] tensor less per call),
    with fp8 in FP8 (fabric_lin/ops/fp8_matmul.py), and `groups` of consecutive projections come out side by side
    (rms_norm_linears); else the norm, then each Linear module."""
    if fused_linears:
        outs, h = rms_norm_linears(x, norm.weight, norm.eps, [lin.weight for lin in linears], residual=delta,
                                   dtype=compute_dtype(x), backend="triton", launch=norm.launch, fp8=fp8, groups=groups)
        return h, outs
    y, h = norm(x, residual=delta)
    return h, [lin(y) for lin in linears]


def gated_output(o: torch.Tensor, g: torch.Tensor, norm: RMSNorm, o_proj: nn.Linear, fused_linears: bool,
                 fp8: bool = False) -> torch.Tensor:
    """o_proj(RMSNorm(o) * swish(g)) per head: o, g [B, T, H, V] -> [B, T, hidden]. fused_linears: one kernel and
    a product from o_proj's weight, the gated activation recomputed in the backward pass."""
    o = o.to(g.dtype)
    if fused_linears:
        return rms_norm_gated_linear(o, g, norm.weight, norm.eps, o_proj.weight, backend="triton", launch=norm.launch,
                                     fp8=fp8)
    return o_proj(rms_norm_gated(o, g, norm.weight, norm.eps, backend=norm.backend, launch=norm.launch).flatten(-2))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), x = the normed block stream."""

    def __init__(self, config: Config, fused: bool = False, float8: bool = False, launch: SwiGLULaunch = SwiGLULaunch(),
                 fp8_products: bool = False):
        super().__init__()
        d, i, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.backend = backend_of(fused)
        self.fused_linears = fused and not float8
        self.fp8_products = fp8_products
        self.launch = launch
        self.gate_proj = Linear(d, i, std=std)
        self.up_proj = Linear(d, i, std=std)
        self.down_proj = Linear(i, d, std=std)

    def forward(self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, mlp(norm(x + delta)))."""
        if not self.fused_linears:
            x, (gate, up) = prenorm_projections(norm, x, delta, [self.gate_proj, self.up_proj], False)
            return x, self.down_proj(swiglu(gate, up, backend=self.backend, launch=self.launch))
        # gate and up side by side in one tensor, whose gradient the SwiGLU kernel writes as one tensor (no
        # concatenation in the projections' backward); the activation is recomputed in the backward pass
        gate_up, h = rms_norm_linears(x, norm.weight, norm.eps, [self.gate_proj.weight, self.up_proj.weight], residual=delta,
                                      dtype=compute_dtype(x), backend="triton", side_by_side=True, launch=norm.launch,
                                      fp8=self.fp8_products)
        return h, swiglu_linear(gate_up, self.down_proj.weight, backend="triton", launch=self.launch, fp8=self.fp8_products)


class GatedLinearAttention(nn.Module):
    def __init__(self, config: Config, fused: bool = False, launch: Launches = Launches(), float8: bool = False,
                 fp8_products: bool = False):
        super().__init__()
        self.config = config
        self.backend = backend_of(fused)
        self.fused_linears = fused and not float8
        self.fp8_products = fp8_products
        self.launch = launch.gla
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
        self.g_norm = RMSNorm(config.head_v_dim, eps=config.head_norm_eps, fused=fused, launch=launch.norm)  # per head, before the gate

    def forward(
        self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional["DecodeCache"] = None, layer: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, attention(norm(x + delta)))."""
        c = self.config
        B, T, _ = x.shape
        groups = c.num_heads // c.num_kv_heads
        x, (q, k, v, gate_low_rank, g) = prenorm_projections(
            norm, x, delta, [self.q_proj, self.k_proj, self.v_proj, self.gk_proj[0], self.g_proj], self.fused_linears,
            self.fp8_products,
        )
        q = q.view(B, T, c.num_heads, c.head_k_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_k_dim)
        v = v.view(B, T, c.num_kv_heads, c.head_v_dim)
        gate_logits = self.gk_proj[1](gate_low_rank).view(B, T, c.num_kv_heads, c.head_k_dim)
        if groups > 1:  # key/value head h serves query heads h*groups ... h*groups + groups - 1
            k, v, gate_logits = (t.repeat_interleave(groups, dim=2) for t in (k, v, gate_logits))

        if cache is None:  # training: the log forget gate logsigmoid(logits) / normalizer is formed inside the op
            o, _ = chunk_gla_from_logits(q, k, v, gate_logits, c.gate_logit_normalizer, cu_seqlens=cu_seqlens,
                                         backend=self.backend, launch=self.launch)
        else:  # decoding from the cached state: one token, or a prompt
            gk = log_decay(gate_logits, c.gate_logit_normalizer)  # fp32, <= 0
            if T == 1:
                o, cache.layers[layer] = fused_recurrent_gla_step(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], cache.layers[layer],
                                                                  backend=self.backend, launch=self.launch)
                o = o.unsqueeze(1)
            else:
                o, cache.layers[layer] = chunk_gla(q, k, v, gk, initial_state=cache.layers[layer], output_final_state=True,
                                                   backend=self.backend, launch=self.launch)
        g = g.view(B, T, c.num_heads, c.head_v_dim)
        return x, gated_output(o, g, self.g_norm, self.o_proj, self.fused_linears, self.fp8_products)


class ShortConvolution(nn.Module):
    """Causal depthwise convolution of `width` taps over each channel, then SiLU (fabric_lin/ops/short_conv.py);
    the weight [channels, 1, width] as nn.Conv1d and flash-linear-attention's ShortConvolution keep it."""

    def __init__(self, channels: int, width: int, std: float = 0.02, fused: bool = False,
                 launch: ShortConvLaunch = ShortConvLaunch()):
        super().__init__()
        self.std = std
        self.backend = backend_of(fused)
        self.launch = launch
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        self.reset_parameters()

    def forward(self, x: torch.Tensor, cache: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
        """x [B, T, channels] -> (silu(conv(x)), the last width - 1 inputs: the cache a next call continues from)."""
        return causal_conv1d(x, self.weight[:, 0], cache, cu_seqlens, backend=self.backend, launch=self.launch)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class DeltaRuleLayer(nn.Module):
    """What the Gated DeltaNet and DeltaNet layers share past their projections (each builds its own, in
    flash-linear-attention's order): q, k, v through their short convolutions, then the delta rule with q and k
    L2-normalised - one decoding step or the chunked op - continuing from and leaving a decoding cache."""

    def projections(self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, others: List[nn.Linear]):
        """(x + delta, qkv, [linear(norm(x + delta)) for linear in others]). qkv: with the fused product, q, k and
        v side by side in one tensor [B, T, 2 H*K + H*V], which the three convolutions then take in one call
        (no copy, one launch each way); else the three tensors."""
        linears = [self.q_proj, self.k_proj, self.v_proj] + others
        if self.fused_linears:
            x, (qkv, *rest) = prenorm_projections(norm, x, delta, linears, True, self.fp8_products,
                                                  groups=[3] + [1] * len(others))
            return x, qkv, rest
        x, (q, k, v, *rest) = prenorm_projections(norm, x, delta, linears, False, self.fp8_products)
        return x, (q, k, v), rest

    def short_convolutions(self, qkv, conv_q, conv_k, conv_v, cu_seqlens):
        """(q, k, v, and their new caches) through q_conv1d, k_conv1d and v_conv1d; qkv one tensor side by side:
        one convolution over its channels, the weights (and caches) concatenated for the call."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if not isinstance(qkv, torch.Tensor):
            (q, conv_q), (k, conv_k), (v, conv_v) = (conv(t, c, cu_seqlens) for conv, t, c in
                                                     zip(convs, qkv, (conv_q, conv_k, conv_v)))
            return q, k, v, conv_q, conv_k, conv_v
        sizes = [conv.weight.shape[0] for conv in convs]
        weight = torch.cat([conv.weight[:, 0] for conv in convs])
        cache = None if conv_q is None else torch.cat([conv_q, conv_k, conv_v], dim=2)
        (q, k, v), cache = causal_conv1d_split(qkv, weight, sizes, cache, cu_seqlens, backend=self.q_conv1d.backend,
                                               launch=self.q_conv1d.launch)
        return (q, k, v, *cache.split(sizes, dim=2))

    def delta_rule(self, qkv, decay: Optional[torch.Tensor], beta: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                   cache: Optional["DecodeCache"], layer: int) -> torch.Tensor:
        """o [B, T, H, V] from `projections`' qkv (before the convolutions): q, k [B, T, H*K] and v [B, T, H*V]
        side by side or three tensors; decay [B, T, H] fp32 or None (no decay) and beta [B, T, H]."""
        c = self.config
        B, T = beta.shape[:2]
        H, K, V = c.num_heads, c.head_k_dim, c.head_v_dim
        conv_q, conv_k, conv_v, state = cache.layers[layer] if cache is not None and cache.layers[layer] else (None,) * 4
        q, k, v, conv_q, conv_k, conv_v = self.short_convolutions(qkv, conv_q, conv_k, conv_v, cu_seqlens)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
        if cache is not None and T == 1:  # one decoding step
            o, state = fused_recurrent_gated_delta_rule_step(
                q[:, 0], k[:, 0], v[:, 0], None if decay is None else decay[:, 0], beta[:, 0], state,
                use_qk_l2norm=True, backend=self.backend, launch=self.launch)
            o = o.unsqueeze(1)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state, output_final_state=cache is not None,
                                              cu_seqlens=cu_seqlens, use_qk_l2norm=True, backend=self.backend,
                                              launch=self.launch)
        if cache is not None:
            cache.layers[layer] = (conv_q, conv_k, conv_v, state)
        return o


class GatedDeltaNet(DeltaRuleLayer):
    """Gated DeltaNet attention, as flash-linear-attention's GatedDeltaNet layer (parameter names too): q, k, v
    projections each through a short causal convolution and SiLU; per head a decay g = -exp(A_log) *
    softplus(a + dt_bias) and a write strength beta = sigmoid(b); q and k L2-normalised; the gated delta rule
    (fabric_lin/ops/gdn/); the output normed per head times swish(g_proj(x)), then o_proj."""

    no_weight_decay = ("A_log", "dt_bias")  # as flash-linear-attention keeps them

    def __init__(self, config: Config, fused: bool = False, launch: Launches = Launches(), float8: bool = False,
                 fp8_products: bool = False):
        super().__init__()
        self.config = config
        self.backend = backend_of(fused)
        self.fused_linears = fused and not float8
        self.fp8_products = fp8_products
        self.launch = launch.gdn
        d, std, H = config.hidden_size, config.initializer_range, config.num_heads
        self.q_proj = Linear(d, config.key_dim, std=std)
        self.k_proj = Linear(d, config.key_dim, std=std)
        self.v_proj = Linear(d, config.value_dim, std=std)
        self.a_proj = Linear(d, H, std=std)
        self.b_proj = Linear(d, H, std=std)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.q_conv1d = ShortConvolution(config.key_dim, config.conv_size, std, fused, launch.short_conv)
        self.k_conv1d = ShortConvolution(config.key_dim, config.conv_size, std, fused, launch.short_conv)
        self.v_conv1d = ShortConvolution(config.value_dim, config.conv_size, std, fused, launch.short_conv)
        self.g_proj = Linear(d, config.value_dim, std=std)  # output gate
        self.o_norm = RMSNorm(config.head_v_dim, eps=config.head_norm_eps, fused=fused, launch=launch.norm)  # per head, before the gate
        self.o_proj = Linear(config.value_dim, d, std=std)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_log and dt_bias (the submodules initialise their own parameters), as flash-linear-attention draws
        them: A ~ U(0, 16); dt log-uniform in [1e-3, 1e-1] (at least 1e-4) and dt_bias = softplus^-1(dt)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
            dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            dt = dt.clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(
        self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional["DecodeCache"] = None, layer: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, attention(norm(x + delta))). With a cache: the convolutions' last inputs and the state
        continue from it, and are left there."""
        x, qkv, (a, b, g) = self.projections(norm, x, delta, [self.a_proj, self.b_proj, self.g_proj])
        decay, beta = gdn_gate(a, b, self.A_log, self.dt_bias)  # [B, T, H] fp32
        o = self.delta_rule(qkv, decay, beta, cu_seqlens, cache, layer)
        return x, gated_output(o, g.view(o.shape), self.o_norm, self.o_proj, self.fused_linears, self.fp8_products)


class DeltaNet(DeltaRuleLayer):
    """DeltaNet attention, as flash-linear-attention's DeltaNet layer with its training recipes' settings (parameter
    names too): q, k, v projections each through a short causal convolution and SiLU; per head a write strength
    beta = sigmoid(b); q and k L2-normalised; the delta rule, which is the gated one without a decay
    (fabric_lin/ops/gdn/ with g=None); the output normed per head, then o_proj. No output gate."""

    def __init__(self, config: Config, fused: bool = False, launch: Launches = Launches(), float8: bool = False,
                 fp8_products: bool = False):
        super().__init__()
        self.config = config
        self.backend = backend_of(fused)
        self.fused_linears = fused and not float8
        self.fp8_products = fp8_products
        self.launch = launch.gdn
        d, std, H = config.hidden_size, config.initializer_range, config.num_heads
        self.q_proj = Linear(d, config.key_dim, std=std)
        self.k_proj = Linear(d, config.key_dim, std=std)
        self.v_proj = Linear(d, config.value_dim, std=std)
        self.b_proj = Linear(d, H, std=std)
        self.q_conv1d = ShortConvolution(config.key_dim, config.conv_size, std, fused, launch.short_conv)
        self.k_conv1d = ShortConvolution(config.key_dim, config.conv_size, std, fused, launch.short_conv)
        self.v_conv1d = ShortConvolution(config.value_dim, config.conv_size, std, fused, launch.short_conv)
        self.o_norm = RMSNorm(config.head_v_dim, eps=config.head_norm_eps, fused=fused, launch=launch.norm)  # per head
        self.o_proj = Linear(config.value_dim, d, std=std)

    def forward(
        self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional["DecodeCache"] = None, layer: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, attention(norm(x + delta))). With a cache: the convolutions' last inputs and the state
        continue from it, and are left there."""
        x, qkv, (b,) = self.projections(norm, x, delta, [self.b_proj])
        o = self.delta_rule(qkv, None, b.float().sigmoid(), cu_seqlens, cache, layer)
        return x, self.o_proj(self.o_norm(o).flatten(-2))  # o in q's dtype, the projections' compute dtype


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


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Softmax attention [1, H, N, D] of documents packed in one row (cu_seqlens: their offsets): each token attends
    to its document's tokens up to itself. The row is cut into blocks of W positions, W the longest document, so that
    a token's document lies within its own block and the one before: each block's queries are scored against those
    2W keys, about 2NW scores in all. One mask over the whole row would take N^2 (a packed micro batch of 16 rows
    of 2048 tokens: 16 times a row's attention, and a mask of 32768^2 kept for the backward pass of every layer)."""
    _, H, N, D = q.shape
    offsets = cu_seqlens.to(q.device)
    W = int((offsets[1:] - offsets[:-1]).max())
    blocks = -(-N // W)
    # each position's document; the padding that fills the last block is one more document
    doc = torch.searchsorted(offsets[1:], torch.arange(blocks * W, device=q.device), right=True).view(blocks, W)
    q, k, v = (F.pad(t, (0, 0, 0, blocks * W - N)).reshape(H, blocks, W, D).transpose(0, 1) for t in (q, k, v))
    # block j's keys: blocks j - 1 and j (for block 0, a block of zeros before it, left out by position)
    k, v = (torch.cat([torch.cat([torch.zeros_like(t[:1]), t[:-1]]), t], dim=2) for t in (k, v))  # [blocks, H, 2W, D]
    key_doc = torch.cat([torch.cat([doc[:1], doc[:-1]]), doc], dim=1)  # [blocks, 2W]
    query_position = torch.arange(blocks * W, device=q.device).view(blocks, W)
    key_position = (torch.arange(blocks, device=q.device)[:, None] - 1) * W + torch.arange(2 * W, device=q.device)
    mask = ((key_doc[:, None, :] == doc[:, :, None]) & (key_position[:, None, :] <= query_position[:, :, None])
            & (key_position[:, None, :] >= 0))  # [blocks, W, 2W]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    return o.transpose(0, 1).reshape(1, H, blocks * W, D)[:, :, :N]


class CausalSelfAttention(nn.Module):
    """Softmax attention with RoPE through SDPA: the Llama-style baseline, and a hybrid's attention layers (as
    flash-linear-attention's Attention: no biases, no q/k norms, the whole context)."""

    def __init__(self, config: Config, num_heads: int, num_kv_heads: int, fused_linears: bool = False,
                 fp8_products: bool = False):
        super().__init__()
        self.config = config
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.fused_linears, self.fp8_products = fused_linears, fp8_products
        d, std = config.hidden_size, config.initializer_range
        head_dim = d // num_heads
        self.q_proj = Linear(d, d, std=std)
        self.k_proj = Linear(d, num_kv_heads * head_dim, std=std)
        self.v_proj = Linear(d, num_kv_heads * head_dim, std=std)
        self.o_proj = Linear(d, d, std=std)

    def forward(
        self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional["DecodeCache"] = None, layer: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, attention(norm(x + delta)))."""
        c = self.config
        B, T, d = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        head_dim = d // heads
        start = cache.position if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)
        x, (q, k, v) = prenorm_projections(norm, x, delta, [self.q_proj, self.k_proj, self.v_proj], self.fused_linears,
                                           self.fp8_products)
        q = apply_rope(q.view(B, T, heads, head_dim), positions, c.rope_base)
        k = apply_rope(k.view(B, T, kv_heads, head_dim), positions, c.rope_base)
        v = v.view(B, T, kv_heads, head_dim)
        if cache is not None:
            if cache.layers[layer] is not None:
                k_past, v_past = cache.layers[layer]
                k, v = torch.cat([k_past, k], dim=1), torch.cat([v_past, v], dim=1)
            cache.layers[layer] = (k, v)
        groups = heads // kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D] for SDPA
        if cu_seqlens is not None:  # documents packed in one row (B = 1)
            o = document_causal_attention(q, k, v, cu_seqlens)
        elif cache is not None and T == 1:
            o = F.scaled_dot_product_attention(q, k, v)  # one new token sees every cached one
        elif cache is not None and start > 0:
            # a prompt appended to a cache: token i sees the past and new tokens up to itself
            total = k.shape[2]
            mask = torch.ones(T, total, dtype=torch.bool, device=x.device).tril(diagonal=total - T)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x, self.o_proj(o.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, config: Config, fused: bool = False, launch: Launches = Launches(), layer: int = 0,
                 float8: bool = False, fp8_products: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, fused=fused, launch=launch.norm)
        if config.block_type == "transformer":
            self.attn = CausalSelfAttention(config, config.num_heads, config.num_kv_heads, fused and not float8,
                                            fp8_products)
        elif layer in config.attn_layers:  # a hybrid's softmax-attention layer
            self.attn = CausalSelfAttention(config, config.attn_num_heads, config.attn_kv_heads, fused and not float8,
                                            fp8_products)
        elif config.block_type == "gla":
            self.attn = GatedLinearAttention(config, fused, launch, float8, fp8_products)
        elif config.block_type == "deltanet":
            self.attn = DeltaNet(config, fused, launch, float8, fp8_products)
        else:
            self.attn = GatedDeltaNet(config, fused, launch, float8, fp8_products)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, fused=fused, launch=launch.norm)
        self.mlp = MLP(config, fused, float8, launch.swiglu, fp8_products)

    def forward(self, x, delta, cu_seqlens=None, cache=None, layer: int = 0):
        """The residual stream is x + delta (delta: the last sublayer's output, not yet added); returns the
        same pair after this block. The stream stays in x's dtype (fp32 under bf16-mixed)."""
        x, delta = self.attn(self.attn_norm, x, delta, cu_seqlens=cu_seqlens, cache=cache, layer=layer)  # x += delta; delta = attn(attn_norm(x))
        x, delta = self.mlp(self.mlp_norm, x, delta)  # x += delta; delta = mlp(mlp_norm(x))
        return x, delta


@dataclass
class DecodeCache:
    """Per-layer decoding state: GLA keeps a [B, H, K, V] fp32 state (constant size); Gated DeltaNet that state and
    its convolutions' last inputs; softmax attention keeps growing (keys, values)."""

    layers: List = field(default_factory=list)
    position: int = 0


class GPT(nn.Module):
    def __init__(self, config: Config, fused: bool = False, launch: Launches = Launches(), float8: bool = False,
                 fp8_products: bool = False):
        """fused: the training step's fused Triton kernels (norms with their projections, SwiGLU, GLA, GDN and
        its convolutions, cross-entropy; CUDA, or Triton's interpreter on the CPU), else their PyTorch references
        (any device). launch: how those kernels are launched, per family (default: the shipped settings).
        float8: the Linear layers called as modules, for fabric_lin/fp8.py to swap for FP8 ones. fp8_products (with
        fused): the fused ops' projections in FP8, each row scaled (fabric_lin/ops/fp8_matmul.py)."""
        super().__init__()
        self.config = config
        self.fused, self.float8, self.fp8_products = fused, float8, fp8_products
        self.launch = launch
        # Draws made while the submodules are constructed must not shift the generator: the model's
        # init is `reset_parameters()` below, so an eager build and a meta build followed by
        # `reset_parameters()` give the same weights for the same seed.
        with _preserve_rng():
            self.embeddings = Embedding(config.vocab_size, config.hidden_size, std=config.initializer_range)
            self.layers = nn.ModuleList(Block(config, fused, launch, i, float8, fp8_products) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps, fused=fused, launch=launch.norm)
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
        if input_ids.dim() != 2 or input_ids.dtype not in TOKEN_ID_DTYPES:
            hint = "; one sequence is input_ids[None]" if input_ids.dim() == 1 else ""
            raise InvalidValue(f"input_ids must be [B, T] token ids of dtype int64 or int32, got {input_ids.dtype} of "
                               f"shape {tuple(input_ids.shape)}{hint}")
        if isinstance(cu_seqlens, torch.Tensor):  # a copy the caller cannot write: every layer's op reads it once
            cu_seqlens = private_offsets(cu_seqlens)
        x = self.embeddings(input_ids)
        # the first block's delta: zeros in the dtype the sublayers' outputs have, so that every block is
        # called alike (a compiled Block reuses one graph; x + 0 is exactly x)
        delta = torch.zeros_like(x, dtype=compute_dtype(x))
        if self.dynamic_shapes and cache is None:
            for t in (x, delta):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
        for i, block in enumerate(self.layers):
            if cache is None:  # no per-layer int argument in training: a compiled Block would specialise on it
                x, delta = block(x, delta, cu_seqlens=cu_seqlens)
            else:
                x, delta = block(x, delta, cu_seqlens=cu_seqlens, cache=cache, layer=i)
        x, _ = self.norm(x, residual=delta)
        if cache is not None:
            cache.position += input_ids.shape[1]
        if return_hidden:
            return x
        if targets is not None:
            return linear_cross_entropy(x.flatten(0, 1), self.output_weight, targets.flatten(),
                                        backend=backend_of(self.fused), launch=self.launch.cross_entropy)
        return F.linear(x, self.output_weight)


class _preserve_rng:
    """Restore the CPU (and current CUDA device's) generator state on exit."""

    def __enter__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def __exit__(self, *exc):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
