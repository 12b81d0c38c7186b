"""Long-context comparison of the families on one GPU: the Transformer, GLA, Gated DeltaNet and DeltaNet at
340M, each trained at contexts from 2K to 32K with the same tokens per step, on the same data. Per (model,
context): steady-state tokens/s, peak memory and the validation perplexity after the same tokens - the seed
notes' long-document table, measured. Prints one JSON document (and writes it to --out) and the table as
Markdown.

    python benchmarks/long_context.py --out long_context.json
    python benchmarks/long_context.py --models gla-340M gdn-340M --contexts 2048 32768 --steps 60

Every run starts from the same seed, trains `--steps` optimizer steps of `--tokens_per_step` tokens (micro
batch = tokens_per_step / context) from the sample corpus's training split (its 4096-piece tokenizer; the
340M models keep their 32000-entry vocabulary), bf16 autocast over fp32 weights, fused AdamW, warm-up then
cosine learning rate, no compile. Tokens/s is the median step after `--warmup` untimed steps. The perplexity
is exp of the mean loss over the same `--val_tokens` tokens of the validation split, read in windows of the
run's own context. Each run is a process of its own; a run out of GPU memory is repeated with activation
checkpointing (each Block's activations recomputed in the backward pass), and the table says so; one that still
does not fit is reported as out of memory.
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch

from common import write_result
from fabric_lin.config import Config
from fabric_lin.lr_schedule import learning_rate

MODELS = ("transformer-340M", "gla-340M", "gdn-340M", "deltanet-340M")
CONTEXTS = (2048, 8192, 16384, 32768)


def corpus(split: str, windows: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """`windows` sequences [windows, seq_len + 1] of the sample corpus's `split` ("train" or "val"), in the
    loaders' fixed order, on the CPU."""
    from fabric_lin.data import SampleCorpus
    from fabric_lin.data.tokenizer import Tokenizer

    data = SampleCorpus(num_workers=0)
    data.prepare_data()
    data.connect(tokenizer=Tokenizer(data.tokenizer_dir), batch_size=1, max_seq_length=seq_len, vocab_size=vocab_size)
    data.setup()
    rows = []
    while len(rows) < windows:
        before = len(rows)
        for batch in data.train_dataloader() if split == "train" else data.val_dataloader():
            rows.append(batch[0].long())
            if len(rows) == windows:
                break
        if split == "val" and len(rows) == before:
            raise SystemExit(f"the sample corpus's validation split holds no window of {seq_len + 1} tokens")
        if split == "val":
            break
    if len(rows) < windows:
        raise SystemExit(f"--val_tokens: the validation split holds {len(rows)} windows of {seq_len + 1} tokens, "
                         f"{windows} were asked for; give fewer tokens")
    return torch.stack(rows)


def train_and_measure(model_name: str, context: int, args, activation_checkpointing: bool) -> dict:
    from fabric_lin.model import GPT, Block

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.tokens_per_step % context:
        raise SystemExit(f"--tokens_per_step {args.tokens_per_step} is not a multiple of the context {context}")
    micro_batch = args.tokens_per_step // context
    config = Config.from_name(model_name, max_seq_length=context)
    train = corpus("train", (args.warmup + args.steps) * micro_batch, context, config.vocab_size)
    val = corpus("val", args.val_tokens // context, context, config.vocab_size)

    torch.manual_seed(args.seed)
    model = GPT(config, fused=cuda)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    model = model.to(device).train()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step_seconds, losses = [], []
    total_steps = args.warmup + args.steps
    for step in range(total_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.lr, args.lr / 10, args.warmup, total_steps, "cosine")
        batch = train[step * micro_batch:(step + 1) * micro_batch].to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step
        step_seconds.append(time.perf_counter() - start)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    model.eval()
    val_losses = []
    with torch.no_grad(), autocast:
        for window in val.split(1):
            window = window.to(device)
            val_losses.append(model(window[:, :-1], targets=window[:, 1:]).item())
    val_loss = sum(val_losses) / len(val_losses)
    return {
        "model": model_name, "context": context, "micro_batch": micro_batch,
        "activation_checkpointing": activation_checkpointing,
        "tokens_per_s": round(args.tokens_per_step / statistics.median(step_seconds[args.warmup:])),
        "peak_memory_gib": round(peak_gib, 2) if peak_gib is not None else None,
        "first_step_s": round(step_seconds[0], 1), "train_loss_first": round(losses[0], 4),
        "train_loss_last": round(losses[-1], 4), "train_tokens": total_steps * args.tokens_per_step,
        "val_tokens": len(val_losses) * context, "val_loss": round(val_loss, 4),
        "val_perplexity": round(math.exp(val_loss), 2),
    }


def run_isolated(model_name: str, context: int, args, activation_checkpointing: bool) -> dict:
    """One run in a process of its own (a clean GPU and peak-memory count); its result, or why there is none."""
    command = [sys.executable, __file__, "--worker", model_name, str(context), *sys.argv[1:]]
    if activation_checkpointing:
        command.append("--activation_checkpointing")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model_name, "context": context, "error": f"no result within {args.timeout} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"model": model_name, "context": context, "error": done.stderr.strip()[-600:] or f"exit {done.returncode}"}


def markdown_table(rows: list) -> str:
    lines = ["| model | context | tokens/s | peak memory (GiB) | val perplexity | note |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            note = "out of memory" if row.get("out_of_memory") else row["error"].splitlines()[-1][:80]
            lines.append(f"| {row['model']} | {row['context']} | - | - | - | {note} |")
            continue
        note = "activation checkpointing" if row["activation_checkpointing"] else ""
        memory = row["peak_memory_gib"] if row["peak_memory_gib"] is not None else "-"
        lines.append(f"| {row['model']} | {row['context']} | {row['tokens_per_s']:,} | {memory} | "
                     f"{row['val_perplexity']} | {note} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="fabric-lin model names")
    parser.add_argument("--contexts", nargs="*", type=int, default=list(CONTEXTS))
    parser.add_argument("--tokens_per_step", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (also the learning rate's warm-up)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val_tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a try with tiny models")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--activation_checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for context in args.contexts:
        if args.val_tokens < context:
            parser.error(f"--val_tokens {args.val_tokens} is less than one window of context {context}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("long_context.py needs a CUDA GPU (--device cpu runs tiny models on the CPU)")

    if args.worker:  # one run, in this process
        model_name, context = args.worker[0], int(args.worker[1])
        try:
            result = train_and_measure(model_name, context, args, args.activation_checkpointing)
        except torch.cuda.OutOfMemoryError as e:
            result = {"model": model_name, "context": context, "out_of_memory": True,
                      "activation_checkpointing": args.activation_checkpointing, "error": str(e).splitlines()[0]}
        print(json.dumps(result), flush=True)
        return

    corpus("val", 1, 16, 4096)  # the sample corpus built (or found) once, before the runs read it
    rows = []
    for model_name in args.models:
        for context in args.contexts:
            row = run_isolated(model_name, context, args, activation_checkpointing=False)
            if row.get("out_of_memory"):
                row = run_isolated(model_name, context, args, activation_checkpointing=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = markdown_table(rows)
    write_result({"tokens_per_step": args.tokens_per_step, "steps": args.steps, "warmup": args.warmup,
                  "lr": args.lr, "val_tokens": args.val_tokens, "device": args.device, "results": rows,
                  "table": table}, args.out)
    print(table)


if __name__ == "__main__":
    main()
