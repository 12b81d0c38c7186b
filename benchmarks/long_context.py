"""Long-context comparison of the families on one GPU, the seed notes' long-document table: the Transformer, GLA,
Gated DeltaNet and DeltaNet at contexts 2K to 32K, at the same tokens per step, on the long-document corpus
(`fabric_lin.data.LongDocuments`: the installed torch's Python sources, each package a document of 64K+ tokens,
every block cut from within one document). A cell is one family at one context, a process of its own, and
measures two things:

- speed: the family's `--size` model (340M), `--speed_warmup` untimed steps, then `--speed_steps` timed ones:
  the median step's tokens/s and the peak memory. A run out of GPU memory is repeated with activation
  checkpointing (each Block's activations recomputed in the backward pass), and the table says so.
- quality: the family's `--size` model with `--quality_layers` layers (its width and heads; the corpus's
  4096-token vocabulary), trained from the same seed for `--quality_steps` steps, the same number of tokens at
  every context, then `fabric_lin.evaluate`'s loss on the same held-out tokens: `--val_windows` windows of
  `--eval_window` + 1 tokens from the held-out documents, each read at the cell's context as consecutive pieces
  (every context predicts exactly the same tokens, each piece from its own tokens only): the perplexity, and
  the loss by position in buckets 0-2K, 2K-8K, 8K-16K and 16K-32K, which shows whether a family uses the
  context past 2K.

Both train in bf16 autocast over fp32 weights with fused AdamW, a warm-up then a cosine learning rate, no compile.
Before any cell the whole plan is checked against the corpus (every context's training blocks, the quality runs'
tokens read once, the held-out windows, every model at every context); what does not fit is listed and nothing
runs. `--check_plan` stops there.

Results go to `--out`, one JSON document into which each cell's row is merged as soon as the cell ends (the row
of the same family and context replaced), so that calls of a few families or contexts each fill the same file;
a file of another plan (other settings or corpus) is refused. The Markdown table is rebuilt from all its rows.

    python benchmarks/long_context.py --families gla --out long_context.json    # one family, every context
    python benchmarks/long_context.py --check_plan                              # the plan against the corpus
    python benchmarks/long_context.py --device cpu --size debug --quality_layers 1 --tokens_per_step 2048 \\
        --contexts 2048 --eval_window 2048 --speed_steps 1 --speed_warmup 0 --quality_steps 1 --val_windows 1
"""
import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from common import out_arg, run_record, write_result
from fabric_lin.config import Config
from fabric_lin.errors import UserError
from fabric_lin.lr_schedule import learning_rate

