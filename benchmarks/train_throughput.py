"""Training throughput of gla-340M on one GPU, side by side with flash-linear-attention's
GLAForCausalLM (same config, batch and optimizer) and fabric-lin's transformer-340M.

Regime (a) "bf16-weights": weights in bf16, fused AdamW, no compile, micro batch x context tokens per
step, random tokens - the regime in which flash-linear-attention's own trainer is usually measured.
Regime (b) "real-loop": `fabric-lin pretrain` itself (bf16-mixed, each Block compiled, the Fabric step,
a prepared corpus through the data loader: bench_corpus.py), tokens/s as the trainer logs it.
Each measurement runs in its own process with a time limit (a peer that spends its limit autotuning
is reported as such). Prints one JSON object; run on a GPU:

    python benchmarks/train_throughput.py --batch_size 16 --seq_len 2048 --steps 20
    python benchmarks/train_throughput.py --batch_size 2 --seq_len 16384 --models fabric-lin,transformer
    python benchmarks/train_throughput.py --models fla,fabric-lin-compiled,fabric-lin-fp8,fabric-lin-fp8-fused \
        --regimes bf16-weights,real-loop      # FP8 (H100/H200): the models a regime does not run are skipped
    python benchmarks/train_throughput.py --models gla-1B,gla-1B-fp8,gla-1B-fp8-fused --regimes real-loop
"""
import argparse
import functools
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

import torch

from bench_corpus import benchmark_corpus, pretrain_data_args
from common import out_arg, write_result
from fabric_lin.config import Config
from fabric_lin.flops import flops_per_token, peak_flops
from fabric_lin.model import GPT, Launches


def fla_model(config: Config):
    import fla.models

    from common import lift_fla_gdn_hopper_guard
    from fabric_lin.convert.hf import fla_config

    if config.block_type == "gdn":
        lift_fla_gdn_hopper_guard()  # timed only: its losses are not taken as a reference here

    # the same config.json fields that `fabric-lin convert_to_hf` writes (fused norm, swiglu and
    # cross-entropy on), less the keys that name the format rather than the model
    fields = fla_config(config)
    architecture = fields["architectures"][0]  # GLAForCausalLM or GatedDeltaNetForCausalLM
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type", "fabric_lin")}
    config_class = getattr(fla.models, architecture.replace("ForCausalLM", "Config"))
    model = getattr(fla.models, architecture)(config_class(**fields))

    def loss_fn(ids, targets):
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn


def ours(config: Config, gla_launch=None, compiled=False, fp8_recipe="none"):
    # the fused Triton ops, chosen when the model is built (it is built on the CPU, then moved to the GPU);
    # gla_launch: the GLA kernels' launch settings (None: the shipped ones); compiled: each Block compiled as
    # the trainer does; fp8_recipe: its Linear layers converted as `--fp8.recipe` does
    from fabric_lin.fp8 import FP8Args, convert_to_fp8

    fp8 = FP8Args(recipe=fp8_recipe)
    model = GPT(config, fused=True, launch=Launches() if gla_launch is None else Launches(gla=gla_launch),
                float8=fp8.torchao, fp8_products=fp8.recipe == "fused")
    if fp8.torchao:
        convert_to_fp8(model, fp8)
    if compiled:
        for block in model.layers:
            block.compile()

    def loss_fn(ids, targets):
        return model(ids, targets=targets)

    return model, loss_fn


