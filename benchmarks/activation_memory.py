"""Bytes one Block keeps for its backward pass, per token: the activation memory of training, which
(times layers and tokens per micro batch) is most of a GLA model's peak memory.

Counts every tensor autograd saves while the second Block of a two-layer model runs its forward pass
(torch.autograd.graph.saved_tensors_hooks), each storage once, parameters left out, with the fused
Triton ops of the CUDA path (`GPT(config, fused=True)`), at two sequence lengths: the growth is the
activation memory per token, the rest (weights cast for a product and kept for its backward pass) a
constant per layer. The second Block, because its inputs are a Block's outputs, as for every layer but
the first. Runs anywhere: on the CPU the Triton kernels run in the interpreter (set before Triton is
imported), in bf16 for the bookkeeping only (no GPU numerics are involved). Prints JSON.

    python benchmarks/activation_memory.py                         # gla-340M
    python benchmarks/activation_memory.py --model transformer-340M --out activation_memory.json
    python benchmarks/activation_memory.py --fp8 none tensorwise   # the Linear layers in FP8 (torchao)

With --fp8 the Linear layers are converted as `--fp8.recipe` converts them (on the CPU with torchao's emulation,
which keeps the same tensors for the backward pass): what FP8 adds to, or takes from, the activation memory.
"""
import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import exit_on_user_error, out_arg, positive_int, write_result  # noqa: E402
from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402


def saved_bytes_per_token(model_name: str, tokens: int, device: str, fp8_recipe: str = "none"):
    """(bytes per token, list of saved tensors) for one Block's forward at micro batch 1 x `tokens`."""
    from fabric_lin.fp8 import FP8Args, convert_to_fp8

    torch.manual_seed(0)
    config = Config.from_name(model_name, num_layers=2)
    fp8 = FP8Args(recipe=fp8_recipe)
    model = GPT(config, fused=True, float8=fp8.enabled).to(device=device, dtype=torch.bfloat16)
    if fp8.enabled:
        convert_to_fp8(model, fp8, emulate=device != "cuda")
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}
    inside = [False]  # set while the measured Block runs its forward pass

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if inside[0] and key[0] not in parameters:
            nbytes = t.numel() * t.element_size()
            if nbytes > saved.get(key, (0,))[0]:
                saved[key] = (nbytes, list(t.shape), str(t.dtype).replace("torch.", ""))
        return t

    block = model.layers[1]
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    rows = sorted(saved.values(), key=lambda r: -r[0])
    return sum(r[0] for r in rows) / tokens, [{"bytes_per_token": r[0] / tokens, "shape": r[1], "dtype": r[2]} for r in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gla-340M")
    parser.add_argument("--tokens", type=positive_int, default=128,
                        help="sequence length of the probe; any length (nothing kept is padded to the chunk size, 64)")
    parser.add_argument("--micro_batch_tokens", type=positive_int, default=16 * 2048, help="to scale to one micro batch")
    parser.add_argument("--fp8", nargs="+", default=["none"], choices=["none", "tensorwise"],
                        help="the Linear layers' products: bf16 (none) or FP8 through torchao's layers (tensorwise); several: one entry each")
    parser.add_argument("--out", type=out_arg, help="also write the JSON document here (with the command, date and machine)")
    args = parser.parse_args()
    config = Config.from_name(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    for recipe in args.fp8:
        # twice the tokens: what grows with them is activation memory; what does not (copies of weights
        # cast to the compute dtype, kept for the backward pass) is a per-layer constant
        per_token, tensors = saved_bytes_per_token(args.model, args.tokens, device, recipe)
        per_token_2, _ = saved_bytes_per_token(args.model, 2 * args.tokens, device, recipe)
        total, total_2 = per_token * args.tokens, per_token_2 * 2 * args.tokens
        slope = (total_2 - total) / args.tokens
        constant = total - slope * args.tokens
        per_micro_batch = (slope * args.micro_batch_tokens + constant) * config.num_layers
        results[recipe] = {
            "bytes_per_token_per_layer": slope, "bytes_per_layer_independent_of_tokens": constant,
            "activation_gib_per_micro_batch": round(per_micro_batch / 2**30, 2),
            "saved_tensors_at_probe_length": [dict(t, bytes=t.pop("bytes_per_token") * args.tokens) for t in tensors],
        }
    document = {"model": args.model, "device": device, "micro_batch_tokens": args.micro_batch_tokens,
                "layers": config.num_layers, **(results["none"] if args.fp8 == ["none"] else {"fp8": results})}
    write_result(document, args.out)

if __name__ == "__main__":
    exit_on_user_error(main)
