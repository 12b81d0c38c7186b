"""Where a training step's time goes: `fabric-lin pretrain` itself (the real loop, one GPU or FSDP2
over several, on bench_corpus.py's corpus) with torch.profiler around a few optimizer steps after warmup.
Per rank: the step's wall time, GPU time by kind of kernel (matmul, GLA recurrence, fused norm/SwiGLU/cross-entropy, Inductor-compiled,
communication, optimizer, other), how long no compute kernel ran (the GPU waiting for the host or for
communication), and the top kernels. Prints one JSON object; run on a GPU:

    python benchmarks/profile_step.py --devices 2
    python benchmarks/profile_step.py --config config_hub/transformer_340M.yaml --batch_size 16

`summarize_trace` is also what `train_throughput.py --profile` uses for regime (a).
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent

KINDS: List[Tuple[str, re.Pattern]] = [  # first match wins
    ("communication", re.compile(r"nccl", re.I)),
    # GLA's, Gated DeltaNet's and DeltaNet's kernels (some names are shared), then fla's
    ("linear-attention recurrence", re.compile(
        r"^_(gate_cumsum|fwd_state|chunk_update|state_scan|fwd_scores|fwd_output|bwd_state|bwd_both_states|bwd_dv|bwd_dqk"
        r"|solve|wu|state_passes|bwd_dd_local|bwd_dqkw|wy_bwd|l2norm_fwd|l2norm_bwd)_kernel"
        r"|chunk_gla|chunk_fwd_kernel_h|chunk_bwd_kernel_dh|chunk_local_cumsum"
        r"|chunk_gated_delta_rule|recompute_w_u|prepare_wy_repr|chunk_bwd_kernel_dqkwg|chunk_bwd_kernel_dv|chunk_fwd_kernel_o"
        r"|chunk_scaled_dot_kkt|solve_tril|merge_16x16|l2norm_(fwd|bwd)_kernel")),
    ("short convolution", re.compile(r"^_conv_(fwd|bwd)_kernel|causal_conv1d")),
    ("fused norm/swiglu/cross-entropy", re.compile(r"^_(norm|swiglu|ce_rows)_|layer_norm|swiglu|cross_entropy|logsumexp", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|wgmma", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    ("inductor-compiled", re.compile(r"^triton_")),
    ("memcpy/memset", re.compile(r"^Memcpy|^Memset|memcpy|memset", re.I)),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other (torch elementwise, reductions)"


def union_us(intervals: List[Tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize_trace(trace_path: Path, steps: int, wall_s: float, top: int = 25) -> Dict:
    """Milliseconds per step from a torch.profiler Chrome trace of `steps` steps that took `wall_s` seconds."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_kind: Dict[str, float] = defaultdict(float)
    by_name: Dict[str, float] = defaultdict(float)
    compute, everything, compute_kernels = [], [], []
    for e in kernels:
        kind = kind_of(e["name"])
        by_kind[kind] += e["dur"]
        by_name[e["name"][:90]] += e["dur"]
        interval = (e["ts"], e["ts"] + e["dur"])
        everything.append(interval)
        if kind != "communication":
            compute.append(interval)
            compute_kernels.append((e["ts"], e["ts"] + e["dur"], e["name"][:60]))
    per_step = lambda us: round(us / 1e3 / steps, 2)  # noqa: E731
    wall_ms = wall_s * 1e3 / steps
    compute_ms = union_us(compute) / 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 2),
        "compute_busy_ms": round(compute_ms, 2),
        # the GPU ran no compute kernel: waiting for the host (launches, syncs, data) or for communication
        "compute_idle_ms": round(wall_ms - compute_ms, 2),
        "any_kernel_busy_ms": per_step(union_us(everything)),
        "ms_by_kind": {k: per_step(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: per_step(v) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]},
        "idle_gaps": idle_gaps(compute_kernels, steps),
    }


def idle_gaps(kernels: List[Tuple[float, float, str]], steps: int, min_us: float = 20.0, top: int = 12) -> Dict:
    """Where the GPU waits: the gaps of at least `min_us` between one compute kernel's end and the next one's
    start, summed per step by the pair of kernels around them ("before -> after"), largest first."""
    by_pair: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    reach, before = None, None
    for start, end, name in sorted(kernels):
        if reach is not None and start - reach >= min_us:
            entry = by_pair[f"{before} -> {name}"]
            entry[0] += start - reach
            entry[1] += 1
        if reach is None or end > reach:
            reach, before = end, name
    total = sum(v[0] for v in by_pair.values())
    largest = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        f"gaps over {min_us:.0f} us, ms per step": round(total / 1e3 / steps, 2),
        "largest (ms per step, gaps per step)": {
            pair: [round(us / 1e3 / steps, 2), round(n / steps, 1)] for pair, (us, n) in largest
        },
    }


