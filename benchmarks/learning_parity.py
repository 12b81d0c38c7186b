"""Learning parity: fabric-lin's model against peers trained side by side from identical weights on identical
batches with the same recipe: bf16 autocast over fp32 weights, AdamW (fused; no weight decay on 1-D parameters:
norms, biases, A_log, dt_bias), the same warmup and cosine schedule, gradient clipping at 1.0. A peer is
flash-linear-attention's model (`fla`, loaded from ours exported with `convert_to_hf`), our own model with its
products in FP8 (`fp8-fused` / `fp8-tensorwise`, as `--fp8.recipe` sets them), `fp32`: our
model on its PyTorch reference ops (`fused=False`) in fp32 without autocast or TF32, a sequence at a time with the
gradients summed over the batch, `reference-bf16`: the same reference ops trained as ours is, in bf16 autocast
over the whole batch, or our fused model with one part on its reference (`ours-reference-attention`: the GLA or
delta-rule op; `ours-unfused-projections`: norms, projections and gates as separate ops) or the reference model
with our attention kernels alone (`reference-our-attention`), which tell which fused part makes ours train apart
from the others. fp32 is the yardstick for the others: two bf16 models that differ from each other are told
apart by which one stays nearer the fp32 run. reference-bf16 is the noise floor of bf16 training: it computes what
ours computes, rounded elsewhere (its products where autocast makes them, the rest as the PyTorch code does: the
GLA and delta-rule references in fp32), so ours against it is how far two bf16 runs of one model drift apart by
their rounding alone; fla's distance to ours is one of rounding too (tests/test_fla_gradients.py), and beyond that
floor it is more than rounding noise. Prints one JSON document, and with --plot draws the curves.

    python benchmarks/learning_parity.py --model gla-340M --peers fla reference-bf16 --steps 300 --out gla_parity.json
    python benchmarks/learning_parity.py --model gdn-340M --peers fla --steps 200 --out gdn_parity.json
    python benchmarks/learning_parity.py --model gla-340M --peers fp8-fused fp32 --out fp8.json --plot fp8.png

The data (`--data`) is the long-document corpus (`fabric_lin.data.LongDocuments`, 13.9M+ training tokens: 300
steps of 8 x 2048 read each token at most once, as pretraining does) or the sample corpus (`sample`, about 1.5M
tokens, read three times over in 300 steps: late in the run the models are fitting it, and small differences
grow). Reported per peer: the relative difference |ours - peer| / peer of the per-step loss (median, mean, last
step, mean of the last 10) and on which share of the steps ours is the lower (one-sided differences are not
noise); with fp32 among the peers, every bf16 model's difference to the fp32 run; for GLA the share of chunks
whose intra-chunk scores take the slower path of the Triton kernels (`fabric_lin.ops.gla.gate.levels_share`) at
the first step, the middle one and the last. Runs on the CPU too, with the fp32 and reference-bf16 peers (ours then
on its reference ops under the CPU's bf16 autocast, as reference-bf16 is), for the tests.
"""
import argparse
import math
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from common import out_arg, write_result
from fabric_lin.config import Config
from fabric_lin.lr_schedule import learning_rate
from fabric_lin.model import GPT

# our fused model with one part back on its reference, or the reference model with our attention kernels alone:
# which part makes ours train differently
PART_PEERS = ("ours-reference-attention", "ours-unfused-projections", "reference-our-attention")
PEERS = ("fla", "fp8-tensorwise", "fp8-fused", "fp32", "reference-bf16") + PART_PEERS
REFERENCE_PEERS = ("fp32", "reference-bf16")  # our model on its PyTorch reference ops: they run on the CPU too


def corpus_batches(data_name: str, steps: int, batch_size: int, seq_len: int, vocab_size: int) -> list:
    """`steps` batches [batch_size, seq_len + 1] of a corpus's training split, on the CPU."""
    from fabric_lin.data import LongDocuments, SampleCorpus
    from fabric_lin.data.tokenizer import Tokenizer

    data = LongDocuments(num_workers=0) if data_name == "long_documents" else SampleCorpus(num_workers=0)
    data.prepare_data()
    data.connect(tokenizer=Tokenizer(data.tokenizer_dir), batch_size=batch_size, max_seq_length=seq_len,
                 vocab_size=vocab_size)
    data.setup()
    batches = []
    while len(batches) < steps:
        for batch in data.train_dataloader():
            batches.append(batch.long())
            if len(batches) == steps:
                break
    return batches


