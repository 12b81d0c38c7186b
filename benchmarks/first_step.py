"""Time to first optimizer step of gla-340M in a fresh process: fabric-lin with empty and with warm
compile caches, and flash-linear-attention's GLAForCausalLM where it is importable. Run on a GPU:

    python benchmarks/first_step.py --out first_step.json
    python benchmarks/first_step.py --seq_lens 2048 --no-fla
    python benchmarks/first_step.py --seq_lens 2048 --no-fla --compare_precompile

fabric-lin: `fabric-lin pretrain` (config_hub/gla_340M.yaml, bf16-mixed, compile on, the sample corpus,
prepared before the clock starts as any real run's data is) into a new out_dir, so its compile caches
(out_dir/compile_cache: Triton's and Inductor's) start empty; then `--resume auto` into the same out_dir,
which is what a restart after preemption does, with the caches warm. The figure is the trainer's own
"time to first step" (process start to the end of the first optimizer step), checked against the wall
time seen from here. The peer: the same config, bf16-mixed (autocast), fused AdamW, no compile (how it
is usually trained), a new empty Triton cache directory. A run that does not reach its first step
within --timeout seconds is recorded as such.

--compare_precompile: instead of the empty-then-warm pair, two runs with empty caches, each into a new out_dir: with
`--compile.precompile true` (the first step's Triton kernels compiled by background processes) and then with false
(each compiled at its first launch). The first run of a call also pays for reading the libraries from disk, so the
precompiled run goes first: any such cost counts against it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MICRO_BATCH = {2048: 16, 16384: 2}  # 32K tokens per step at 2048, as in the throughput benchmark


def first_step_record(metrics_file):
    """The record with time_to_first_step_s in a metrics file, or None (a line still being written is skipped)."""
    if not metrics_file.exists():
        return None
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "time_to_first_step_s" in record:
            return record
    return None


def run_until_first_step(cmd, env, metrics_file, timeout, log_file):
    """Run cmd; return (wall seconds until metrics_file reports the first step or None, its record, exit code)."""
    start = time.time()
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        seen = None
        while time.time() - start < timeout:
            if seen is None:
                record = first_step_record(metrics_file)
                if record is not None:
                    seen = (round(time.time() - start, 1), record)
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
    if seen is None:  # finished between two polls
        record = first_step_record(metrics_file)
        if record is not None:
            seen = (round(time.time() - start, 1), record)
    return (seen[0], seen[1], rc) if seen else (None, None, rc)


def why_no_first_step(rc, timeout, log_file):
    if rc == -9:  # killed here at the limit
        return f"no first step within {timeout} s"
    return f"exited with code {rc} before its first step (see {log_file})"


def pretrain_command(config, out_dir, seq_len):
    return [
        sys.executable, "-m", "fabric_lin.cli", "pretrain", "--config", str(config),
        "--data", "SampleCorpus", "--data.validation", "false", "--tokenizer_dir", "null", "--out_dir", str(out_dir), "--logger_name", "csv",
        "--train.max_seq_length", str(seq_len), "--train.micro_batch_size", str(MICRO_BATCH[seq_len]),
        "--train.global_batch_size", str(MICRO_BATCH[seq_len]), "--train.max_tokens", "null",
        "--train.lr_warmup_steps", "1", "--train.log_interval", "1", "--train.save_interval", "null",
        "--eval.initial_validation", "false", "--eval.final_validation", "false",
    ]


def fabric_lin_run(command, out_dir, log_file, timeout, seq_len, config, caches, **extra):
    """Run `command` (a pretrain into out_dir) until its first step; its record."""
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.rename(out_dir / "metrics-previous.jsonl")  # so that the next first step is this run's
    wall, record, rc = run_until_first_step(command, dict(os.environ), metrics, timeout, log_file)
    result = {
        "model": f"fabric-lin {Path(config).name}", "seq_len": seq_len, "micro_batch": MICRO_BATCH[seq_len],
        "compile": "the config's (on with CUDA by default)", "caches": caches, **extra, "exit_code": rc,
        "time_to_first_step_s": round(record["time_to_first_step_s"], 1) if record else None,
        "wall_s_seen_here": wall, "compiled_graphs_at_first_step": (record or {}).get("compiled_graphs"),
        "startup_phases_s": {k: round(v, 1) for k, v in (record or {}).get("startup_phases_s", {}).items()},
        "note": None if record else why_no_first_step(rc, timeout, log_file),
    }
    print(json.dumps(result), flush=True)
    return result


def fabric_lin_runs(seq_len, work, timeout, steps, config):
    """A new run (empty caches), then the same out_dir resumed (warm caches)."""
    out_dir = work / f"fabric-lin-{seq_len}"
    base = pretrain_command(config, out_dir, seq_len)
    results = []
    for caches, extra in (("empty", ["--train.max_steps", str(steps)]),
                          ("warm (resumed run, same out_dir)", ["--train.max_steps", str(2 * steps), "--resume", "auto",
                                                                               "--resume_changes", "[train.max_steps]"])):
        log_file = work / f"fabric-lin-{seq_len}-{len(results)}.log"
        results.append(fabric_lin_run(base + extra, out_dir, log_file, timeout, seq_len, config, caches))
    return results


def precompile_runs(seq_len, work, timeout, steps, config):
    """Two new runs (empty caches, each its own out_dir): the first step's kernels precompiled, then not. Each
    record has the lines the run printed about the precompile."""
    results = []
    for precompile in ("true", "false"):
        out_dir = work / f"fabric-lin-{seq_len}-precompile-{precompile}"
        log_file = work / f"fabric-lin-{seq_len}-precompile-{precompile}.log"
        command = pretrain_command(config, out_dir, seq_len) + ["--train.max_steps", str(steps),
                                                                "--compile.precompile", precompile]
        result = fabric_lin_run(command, out_dir, log_file, timeout, seq_len, config, "empty",
                                precompile=precompile == "true")
        result["precompile_lines"] = [line for line in log_file.read_text(errors="replace").splitlines()
                                      if "Triton kernels" in line]
        results.append(result)
    if all(r["time_to_first_step_s"] for r in results):
        print(json.dumps({"seq_len": seq_len, "first_step_s_precompiled": results[0]["time_to_first_step_s"],
                          "first_step_s_not": results[1]["time_to_first_step_s"]}), flush=True)
    return results


def fla_worker(seq_len, steps, out_path):
    """In its own process: build flash-linear-attention's model and report the first optimizer step."""
    import torch
    from train_throughput import fla_model  # the peer built as in the throughput benchmark (this folder)

    from fabric_lin.config import Config

    config = Config.from_name("gla-340M")
    model, loss_fn = fla_model(config)
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (MICRO_BATCH[seq_len], seq_len), device="cuda")
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step == 0:
            from fabric_lin.metrics import PROCESS_START

            with open(out_path, "w") as f:  # the parent polls this file
                f.write(json.dumps({"time_to_first_step_s": time.time() - PROCESS_START}) + "\n")