def measure(name, build, config, batch_size, seq_len, steps, warmup, extra=None, profile_steps=0):
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model, loss_fn = build(config)
    model = model.cuda().to(torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    data = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device="cuda")
    ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def train_step():
        loss = loss_fn(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    times = []
    compile_start = time.perf_counter()
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step == 0:
            first_step = time.perf_counter() - compile_start
    if profile_steps:  # after the timed steps, so that profiling costs them nothing
        from profile_step import profiler, summarize_trace

        with profiler() as prof:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(profile_steps):
                loss = train_step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            extra = dict(extra or {}, profile=summarize_trace(Path(f"{tmp}/trace.json"), profile_steps, wall))
    step_time = sorted(times[warmup:])[len(times[warmup:]) // 2]  # median
    tokens_per_s = batch_size * seq_len / step_time
    peak = peak_flops(torch.device("cuda"), "bf16-true")
    result = {
        "model": name,
        "tokens_per_s": round(tokens_per_s),
        "ms_per_step": round(step_time * 1e3, 2),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "mfu": round(tokens_per_s * flops_per_token(config, seq_len) / peak, 4) if peak else None,
        "first_step_s": round(first_step, 1),
        "final_loss": round(loss.item(), 3),
        **(extra or {}),
    }
    del model, optimizer, loss
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(result), flush=True)
    return result


REGIME_A_MODELS = ("fabric-lin", "fabric-lin-tuned", "fabric-lin-compiled", "fabric-lin-fp8", "fabric-lin-fp8-fused",
                   "gla-1B-compiled", "gla-1B-fp8-fused", "fla", "transformer", "gdn", "fla-gdn")
REAL_LOOP_CONFIGS = {  # key: (recipe, extra arguments)
    "fabric-lin": ("config_hub/gla_340M.yaml", []),
    # the same with shapes specialised, to show what marking them dynamic costs in step time
    "fabric-lin-static": ("config_hub/gla_340M.yaml", ["--compile.dynamic", "false"]),
    # several GPUs (the recipe: FSDP with the whole model one unit): one FSDP unit per Block instead, its
    # gathered weights kept from its forward to its backward pass and across accumulated micro-batches
    "fabric-lin-fsdp-block": ("config_hub/gla_340M.yaml", ["--parallelism.fsdp_unit", "block"]),
    # the same, each Block's weights freed after its forward pass and gathered again for its backward pass
    "fabric-lin-fsdp-block-reshard": ("config_hub/gla_340M.yaml", ["--parallelism.fsdp_unit", "block",
                                                                "--parallelism.fsdp_reshard_after_forward", "true"]),
    # several GPUs: DistributedDataParallel instead of FSDP (whole model on every GPU, fewer host hooks)
    "fabric-lin-ddp": ("config_hub/gla_340M.yaml", ["--parallelism.data_parallel", "ddp"]),
    # one GPU: each Block's forward and backward pass replayed as a CUDA graph (what "fabric-lin" runs on one
    # GPU by compile.mode auto) or launched kernel by kernel (what it runs on several)
    "fabric-lin-cudagraphs": ("config_hub/gla_340M.yaml", ["--compile.mode", "reduce-overhead"]),
    "fabric-lin-no-cudagraphs": ("config_hub/gla_340M.yaml", ["--compile.mode", "default"]),
    # the Linear layers' products in FP8 (torchao), one scale per tensor
    "fabric-lin-fp8": ("config_hub/gla_340M.yaml", ["--fp8.recipe", "tensorwise"]),
    "gla-1B": ("config_hub/gla_1B.yaml", []),
    "gla-1B-fp8": ("config_hub/gla_1B.yaml", ["--fp8.recipe", "tensorwise"]),
    # FP8 products made inside the fused ops (fabric_lin/ops/fp8_matmul.py), not by torchao's layers
    "gla-1B-fp8-fused": ("config_hub/gla_1B.yaml", ["--fp8.recipe", "fused"]),
    "fabric-lin-fp8-fused": ("config_hub/gla_340M.yaml", ["--fp8.recipe", "fused"]),
    "transformer": ("config_hub/transformer_340M.yaml", []),
    "gdn": ("config_hub/gdn_340M.yaml", []),
}
ROOT = Path(__file__).resolve().parent.parent


def real_loop(key, batch_size, seq_len, steps, warmup, timeout, devices=1, accumulation=1, num_workers=4):
    """Regime (b): `fabric-lin pretrain` for warmup + steps optimizer steps; the median logged tokens/s after
    warmup. With devices > 1: FSDP2 (or DDP) over that many GPUs, micro batch batch_size on each; each
    optimizer step accumulates `accumulation` micro-batches on each device. The corpus (bench_corpus.py:
    random tokens, chunk files as large as a real corpus's) is read by `num_workers` loader processes per
    rank (the recipes use 8)."""
    recipe, extra = REAL_LOOP_CONFIGS[key]
    name = f"fabric-lin pretrain {Path(recipe).stem} {' '.join(extra)} (real loop: the config's precision, compile on with CUDA)"
    if devices > 1:
        name += f", {'DDP' if 'ddp' in extra else 'FSDP2'} over {devices} GPUs"
    if accumulation > 1:
        name += f", {accumulation} micro-batches per step"
    work = Path(tempfile.mkdtemp(prefix="throughput-"))
    out_dir = work / "out"
    try:
        corpus = benchmark_corpus(work / "corpus", batch_size, seq_len, (warmup + steps) * devices * accumulation,
                                  loaders=devices * max(num_workers, 1))
        # log (and so wait for the GPU) every few steps, as a real run does, not after every step
        log_interval = max(1, min(5, steps // 2))
        cmd = [
            sys.executable, "-m", "fabric_lin.cli", "pretrain", "--config", str(ROOT / recipe), *extra,
            *pretrain_data_args(corpus, num_workers), "--out_dir", str(out_dir),
            "--logger_name", "csv", "--train.max_seq_length", str(seq_len), "--train.micro_batch_size", str(batch_size),
            "--train.global_batch_size", str(batch_size * devices * accumulation), "--train.max_tokens", "null",
            "--devices", str(devices), "--train.max_steps", str(warmup + steps), "--train.lr_warmup_steps", "1",
            "--train.log_interval", str(log_interval), "--train.save_interval", "null",
            "--eval.initial_validation", "false", "--eval.final_validation", "false",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"model": name, "skipped": f"did not finish within {timeout} s"}
        metrics = out_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    finally:  # the corpus and the final checkpoint (GBs)
        shutil.rmtree(work, ignore_errors=True)
    # the log-step records whose window of log_interval steps starts after the warm-up
    steady = [r for r in records if "tokens_per_sec" in r and r["step"] - log_interval >= warmup]
    losses = [r["loss"] for r in records if "loss" in r]  # the per-step records
    if proc.returncode != 0 or not steady:
        return {"model": name, "skipped": f"exit code {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    tokens_per_s = statistics.median(r["tokens_per_sec"] for r in steady)
    first = next((r for r in records if "time_to_first_step_s" in r), {})
    return {
        "model": name,
        "devices": devices,
        "accumulation": accumulation,
        "tokens_per_s": round(tokens_per_s),
        "tokens_per_s_per_device": round(tokens_per_s / devices),
        "ms_per_step": round(batch_size * devices * accumulation * seq_len / tokens_per_s * 1e3, 2),
        "peak_memory_gib": round(max(r.get("max_memory_gb", 0.0) for r in steady) * 1e9 / 2**30, 2),
        "mfu": round(statistics.median(r["mfu"] for r in steady), 4) if "mfu" in steady[0] else None,
        "first_step_s": round(first.get("time_to_first_step_s", float("nan")), 1),
        "recompilations": steady[-1].get("recompilations"),
        "final_loss": round(losses[-1], 3),
    }


def data_loader_alone(batch_size, seq_len, batches, num_workers, corpus="benchmark", busy_ms=50.0):
    """The training data loader by itself, on the real loop's corpus (bench_corpus.py) or, with corpus
    "sample", on the sample corpus (one micro-batch per chunk file): tokens/s it can deliver, to set
    against the tokens/s a training step consumes; then how long each fetch waits when the training
    process is busy between fetches (`busy_ms` of Python, as a host launching kernels): a loader fast on
    average can still hold a step back now and then."""
    from fabric_lin.data import SampleCorpus, SlimPajamaStarcoder

    work = Path(tempfile.mkdtemp(prefix="loader-"))
    try:
        if corpus == "sample":
            data = SampleCorpus(num_workers=num_workers, validation=False)
            data.prepare_data()
        else:
            path = benchmark_corpus(work / "corpus", batch_size, seq_len, 2 * batches + 1, loaders=max(num_workers, 1))
            data = SlimPajamaStarcoder(data_path=path, num_workers=num_workers, validation=False)
        data.connect(batch_size=batch_size, max_seq_length=seq_len)
        data.setup()
        return fetch_times(data.train_dataloader(), batches, busy_ms, f"data loader alone ({corpus} corpus, {num_workers} workers)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fetch_times(loader, batches, busy_ms, name):
    """Tokens/s over `batches` fetches back to back, then each of `batches` more fetches' wait with the
    host busy for `busy_ms` before it."""
    iterator = iter(loader)

    def fetch():
        nonlocal iterator
        while True:
            try:
                return next(iterator)
            except StopIteration:  # a small corpus: go round again, as the trainer's CycleIterator does
                iterator = iter(loader)

    batch = fetch()  # the first batch pays for worker start-up
    start = time.perf_counter()
    for _ in range(batches):
        batch = fetch()
    elapsed = time.perf_counter() - start
    waits_ms = []
    for _ in range(batches):
        until = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < until:  # busy, holding the interpreter as a launching host does
            pass
        fetch_start = time.perf_counter()
        fetch()
        waits_ms.append((time.perf_counter() - fetch_start) * 1e3)
    waits_ms.sort()
    return {"model": name, "batches": batches,
            "tokens_per_s": round(batches * batch.shape[0] * (batch.shape[1] - 1) / elapsed),
            f"fetch wait with the host busy {busy_ms:.0f} ms between fetches, ms": {
                "median": round(statistics.median(waits_ms), 1), "p90": round(waits_ms[int(0.9 * len(waits_ms))], 1),
                "max": round(waits_ms[-1], 1), "fetches over 20 ms": sum(w > 20 for w in waits_ms)}}


def run_isolated(regime, key, args):
    """One measurement in its own process (a clean allocator and peak-memory count, and a time limit)."""
    cmd = [sys.executable, __file__, "--worker", regime, "--models", key, "--batch_size", str(args.batch_size),
           "--seq_len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--timeout", str(args.timeout), "--num_workers", str(args.num_workers), "--devices", str(args.devices),
           "--loader_corpus", args.loader_corpus,
           "--accumulation", str(args.accumulation), "--profile", str(args.profile)]
    # its own process group: at its time limit, or ours (SIGTERM), the worker goes with the trainer it started,
    # which would otherwise hold the GPU's memory through the measurements after it
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout + 60)
        except BaseException as error:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            return {"model": key, "skipped": f"no result within {args.timeout + 60} s (start-up: compilation, autotuning)"}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"model": key, "skipped": f"exit code {proc.returncode}: {(stdout + stderr)[-1500:]}"}
    return json.loads(lines[-1])


def worker(regime, key, args):
    if regime == "real-loop":
        print(json.dumps(real_loop(key, args.batch_size, args.seq_len, args.steps, args.warmup, args.timeout, args.devices,
                                   args.accumulation, args.num_workers)))
        return
    if regime == "data-loader":
        print(json.dumps(data_loader_alone(args.batch_size, args.seq_len, 10 * args.steps, args.num_workers, args.loader_corpus)))
        return
    gla = Config.from_name("gla-340M")
    runs = {
        "fabric-lin": ("fabric-lin gla-340M", ours, gla),
        "fabric-lin-tuned": ("fabric-lin gla-340M, launch settings searched first (as compile.kernel_autotune does)", ours, gla),
        "fabric-lin-compiled": ("fabric-lin gla-340M, each Block compiled", functools.partial(ours, compiled=True), gla),
        "fabric-lin-fp8": ("fabric-lin gla-340M, FP8 tensorwise, each Block compiled",
                           functools.partial(ours, compiled=True, fp8_recipe="tensorwise"), gla),
        "fabric-lin-fp8-fused": ("fabric-lin gla-340M, FP8 products in the fused ops, each Block compiled",
                                 functools.partial(ours, compiled=True, fp8_recipe="fused"), gla),
        "gla-1B-compiled": ("fabric-lin gla-1.3B, each Block compiled", functools.partial(ours, compiled=True),
                            Config.from_name("gla-1.3B")),
        "gla-1B-fp8-fused": ("fabric-lin gla-1.3B, FP8 products in the fused ops, each Block compiled",
                             functools.partial(ours, compiled=True, fp8_recipe="fused"), Config.from_name("gla-1.3B")),
        "fla": ("flash-linear-attention GLAForCausalLM 340M", fla_model, gla),
        "transformer": ("fabric-lin transformer-340M", ours, Config.from_name("transformer-340M")),
        "gdn": ("fabric-lin gdn-340M", ours, Config.from_name("gdn-340M")),
        "fla-gdn": ("flash-linear-attention GatedDeltaNetForCausalLM 340M", fla_model, Config.from_name("gdn-340M")),
    }
    name, build, config = runs[key]
    extra = {}
    if key == "fabric-lin-tuned":
        from fabric_lin.ops.gla.tune import tune_launch

        start = time.perf_counter()
        found = tune_launch(args.batch_size, args.seq_len, config.num_heads, config.head_k_dim, config.head_v_dim)
        build = functools.partial(ours, gla_launch=found["launch"])  # the search returns settings, changes none
        extra = {"search_s": round(time.perf_counter() - start, 1), "launch": json.loads(found["launch"].as_json),
                 "kernel_fwd_bwd_ms_shipped_vs_searched": [found["start_fwd_bwd_ms"], found["fwd_bwd_ms"]]}
    try:
        measure(name, build, config, args.batch_size, args.seq_len, args.steps, args.warmup, extra, args.profile)
    except ImportError as e:
        print(json.dumps({"model": name, "skipped": f"not importable: {e}"}))
    except torch.cuda.OutOfMemoryError as e:
        print(json.dumps({"model": name, "skipped": f"out of memory: {str(e)[:300]}"}))


# pairs of measurements of one regime, (what the ratio says, first, second)
STEP_TIME_PAIRS = [  # the first's ms/step over the second's
    ("shipped launch table vs searched (a)", "bf16-weights/fabric-lin", "bf16-weights/fabric-lin-tuned"),
    ("dynamic shapes vs specialised (b)", "real-loop/fabric-lin", "real-loop/fabric-lin-static"),
    ("kernels launched one by one vs CUDA graphs (b)", "real-loop/fabric-lin-no-cudagraphs", "real-loop/fabric-lin-cudagraphs"),
    ("kernels launched one by one vs compile.mode auto (b)", "real-loop/fabric-lin-no-cudagraphs", "real-loop/fabric-lin"),
]
FP8_PAIRS = [  # FP8 (second) against the same model and regime in bf16 (first): its tokens/s and peak memory over bf16's
    ("FP8 tensorwise vs bf16 (a, compiled)", "bf16-weights/fabric-lin-compiled", "bf16-weights/fabric-lin-fp8"),
    ("FP8 tensorwise vs bf16 (b)", "real-loop/fabric-lin", "real-loop/fabric-lin-fp8"),
    ("gla-1.3B FP8 tensorwise vs bf16 (b)", "real-loop/gla-1B", "real-loop/gla-1B-fp8"),
    ("FP8 fused vs bf16 (a, compiled)", "bf16-weights/fabric-lin-compiled", "bf16-weights/fabric-lin-fp8-fused"),
    ("FP8 fused vs bf16 (b)", "real-loop/fabric-lin", "real-loop/fabric-lin-fp8-fused"),
    ("gla-1.3B FP8 fused vs bf16 (a, compiled)", "bf16-weights/gla-1B-compiled", "bf16-weights/gla-1B-fp8-fused"),
    ("gla-1.3B FP8 fused vs bf16 (b)", "real-loop/gla-1B", "real-loop/gla-1B-fp8-fused"),
]


def like_for_like_ratios(results: Dict[str, Dict]) -> Dict[str, float]:
    """The report's ratios, each between two measurements of one regime: every regime (a) model of ours against
    flash-linear-attention's in regime (a) - GDN's against GatedDeltaNetForCausalLM, the others against
    GLAForCausalLM -, tokens/s and peak memory; then STEP_TIME_PAIRS and FP8_PAIRS. fla has no real loop, and
    the data loader's tokens/s is what it can deliver, not a training step's speed: neither is set against fla.
    `results`: {"<regime>/<model>": measurement}; a skipped measurement (no tokens/s) gives no ratio."""
    measured = {label: r for label, r in results.items() if "tokens_per_s" in r}
    ratios = {}
    for label, result in measured.items():
        regime, key = label.split("/", 1)
        if regime != "bf16-weights" or key.startswith("fla"):
            continue
        peer = "fla-gdn" if "gdn" in key else "fla"
        if f"bf16-weights/{peer}" in measured:
            fla = measured[f"bf16-weights/{peer}"]
            ratios[f"{label} tokens/s vs {peer} (a)"] = round(result["tokens_per_s"] / fla["tokens_per_s"], 3)
            ratios[f"{label} peak memory vs {peer} (a)"] = round(result["peak_memory_gib"] / fla["peak_memory_gib"], 3)
    for label, base, other in STEP_TIME_PAIRS:
        if base in measured and other in measured:
            ratios[f"{label}, ms/step"] = round(measured[base]["ms_per_step"] / measured[other]["ms_per_step"], 4)
    for label, bf16, fp8 in FP8_PAIRS:
        if bf16 in measured and fp8 in measured:
            ratios[f"{label}, tokens/s"] = round(measured[fp8]["tokens_per_s"] / measured[bf16]["tokens_per_s"], 3)
            ratios[f"{label}, peak memory"] = round(measured[fp8]["peak_memory_gib"] / measured[bf16]["peak_memory_gib"], 3)
    return ratios


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default="fabric-lin,fla,transformer",
                        help="of fabric-lin, fabric-lin-tuned (regime a after the launch search), fabric-lin-static "
                        "(regime b with specialised shapes), fabric-lin-fsdp-block (regime b, one FSDP unit per Block), "
                        "fabric-lin-fsdp-block-reshard (the same, weights gathered again for the backward pass), fabric-lin-ddp (regime b, DDP "
                        "over several GPUs), fabric-lin-cudagraphs / fabric-lin-no-cudagraphs (regime b, one GPU, CUDA graphs "
                        "forced on / off; fabric-lin: compile.mode auto, on), fla, transformer, gdn (gdn-340M, both regimes), "
                        "fla-gdn (fla's GatedDeltaNetForCausalLM, regime a), fabric-lin-compiled (regime a, each Block compiled), "
                        "fabric-lin-fp8 (FP8 tensorwise, both regimes; regime a compiles each Block), "
                        "gla-1B / gla-1B-fp8 (regime b, gla-1.3B in bf16 / FP8), fabric-lin-fp8-fused / gla-1B-fp8-fused (both "
                        "regimes: FP8 products inside the fused ops), gla-1B-compiled (regime a)")
    parser.add_argument("--regimes", default="bf16-weights,real-loop,data-loader",
                        help="bf16-weights (a), real-loop (b), data-loader (the loader alone, no GPU needed)")
    parser.add_argument("--num_workers", type=int, default=4, help="data loader workers (per rank) of the real loop and the data-loader regime")
    parser.add_argument("--loader_corpus", choices=["benchmark", "sample"], default="benchmark",
                        help="data-loader regime: the real loop's corpus (bench_corpus.py) or the sample corpus")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per measurement")
    parser.add_argument("--devices", type=int, default=1,
                        help="GPUs for the real loop (FSDP2 when > 1; micro batch --batch_size on each)")
    parser.add_argument("--accumulation", type=int, default=1, help="real loop: micro-batches per optimizer step")
    parser.add_argument("--profile", type=int, default=0,
                        help="regime (a): also profile this many steps after the timed ones (GPU time by kind of kernel)")
    parser.add_argument("--out", type=out_arg, help="also write the JSON document here (with the command, date and machine)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.models, args)
        return

    # a time limit's SIGTERM stops the measurement under way (run_isolated kills its process group on the way out)
    # and what was measured before it is still written
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results, stopped = {}, None
    try:
        for regime in args.regimes.split(","):
            for key in args.models.split(","):
                if regime == "real-loop" and key not in REAL_LOOP_CONFIGS:
                    continue  # the peer has no fabric-lin loop
                if regime == "bf16-weights" and key not in REGIME_A_MODELS:
                    continue  # a setting of the real loop only (compile, FSDP, CUDA graphs)
                if regime == "data-loader" and key != "fabric-lin":
                    continue  # one loader serves every model
                stopped = f"{regime}/{key}"
                results[f"{regime}/{key}"] = run_isolated(regime, key, args)
                print(json.dumps({f"{regime}/{key}": results[f"{regime}/{key}"]}), flush=True)
        stopped = None
    except KeyboardInterrupt:
        print(f"stopped (SIGTERM or Ctrl-C) while measuring {stopped}", file=sys.stderr, flush=True)
    ratios = like_for_like_ratios(results)
    fla_ran = any("tokens_per_s" in results.get(f"bf16-weights/{peer}", {}) for peer in ("fla", "fla-gdn"))
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "batch_size": args.batch_size, "seq_len": args.seq_len,
              "torch": torch.__version__, "results": results, "ratios": ratios}
    if stopped:
        report["stopped_while_measuring"] = stopped
    write_result(report, args.out, fla_ran=fla_ran)


if __name__ == "__main__":
    main()
