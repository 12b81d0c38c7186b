"""Training throughput of gla-340M on one GPU, side by side with flash-linear-attention's
GLAForCausalLM (same config, batch and optimizer) and fabric-lin's transformer-340M.

Regime "bf16-weights": weights in bf16, fused AdamW, no compile, micro batch x context tokens per
step - the regime in which flash-linear-attention's own trainer is usually measured.
Prints one JSON object; run on a GPU:

    python benchmarks/train_throughput.py --batch_size 16 --seq_len 2048 --steps 20
"""
import argparse
import gc
import json
import time

import torch

from fabric_lin.config import Config
from fabric_lin.flops import flops_per_token, peak_flops
from fabric_lin.model import GPT


def fla_model(config: Config):
    from fla.models import GLAConfig, GLAForCausalLM

    from fabric_lin.convert.hf import fla_config

    # the same config.json fields that `fabric-lin convert_to_hf` writes (fused norm, swiglu and
    # cross-entropy on), less the keys that name the format rather than the model
    fields = {k: v for k, v in fla_config(config).items() if k not in ("architectures", "model_type", "fabric_lin")}
    model = GLAForCausalLM(GLAConfig(**fields))

    def loss_fn(ids, targets):
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn


def ours(config: Config):
    model = GPT(config)

    def loss_fn(ids, targets):
        return model(ids, targets=targets)

    return model, loss_fn


def measure(name, build, config, batch_size, seq_len, steps, warmup):
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model, loss_fn = build(config)
    model = model.cuda().to(torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    data = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device="cuda")
    ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    times = []
    compile_start = time.perf_counter()
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step == 0:
            first_step = time.perf_counter() - compile_start
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
    }
    del model, optimizer, loss
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(result), flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default="fabric-lin,fla,transformer")
    args = parser.parse_args()

    gla = Config.from_name("gla-340M")
    runs = {
        "fabric-lin": ("fabric-lin gla-340M", ours, gla),
        "fla": ("flash-linear-attention GLAForCausalLM 340M", fla_model, gla),
        "transformer": ("fabric-lin transformer-340M", ours, Config.from_name("transformer-340M")),
    }
    results = {}
    for key in args.models.split(","):
        name, build, config = runs[key]
        try:
            results[key] = measure(name, build, config, args.batch_size, args.seq_len, args.steps, args.warmup)
        except ImportError as e:
            results[key] = {"model": name, "skipped": f"not importable: {e}"}
        except torch.cuda.OutOfMemoryError as e:
            results[key] = {"model": name, "skipped": f"out of memory: {e}"}
            torch.cuda.empty_cache()
    if "tokens_per_s" in results.get("fabric-lin", {}) and "tokens_per_s" in results.get("fla", {}):
        ours_r, peer = results["fabric-lin"], results["fla"]
        results["ratios"] = {
            "tokens_per_s_vs_fla": round(ours_r["tokens_per_s"] / peer["tokens_per_s"], 3),
            "peak_memory_vs_fla": round(ours_r["peak_memory_gib"] / peer["peak_memory_gib"], 3),
        }
    print(json.dumps({"device": torch.cuda.get_device_name(), "batch_size": args.batch_size, "seq_len": args.seq_len,
                      "torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