def fla_run(seq_len, work, timeout, steps, cache_dir):
    try:
        import fla  # noqa: F401
    except Exception as e:
        return {"model": "flash-linear-attention GLAForCausalLM", "skipped": f"not importable: {type(e).__name__}: {e}"}
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / f"fla-{seq_len}.jsonl"
    cache_dir = Path(cache_dir or work / f"fla-{seq_len}-triton-cache")
    caches = "empty" if not cache_dir.exists() or not any(cache_dir.iterdir()) else "warm"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, __file__, "--fla-worker", str(seq_len), "--steps", str(steps), "--worker-out", str(metrics)]
    log_file = work / f"fla-{seq_len}.log"
    wall, record, rc = run_until_first_step(cmd, env, metrics, timeout, log_file)
    result = {
        "model": "flash-linear-attention GLAForCausalLM", "seq_len": seq_len, "micro_batch": MICRO_BATCH[seq_len],
        "compile": False, "caches": caches, "exit_code": rc,
        "time_to_first_step_s": round(record["time_to_first_step_s"], 1) if record else None,
        "wall_s_seen_here": wall, "note": None if record else why_no_first_step(rc, timeout, log_file),
    }
    print(json.dumps(result), flush=True)
    return result


def main():
    from common import out_arg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_lens", nargs="*", type=int, default=[2048, 16384], choices=sorted(MICRO_BATCH))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take to reach its first step")
    parser.add_argument("--config", default=str(ROOT / "config_hub/gla_340M.yaml"),
                        help="fabric-lin's model and run settings (the peer always builds gla-340M)")
    parser.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
    parser.add_argument("--compare_precompile", action="store_true",
                        help="two runs with empty caches, --compile.precompile true then false, instead of empty then warm")
    parser.add_argument("--fla_seq_lens", nargs="*", type=int, default=[2048], help="context lengths run for the peer")
    parser.add_argument("--fla_cache_dir", help="the peer's Triton cache (default: a new one per run); "
                        "naming one lets later benchmarks reuse its autotuning")
    parser.add_argument("--work_dir", help="where the runs write (default: a new temporary directory)")
    parser.add_argument("--out", type=out_arg, help="also write the JSON document here (with the command, date and machine)")
    parser.add_argument("--fla-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fla_worker:
        fla_worker(args.fla_worker, args.steps, args.worker_out)
        return

    from fabric_lin.data.sample_corpus import ensure_sample_corpus

    ensure_sample_corpus()  # data preparation is not start-up: build the corpus before any clock starts
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="first_step-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for seq_len in args.seq_lens:
        runs = precompile_runs if args.compare_precompile else fabric_lin_runs
        results += runs(seq_len, work, args.timeout, args.steps, args.config)
        if not args.no_fla and seq_len in args.fla_seq_lens:
            results.append(fla_run(seq_len, work, args.timeout, args.steps, args.fla_cache_dir))
    import torch

    from common import write_result

    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "work_dir": str(work), "results": results}
    write_result(report, args.out, fla_ran=any(r.get("time_to_first_step_s") and "flash" in r["model"] for r in results))


if __name__ == "__main__":
    main()