def adamw(named_parameters, lr: float, weight_decay: float):
    params = list(named_parameters)
    groups = [{"params": [p for _, p in params if p.ndim > 1], "weight_decay": weight_decay},
              {"params": [p for _, p in params if p.ndim <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def fla_from_export(model: GPT, config: Config):
    """fla's model class for the config, loaded from our weights exported as `fabric-lin convert_to_hf` does."""
    from transformers import AutoModelForCausalLM

    import fla  # noqa: F401  (registers fla's model types with transformers)
    from common import lift_fla_gdn_hopper_guard
    from fabric_lin.convert.hf import convert_to_hf
    from fabric_lin.convert.model_dir import save_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, hf_dir = Path(tmp) / "model", Path(tmp) / "hf"
        model_dir.mkdir()
        save_model_dir({k: v.detach().cpu() for k, v in model.state_dict().items()}, config, model_dir)
        convert_to_hf(model_dir, hf_dir, dtype="float32")
        if config.block_type == "gdn":
            # a peer to train beside, not a reference: fla says its GDN backward is wrong on Hopper with Triton
            # 3.4-3.7.0; the report says whether its guard was lifted
            model.fla_guard_lifted = lift_fla_gdn_hopper_guard()
        return AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)


def fp8_copy(model: GPT, config: Config, recipe: str) -> GPT:
    """Our model with the same weights, its products in FP8 as `fabric-lin pretrain --fp8.recipe` sets them."""
    from fabric_lin.fp8 import FP8Args, convert_to_fp8

    fp8 = FP8Args(recipe=recipe)
    copy = GPT(config, fused=True, float8=fp8.torchao, fp8_products=recipe == "fused")
    copy.load_state_dict(model.state_dict())
    if fp8.torchao:
        convert_to_fp8(copy, fp8)
    return copy


def reference_copy(model: GPT, config: Config) -> GPT:
    """Our model with the same weights on its PyTorch reference ops: run in fp32, the yardstick; in bf16 autocast,
    the noise floor."""
    copy = GPT(config, fused=False)
    copy.load_state_dict(model.state_dict())
    return copy


def ours_with_references(model: GPT, config: Config, part: str) -> GPT:
    """Our fused model with one part back on its PyTorch reference, the rest fused: `attention` (the GLA / delta-rule
    op between the projections) or `projections` (each norm, its projections and the output gate as separate ops).
    Which of our fused parts carries our gradient's extra error is then the one whose reference brings it down."""
    copy = GPT(config, fused=model.fused)
    copy.load_state_dict(model.state_dict())
    for block in copy.layers:
        if part == "attention":
            block.attn.backend = "torch"
        else:
            block.attn.fused_linears = block.mlp.fused_linears = False
    return copy


def reference_with_our_attention(model: GPT, config: Config) -> GPT:
    """Our model on its PyTorch reference ops but for the attention (the GLA / delta-rule op), on our kernels."""
    copy = reference_copy(model, config)
    for block in copy.layers:
        block.attn.backend = "triton"
    return copy


def part_peer(model: GPT, config: Config, peer: str) -> GPT:
    if peer == "reference-our-attention":
        return reference_with_our_attention(model, config)
    return ours_with_references(model, config, peer.rsplit("-", 1)[1])


@dataclass
class Trainee:
    """One model of the comparison and how it steps: in bf16 autocast over the whole batch, or (fp32) without
    autocast a sequence at a time, the gradients summed over the batch (the same mean loss: every sequence has
    as many targets)."""
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    fp32: bool = False
    max_norm: float = 1.0  # gradient clipping

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, GPT):
            return self.model(batch[:, :-1], targets=batch[:, 1:])
        # fla predicts labels[t + 1] at t and ignores the last position: the same targets as ours
        return self.model(input_ids=batch, labels=batch).loss

    def backward(self, batch: torch.Tensor) -> float:
        """The batch's mean loss, its gradients added to the parameters'."""
        if self.fp32:
            total = 0.0
            for sequence in batch.split(1):
                loss = self.loss(sequence) / len(batch)
                loss.backward()
                total += loss.item()
            return total
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss = self.loss(batch)
        loss.backward()
        return loss.item()

    def step(self, batch: torch.Tensor, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = self.backward(batch)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def plot_losses(rows: list, names: List[str], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 1])
    steps = [r["step"] for r in rows]
    for name in names:
        top.plot(steps, [r["loss"][name] for r in rows], label="fabric-lin (bf16)" if name == "ours" else name,
                 alpha=1.0 if name == "ours" else 0.8)
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    for peer in names[1:]:
        bottom.plot(steps, [100 * relative(r["loss"]["ours"], r["loss"][peer]) for r in rows], label=f"ours vs {peer}")
    bottom.set_ylabel("|difference| (%)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gate_share_hooks(model: GPT, shares: list) -> list:
    """Forward hooks on every GLA layer's gate that append the share of chunks on the slower path."""
    from fabric_lin.ops.gla.gate import levels_share

    c = model.config

    def record(module, inputs, logits):
        gk = F.logsigmoid(logits.float()).unflatten(-1, (c.num_kv_heads, -1)) / c.gate_logit_normalizer
        shares.append(levels_share(gk))

    return [block.attn.gk_proj[1].register_forward_hook(record) for block in model.layers if hasattr(block.attn, "gk_proj")]


def relative(loss: float, yardstick: float) -> float:
    return abs(loss - yardstick) / yardstick


def train_side_by_side(batches, trainees: List[Trainee], args, device, rows, shares, share_at) -> None:
    """Every trainee one step on every batch, appending a row of their losses per step to `rows`."""
    check_at = {0, args.steps // 2, args.steps - 1}
    for step, batch in enumerate(batches):
        lr = learning_rate(step, args.lr, 0.1 * args.lr, args.warmup, args.steps, "cosine")
        batch = batch.to(device)
        shares.clear()
        losses, seconds = {}, {}
        for trainee in trainees:  # each step ends in loss.item(): the GPU's work is in the time
            start = time.perf_counter()
            losses[trainee.name] = trainee.step(batch, lr)
            seconds[trainee.name] = round(time.perf_counter() - start, 4)
        if step in check_at and shares:
            share_at[step] = sum(shares) / len(shares)
        rows.append({"step": step, "lr": lr, "loss": losses, "seconds": seconds})


def difference(rows: List[Dict], name: str, yardstick: str) -> Dict:
    """How far `name`'s per-step loss is from `yardstick`'s, relative to the yardstick's."""
    diffs = [relative(r["loss"][name], r["loss"][yardstick]) for r in rows]
    last = rows[-10:]
    mean_last = {n: sum(r["loss"][n] for r in last) / len(last) for n in (name, yardstick)}
    return {
        "median_relative_difference": statistics.median(diffs),
        "mean_relative_difference": sum(diffs) / len(diffs),
        "final_relative_difference": diffs[-1],
        f"last_10_mean_loss_{name}": mean_last[name], f"last_10_mean_loss_{yardstick}": mean_last[yardstick],
        "last_10_relative_difference": relative(mean_last[name], mean_last[yardstick]),
        f"share_of_steps_{name}_lower": sum(r["loss"][name] < r["loss"][yardstick] for r in rows) / len(rows),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gla-340M", help="a fabric-lin model name")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=["fla"])
    parser.add_argument("--data", choices=["long_documents", "sample"], default="long_documents")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    parser.add_argument("--plot", help="also draw the loss curves into this PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.plot:
        import matplotlib  # noqa: F401  (missing: fail now, not after the run)
    config = Config.from_name(args.model)
    if "fla" in args.peers and config.block_type == "transformer":
        raise SystemExit(f"--model {args.model}: fla's peer needs a linear-attention model (GLA, GDN, DeltaNet)")
    if device.type != "cuda" and set(args.peers) - set(REFERENCE_PEERS):
        raise SystemExit(f"--peers {' '.join(args.peers)}: on the CPU only {' and '.join(REFERENCE_PEERS)} run "
                         "(fla's and FP8's kernels need a GPU)")
    peers = list(dict.fromkeys(args.peers))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32's products in full fp32; bf16 products are not affected
    batches = corpus_batches(args.data, args.steps, args.batch_size, args.seq_len, config.vocab_size)

    torch.manual_seed(args.seed)
    ours = GPT(config, fused=device.type == "cuda")
    models = {"ours": ours}
    for peer in peers:
        models[peer] = (fla_from_export(ours, config) if peer == "fla" else reference_copy(ours, config)
                        if peer in REFERENCE_PEERS else part_peer(ours, config, peer) if peer in PART_PEERS else fp8_copy(ours, config, peer.removeprefix("fp8-")))
    trainees = [Trainee(name, model.to(device).train(), adamw(model.named_parameters(), args.lr, args.weight_decay),
                        fp32=name == "fp32") for name, model in models.items()]
    shares, share_at = [], {}
    hooks = gate_share_hooks(ours, shares) if config.block_type == "gla" and device.type == "cuda" else []

    rows = []
    start = time.perf_counter()
    # a time limit's SIGTERM ends the loop, and the steps done so far are still reported (marked "stopped_at_step")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt, as SIGINT does
    try:
        train_side_by_side(batches, trainees, args, device, rows, shares, share_at)
    except KeyboardInterrupt:
        print(f"stopped after {len(rows)} of {args.steps} steps", flush=True)
    if not rows:
        raise SystemExit("no step finished")
    for hook in hooks:
        hook.remove()
    bf16_models = [name for name in models if name != "fp32"]
    report = {
        "model": args.model, "peers": peers, "data": args.data, "steps": args.steps, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "device": str(device),
        "seconds": round(time.perf_counter() - start, 1),
        # the first step holds compilation and autotuning; the median of the others is the steady state
        "first_step_seconds": rows[0]["seconds"],
        "median_step_seconds": {name: statistics.median(r["seconds"][name] for r in rows[1:] or rows) for name in models},
        "ours_against": {peer: difference(rows, "ours", peer) for peer in peers},
        "against_fp32": {name: difference(rows, name, "fp32") for name in bf16_models} if "fp32" in peers else {},
        "levels_share_at_step": share_at,
        "fla_gdn_hopper_guard_lifted": getattr(ours, "fla_guard_lifted", False),
        "stopped_at_step": None if len(rows) == args.steps else len(rows),
        "diverged": any(not math.isfinite(loss) for r in rows for loss in r["loss"].values()),
        "per_step": rows,
    }
    write_result(report, args.out, fla_ran="fla" in peers)
    if args.plot:
        plot_losses(rows, list(models), f"{args.model}: fabric-lin vs {', '.join(peers)}, "
                    f"{args.batch_size} x {args.seq_len}, {args.data}", args.plot)
    return report


if __name__ == "__main__":
    main()
