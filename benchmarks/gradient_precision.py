"""Where bf16 gradients part from fp32's, parameter kind by parameter kind: fabric-lin's model (its Triton kernels in
bf16 autocast, as it trains), its PyTorch reference ops in bf16 autocast (`reference-bf16`) and fla's model (`fla`),
each against our model's gradient in fp32 (reference ops, no autocast, no TF32; learning_parity.py's yardstick),
from the same weights on the same batch. learning_parity.py shows that two bf16 runs drift apart; this shows which
parameters' gradients carry the difference, and whether ours or the peer is nearer fp32.

    python benchmarks/gradient_precision.py --model gla-340M --peers fla reference-bf16 --after 12

--after N first trains our model N steps (learning_parity.py's recipe and batches), then every model starts from
its weights: the first steps of a run, where the loss falls fastest, are where bf16 runs part. For each model and
parameter kind (the name with its layer index as `*`): the relative error |g - g32| / |g32| over all layers' tensors
of that kind, and the cosine of the two; also each model's loss and total gradient norm (clipping scales every
gradient by it). `ours-reference-attention` and `ours-unfused-projections` are ours with one fused part back on its
PyTorch reference: which part carries ours' extra error. Runs on the CPU too (reference-bf16 alone, and ours then on its reference ops), for the tests.
"""
import argparse
import itertools
import re
from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch

from common import out_arg, write_result
import fabric_lin.model
from fabric_lin.config import Config
from fabric_lin.convert.hf import to_hf_name
from fabric_lin.model import GPT
from fabric_lin.ops.gla import chunk_gla_from_logits
from fabric_lin.ops.gla.tune import rel_rms
from learning_parity import (PART_PEERS, Trainee, adamw, corpus_batches, fla_from_export, part_peer, reference_copy,
                             train_side_by_side)

PEERS = ("fla", "reference-bf16") + PART_PEERS


def parameter_kind(name: str) -> str:
    """`blocks.3.attn.q_proj.weight` -> `blocks.*.attn.q_proj.weight`: one row for a kind's tensors in every layer."""
    return re.sub(r"\.\d+\.", ".*.", name)


def gradients(model: torch.nn.Module, batch: torch.Tensor, fp32: bool) -> tuple:
    """(loss, {name: gradient}) of the mean next-token loss on `batch`, as learning_parity.py's Trainee computes it:
    fp32 a sequence at a time with the gradients summed, bf16 in autocast over the whole batch."""
    model.zero_grad(set_to_none=True)
    loss = Trainee("probe", model, optimizer=None, fp32=fp32).backward(batch)
    return loss, {name: p.grad.detach().float() for name, p in model.named_parameters()}


def compare(grads: Dict[str, torch.Tensor], yardstick: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, float]]:
    """Per parameter kind: the relative error and cosine of `grads` against `yardstick` over all its tensors."""
    sums: Dict[str, list] = {}
    for name, reference in yardstick.items():
        g, r = grads[name].double(), reference.double()
        s = sums.setdefault(parameter_kind(name), [0.0, 0.0, 0.0, 0.0])  # |g - r|^2, |r|^2, |g|^2, g . r
        s[0] += (g - r).square().sum().item()
        s[1] += r.square().sum().item()
        s[2] += g.square().sum().item()
        s[3] += (g * r).sum().item()
    return {kind: {"relative_error": (d / max(rr, 1e-300)) ** 0.5, "cosine": gr / max((gg * rr) ** 0.5, 1e-300)}
            for kind, (d, rr, gg, gr) in sums.items()}


