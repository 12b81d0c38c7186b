"""Learning parity: fabric-lin's model against a peer trained side by side from identical weights on identical
batches with the same recipe: bf16 autocast over fp32 weights, AdamW (fused; no weight decay on 1-D parameters:
norms, biases, A_log, dt_bias), the same warmup and cosine schedule, gradient clipping at 1.0. The peer is
flash-linear-attention's model (`--peer fla`, loaded from ours exported with `convert_to_hf`) or our own model
with its products in FP8 (`--peer fp8-fused` / `fp8-tensorwise` / `fp8-rowwise`, as `--fp8.recipe` sets them; then
"ours" is the bf16 run). One GPU, one process; prints one JSON document, and with --plot draws both loss curves.

    python benchmarks/learning_parity.py --model gla-340M --steps 200 --out gla_parity.json
    python benchmarks/learning_parity.py --model gdn-340M --steps 200 --out gdn_parity.json
    python benchmarks/learning_parity.py --model gla-340M --steps 300 --peer fp8-fused --out fp8.json --plot fp8.png

The data is the sample corpus (the Python standard library as prose and code, `fabric_lin.data.SampleCorpus`):
real text, built on the machine, the same batches for both models. Reported: both losses at every step, the
relative difference |ours - peer| / peer per step, its mean, the final losses (last step and the mean of the
last 10), and for GLA the share of chunks whose intra-chunk scores take the slower path of the Triton kernels
(`fabric_lin.ops.gla.gate.levels_share`) at the first step, the middle one and the last.
"""
import argparse
import math
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import write_result
from fabric_lin.config import Config
from fabric_lin.lr_schedule import learning_rate
from fabric_lin.model import GPT


def sample_batches(steps: int, batch_size: int, seq_len: int, vocab_size: int) -> list:
    """`steps` batches [batch_size, seq_len + 1] of the sample corpus's training split, on the CPU."""
    from fabric_lin.data import SampleCorpus
    from fabric_lin.data.tokenizer import Tokenizer

    data = SampleCorpus(num_workers=0)
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
    from fabric_lin.weights import MODEL_FILE
    from fabric_lin.convert.hf import convert_to_hf

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, hf_dir = Path(tmp) / "model", Path(tmp) / "hf"
        model_dir.mkdir()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, model_dir / MODEL_FILE)
        config.save(model_dir / "model_config.yaml")
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


def plot_losses(rows: list, peer_name: str, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 1])
    steps = [r["step"] for r in rows]
    top.plot(steps, [r["loss_ours"] for r in rows], label="fabric-lin (bf16)" if peer_name.startswith("fp8") else "fabric-lin")
    top.plot(steps, [r["loss_peer"] for r in rows], label=peer_name, alpha=0.8)
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    bottom.plot(steps, [100 * r["relative_difference"] for r in rows], color="gray")
    bottom.set_ylabel("|difference| (%)")
    bottom.set_xlabel("step")
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


def train_side_by_side(batches, rows, ours, peer, opt_ours, opt_peer, args, min_lr, check_at, shares, share_at):
    """Both models one step each on every batch, appending a row per step to `rows`."""
    for step, batch in enumerate(batches):
        lr = learning_rate(step, args.lr, min_lr, args.warmup, args.steps, "cosine")
        batch = batch.cuda()
        shares.clear()
        losses = {}
        for name, model, opt in (("ours", ours, opt_ours), ("peer", peer, opt_peer)):
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if isinstance(model, GPT):
                    loss = model(batch[:, :-1], targets=batch[:, 1:])
                else:  # fla predicts labels[t + 1] at t and ignores the last position: the same targets as ours
                    loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name] = loss.item()
        if step in check_at and shares:
            share_at[step] = sum(shares) / len(shares)
        rows.append({"step": step, "lr": lr, "loss_ours": losses["ours"], "loss_peer": losses["peer"],
                     "relative_difference": abs(losses["ours"] - losses["peer"]) / losses["peer"]})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gla-340M", help="a fabric-lin model name (GLA or GDN)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--peer", choices=["fla", "fp8-tensorwise", "fp8-rowwise", "fp8-fused"], default="fla")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--plot", help="also draw both loss curves into this PNG (needs matplotlib)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("learning_parity.py needs a CUDA GPU (the fused kernels)")
    if args.plot:
        import matplotlib  # noqa: F401  (missing: fail now, not after the run)
    config = Config.from_name(args.model)
    if args.peer == "fla" and config.block_type not in ("gla", "gdn"):
        raise SystemExit(f"--model {args.model}: expected a GLA or Gated DeltaNet model (fla has its own class for each)")
    batches = sample_batches(args.steps, args.batch_size, args.seq_len, config.vocab_size)

    torch.manual_seed(args.seed)
    ours = GPT(config, fused=True)
    if args.peer == "fla":
        peer = fla_from_export(ours, config)
    else:
        peer = fp8_copy(ours, config, args.peer.removeprefix("fp8-"))
    guard_lifted = getattr(ours, "fla_guard_lifted", False)
    peer = peer.cuda().train()
    ours = ours.cuda().train()
    opt_ours = adamw(ours.named_parameters(), args.lr, args.weight_decay)
    opt_peer = adamw(peer.named_parameters(), args.lr, args.weight_decay)
    min_lr = 0.1 * args.lr
    check_at = {0, args.steps // 2, args.steps - 1}
    shares, share_at = [], {}
    hooks = gate_share_hooks(ours, shares) if config.block_type == "gla" else []

    rows = []
    start = time.perf_counter()
    # a time limit's SIGTERM ends the loop, and the steps done so far are still reported (marked "stopped_at_step")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt, as SIGINT does
    try:
        train_side_by_side(batches, rows, ours, peer, opt_ours, opt_peer, args, min_lr, check_at, shares, share_at)
    except KeyboardInterrupt:
        print(f"stopped after {len(rows)} of {args.steps} steps", flush=True)
    if not rows:
        raise SystemExit("no step finished")
    for hook in hooks:
        hook.remove()
    last = rows[-10:]
    final_ours = sum(r["loss_ours"] for r in last) / len(last)
    final_peer = sum(r["loss_peer"] for r in last) / len(last)
    report = {
        "model": args.model, "peer": args.peer, "steps": args.steps, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "seconds": round(time.perf_counter() - start, 1),
        "mean_relative_difference": sum(r["relative_difference"] for r in rows) / len(rows),
        "median_relative_difference": statistics.median(r["relative_difference"] for r in rows),
        "final_loss_ours": rows[-1]["loss_ours"], "final_loss_peer": rows[-1]["loss_peer"],
        "final_relative_difference": abs(rows[-1]["loss_ours"] - rows[-1]["loss_peer"]) / rows[-1]["loss_peer"],
        "last_10_mean_loss_ours": final_ours, "last_10_mean_loss_peer": final_peer,
        "last_10_relative_difference": abs(final_ours - final_peer) / final_peer,
        "levels_share_at_step": share_at,
        "fla_gdn_hopper_guard_lifted": guard_lifted,
        "stopped_at_step": None if len(rows) == args.steps else len(rows),
        "diverged": any(not math.isfinite(r[key]) for r in rows for key in ("loss_ours", "loss_peer")),
        "per_step": rows,
    }
    write_result(report, args.out, fla_ran=args.peer == "fla")
    if args.plot:
        plot_losses(rows, args.peer, f"{args.model}: fabric-lin vs {args.peer}, {args.batch_size} x {args.seq_len}", args.plot)


if __name__ == "__main__":
    main()
