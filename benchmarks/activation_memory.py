"""Bytes one Block keeps for its backward pass, per token: the activation memory of training, which
(times layers and tokens per micro batch) is most of a GLA model's peak memory.

Counts every tensor autograd saves during one Block's forward (torch.autograd.graph.saved_tensors_hooks),
each storage once, parameters left out, with the fused Triton ops of the CUDA path, at two sequence
lengths: the growth is the activation memory per token, the rest (weights cast for a product and kept
for its backward pass) a constant per layer. Runs anywhere: on
the CPU the Triton kernels run in the interpreter (set before Triton is imported), in bf16 for the
bookkeeping only (no GPU numerics are involved). Prints JSON.

    python benchmarks/activation_memory.py                         # gla-340M
    python benchmarks/activation_memory.py --model transformer-340M
"""
import argparse
import functools
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fabric_lin.model as model_module  # noqa: E402
from fabric_lin.config import Config  # noqa: E402


def saved_bytes_per_token(config: Config, tokens: int, device: str):
    """(bytes per token, list of saved tensors) for one Block's forward at micro batch 1 x `tokens`."""
    # the fused ops (the CUDA path) wherever this runs
    model_module.use_fused = lambda x: True
    for name in ("chunk_gla", "chunk_gla_from_logits", "rms_norm", "rms_norm_gated", "rms_norm_gated_linear",
                 "rms_norm_linears", "swiglu", "swiglu_linear"):
        if hasattr(model_module, name):  # the fused ops this version of the model uses
            setattr(model_module, name, functools.partial(getattr(model_module, name), backend="triton"))
    block = model_module.Block(config).to(device=device, dtype=torch.bfloat16)
    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key[0] not in parameters:
            nbytes = t.numel() * t.element_size()
            if nbytes > saved.get(key, (0,))[0]:
                saved[key] = (nbytes, list(t.shape), str(t.dtype).replace("torch.", ""))
        return t

    x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, torch.zeros_like(x))
    rows = sorted(saved.values(), key=lambda r: -r[0])
    return sum(r[0] for r in rows) / tokens, [{"bytes_per_token": r[0] / tokens, "shape": r[1], "dtype": r[2]} for r in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gla-340M")
    parser.add_argument("--tokens", type=int, default=128, help="sequence length of the probe (a multiple of 64)")
    parser.add_argument("--micro_batch_tokens", type=int, default=16 * 2048, help="to scale to one micro batch")
    args = parser.parse_args()
    config = Config.from_name(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # twice the tokens: what grows with them is activation memory; what does not (copies of weights
    # cast to the compute dtype, kept for the backward pass) is a per-layer constant
    per_token, tensors = saved_bytes_per_token(config, args.tokens, device)
    per_token_2, _ = saved_bytes_per_token(config, 2 * args.tokens, device)
    total, total_2 = per_token * args.tokens, per_token_2 * 2 * args.tokens
    slope = (total_2 - total) / args.tokens
    constant = total - slope * args.tokens
    per_micro_batch = (slope * args.micro_batch_tokens + constant) * config.num_layers
    print(json.dumps({
        "model": args.model, "device": device, "bytes_per_token_per_layer": slope,
        "bytes_per_layer_independent_of_tokens": constant,
        "activation_gib_per_micro_batch": round(per_micro_batch / 2**30, 2),
        "micro_batch_tokens": args.micro_batch_tokens, "layers": config.num_layers,
        "saved_tensors_at_probe_length": [dict(t, bytes=t.pop("bytes_per_token") * args.tokens) for t in tensors],
    }, indent=1))


if __name__ == "__main__":
    main()
