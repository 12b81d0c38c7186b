"""Analytic training FLOPs per token and device peak throughput, for MFU.

FLOP counters (torch.utils.flop_counter, Fabric's measure_flops) do not see Triton kernels, so the
GLA and GDN recurrences would count as zero; the numbers here are written out from the model's shapes.

Convention (as PaLM's MFU): a matmul of [m, k] x [k, n] costs 2*m*k*n; training costs 3x the
forward pass (forward, and backward for inputs and for weights); recomputation from activation
checkpointing is not counted (it is overhead, not model FLOPs); norms, activations and the loss's
softmax are ignored.
"""
from typing import Optional

import torch

from fabric_lin.config import Config

# Dense (no sparsity) peak TFLOP/s per GPU, from the vendors' data sheets. Matched in order by substring
# of torch.cuda.get_device_name(), so the more specific names come first.
PEAK_TFLOPS = {
    # name: (bf16/fp16 tensor core, fp32 without TF32)
    "H200": (989.0, 67.0),
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.0, 67.0),  # SXM
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "A10G": (70.0, 31.2),
}


def _attention_params(config: Config, heads: int, kv_heads: int) -> int:
    d = config.hidden_size
    return 2 * d * d + 2 * d * kv_heads * (d // heads)  # q, o; k, v


def _mixer_params(config: Config, layer: int) -> int:
    """Matmul weights of one layer's attention (or recurrent mixer)."""
    d = config.hidden_size
    if config.block_type == "transformer":
        return _attention_params(config, config.num_heads, config.num_kv_heads)
    if layer in config.attn_layers:
        return _attention_params(config, config.attn_num_heads, config.attn_kv_heads)
    key, value = config.key_dim, config.value_dim
    if config.block_type == "gla":
        groups = config.num_heads // config.num_kv_heads
        r = config.gate_low_rank_dim
        attn = d * key + d * key // groups + d * value // groups + d * value  # q, k, v, output gate g
        attn += d * r + r * key // groups  # low-rank forget gate
        return attn + value * d  # o_proj
    if config.block_type == "deltanet":  # q, k, v, b (one output per head), o_proj
        return 2 * d * key + d * value + d * config.num_heads + value * d
    # gdn: q, k, v, output gate g, a and b (one output per head), o_proj
    return 2 * d * key + 2 * d * value + 2 * d * config.num_heads + value * d


def matmul_params(config: Config) -> int:
    """Weights that take part in a matmul per token: every Linear, and the output head.
    The embedding lookup is a gather, not a matmul; a tied head is counted once, as the head."""
    d = config.hidden_size
    mlp = 3 * d * config.intermediate_size
    return sum(_mixer_params(config, i) + mlp for i in range(config.num_layers)) + d * config.vocab_size


def flops_per_token(config: Config, seq_length: int, chunk_size: int = 64) -> float:
    """Training FLOPs per token (forward + backward).

    Chunked forms with chunk size C, per head (key width K, value width V) and token:
      GLA: intra-chunk scores q k^T over the chunk 2*C*K, scores times values 2*C*V; inter-chunk output
        (q * exp(b)) S 2*K*V, state update S += k^T v 2*K*V.
      GDN and DeltaNet (the same products, without the decay): k k^T, q k^T and w = T (beta k) over the chunk 6*C*K; u = T (beta v) and the scores times the
        corrections 4*C*V; w S, q S and the state update 6*K*V; the triangular solve for T, (2/3)*C*C.
      The kernels compute whole C x C blocks, so the causal mask saves nothing and is not halved. The short
      convolutions, like norms and activations, are left out.
    Softmax attention (transformer, a hybrid's attention layers): q k^T and attention times v over the whole
    context, 4*T*d per token and layer (PaLM's 12*L*d*T training term)."""
    forward = 2 * matmul_params(config)
    C = min(chunk_size, seq_length)
    K, V = config.head_k_dim, config.head_v_dim
    for layer in range(config.num_layers):
        if config.block_type == "transformer" or layer in config.attn_layers:
            forward += 4 * seq_length * config.hidden_size
        elif config.block_type == "gla":
            forward += config.num_heads * (2 * C * (K + V) + 4 * K * V)
        else:
            forward += config.num_heads * (6 * C * K + 4 * C * V + 6 * K * V + 2 * C * C / 3)
    return 3.0 * forward


def peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """Peak FLOP/s of one device for the given Fabric precision, or None when unknown (e.g. CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, fp32) in PEAK_TFLOPS.items():
        if key in name:
            low_precision = precision.startswith(("bf16", "16"))
            return (half if low_precision else fp32) * 1e12
    return None