def profiler(host_ops: bool = False) -> torch.profiler.profile:
    # GPU kernels only, unless asked: recording every host-side op as well slows the host enough to
    # starve the GPU (the step's wall time then says little)
    activities = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    if host_ops or not activities:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    return torch.profiler.profile(activities=activities)


def top_host_ops(prof: torch.profiler.profile, steps: int, top: int = 25) -> Dict[str, float]:
    """Host-side milliseconds per step by op, self time (excluding the ops each one calls)."""
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    return {k[:90]: round(us / 1e3 / steps, 2) for k, us in sorted(ops, key=lambda kv: -kv[1])[:top]}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def install_profiler(first_micro: int, micros: int, steps: int, report_dir: Path, host_ops: bool = False) -> None:
    """Wrap the trainer's loss function: start profiling at micro-batch `first_micro` (counted from 0, a
    step's first), stop `micros` micro-batches later (the next step's first), and write this rank's summary."""
    import fabric_lin.pretrain as pretrain

    compute_loss = pretrain.compute_loss
    calls = {"n": 0}
    prof = profiler(host_ops)
    timing = {}

    def profiled_compute_loss(*args, **kwargs):
        n = calls["n"]
        calls["n"] += 1
        if n == first_micro:
            synchronize()
            prof.start()
            timing["start"] = time.perf_counter()
        elif n == first_micro + micros:
            synchronize()
            wall = time.perf_counter() - timing["start"]
            prof.stop()
            rank = int(os.environ.get("LOCAL_RANK", 0)) + int(os.environ.get("NODE_RANK", 0)) * 1000
            trace = report_dir / f"trace-rank{rank}.json"
            prof.export_chrome_trace(str(trace))
            summary = summarize_trace(trace, steps, wall)
            if host_ops:
                summary["host_self_ms_by_op"] = top_host_ops(prof, steps)
            (report_dir / f"rank{rank}.json").write_text(json.dumps(summary))
            trace.unlink()
        return compute_loss(*args, **kwargs)

    pretrain.compute_loss = profiled_compute_loss


def main():
    from common import out_arg

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config_hub/gla_340M.yaml")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps before profiling")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps profiled")
    parser.add_argument("--num_workers", type=int, default=4, help="data loader workers per rank")
    parser.add_argument("--host_ops", action="store_true",
                        help="also record host-side ops (where the host's time per step goes; slows the step)")
    parser.add_argument("--report_dir", help="where each rank writes its summary (default: a new temporary folder)")
    parser.add_argument("--out", type=out_arg, help="also write the JSON document here (with the command, date and machine)")
    args, extra = parser.parse_known_args()  # anything else goes to `fabric-lin pretrain`

    # Fabric starts ranks 1.. by running this same command again; they must use rank 0's folders
    report_dir = Path(args.report_dir or os.environ.setdefault("PROFILE_STEP_DIR", tempfile.mkdtemp(prefix="profile-step-")))
    report_dir.mkdir(parents=True, exist_ok=True)
    install_profiler(args.warmup * args.accumulation, args.steps * args.accumulation, args.steps, report_dir, args.host_ops)

    corpus = report_dir / "corpus"
    from bench_corpus import benchmark_corpus, pretrain_data_args
    from common import write_result

    if "LOCAL_RANK" not in os.environ:  # the first process writes it; the ranks Fabric starts read it
        benchmark_corpus(corpus, args.batch_size, args.seq_len, (args.warmup + args.steps + 1) * args.devices * args.accumulation,
                         loaders=args.devices * max(args.num_workers, 1))

    from fabric_lin.cli import main as cli

    cli([
        "pretrain", "--config", str(ROOT / args.config),
        *pretrain_data_args(corpus, args.num_workers),
        "--out_dir", str(report_dir / "run"), "--logger_name", "csv", "--devices", str(args.devices),
        "--train.max_seq_length", str(args.seq_len), "--train.micro_batch_size", str(args.batch_size),
        "--train.global_batch_size", str(args.batch_size * args.devices * args.accumulation),
        "--train.max_tokens", "null", "--train.max_steps", str(args.warmup + args.steps + 1),
        "--train.lr_warmup_steps", "1", "--train.log_interval", "1000", "--train.save_interval", "null",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", *extra,
    ])
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    deadline = time.time() + 60  # the other ranks write theirs at the same step
    while len(list(report_dir.glob("rank*.json"))) < args.devices and time.time() < deadline:
        time.sleep(0.5)
    ranks = {p.stem: json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))}
    result = {
        "config": args.config, "devices": args.devices, "micro_batch": args.batch_size, "seq_len": args.seq_len,
        "accumulation": args.accumulation, "extra_args": extra,
        "tokens_per_s_per_device": round(args.batch_size * args.seq_len * args.accumulation
                                         / ranks["rank0"]["wall_ms_per_step"] * 1e3) if "rank0" in ranks else None,
        "ranks": ranks,
    }
    write_result(result, args.out)
    if not args.report_dir:  # a folder of its own: the corpus and the run's checkpoint (GBs) go with it
        shutil.rmtree(report_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