def layer_errors(grads: Dict[str, torch.Tensor], yardstick: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The relative error of each layer's gradients (all its tensors together) against `yardstick`'s: where in
    depth an error enters (the backward pass carries it down to every layer below)."""
    sums: Dict[str, list] = {}
    for name, reference in yardstick.items():
        layer = re.search(r"\.(\d+)\.", name)
        s = sums.setdefault(layer.group(1) if layer else "outside the layers", [0.0, 0.0])
        s[0] += (grads[name].double() - reference.double()).square().sum().item()
        s[1] += reference.double().square().sum().item()
    return {layer: (d / max(r, 1e-300)) ** 0.5 for layer, (d, r) in sums.items()}


def total_norm(grads: Dict[str, torch.Tensor]) -> float:
    return sum(g.double().square().sum().item() for g in grads.values()) ** 0.5


@contextmanager
def gla_calls_recorded(layers: List[int]) -> Iterator[Dict[int, dict]]:
    """Within: the calls of the GLA op in our model at `layers` (counted in the forward pass's order) recorded, each
    with its inputs (q, k, v, gate logits, as the model passed them) and, once the backward pass has run, the gradient
    that reached its output (`do`); the others are not kept."""
    original = fabric_lin.model.chunk_gla_from_logits
    calls: Dict[int, dict] = {}
    count = itertools.count()

    def recording(q, k, v, gate_logits, normalizer, **kwargs):
        o, state = original(q, k, v, gate_logits, normalizer, **kwargs)
        layer = next(count)
        if layer in layers:
            call = calls[layer] = {"inputs": [t.detach().clone() for t in (q, k, v, gate_logits)], "normalizer": normalizer}
            o.register_hook(lambda grad: call.__setitem__("do", grad.detach().clone()))
        return o, state

    fabric_lin.model.chunk_gla_from_logits = recording
    try:
        yield calls
    finally:
        fabric_lin.model.chunk_gla_from_logits = original


def op_gradients(call: dict, backend: str, autocast: bool, fp32: bool) -> Dict[str, torch.Tensor]:
    """The GLA op's output and its inputs' gradients for a recorded call: on `backend`, in bf16 autocast as the model
    runs it, or with its inputs made fp32 (no autocast), the yardstick."""
    inputs = [(t.float() if fp32 else t.clone()).requires_grad_() for t in call["inputs"]]
    with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16, enabled=autocast):
        o, _ = chunk_gla_from_logits(*inputs, call["normalizer"], backend=backend)
    o.backward(call["do"].to(o.dtype))
    return dict(zip(("o", "dq", "dk", "dv", "dgate_logits"), [o.detach()] + [t.grad for t in inputs]))


def token_sum_error(x: torch.Tensor, yardstick: torch.Tensor) -> float:
    """rel_rms of the sums over the batch and the sequence ([B, T, H, D] -> [H, D]): an error that leans the same
    way at every token grows with their number in a weight's gradient, where one of random sign averages out."""
    return rel_rms(x.float().sum((0, 1)), yardstick.float().sum((0, 1)))


def op_precision(calls: Dict[int, dict], device: torch.device) -> Dict[str, dict]:
    """At each layer of `calls` (gla_calls_recorded's, in our model's bf16 step): the GLA op's own bf16 output and
    gradients against fp32's, for the inputs and output gradient it met there: our Triton kernels (on CUDA) and the
    PyTorch reference in autocast."""
    report = {}
    backends = {"triton": "triton", "reference-bf16": "torch"} if device.type == "cuda" else {"reference-bf16": "torch"}
    for layer, call in calls.items():
        yardstick = op_gradients(call, "torch", autocast=False, fp32=True)
        row = report[f"layer {layer}"] = {}
        for name, backend in backends.items():
            ours = op_gradients(call, backend, autocast=True, fp32=False)
            row[name] = {key: rel_rms(value, yardstick[key]) for key, value in ours.items()}
            row[name + " token sums"] = {key: token_sum_error(value, yardstick[key]) for key, value in ours.items()}
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gla-340M", help="a fabric-lin model name")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=["reference-bf16"])
    parser.add_argument("--after", type=int, default=0, help="steps our model trains before the gradients are taken")
    parser.add_argument("--data", choices=["long_documents", "sample"], default="long_documents")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--op_layers", nargs="*", type=int, default=[],
                        help="also the GLA op's own gradient errors at these layers, from the inputs it met")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and "fla" in args.peers:
        raise SystemExit("--peers fla: fla's kernels need a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    config = Config.from_name(args.model)
    if any(not 0 <= layer < config.num_layers for layer in args.op_layers):
        raise SystemExit(f"--op_layers {args.op_layers}: {args.model} has layers 0 to {config.num_layers - 1}")
    batches = corpus_batches(args.data, args.after + 1, args.batch_size, args.seq_len, config.vocab_size)

    torch.manual_seed(args.seed)
    ours = GPT(config, fused=device.type == "cuda").to(device).train()
    if args.after:
        # learning_parity.py's schedule over a run of 300 steps, so that step N's weights are that run's
        args.steps = 300
        trainee = Trainee("ours", ours, adamw(ours.named_parameters(), args.lr, 0.01))
        train_side_by_side(batches[:args.after], [trainee], args, device, rows=[], shares=[], share_at={})
    batch = batches[args.after].to(device)

    fp32_model = reference_copy(ours, config).to(device).train()
    loss32, grads32 = gradients(fp32_model, batch, fp32=True)
    del fp32_model
    report = {"model": args.model, "after_steps": args.after, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "device": str(device), "fp32": {"loss": loss32, "gradient_norm": total_norm(grads32)}, "models": {}}
    models = {"ours": lambda: ours}
    for peer in args.peers:
        if peer == "fla":
            models[peer] = lambda: fla_from_export(ours, config)
        elif peer == "reference-bf16":
            models[peer] = lambda: reference_copy(ours, config)
        else:
            models[peer] = lambda peer=peer: part_peer(ours, config, peer)
    for name, make in models.items():
        model = make().to(device).train()
        with gla_calls_recorded(args.op_layers if name == "ours" else []) as calls:
            loss, grads = gradients(model, batch, fp32=False)
        if name == "ours":
            ours_calls = calls
        if name == "fla":  # fla's names for our parameters
            grads = {ours_name: grads[to_hf_name(ours_name)] for ours_name in grads32}
        kinds = compare(grads, grads32)
        worst = sorted(kinds, key=lambda k: kinds[k]["relative_error"], reverse=True)
        report["models"][name] = {"loss": loss, "gradient_norm": total_norm(grads), "worst_kinds": worst[:5],
                                  "kinds": kinds, "layers": layer_errors(grads, grads32)}
        print(f"{name}: loss {loss:.5f} (fp32 {loss32:.5f}); worst: " +
              ", ".join(f"{k} {kinds[k]['relative_error']:.2e}" for k in worst[:5]), flush=True)
        if model is not ours:
            del model
    if args.op_layers:
        report["gla_op"] = op_precision(ours_calls, device)
        for layer, row in report["gla_op"].items():
            print(layer, {name: {k: f"{e:.1e}" for k, e in errors.items()} for name, errors in row.items()}, flush=True)
    write_result(report, args.out, fla_ran="fla" in args.peers)
    return report


if __name__ == "__main__":
    main()