FAMILIES = ("transformer", "gla", "gdn", "deltanet")
CONTEXTS = (2048, 8192, 16384, 32768)
POSITION_EDGES = [2048, 8192, 16384]  # the buckets of the loss by position: 0-2K, 2K-8K, 8K-16K, 16K to the end
PARTS = ("speed", "quality")
# the settings that make rows comparable: a --out file holds the rows of one plan
PLAN_SETTINGS = ("size", "tokens_per_step", "speed_warmup", "speed_steps", "quality_layers", "quality_steps",
                 "quality_warmup", "lr", "val_windows", "eval_window", "seed", "device")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    parser.add_argument("--size", default="340M", help="the models <family>-<size>: 340M, or debug for the CPU")
    parser.add_argument("--tokens_per_step", type=int, default=32768, help="the micro batch is this / the context")
    parser.add_argument("--speed_warmup", type=int, default=3, help="untimed first steps of the speed run")
    parser.add_argument("--speed_steps", type=int, default=10, help="timed steps of the speed run")
    parser.add_argument("--quality_layers", type=int, default=6, help="layers of the quality run's model")
    parser.add_argument("--quality_steps", type=int, default=300, help="optimizer steps of the quality run")
    parser.add_argument("--quality_warmup", type=int, default=30, help="the quality run's learning-rate warm-up steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (a tenth of it at the end)")
    parser.add_argument("--val_windows", type=int, default=16, help="held-out windows every cell is evaluated on")
    parser.add_argument("--eval_window", type=int, default=32768,
                        help="tokens per held-out window (a multiple of every context), read in pieces of the context")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a try with tiny models (--size debug)")
    parser.add_argument("--cache_dir", type=Path, help="where the corpus is built (default: LongDocuments')")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per cell process")
    parser.add_argument("--out", type=out_arg, help="the JSON document that the rows are merged into")
    parser.add_argument("--check_plan", action="store_true", help="check the plan against the corpus, print it, stop")
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--activation_checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("tokens_per_step", "speed_steps", "quality_layers", "quality_steps", "val_windows", "eval_window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.contexts) < 1:
        parser.error(f"--contexts must be positive numbers of tokens, got {args.contexts}")
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.check_plan:
        parser.error("long_context.py needs a CUDA GPU (--device cpu --size debug runs tiny models on the CPU)")
    return args


# ---------------------------------------------------------------- the data


def corpus(args):
    from fabric_lin.data import LongDocuments

    return LongDocuments(cache_dir=args.cache_dir, seed=args.seed, num_workers=0)


def connected(data, context: int, batch_size: int, vocab_size: int):
    """`data` set up to give blocks of `context` + 1 tokens, `batch_size` at a time (built first if need be)."""
    from fabric_lin.data import Tokenizer

    data.prepare_data()
    data.connect(tokenizer=Tokenizer(data.tokenizer_dir), batch_size=batch_size, max_seq_length=context,
                 vocab_size=vocab_size)
    data.setup()
    return data


def training_batches(data, context: int, micro_batch: int, vocab_size: int) -> Iterator[torch.Tensor]:
    """The corpus's training stream at `context`: micro batches [micro_batch, context + 1], without end."""
    return iter(connected(data, context, micro_batch, vocab_size).train_dataloader())


def held_out_windows(data, window: int, count: int, vocab_size: int) -> torch.Tensor:
    """`count` windows [count, window + 1] of the held-out split, taken from its documents in turn (each one's first
    window, then each one's second, ...), so that they come from as many documents as they can. A document is a
    chunk file of the split, which the loader cuts into windows in order."""
    from fabric_lin.data.prepared import chunk_tokens

    windows = [batch[0] for batch in connected(data, window, 1, vocab_size).val_dataloader()]
    places = [(k, document) for document, n in enumerate(chunk_tokens(data.val_path) // (window + 1)) for k in range(n)]
    if len(places) != len(windows):  # the loader reads every window of every chunk file, in order
        raise RuntimeError(f"{data.val_path}: its chunk files hold {len(places)} windows, the loader gave {len(windows)}")
    if len(windows) < count:
        raise UserError(f"the held-out split gives {len(windows)} windows of {window + 1} tokens, {count} were asked "
                        f"(--val_windows)")
    return torch.stack([windows[i] for i in sorted(range(len(places)), key=places.__getitem__)[:count]])


class Pieces:
    """Held-out windows [N, window + 1] read at `context`: each window's consecutive pieces of context + 1 tokens
    (inputs and shifted targets; a piece's last token is the next one's first), `batch_size` pieces a batch. What
    `fabric_lin.evaluate.evaluate_length` reads: every context predicts the same tokens of the windows."""

    def __init__(self, windows: torch.Tensor, context: int, batch_size: int):
        per_window = (windows.shape[1] - 1) // context
        self.pieces = torch.stack([window[i * context : (i + 1) * context + 1]
                                   for window in windows for i in range(per_window)])
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.pieces) // self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.pieces.split(self.batch_size))


# ---------------------------------------------------------------- the models


def micro_batch_size(args, context: int) -> int:
    """Blocks per step at `context`: every context trains on --tokens_per_step tokens a step (check_plan refuses a
    context that does not divide them)."""
    return args.tokens_per_step // context


def speed_config(family: str, context: int, args) -> Config:
    return Config.from_name(f"{family}-{args.size}", max_seq_length=context)


def quality_config(family: str, context: int, args, vocab_size: int) -> Config:
    return Config.from_name(f"{family}-{args.size}", num_layers=args.quality_layers, vocab_size=vocab_size,
                            max_seq_length=context)


def build_model(config: Config, device: torch.device, seed: int, activation_checkpointing: bool):
    from fabric_lin.model import GPT, Block

    torch.manual_seed(seed)
    model = GPT(config, fused=device.type == "cuda")
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    return model.to(device).train()


def train(model, batches: Iterator[torch.Tensor], steps: int, warmup: int, lr: float, device: torch.device):
    """`steps` optimizer steps on the next batches, the learning rate warmed up over `warmup` steps then cosine
    to a tenth: (seconds of each step, loss of each step)."""
    cuda = device.type == "cuda"
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    seconds, losses = [], []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, lr, lr / 10, warmup, steps, "cosine")
        batch = next(batches).to(device)
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
        seconds.append(time.perf_counter() - start)
    return seconds, losses


# ---------------------------------------------------------------- a cell


def measure_speed(family: str, context: int, args, activation_checkpointing: bool) -> Dict:
    device = torch.device(args.device)
    config = speed_config(family, context, args)
    micro_batch = micro_batch_size(args, context)
    batches = training_batches(corpus(args), context, micro_batch, config.vocab_size)
    model = build_model(config, device, args.seed, activation_checkpointing)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, losses = train(model, batches, args.speed_warmup + args.speed_steps, args.speed_warmup, args.lr, device)
    timed = seconds[args.speed_warmup:]
    return {
        "model": config.name, "parameters": sum(p.numel() for p in model.parameters()), "micro_batch": micro_batch,
        "activation_checkpointing": activation_checkpointing,
        "tokens_per_s": round(args.tokens_per_step / statistics.median(timed)),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "first_step_s": round(seconds[0], 2), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
    }


def measure_quality(family: str, context: int, args, activation_checkpointing: bool) -> Dict:
    import lightning_fabric as L

    from fabric_lin.batches import batch_fingerprint
    from fabric_lin.data import Tokenizer
    from fabric_lin.evaluate import bucket_starts, evaluate_length

    device = torch.device(args.device)
    data = corpus(args)
    data.prepare_data()
    vocab_size = Tokenizer(data.tokenizer_dir).vocab_size
    config = quality_config(family, context, args, vocab_size)
    micro_batch = micro_batch_size(args, context)
    model = build_model(config, device, args.seed, activation_checkpointing)
    start = time.perf_counter()
    _, losses = train(model, training_batches(data, context, micro_batch, vocab_size), args.quality_steps,
                      args.quality_warmup, args.lr, device)
    train_seconds = time.perf_counter() - start

    windows = held_out_windows(data, args.eval_window, args.val_windows, vocab_size)
    fabric = L.Fabric(accelerator=device.type, devices=[device.index or 0] if device.type == "cuda" else 1,
                      precision="bf16-mixed" if device.type == "cuda" else "32-true")
    model.eval()
    result = evaluate_length(fabric, model, Pieces(windows, context, micro_batch), context, micro_batch, None,
                             bucket_starts(context, None, POSITION_EDGES))
    return {
        "model": f"{config.name}, num_layers {config.num_layers}, vocab_size {config.vocab_size}",
        "parameters": sum(p.numel() for p in model.parameters()), "micro_batch": micro_batch,
        "activation_checkpointing": activation_checkpointing,
        "train_tokens": args.quality_steps * args.tokens_per_step, "train_seconds": round(train_seconds, 1),
        "train_loss_first": round(losses[0], 4), "train_loss_last": round(losses[-1], 4),
        "val_tokens": result["tokens"], "val_loss": round(result["loss"], 4),
        "val_perplexity": round(math.exp(result["loss"]), 3),
        # the same at every context: the held-out windows themselves
        "held_out_fingerprint": int(batch_fingerprint(windows)),
        "by_position": {key: result["by_position"][key] for key in ("start", "end", "loss", "tokens")},
    }


def run_cell(family: str, context: int, args) -> Dict:
    """The parts asked of one cell, in this process; a part out of GPU memory says so and the next one runs."""
    row: Dict = {"family": family, "context": context}
    for part, measure in (("speed", measure_speed), ("quality", measure_quality)):
        if part not in args.parts:
            continue
        try:
            row[part] = measure(family, context, args, args.activation_checkpointing)
        except torch.cuda.OutOfMemoryError as e:
            row[part] = {"out_of_memory": True, "activation_checkpointing": args.activation_checkpointing,
                         "error": str(e).splitlines()[0]}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def run_isolated(family: str, context: int, argv: List[str], args, parts: Sequence[str],
                 activation_checkpointing: bool) -> Dict:
    """One cell in a process of its own (a clean GPU and peak-memory count): its row, or why there is none."""
    command = [sys.executable, __file__, *argv, "--worker", family, str(context), "--parts", *parts]
    if activation_checkpointing:
        command.append("--activation_checkpointing")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"family": family, "context": context, "error": f"no result within {args.timeout:.0f} s (--timeout)"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    why = done.stderr.strip()[-800:] or f"exit code {done.returncode}"
    return {"family": family, "context": context, "error": why}


def measure_cell(family: str, context: int, argv: List[str], args) -> Dict:
    """Both parts of a cell; a part out of memory again with activation checkpointing, in a process of its own."""
    start = time.perf_counter()
    row = run_isolated(family, context, argv, args, PARTS, activation_checkpointing=False)
    for part in PARTS:
        if row.get(part, {}).get("out_of_memory"):
            retry = run_isolated(family, context, argv, args, [part], activation_checkpointing=True)
            row[part] = retry.get(part, {"error": retry.get("error", "no result"), "activation_checkpointing": True})
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


# ---------------------------------------------------------------- the plan


def check_plan(args) -> Dict:
    """Every cell's data and models against the corpus, before any runs: what each context reads from the training
    split (a step's micro batch, and the quality run's blocks, each read once), the held-out windows, every model's
    configuration at every context. Raises SystemExit listing each part that does not fit; returns the plan."""
    from fabric_lin.data import Tokenizer
    from fabric_lin.data.prepared import chunk_tokens

    data = corpus(args)
    data.prepare_data()
    vocab_size = Tokenizer(data.tokenizer_dir).vocab_size
    document_tokens = chunk_tokens(data.train_path)
    longest_training = int(document_tokens.max(initial=0))
    longest_held_out = int(chunk_tokens(data.val_path).max(initial=0))
    problems, cells = [], []
    for context in args.contexts:
        if args.tokens_per_step % context or args.eval_window % context:
            problems.append(f"context {context}: --tokens_per_step {args.tokens_per_step} and --eval_window "
                            f"{args.eval_window} must be multiples of it (the same tokens per step and held-out tokens)")
            continue
        # each chunk file of the corpus is one document, and a block never crosses documents: said here in this
        # script's terms, not the loader's (which names pretrain's train.max_seq_length and chunk_size)
        if context + 1 > longest_training:
            problems.append(f"context {context}: a training block of {context + 1} tokens lies within one document, "
                            f"and the longest training document holds {longest_training}: leave it out "
                            f"of --contexts")
            continue
        micro_batch = micro_batch_size(args, context)
        blocks = int((document_tokens // (context + 1)).sum())
        if 0 < blocks < args.quality_steps * micro_batch:  # no block at all: the loader says why below
            problems.append(f"context {context}: the quality runs read {args.quality_steps * micro_batch} blocks of "
                            f"{context + 1} tokens (--quality_steps x micro batch {micro_batch}), the training split "
                            f"holds {blocks}: lower --quality_steps")
        try:
            batch = next(training_batches(data, context, micro_batch, vocab_size))
            if batch.shape != (micro_batch, context + 1):
                problems.append(f"context {context}: the training loader gave a batch of shape {tuple(batch.shape)}, "
                                f"expected ({micro_batch}, {context + 1})")
        except UserError as e:
            problems.append(f"context {context}: {e}")
        cells += [{"family": family, "context": context, "micro_batch": micro_batch, "training_blocks": blocks}
                  for family in args.families]
    for family in args.families:  # a model is the same at every context: its configuration checks every value
        try:
            speed_config(family, max(args.contexts), args), quality_config(family, max(args.contexts), args, vocab_size)
        except UserError as e:
            problems.append(f"{family}: {e}")
    windows = None
    if args.eval_window + 1 > longest_held_out:
        problems.append(f"--eval_window {args.eval_window}: a held-out window of {args.eval_window + 1} tokens lies "
                        f"within one document, and the longest held-out document holds {longest_held_out}: lower "
                        f"--eval_window (with the contexts it is a multiple of)")
    else:
        try:
            windows = held_out_windows(data, args.eval_window, args.val_windows, vocab_size)
        except UserError as e:
            problems.append(f"--eval_window {args.eval_window}: {e}")
    if problems:
        raise SystemExit("long_context.py: the plan does not fit the long-document corpus "
                         f"({data.data_path}):\n  " + "\n  ".join(problems))
    info = json.loads((Path(data.data_path) / "corpus.json").read_text(encoding="utf-8"))
    return {
        "corpus": {"path": str(data.data_path), "fingerprint": info["fingerprint"], "source": info["source"],
                   "tokenizer_sha256": info["tokenizer_sha256"], "train": info["train"], "val": info["val"]},
        "held_out_tokens": windows.shape[0] * args.eval_window,
        "cells": cells,
    }


# ---------------------------------------------------------------- the results


def settings(args, plan: Dict) -> Dict:
    return {**{name: getattr(args, name) for name in PLAN_SETTINGS}, "corpus_fingerprint": plan["corpus"]["fingerprint"]}


def earlier_rows(path: Optional[str], these_settings: Dict) -> List[Dict]:
    """The rows already in --out, which must come from the same plan."""
    if not path or not Path(path).is_file():
        return []
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    if document.get("settings") != these_settings:
        theirs = document.get("settings") or {}
        differ = [f"{key} {theirs.get(key)!r} there, {value!r} here" for key, value in these_settings.items()
                  if theirs.get(key) != value]
        raise SystemExit(f"long_context.py: --out {path} holds the rows of another plan ({'; '.join(differ)}): "
                         f"give another --out, or the same settings")
    return document["rows"]


def merged(rows: List[Dict], row: Dict) -> List[Dict]:
    kept = [r for r in rows if (r["family"], r["context"]) != (row["family"], row["context"])]
    return sorted(kept + [row], key=lambda r: (FAMILIES.index(r["family"]), r["context"]))


def position_label(start: int, end: int) -> str:
    def short(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    return f"{short(start)}-{short(end)}"


def markdown_table(rows: List[Dict], eval_window: int) -> str:
    starts = [0] + [edge for edge in POSITION_EDGES if edge < eval_window]
    buckets = list(zip(starts, starts[1:] + [eval_window]))
    header = ["family", "context", "micro batch", "tokens/s", "peak memory (GiB)", "val perplexity",
              *[f"loss {position_label(s, e)}" for s, e in buckets], "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        speed, quality = row.get("speed", {}), row.get("quality", {})
        notes = []
        for part, measured in (("speed", speed), ("quality", quality)):
            if measured.get("out_of_memory"):
                with_checkpointing = " with activation checkpointing" if measured.get("activation_checkpointing") else ""
                notes.append(f"{part}: out of memory{with_checkpointing}")
            elif "error" in measured:
                notes.append(f"{part}: {measured['error'].splitlines()[-1][:80]}")
            elif measured.get("activation_checkpointing"):
                notes.append(f"{part}: activation checkpointing")
        if "error" in row:
            notes.append(row["error"].splitlines()[-1][:80])
        # a context's buckets start at the columns' edges; its last one ends at the context, which may fall short of
        # the column's end (context 1K: positions 0-1K of column 0-2K), so a bucket is placed by its start
        loss_at = {}
        if "by_position" in quality:
            loss_at = dict(zip(quality["by_position"]["start"], quality["by_position"]["loss"]))
        cells = [
            row["family"], f"{row['context']:,}", str(speed.get("micro_batch", quality.get("micro_batch", "-"))),
            f"{speed['tokens_per_s']:,}" if "tokens_per_s" in speed else "-",
            str(speed["peak_memory_gib"]) if speed.get("peak_memory_gib") is not None else "-",
            f"{quality['val_perplexity']:.2f}" if "val_perplexity" in quality else "-",
            *[f"{loss_at[start]:.3f}" if start in loss_at else "-" for start, _ in buckets],
            "; ".join(notes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_rows(args, plan: Dict, rows: List[Dict]) -> None:
    """--out written anew (atomically) with every row."""
    write_result({"settings": settings(args, plan), "corpus": plan["corpus"], "rows": rows,
                  "table": markdown_table(rows, args.eval_window)}, args.out, echo=False)


def summary_line(row: Dict) -> str:
    speed, quality = row.get("speed", {}), row.get("quality", {})
    parts = [f"{row['family']} at {row['context']}:"]
    if "tokens_per_s" in speed:
        memory = f", {speed['peak_memory_gib']} GiB" if speed.get("peak_memory_gib") is not None else ""
        checkpointing = " (activation checkpointing)" if speed["activation_checkpointing"] else ""
        parts.append(f"{speed['tokens_per_s']:,} tokens/s{memory}{checkpointing}")
    if "val_perplexity" in quality:
        parts.append(f"perplexity {quality['val_perplexity']:.2f} after {quality['train_tokens']:,} tokens")
    for part, measured in (("speed", speed), ("quality", quality)):
        if "error" in measured:
            parts.append(f"{part}: {measured['error'].splitlines()[-1][:120]}")
    if "error" in row:
        parts.append(row["error"].splitlines()[-1][:200])
    return " ".join(parts) + f" ({row.get('seconds', 0):.0f} s)"


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:  # one cell, in this process: its row as the last line
        print(json.dumps(run_cell(args.worker[0], int(args.worker[1]), args)), flush=True)
        return []

    plan = check_plan(args)
    corpus_info = plan["corpus"]
    print(f"long-document corpus {corpus_info['fingerprint']} ({corpus_info['source']['package']} "
          f"{corpus_info['source']['version']}): {corpus_info['train']['tokens']:,} training tokens, "
          f"{plan['held_out_tokens']:,} held-out tokens read by every cell", flush=True)
    if args.check_plan:
        print(json.dumps(plan, indent=1))
        return []
    rows = earlier_rows(args.out, settings(args, plan))  # a file of another plan refused before the first cell
    cells = [(family, context) for family in args.families for context in args.contexts]
    for done, (family, context) in enumerate(cells):
        try:
            row = measure_cell(family, context, argv, args)
        except KeyboardInterrupt:  # Ctrl-C: which of this call's cells --out lacks, rather than a traceback
            left = ", ".join(f"{f} at {c}" for f, c in cells[done:])
            kept = f"{args.out} holds the {done} finished before it" if args.out else "nothing is written (no --out)"
            print(f"long_context.py: interrupted during {family} at {context}: {kept}; not measured: {left}",
                  file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        rows = merged(rows, {**row, "run": run_record()})
        if args.out:
            write_rows(args, plan, rows)
        print(summary_line(row), flush=True)
    print(markdown_table(rows, args.eval_window))
    return rows


if __name__ == "__main__":
    main()
